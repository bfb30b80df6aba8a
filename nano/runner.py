"""The device side of a step, which never sees a Sequence (docs/how-it-works.md#one-step): the
forward pass, the KV pool on the device and swap space in host memory (layouts: kv_cache.py)."""
import time

import numpy as np

from nano.cpu_setup import BlasThreads
from nano.device import Device
from nano.graphs import DecodeGraphs, GraphStep
from nano.kv_cache import KVCache
from nano.model import ForwardBatch
from nano.plan import packed_shape, unpack_step


class ModelRunner:
    def __init__(self, model, device: Device, num_blocks: int, num_swap_blocks: int,
                 block_size: int, kv_cache_dtype: str = "auto", key_scheme: str | None = None,
                 broadcast=None, cuda_graphs: bool = False, max_num_seqs: int = 1,
                 max_model_len: int = 1):
        """kv_cache_dtype: auto (the device's dtype) or int8, with key_scheme (kv_cache.py).
        broadcast: sends rank 0's packed steps to the other TP ranks (parallel.Group).
        cuda_graphs: on a GPU, replay decode steps of up to max_num_seqs sequences from
        CUDA graphs (graphs.py); block tables are then max_model_len / block_size wide."""
        self.model = model
        self.device = device
        self.block_size = block_size
        self.broadcast = broadcast or (lambda packed: packed)
        cfg = model.cfg

        def pool(xp, blocks):
            return KVCache(xp, cfg.num_layers, blocks, model.num_kv_heads, block_size, cfg.head_dim,
                           device.dtype, kv_cache_dtype, key_scheme)

        self.kv_cache, self.host_cache = pool(device.xp, num_blocks), pool(np, num_swap_blocks)
        self.graphs = None
        if cuda_graphs and device.kind == "gpu":
            self.graphs = DecodeGraphs(model, self.kv_cache, max_num_seqs,
                                       -(-max_model_len // block_size))
        self.adapters = None  # nano/lora's pool: the device slots of LoRA adapters
        self.blas_threads = (BlasThreads() if device.kind == "cpu" and not model.ops.fixed_threads
                             else None)

    def touch_kv_cache(self) -> None:
        """Write every page of the KV pool now: on the CPU np.zeros maps pages on first write,
        which steps would pay as page faults (docs/perf_notes.md). cupy.zeros writes a GPU pool."""
        if self.device.kind == "cpu":
            for pool in self.kv_cache.block_arrays():
                pool.fill(0)

    # ---- swap --------------------------------------------------------------------------
    def swap(self, blocks_out, blocks_in) -> tuple[int, float]:
        """Copy blocks out to host ((device, host) pairs) and back in ((host, device) pairs).
        Out first: blocks freed by a swap-out may be refilled in this same step.
        Returns (bytes moved, seconds) for the cost model."""
        moved, start = 0, time.perf_counter()
        pools = list(zip(self.kv_cache.block_arrays(), self.host_cache.block_arrays()))
        if len(blocks_out):
            dev, host = _columns(blocks_out)
            dev = self.device.xp.asarray(dev)
            for device_pool, host_pool in pools:
                staging = self.model.ops.gather_blocks(device_pool, dev)
                host_pool[:, :, host] = self.device.to_host(staging)
                moved += staging.nbytes
        if len(blocks_in):
            host, dev = _columns(blocks_in)
            dev = self.device.xp.asarray(dev)
            for device_pool, host_pool in pools:
                staging = self.device.xp.asarray(host_pool[:, :, host])
                self.model.ops.scatter_blocks(device_pool, dev, staging)
                moved += staging.nbytes
        if moved:
            self.device.synchronize()
        return moved, time.perf_counter() - start

    # ---- blocks read out and written in ------------------------------------------------
    def read_blocks(self, block_ids: list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Blocks of the pool as host bytes (into out if given), (n, block_bytes) uint8: a row is
        that block's slice of each block array (KV, then int8 scales), all layers, for a pool of the
        same layout."""
        payload = out if out is not None else np.empty((len(block_ids), self.kv_cache.block_nbytes),
                                                       np.uint8)
        ids = self.device.xp.asarray(np.asarray(block_ids, np.int32))
        for pool, rows in zip(self.kv_cache.block_arrays(), self._payload_rows(payload)):
            blocks = np.moveaxis(rows, 0, 2)  # (L, 2, n, *rest), a view into the payload
            if self.device.kind == "cpu":
                # straight into the payload: no temporary
                self.model.ops.gather_blocks(pool, ids, out=blocks)
            else:
                blocks[...] = self.device.to_host(self.model.ops.gather_blocks(pool, ids))
        return payload

    def write_blocks(self, block_ids: list[int], payload: np.ndarray) -> None:
        """Write read_blocks' rows into these blocks of this pool."""
        ids = self.device.xp.asarray(np.asarray(block_ids, np.int32))
        for pool, rows in zip(self.kv_cache.block_arrays(), self._payload_rows(payload)):
            self.model.ops.scatter_blocks(pool, ids,
                                          self.device.xp.asarray(np.moveaxis(rows, 0, 2)))
        self.device.synchronize()

    def _payload_rows(self, payload: np.ndarray) -> list[np.ndarray]:
        """Views of a payload's columns, one per block array: (n, L, 2, *rest) each."""
        views, start = [], 0
        for pool in self.kv_cache.block_arrays():
            shape = (len(payload), *pool.shape[:2], *pool.shape[3:])
            width = int(np.prod(shape[1:])) * pool.itemsize
            views.append(payload[:, start:start + width].view(pool.dtype).reshape(shape))
            start += width
        return views

    def use_adapters(self, adapters) -> None:
        """Add nano/lora's pool's LoRA product to each layer's projections."""
        self.adapters = adapters
        self.model.ops = adapters.op_set(self.model.ops)
        for weights, pools in zip(self.model.layers, adapters.layers):
            weights.lora = {proj: (a, b, adapters.scales) for proj, (a, b) in pools.items()}
        if self.graphs is not None:  # decode graphs captured before now run without the product
            self.graphs.captured.clear()

    # ---- inputs ------------------------------------------------------------------------
    def prepare(self, packed: np.ndarray) -> ForwardBatch | GraphStep | None:
        """Rank 0: a packed step (plan.py) sent to the other TP ranks (which replay it,
        fleet/worker.py), and put on the device."""
        self.broadcast(packed)
        return self.to_device(packed)

    def to_device(self, packed: np.ndarray) -> ForwardBatch | GraphStep | None:
        """A packed step's inputs on the device, None if no row runs: one host-to-device copy
        of the whole array, then views into it. A decode-only step that a CUDA graph can run
        goes into its bucket's static buffer instead (also one copy)."""
        n = packed_shape(packed)
        if n.seqs == 0:
            return None
        if self.adapters is not None:  # adapter ids -> this rank's slots, loaded if need be
            packed = self.adapters.place_step(packed, n)
        # Graphs run steps where every sequence has one token and a logits row (a one-token
        # prefill chunk short of the prompt's end has none, unless it scores the prompt).
        if (self.graphs is not None and n.tokens == n.decodes == n.logits
                and self.graphs.fits(n.seqs, n.max_blocks)):
            host = unpack_step(packed, n)
            return self.graphs.prepare(host["input_ids"], host["positions"], host["slot_mapping"],
                                       host["context_lens"], host["block_tables"],
                                       host["lora_slots"])
        return ForwardBatch.from_step(unpack_step(self.device.xp.asarray(packed), n), n.decodes)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, inputs: ForwardBatch | GraphStep):
        """Logits (R, V) of the rows that sample or score a prompt (plan.StepPlan's samples and
        scores)."""
        if isinstance(inputs, GraphStep):
            return self.graphs.replay(inputs)
        if self.blas_threads:
            self.blas_threads.choose()
        return self.model.forward(inputs, self.kv_cache)


def _columns(pairs) -> tuple[np.ndarray, np.ndarray]:
    """Block pairs (a list, or an (n, 2) array) -> the first blocks and the second blocks."""
    first, second = np.asarray(pairs, np.int32).reshape(-1, 2).T
    return np.ascontiguousarray(first), np.ascontiguousarray(second)
