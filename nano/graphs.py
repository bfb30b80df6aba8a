"""CUDA graphs for decode steps: one graph per batch-size bucket, every bucket captured at the
first decode step (a run's warm-up, where it has one). A step of n decoding sequences replays
the smallest bucket >= n, rows n.. padded, its inputs views into the bucket's static int32
buffer (a packed step, plan.py); prefill and mixed steps stay eager. The buckets, the padding,
the memory pool, and why they are safe: docs/gpu-path.md#cuda-graphs-for-decode-steps.
"""
from dataclasses import dataclass

import numpy as np

from nano.model import ForwardBatch
from nano.plan import PackedShape, pack_step, unpack_step


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16)) if b <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


@dataclass
class GraphStep:
    """A decode step whose inputs are already in its bucket's static buffer."""
    bucket: int
    num_seqs: int


@dataclass
class _Captured:
    inputs: object   # the bucket's static int32 device buffer
    graph: object    # cupy.cuda.Graph
    logits: object   # (bucket, V): written by every replay


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_num_seqs: int, max_blocks: int):
        import cupy
        self.model, self.kv_cache = model, kv_cache
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = max_blocks  # block table width
        # capture cannot use the legacy default stream
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        self.captured: dict[int, _Captured] = {}

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_blocks <= self.max_blocks

    def shape(self, bucket: int) -> PackedShape:
        """A bucket's packed step: `bucket` one-token rows that all sample, no swaps."""
        return PackedShape(tokens=bucket, seqs=bucket, decodes=bucket, max_blocks=self.max_blocks,
                           logits=bucket)

    def layout(self, bucket: int, ids, positions, slots, context_lens, block_tables,
               lora_slots) -> np.ndarray:
        """The bucket's input buffer on the host: the step's n rows, then padding rows."""
        n, w = block_tables.shape

        def padded(real, pad):
            field = np.full(bucket, pad, np.int32)
            field[:n] = real
            return field

        tables = np.full((bucket, self.max_blocks), -1, np.int32)
        tables[:n, :w] = block_tables
        tables[n:, 0] = 0  # padding rows read block 0
        return pack_step(self.shape(bucket), blocks_to_swap_out=(), blocks_to_swap_in=(),
                         input_ids=padded(ids, 0), positions=padded(positions, 0),
                         slot_mapping=padded(slots, -1), context_lens=padded(context_lens, 1),
                         block_tables=tables, cu_seqlens_q=[0],  # no prefill chunk
                         logits_indices=np.arange(bucket),   # every row's (padding rows' ignored)
                         lora_slots=padded(lora_slots, -1))

    def prepare(self, ids, positions, slots, context_lens, block_tables, lora_slots) -> GraphStep:
        """Host arrays of a decode step (n rows) -> its bucket's static buffer, one copy."""
        n = len(ids)
        bucket = next(b for b in self.buckets if b >= n)
        host = self.layout(bucket, ids, positions, slots, context_lens, block_tables, lora_slots)
        if not self.captured:  # every bucket, largest first: no later step pays for a capture
            self.captured = {b: self._capture(b) for b in reversed(self.buckets)}
        self.captured[bucket].inputs.set(host)
        return GraphStep(bucket, n)

    def replay(self, step: GraphStep):
        """Replays on the current stream, after the input copy. Returns logits (n, V)."""
        captured = self.captured[step.bucket]
        captured.graph.launch()
        return captured.logits[:step.num_seqs]

    def _batch(self, inputs, bucket: int) -> ForwardBatch:
        return ForwardBatch.from_step(unpack_step(inputs, self.shape(bucket)), bucket)

    def _capture(self, bucket: int) -> _Captured:
        """Warm up (loads kernels, lets cuBLAS choose its algorithms, fills the graph pool with
        this bucket's buffers), then capture the same forward pass on the capture stream.
        The inputs are all padding rows, so neither run writes the KV cache."""
        import cupy
        none = np.zeros(0, np.int32)
        inputs = cupy.asarray(self.layout(bucket, none, none, none, none, none.reshape(0, 0), none))
        batch = self._batch(inputs, bucket)
        cupy.cuda.Device().synchronize()  # the input copy ran on the default stream
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.model.forward(batch, self.kv_cache)
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                logits = self.model.forward(batch, self.kv_cache)
            except Exception:
                try:  # leave capture mode; the forward pass's own error is the one to report
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            graph = self.stream.end_capture()
        self.stream.synchronize()
        return _Captured(inputs, graph, logits)
