"""cachemgr: keeps the on-disk KV cache tier of SGLang and vLLM valid, bounded and observable."""

__version__ = "0.1.0"
