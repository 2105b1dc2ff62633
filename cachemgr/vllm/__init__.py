"""vLLM's file-system KV tier (`TieringOffloadingSpec`, `secondary_tiers: [{type: fs}]`): its launch
options, its identity and its on-disk format, as cachemgr needs them (docs/vllm-notes.md)."""
