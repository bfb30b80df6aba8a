"""Multi-LoRA serving's own parts: PEFT adapter folders read and checked (peft.py: LoRARequest,
read_adapter) and the pool they serve from (pool.py: an LRU of adapters in host memory, an LRU
of device slots, each rank's tensor-parallel share). docs/lora.md says how the pieces fit."""
from nano.lora.peft import LoRARequest, read_adapter
from nano.lora.pool import AdapterPool

__all__ = ["AdapterPool", "LoRARequest", "read_adapter"]
