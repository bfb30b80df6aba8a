"""Multi-LoRA serving's own parts: PEFT adapter folders read and checked (peft.py: LoRARequest,
read_adapter) and the pool they serve from (pool.py: an LRU of adapters in host memory, an LRU
of device slots, each rank's tensor-parallel share), given to an engine by attach (to a
tensor-parallel rank's runner by rank_pool and its use_adapters). LLM is the Python API's LLM
with vLLM's LoRA arguments; cli.py, run.py's flags. docs/lora.md says how the pieces fit.

    from nano.lora import LLM, LoRARequest
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("mine", 1, "path/to/peft-folder"))
"""
from nano import llm, parallel
from nano.config import ModelConfig
from nano.device import Device
from nano.errors import NanoError
from nano.lora.peft import LoRARequest, read_adapter
from nano.lora.pool import AdapterPool
from nano.tp import partition

__all__ = ["LLM", "AdapterPool", "LoRARequest", "attach", "rank_pool", "read_adapter"]

MAX_LORAS, MAX_LORA_RANK = 4, 16  # the defaults of LLM, attach and the command line


def rank_pool(cfg: ModelConfig, device: Device, max_loras: int = MAX_LORAS,
              max_lora_rank: int = MAX_LORA_RANK, max_cpu_loras: int | None = None) -> AdapterPool:
    """A pool of this tensor-parallel rank's shares: max_loras device slots (at most that many
    adapters run at once), ranks up to max_lora_rank, max_cpu_loras adapters kept read in host
    memory."""
    group = parallel.tp_group()
    return AdapterPool(cfg, partition(cfg, group.rank, group.world), device, max_loras,
                       max_lora_rank, max_cpu_loras)


def attach(engine, max_loras: int = MAX_LORAS, max_lora_rank: int = MAX_LORA_RANK,
           max_cpu_loras: int | None = None) -> AdapterPool:
    """Serve adapters from this engine (rank_pool's arguments); returns its pool."""
    pool = rank_pool(engine.model_config, engine.device, max_loras, max_lora_rank, max_cpu_loras)
    engine.use_adapters(pool)
    return pool


class LLM(llm.LLM):
    """nano's LLM with vLLM's LoRA arguments: enable_lora, max_loras, max_lora_rank,
    max_cpu_loras; generate(..., lora_request=) takes one LoRARequest, or one per prompt."""

    def __init__(self, model: str | None = None, enable_lora: bool = False,
                 max_loras: int = MAX_LORAS, max_lora_rank: int = MAX_LORA_RANK,
                 max_cpu_loras: int | None = None, **engine_args):
        super().__init__(model, **engine_args)
        if enable_lora:
            attach(self.engine, max_loras, max_lora_rank, max_cpu_loras)

    def generate(self, prompts, params=None, lora_request=None):
        if lora_request is not None and not isinstance(lora_request, (list, LoRARequest)):
            raise NanoError(f"lora_request must be a LoRARequest or a list of them, got "
                            f"{type(lora_request).__name__}")
        seqs = self.engine.generate(prompts, llm.SamplingParams() if params is None else params,
                                    lora_request=lora_request)
        return [self.output(seq) for seq in seqs]
