"""eightbit: a compact int8 LLM inference engine (W8A8 GEMMs, int8 paged KV cache, Triton kernels)."""

__version__ = "0.1.0"
