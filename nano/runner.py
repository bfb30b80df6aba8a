"""Turns a scheduler plan into flat device arrays, runs the model, and owns the KV memory.

KV memory:
  kv_cache:   (num_layers, 2, num_blocks, nkv, block_size, d) on the device ([:, 0] K, [:, 1] V)
  host_cache: (num_layers, 2, num_swap_blocks, nkv, block_size, d) in host memory (swap space)
A swap moves all of a step's blocks in one gather + one device-host copy per direction.

On the GPU, decode-only steps replay CUDA graphs (graphs.py); prefill and mixed steps run
the model eagerly.
"""
import time

import numpy as np

from nano import ops
from nano.capacity import host_memory
from nano.graphs import DecodeGraphs, GraphStep
from nano.model import ForwardBatch
from nano.plan import SchedulerOutput
from nano.sequence import Sequence

PACKED_HEADER = 5  # pack()'s leading sizes: tokens, sequences, max blocks, decodes, logits rows


def select_device(name: str) -> str:
    """'auto' takes the GPU when CuPy sees one."""
    if name == "cpu":
        return "cpu"
    try:
        import cupy
        found = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean the same here
        found = False
    if name == "gpu" and not found:
        from nano.errors import NanoError
        raise NanoError("--device gpu: no CUDA device visible to CuPy")
    return "gpu" if found else "cpu"


def gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


class Device:
    """Where arrays live: NumPy float32 on the CPU, CuPy float16 on the GPU."""

    def __init__(self, kind: str, index: int = 0):
        self.kind = kind
        if kind == "gpu":
            import cupy
            cupy.cuda.Device(index).use()
            self.xp, self.dtype = cupy, np.float16
        else:
            self.xp, self.dtype = np, np.float32

    def put(self, host: np.ndarray, keep_float32: bool = False, gemm: bool = False):
        """gemm: a (N, K) weight that ops.linear multiplies by. On the CPU it is stored
        column-major, so x @ w.T is one plain GEMM with no transposed operand: measured on
        the 2-core CPU (default model, weights streamed from memory), a 1-sequence decode
        step took 25.5 ms instead of 28, and 32 rows no longer needed a copy of (w @ x.T).T."""
        dtype = np.float32 if keep_float32 else self.dtype
        if gemm and self.kind == "cpu":
            return np.asfortranarray(host, dtype=dtype)
        return self.xp.asarray(np.ascontiguousarray(host, dtype=dtype))

    def free_memory(self) -> int:
        """Bytes that can still be allocated on this device."""
        if self.kind == "gpu":
            return self.xp.cuda.runtime.memGetInfo()[0]
        return host_memory()[0]

    def to_host(self, arr) -> np.ndarray:
        return arr.get() if self.kind == "gpu" else arr

    def synchronize(self) -> None:
        if self.kind == "gpu":
            self.xp.cuda.get_current_stream().synchronize()


