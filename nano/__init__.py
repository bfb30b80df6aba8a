"""nano: a minimal LLM inference engine (paged KV cache, continuous batching, CUDA kernels)."""
from nano.llm import LLM, RequestOutput
from nano.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
