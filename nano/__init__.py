"""nano: a minimal LLM inference engine (paged KV cache, continuous batching, CUDA kernels)."""
from nano import cpu_setup

cpu_setup.configure()  # first: OpenBLAS reads its settings when NumPy loads it

from nano.llm import LLM, RequestOutput
from nano.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
