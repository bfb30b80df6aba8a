"""Where adapters live while they serve: every adapter requested is known by its id, up to
max_cpu_loras of them are kept read in host memory (least recently used out first), and up to
max_loras of those sit in the device pool's slots, which the LoRA product gathers from by a
slot index per row (docs/lora.md#the-pool).

The pool holds one (A, B) pair of arrays per layer and fused projection, each adapter in one
slot of it, its rank zero-padded to the pool's, so that every step runs the same shapes:
  A: (max_loras, k * max_rank, K)    B: (max_loras, N, k * max_rank)    scales: (max_loras,)
for a projection that fuses k of the adapter's modules (q, k and v: 3; gate and up: 2), each
module's rank block on its own rows of A and its own output rows of B (B is block-diagonal).
Under tensor parallelism each rank holds its share as the base projection is sharded
(tp.py): column-parallel qkv and gate_up keep A whole and their output rows of B; row-parallel
o_proj and down keep their input columns of A and all of B, and the layer's all-reduce sums
the partial products with the base's."""
import dataclasses
from collections import OrderedDict

import numpy as np

from nano import checks
from nano.config import ModelConfig
from nano.device import Device, from_float32
from nano.errors import NanoError
from nano.ops import OpSet
from nano.lora.peft import Adapter, LoRARequest, check_request, read_adapter
from nano.plan import PackedShape, unpack_step
from nano.tp import Partition