class ModelRunner:
    def __init__(self, model, device: Device, num_blocks: int, num_swap_blocks: int,
                 block_size: int, sampler, cuda_graphs: bool = False, max_num_seqs: int = 1,
                 max_model_len: int = 1):
        """cuda_graphs: on a GPU, replay decode steps of up to max_num_seqs sequences from
        CUDA graphs (graphs.py); block tables are then max_model_len / block_size wide."""
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sampler = sampler
        cfg = model.cfg
        shape = (cfg.num_layers, 2, num_blocks, model.num_kv_heads, block_size, cfg.head_dim)
        self.kv_cache = device.xp.zeros(shape, dtype=device.dtype)
        # np.zeros maps pages lazily: swap space costs host memory only once used.
        self.host_cache = np.zeros(shape[:2] + (num_swap_blocks,) + shape[3:], dtype=device.dtype)
        self.graphs = None
        if cuda_graphs and device.kind == "gpu":
            self.graphs = DecodeGraphs(model, self.kv_cache, max_num_seqs, -(-max_model_len // block_size))

    def touch_kv_cache(self) -> None:
        """Write every page of the KV pool now. On the CPU np.zeros maps pages on first write,
        which costs ~2 us per KB on this project's VMs (2.15 GB: 4.7 s): a 32-sequence decode
        step in which every sequence opened a new block paid ~55 ms of page faults. A server
        pays that once per block over its life; a benchmark pays it before timing. A GPU pool
        is written by cupy.zeros already."""
        if self.device.kind == "cpu":
            self.kv_cache.fill(0)

    # ---- swap --------------------------------------------------------------------------
    def swap(self, plan: SchedulerOutput) -> tuple[int, float]:
        """Copy preempted blocks out to host and returning ones back in.
        Out first: blocks freed by a swap-out may be refilled in this same step.
        Returns (bytes moved, seconds) for the cost model."""
        moved, start = 0, time.perf_counter()
        if plan.blocks_to_swap_out:
            dev, host = (np.array(x, dtype=np.int32) for x in zip(*plan.blocks_to_swap_out))
            staging = ops.gather_blocks(self.kv_cache, self.device.xp.asarray(dev))
            self.host_cache[:, :, host] = self.device.to_host(staging)
            moved += staging.nbytes
        if plan.blocks_to_swap_in:
            host, dev = (np.array(x, dtype=np.int32) for x in zip(*plan.blocks_to_swap_in))
            staging = self.device.xp.asarray(self.host_cache[:, :, host])
            ops.scatter_blocks(self.kv_cache, self.device.xp.asarray(dev), staging)
            moved += staging.nbytes
        if moved:
            self.device.synchronize()
        return moved, time.perf_counter() - start

    # ---- inputs ------------------------------------------------------------------------
    def pack(self, plan: SchedulerOutput) -> tuple[np.ndarray, list[Sequence]]:
        """Flatten the plan, decodes first, then prefill chunks, into one int32 host array
        (what rank 0 broadcasts under TP). Also returns the sequences that sample a token
        this step (those whose chunk reaches their end)."""
        scheduled = sorted(plan.scheduled, key=lambda item: item[1] != 1)  # stable: decodes first
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        bs = self.block_size
        ids, positions, context_lens, logits_indices, sampled = [], [], [], [], []
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        block_tables = np.full((len(scheduled), max_blocks), -1, dtype=np.int32)
        cu_seqlens = [0]
        for i, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions.append(np.arange(start, start + n, dtype=np.int32))
            context_lens.append(start + n)
            block_tables[i, :len(seq.block_table)] = seq.block_table
            if i >= num_decodes:
                cu_seqlens.append(cu_seqlens[-1] + n)
            if start + n == seq.num_tokens:
                logits_indices.append(len(ids) - 1)
                sampled.append(seq)
        positions = np.concatenate(positions)
        rows = np.repeat(np.arange(len(scheduled)), [n for _, n in scheduled])
        slot_mapping = block_tables[rows, positions // bs] * bs + positions % bs
        header = [len(ids), len(scheduled), max_blocks, num_decodes, len(logits_indices)]
        parts = [np.asarray(header, np.int32), np.asarray(ids, np.int32), positions,
                 slot_mapping.astype(np.int32), np.asarray(context_lens, np.int32),
                 block_tables.ravel(), np.asarray(cu_seqlens, np.int32),
                 np.asarray(logits_indices, np.int32)]
        return np.concatenate(parts), sampled

    def load(self, packed: np.ndarray) -> ForwardBatch | GraphStep:
        """Unpack pack()'s array: one host-to-device copy for all the step's metadata,
        then views into it. Its header gives the sizes of the parts that follow.
        A decode-only step that a CUDA graph can run goes into its bucket's static buffer
        instead (also one copy)."""
        tokens, seqs, max_blocks, num_decodes, rows = packed[:PACKED_HEADER].tolist()
        sizes = [tokens, tokens, tokens, seqs, seqs * max_blocks, seqs - num_decodes + 1, rows]
        offsets = np.cumsum([0] + sizes).tolist()
        # Graphs run steps where every sequence has one token and samples (a one-token
        # prefill chunk that does not reach the prompt's end has one token but no logits row).
        if (self.graphs is not None and tokens == num_decodes == rows
                and self.graphs.fits(seqs, max_blocks)):
            ids, pos, slots, ctx, tables = (packed[PACKED_HEADER + a:PACKED_HEADER + b]
                                            for a, b in zip(offsets[:5], offsets[1:6]))
            return self.graphs.prepare(ids, pos, slots, ctx, tables.reshape(seqs, max_blocks))
        flat = self.device.xp.asarray(packed[PACKED_HEADER:])
        ids, pos, slots, ctx, tables, cu, logits = (flat[a:b] for a, b in zip(offsets, offsets[1:]))
        return ForwardBatch(ids, pos, slots, num_decodes, ctx, tables.reshape(seqs, max_blocks),
                            cu, logits)

    # ---- forward + sample --------------------------------------------------------------
    def forward(self, batch: ForwardBatch | GraphStep):
        """Logits (R, V) of the rows that sample."""
        if isinstance(batch, GraphStep):
            return self.graphs.replay(batch)
        return self.model.forward(batch, self.kv_cache)

    def sample(self, logits, seqs: list[Sequence]) -> list[int]:
        return self.sampler.sample(logits, seqs)
