"""nano: a minimal LLM inference engine (paged KV cache, continuous batching, CUDA kernels)."""
from nano import blas

blas.configure()  # first: OpenBLAS reads its settings when NumPy loads it

from nano.llm import LLM, RequestOutput
from nano.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