# The model's fused projections (model.LayerWeights) and the adapter modules each runs.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def check_limits(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    """The pool's sizes, each in its range (the command line checks them before the model
    loads, the pool again when built)."""
    checks.integer("--max-loras", max_loras, 1, 1024)
    checks.integer("--max-lora-rank", max_lora_rank, 1, 1024)
    checks.integer("--max-cpu-loras", max_cpu_loras, 1, optional=True)
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise NanoError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras "
                        f"({max_loras})")


class AdapterPool:
    def __init__(self, cfg: ModelConfig, part: Partition, device: Device, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None = None):
        """max_cpu_loras: adapters kept read in host memory, at least max_loras (its default)."""
        check_limits(max_loras, max_lora_rank, max_cpu_loras)
        self.cfg, self.device = cfg, device
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        d = cfg.head_dim
        q = slice(part.q_heads.start * d, part.q_heads.stop * d)
        kv = slice(part.kv_heads.start * d, part.kv_heads.stop * d)
        # this rank's output rows (column-parallel) or input columns (row-parallel) per module
        self.rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": part.inter,
                     "up_proj": part.inter}
        self.cols = {"o_proj": q, "down_proj": part.inter}
        self.known: dict[int, LoRARequest] = {}
        self.leaving: dict[int, LoRARequest] = {}  # retired, still used by running sequences
        self.host: OrderedDict[int, Adapter] = OrderedDict()
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.loads = 0  # adapters copied into a slot, ever
        xp, dtype = device.xp, device.dtype
        self.scales = xp.zeros(max_loras, np.float32)
        self.layers = []  # per layer: fused projection -> (A pool, B pool)
        for _ in range(cfg.num_layers):
            self.layers.append({
                proj: (xp.zeros((max_loras, len(mods) * max_lora_rank, self._width(mods[0])),
                                dtype),
                       xp.zeros((max_loras, sum(self._height(m) for m in mods),
                                 len(mods) * max_lora_rank), dtype))
                for proj, mods in FUSED.items()})

    def _width(self, module: str) -> int:
        """The input width K of module's product on this rank."""
        cfg = self.cfg
        full = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
        cols = self.cols.get(module)
        return len(range(full[module])[cols]) if cols else cfg.hidden_size

    def _height(self, module: str) -> int:
        """The output rows N of module's product on this rank."""
        cfg = self.cfg
        full = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
                "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
                "up_proj": cfg.intermediate_size}
        rows = self.rows.get(module)
        return len(range(full[module])[rows]) if rows else cfg.hidden_size

    # ---- host side -------------------------------------------------------------------------
    def resolve(self, request: LoRARequest) -> LoRARequest:
        """Check a request's adapter and read it into host memory now, so that a bad folder
        fails the request that names it, not a step; return the request its sequences carry.
        An id names one adapter, and so does a name."""
        check_request(request)
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise NanoError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r:.40} "
                            f"at {known.lora_path:.200}, not {request.lora_name!r:.40} at "
                            f"{request.lora_path:.200}")
        for other in self.known.values():
            if other.lora_name == request.lora_name and other != request:
                raise NanoError(f"LoRA adapter {request.lora_name!r:.40} is already lora_int_id "
                                f"{other.lora_int_id} at {other.lora_path:.200}")
        self.read(request)
        self.known[request.lora_int_id] = request
        return request

    def read(self, request: LoRARequest) -> Adapter:
        """The adapter in host memory: kept from before, or read now."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            adapter = read_adapter(request, self.cfg, self.max_rank)
        self.keep(adapter)
        return adapter

    def holds(self, adapter_id: int) -> bool:
        """Say whether an adapter is in host memory, so that a request for it reads no folder."""
        return adapter_id in self.host

    def keep(self, adapter: Adapter) -> None:
        """Keep an adapter in host memory as the most recently used, whether read here or by a
        server's worker thread, and drop the least recently used one past max_cpu_loras (it is
        read again if asked for)."""
        self.host[adapter.request.lora_int_id] = adapter
        self.host.move_to_end(adapter.request.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def retire(self, adapter_id: int) -> None:
        """Free an adapter's name for another (a server unloaded it) while the sequences that
        use it run on; forget drops it once they have ended."""
        if adapter_id in self.known:  # else no request has asked for it yet
            self.leaving[adapter_id] = self.known.pop(adapter_id)

    def forget(self, adapter_id: int) -> None:
        """Drop a retired adapter that no sequence uses any more: its slot, which the next
        adapter loaded takes, its copy in host memory and its request, in that order, so that a
        thread that sees the request gone sees the rest gone too."""
        self.slots.pop(adapter_id, None)
        self.host.pop(adapter_id, None)
        self.leaving.pop(adapter_id, None)

    # ---- device side -----------------------------------------------------------------------
    def op_set(self, ops: OpSet) -> OpSet:
        """The op set that runs this pool's LoRA product: a GPU's gains cuda/lora.cu's
        (nano/lora/kernels.py), which the core's lacks; a CPU's keeps its NumPy add_lora."""
        if self.device.kind != "gpu":
            return ops
        from nano.lora.kernels import add_lora  # needs CuPy, which only a GPU run has
        return dataclasses.replace(ops, add_lora=add_lora)

    def place(self, ids: np.ndarray) -> np.ndarray:
        """A step's adapter ids (S,) int32, -1 for none -> the slots holding them (S,) int32,
        -1 for none. An adapter not in a slot is copied into a free one, or into the least
        recently used one this step does not use; the scheduler never runs more distinct
        adapters in a step than there are slots."""
        step = [int(i) for i in np.unique(ids) if i >= 0]
        if len(step) > self.max_loras:
            raise RuntimeError(f"a step with {len(step)} adapters for {self.max_loras} slots")
        for adapter_id in step:
            if adapter_id in self.slots:
                self.slots.move_to_end(adapter_id)
            else:
                self._load(adapter_id, self._free_slot(step))
        lookup = np.full(max(step, default=0) + 2, -1, np.int32)  # id -> slot, and -1 -> -1
        for adapter_id in step:
            lookup[adapter_id] = self.slots[adapter_id]
        return lookup[ids]

    def place_step(self, packed: np.ndarray, shape: PackedShape) -> np.ndarray:
        """A packed step (plan.py) whose lora_slots field holds adapter ids, as rank 0 packs
        it -> a copy whose field holds this rank's slots, the adapters loaded into them."""
        packed = packed.copy()
        field = unpack_step(packed, shape)["lora_slots"]
        field[:] = self.place(field)
        return packed

    def _free_slot(self, step: list[int]) -> int:
        if len(self.slots) < self.max_loras:
            return next(s for s in range(self.max_loras) if s not in self.slots.values())
        victim = next(i for i in self.slots if i not in step)
        return self.slots.pop(victim)

    def _load(self, adapter_id: int, slot: int) -> None:
        """Copy an adapter's share for this rank into slot, zeros where it has no module."""
        adapter = self.read(self.known.get(adapter_id) or self.leaving[adapter_id])
        r, big = adapter.rank, self.max_rank
        for layer, pools in enumerate(self.layers):
            for proj, (a_pool, b_pool) in pools.items():
                a, b = np.zeros(a_pool.shape[1:], np.float32), np.zeros(b_pool.shape[1:], np.float32)
                top = 0
                for j, module in enumerate(FUSED[proj]):
                    height = self._height(module)
                    if (layer, module) in adapter.weights:
                        full_a, full_b = adapter.weights[layer, module]
                        a[j * big:j * big + r] = full_a[:, self.cols.get(module, slice(None))]
                        b[top:top + height, j * big:j * big + r] = \
                            full_b[self.rows.get(module, slice(None))]
                    top += height
                a_pool[slot], b_pool[slot] = (self.device.xp.asarray(from_float32(w, pool.dtype))
                                              for w, pool in ((a, a_pool), (b, b_pool)))
        self.scales[slot] = adapter.scale
        self.slots[adapter_id] = slot
        self.loads += 1
