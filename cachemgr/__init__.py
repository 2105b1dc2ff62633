"""cachemgr: keeps SGLang's HiCache L3 file cache valid, bounded and observable."""

__version__ = "0.1.0"
