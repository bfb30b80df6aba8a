"""The CUDA side of nano/ops.py: one function per op, same name, same arguments, and the
op set of a GPU run (CUDA, at the end; only a GPU run imports this module).

Each file in cuda/ is compiled once per process by NVRTC (cupy.RawModule); this module only
allocates outputs, checks dtypes and shapes, and picks launch configurations (the kernel
sources explain the algorithms). Importing it needs CuPy but no GPU, so CI compiles every
kernel on a machine without one. Dtypes, launches and split-KV decode: docs/gpu-path.md.
"""
import functools
import os
from pathlib import Path

import cupy
import numpy as np

from nano import cublas, ops
from nano.checks import INT32_MAX
from nano.device import BFLOAT16

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"

# Every kernel is a template over the run's element type T (cuda/common.cuh): float16, or
# bfloat16 held as its bits in uint16 arrays (CuPy has no bfloat16 dtype). dtype -> T.
ELEMENT_TYPES = {np.dtype(np.float16): "__half", BFLOAT16: "__nv_bfloat16"}
# Attention kernels are templates also over the head dim, the GQA group size (query heads per
# KV head) and the cache's element type (T, or int8_t), so their loops and register arrays have
# compile-time bounds. An int8 cache needs one of HEAD_DIMS also for its writes.
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
# TILE_TOKENS in cuda/decode_paths.cuh: the decode kernel's largest tile, in tokens
DECODE_TILE = 64
# ROWS in cuda/prefill_attention.cu by head dim: (token, head) rows per block, 16 per warp
PREFILL_ROWS = {64: 64, 128: 64, 256: 32}
SWAP_UNITS = {16: "uint4", 2: "unsigned short"}  # copy unit of gather/scatter_blocks, in bytes
LORA_ROWS = 16  # the rows a block of cuda/lora.cu's SGMV instance serves; the BGMV one serves 1

_PAIRS = [(t, c) for t in ELEMENT_TYPES.values() for c in (t, "int8_t")]  # (T, CacheT)
# Each source in cuda/ and the template instances compiled of it (kernel names them so).
_TEMPLATES = {
    "layers.cu": [f"{k}<{t}>" for t in ELEMENT_TYPES.values()
                  for k in ("rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "embedding")],
    "sampling.cu": [f"{k}<{t}>" for t in ELEMENT_TYPES.values()
                    for k in ("sample", "edit_logits", "mask_logits")],
    "cache.cu": [f"rope_store_kvcache<{t}, {c}>" for t, c in _PAIRS]
    + [f"{k}<{u}>" for k in ("gather_blocks", "scatter_blocks") for u in SWAP_UNITS.values()],
    "paged_attention.cu": [f"paged_attention_kernel<{d}, {g}, {t}, {c}>"
                           for t, c in _PAIRS for d in HEAD_DIMS for g in GROUPS],
    "prefill_attention.cu": [f"prefill_attention_kernel<{d}, {g}, {t}, {c}>"
                             for t, c in _PAIRS for d in HEAD_DIMS for g in GROUPS],
    "lora.cu": [f"{k}<{t}, {rows}>" for t in ELEMENT_TYPES.values()
                for k in ("lora_shrink", "lora_expand") for rows in (1, LORA_ROWS)],
}


@functools.cache
def _options() -> tuple:
    """NVRTC options: C++17, cuda/ (for common.cuh) and the directory holding cuda_fp16.h and
    cuda_bf16.h, which NVRTC 13 does not find by itself (the CUDA toolkit CuPy uses, or the
    nvidia-cuda-runtime wheel's include/)."""
    toolkit = cupy.cuda.get_cuda_path()  # None without one
    candidates = [os.path.join(toolkit, "include")] if toolkit else []
    candidates += map(os.path.dirname, cublas.wheel_files("**", "include", "cuda_fp16.h"))
    for include in candidates:
        if os.path.isfile(os.path.join(include, "cuda_fp16.h")):
            return ("-std=c++17", f"-I{CUDA_DIR}", f"-I{include}")
    raise RuntimeError("cuda_fp16.h not found: install the CUDA toolkit or nvidia-cuda-runtime")


def _type_of(instance: str) -> str | None:
    """The element type T an instance names, or None (the swap kernels name none)."""
    return next((t for t in ELEMENT_TYPES.values() if t in instance), None)


@functools.cache
def _module(name: str, t: str | None) -> cupy.RawModule:
    """One source's instances of one element type: a run compiles only its own type's."""
    return cupy.RawModule(code=(CUDA_DIR / name).read_text(), options=_options(), backend="nvrtc",
                          name_expressions=[e for e in _TEMPLATES[name] if _type_of(e) == t])


@functools.cache  # get_function builds a new RawKernel each call: host time on every eager launch
def kernel(source: str, name: str):
    """The kernel name (a template instance as _TEMPLATES spells it) of cuda/source, compiled
    on first use; add-ons launch their own kernels through it too."""
    return _module(source, _type_of(name)).get_function(name)


@functools.cache
def _num_sms() -> int:
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def check_dtype(dtype, **arrays):
    for name, array in arrays.items():
        if array.dtype != dtype:
            raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {array.dtype}")


def element_type(**arrays) -> str:
    """T of arrays that share one element type (float16, or bfloat16 bits; anything else is
    refused as not float16)."""
    dtype = np.dtype(next(iter(arrays.values())).dtype)
    check_dtype(dtype if dtype in ELEMENT_TYPES else np.float16, **arrays)
    return ELEMENT_TYPES[dtype]


def _check_cache(cache, op: str, dtype):
    """One layer's LayerKV: k, v (num_blocks, nkv, block_size, d) of the element dtype
    without scales, or int8 with k_scale, v_scale (num_blocks, nkv, block_size) float16; all
    contiguous. Returns (CacheT, scale arrays for the kernels: the real ones, or empty float16
    arrays the T instances never read)."""
    k, v = cache.k, cache.v
    if k.dtype != v.dtype or k.dtype not in (dtype, np.int8):
        raise TypeError(f"{op}: KV cache must be {np.dtype(dtype)} or int8 (k and v alike), got "
                        f"{k.dtype} / {v.dtype}")
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must be (num_blocks, nkv, block_size, head_dim), got "
                         f"{k.shape} / {v.shape}")
    quantized = k.dtype == np.int8
    scales = (cache.k_scale, cache.v_scale)
    if quantized:
        d = k.shape[3]
        if d not in HEAD_DIMS:
            raise ValueError(f"{op}: an int8 KV cache supports head_dim {HEAD_DIMS}, got {d}")
        for name, s in zip(("k_scale", "v_scale"), scales):
            if s is None:
                raise ValueError(f"{op}: an int8 KV cache needs {name}")
            check_dtype(cupy.float16, **{name: s})
            if s.shape != k.shape[:3] or not s.flags.c_contiguous:
                raise ValueError(f"{op}: {name} must be contiguous {k.shape[:3]}, got {s.shape}")
    elif any(s is not None for s in scales):
        raise ValueError(f"{op}: a {k.dtype} KV cache has no scales")
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError(f"{op}: KV caches must be contiguous")
    if not quantized:
        scales = (cupy.empty(0, cupy.float16),) * 2  # never read by the T instances
    return "int8_t" if quantized else ELEMENT_TYPES[np.dtype(dtype)], scales


def _check_attention(q, cache, nq, d, op):
    t = element_type(q=q)
    cache_type, scales = _check_cache(cache, op, q.dtype)
    num_blocks, nkv, block_size, cache_d = cache.k.shape
    if cache_d != d:
        raise ValueError(f"{op}: q has head_dim {d}, the cache {cache_d}")
    if d not in HEAD_DIMS or nq % nkv or nq // nkv not in GROUPS:
        raise ValueError(f"attention supports head_dim {HEAD_DIMS} and {GROUPS} query heads "
                         f"per KV head, got head_dim {d}, {nq} / {nkv} heads")
    if block_size & (block_size - 1):
        raise ValueError("KV caches must have a power-of-two block size")
    return nq // nkv, block_size.bit_length() - 1, f"{t}, {cache_type}", scales


def _check_rows(name, width):
    if width % 8:
        raise ValueError(f"{name} must be a multiple of 8 (rows move as 16-byte chunks), got "
                         f"{width}")


# ---------------------------------------------------------------- layers.cu

def embedding(ids, table, scale=1.0):
    """The kernel rounds the scale to the table's type first, as the checkpoints' code does."""
    check_dtype(cupy.int32, ids=ids)
    t = element_type(table=table)
    vocab, hidden = table.shape
    _check_rows("hidden size", hidden)
    out = cupy.empty((ids.size, hidden), table.dtype)
    if ids.size:
        kernel("layers.cu", f"embedding<{t}>")(
            (ids.size,), (128,), (cupy.ascontiguousarray(ids), cupy.ascontiguousarray(table), out,
                                  np.int32(vocab), np.int32(hidden), np.float32(scale)))
    return out


def rms_norm(x, weight, eps):
    t = element_type(x=x, weight=weight)
    x = cupy.ascontiguousarray(x)
    tokens, hidden = x.shape
    _check_rows("hidden size", hidden)
    out = cupy.empty_like(x)
    if tokens:
        kernel("layers.cu", f"rms_norm<{t}>")(
            (tokens,), (256,), (x, weight, out, np.int32(hidden), np.float32(eps)))
    return out


def add_rms_norm(x, residual, weight, eps):
    if residual is None:  # first layer: the residual stream starts as x
        return rms_norm(x, weight, eps), x
    t = element_type(x=x, residual=residual, weight=weight)
    x, residual = cupy.ascontiguousarray(x), cupy.ascontiguousarray(residual)
    tokens, hidden = x.shape
    _check_rows("hidden size", hidden)
    out, new_residual = cupy.empty_like(x), cupy.empty_like(x)
    if tokens:
        kernel("layers.cu", f"add_rms_norm<{t}>")(
            (tokens,), (256,),
            (x, residual, weight, out, new_residual, np.int32(hidden), np.float32(eps)))
    return out, new_residual


def linear(x, weight, bias=None):
    """cuBLAS GemmEx through ctypes (nano/cublas.py): float16 or bfloat16 operands, float32
    accumulation, one rounding of the result. A bias is copied into the output first and added
    by the GEMM (beta 1), in float32. Capturable into a CUDA graph, unlike cupy.matmul."""
    element_type(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    if x.strides[1] != x.itemsize:
        x = cupy.ascontiguousarray(x)
    weight = cupy.ascontiguousarray(weight)
    out = cupy.empty((x.shape[0], weight.shape[0]), x.dtype)
    if bias is not None:
        out[...] = bias
    if out.size:
        cublas.handle(cupy.cuda.Device().id).linear(x, weight, out, bias is not None)
    return out


def _gated(name, gate_up):
    t = element_type(gate_up=gate_up)
    gate_up = cupy.ascontiguousarray(gate_up)
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    _check_rows("intermediate size", inter)
    out = cupy.empty((tokens, inter), gate_up.dtype)
    n8 = tokens * inter // 8  # one thread per 8 outputs
    if n8:
        kernel("layers.cu", f"{name}<{t}>")(((n8 + 255) // 256,), (256,),
                                  (gate_up, out, np.int32(inter), np.int64(n8)))
    return out


silu_mul = functools.partial(_gated, "silu_mul")
gelu_tanh_mul = functools.partial(_gated, "gelu_tanh_mul")


def sample(logits, temperature, top_k, top_p, log_min_p, seeds, counters):
    """cuda/sampling.cu: grid R (one row per block), 1024 threads."""
    t = element_type(logits=logits)
    check_dtype(cupy.float32, temperature=temperature, top_p=top_p, log_min_p=log_min_p)
    check_dtype(cupy.int32, top_k=top_k, counters=counters)
    check_dtype(cupy.uint64, seeds=seeds)
    rows_params = (temperature, top_k, top_p, log_min_p, seeds, counters)
    logits = cupy.ascontiguousarray(logits)
    rows, vocab = logits.shape
    out = cupy.empty((rows,), cupy.int32)
    if rows:
        kernel("sampling.cu", f"sample<{t}>")(
            (rows,), (1024,),
            (logits, np.int32(vocab), *(cupy.ascontiguousarray(x) for x in rows_params), out))
    return out


def edit_logits(logits, rows, tokens, biases, penalties, shifts):
    """cuda/sampling.cu: a thread per edit, in place on contiguous logits (the step's)."""
    t = element_type(logits=logits)
    check_dtype(cupy.int32, rows=rows, tokens=tokens)
    check_dtype(cupy.float32, biases=biases, penalties=penalties, shifts=shifts)
    if n := len(rows):
        kernel("sampling.cu", f"edit_logits<{t}>")(((n + 255) // 256,), (256,), (
            logits, np.int32(logits.shape[1]), rows, tokens, biases, penalties, shifts,
                                                                            np.int32(n)))
    return logits


def mask_logits(logits, rows, masks):
    """cuda/sampling.cu: grid (M, ceil(V / 256)), a thread per token, in place."""
    t = element_type(logits=logits)
    check_dtype(cupy.int32, rows=rows, masks=masks)
    if len(rows):
        kernel("sampling.cu", f"mask_logits<{t}>")(
            (len(rows), (logits.shape[1] + 255) // 256), (256,),
            (logits, np.int32(logits.shape[1]), rows, masks))
    return logits


# ---------------------------------------------------------------- cache.cu

def rope_store_kvcache(q, k, v, positions, cos_sin, cache, slot_mapping, q_norm=None, k_norm=None,
                       eps=0.0):
    """q, k, v may be views into the fused QKV output: rows strided (k and v alike), each row's
    heads and dims contiguous and 16-byte aligned. cache: one layer's LayerKV, of q's type or
    int8 (quantized here, per (token, KV head)), with or without the Hadamard key rotation;
    q_norm, k_norm (d,) of q's type or None. Returns the rotated q (Hadamard-rotated too),
    contiguous."""
    t = element_type(q=q, k=k, v=v)
    cache_type, (k_scale, v_scale) = _check_cache(cache, "rope_store_kvcache", q.dtype)
    check_dtype(cupy.int32, positions=positions, slot_mapping=slot_mapping)
    check_dtype(cupy.float32, cos_sin=cos_sin)
    tokens, nq, d = q.shape
    nkv = k.shape[1]
    if d % 16:
        raise ValueError(f"rope_store_kvcache: head_dim must be a multiple of 16, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        # A length-1 heads axis (one KV head per TP rank, or MQA) carries whatever stride
        # CuPy's reshape gives it (the row stride); the kernel never steps along it.
        heads_ok = x.shape[1] == 1 or x.strides[1] == d * 2
        if not heads_ok or x.strides[2] != 2 or x.strides[0] % 16 or x.data.ptr % 16:
            raise ValueError(f"rope_store_kvcache: {name} needs contiguous, 16-byte aligned rows "
                             f"of heads, strides {x.strides}")
    if k.strides[0] != v.strides[0]:
        raise ValueError("rope_store_kvcache: k and v must have the same row stride")
    if cache.k.shape[1] != nkv or cache.k.shape[3] != d or nq % nkv:
        raise ValueError(f"rope_store_kvcache: {nq} query and {nkv} KV heads of {d} dims do not "
                         f"match the cache {cache.k.shape}")
    rotate, norms = bool(getattr(cache, "k_rotate", False)), q_norm is not None
    # a head's lanes: a power of two up to a warp
    if (rotate or norms) and (d & (d - 1) or d > 512):
        raise ValueError(f"rope_store_kvcache: the Hadamard key rotation and the q/k norm need a "
                         f"power-of-two head_dim up to 512, got {d}")
    if norms:
        check_dtype(q.dtype, q_norm=q_norm, k_norm=k_norm)
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w.shape != (d,) or not w.flags.c_contiguous:
                raise ValueError(f"rope_store_kvcache: {name} must be contiguous ({d},), got "
                                 f"{w.shape}")
    else:
        q_norm = k_norm = cupy.empty(0, q.dtype)  # never read
    out = cupy.empty((tokens, nq, d), q.dtype)
    if tokens:
        kernel("cache.cu", f"rope_store_kvcache<{t}, {cache_type}>")(
            (tokens,), (128,), (q, k, v, np.int64(q.strides[0] // 2), np.int64(k.strides[0] // 2),
                                cupy.ascontiguousarray(positions), cupy.ascontiguousarray(cos_sin),
                                cupy.ascontiguousarray(slot_mapping), q_norm, k_norm,
                                np.int32(norms),
                                np.float32(eps), np.int32(rotate), out, cache.k, cache.v,
                                k_scale, v_scale,
                                np.int32(nq), np.int32(nkv), np.int32(cache.k.shape[2]),
                                np.int32(d)))
    return out


def _swap(name, pool, block_ids, staging):
    """One thread block per (block, layer * 2 + k/v); each copies one block of one layer's
    K or V (or their scales): prod(pool.shape[3:]) contiguous elements, moved as bytes in
    16-byte units where the block's bytes and both buffers allow, else 2-byte units."""
    check_dtype(cupy.int32, block_ids=block_ids)
    if staging.dtype != pool.dtype:
        raise TypeError(f"gather/scatter_blocks: staging must be {pool.dtype}, got {staging.dtype}")
    if pool.ndim < 3 or staging.shape != pool.shape[:2] + (block_ids.size,) + pool.shape[3:]:
        raise ValueError(f"gather/scatter_blocks: pool {pool.shape} (L, 2, num_blocks, ...) and "
                         f"staging "
                         f"{staging.shape} do not match {block_ids.size} blocks")
    if not (pool.flags.c_contiguous and staging.flags.c_contiguous):
        raise ValueError("gather/scatter_blocks: pool and staging must be contiguous")
    layers, two, num_blocks = pool.shape[:3]
    chunk = int(np.prod(pool.shape[3:], dtype=np.int64)) * pool.dtype.itemsize  # bytes per block
    aligned = pool.data.ptr % 16 == 0 and staging.data.ptr % 16 == 0
    unit = 16 if chunk % 16 == 0 and aligned else 2
    if chunk % unit or pool.data.ptr % unit or staging.data.ptr % unit:
        raise ValueError(f"gather/scatter_blocks: a block of {chunk} bytes cannot move in 2-byte "
                         f"units")
    n = block_ids.size
    if n and chunk:
        kernel("cache.cu", f"{name}<{SWAP_UNITS[unit]}>")(
            (n, layers * two), (256,), (pool.view(cupy.uint8), staging.view(cupy.uint8),
                                        cupy.ascontiguousarray(block_ids), np.int32(num_blocks),
                                        np.int32(n), np.int32(chunk // unit)))


def gather_blocks(pool, block_ids):
    """pool: (L, 2, num_blocks, *rest), any dtype (K/V data or scales) -> (L, 2, n, *rest)."""
    staging = cupy.empty(pool.shape[:2] + (block_ids.size,) + pool.shape[3:], pool.dtype)
    _swap("gather_blocks", pool, block_ids, staging)
    return staging


def scatter_blocks(pool, block_ids, staging):
    _swap("scatter_blocks", pool, block_ids, cupy.ascontiguousarray(staging))


# ---------------------------------------------------------------- attention

def decode_partitions(num_blocks: int, max_context: int, num_sms: int) -> tuple:
    """Split-KV choice for decode: returns (partitions, partition_size in tokens), about 4
    grid blocks per SM when num_blocks (sequences * KV heads) leaves SMs idle. `max_context`
    is an upper bound taken from shapes, so choosing never waits for the GPU (docs/gpu-path.md)."""
    if num_blocks >= 2 * num_sms or max_context <= 2 * DECODE_TILE:
        return 1, max(max_context, 1)
    wanted = -(-4 * num_sms // num_blocks)
    size = -(-max_context // wanted)
    size = max(2 * DECODE_TILE, -(-size // DECODE_TILE) * DECODE_TILE)
    return -(-max_context // size), size


def paged_attention(q, cache, block_tables, context_lens, scale, window=None):
    """Decode attention (cuda/paged_attention.cu) over one layer's LayerKV, of q's type or int8.
    Grid (nkv, S, partitions), 128 threads; with more than one partition, the last of a
    (sequence, KV head) to finish merges them. A window bounds the keys each sequence reads,
    so the partitions are chosen for the window's length, not the context's."""
    seqs, nq, d = q.shape
    nkv = cache.k.shape[1]
    group, log2_block_size, types, (k_scale, v_scale) = _check_attention(q, cache, nq, d,
                                                                         "paged_attention")
    check_dtype(cupy.int32, block_tables=block_tables, context_lens=context_lens)
    q, block_tables, context_lens = (cupy.ascontiguousarray(x) for x in (q, block_tables,
                                                                         context_lens))
    out = cupy.empty_like(q)
    if seqs == 0:
        return out
    max_blocks = block_tables.shape[1]
    # keys read: at most the whole table
    window = min(window or INT32_MAX, max_blocks << log2_block_size)
    parts, size = decode_partitions(seqs * nkv, window, _num_sms())
    # Split-KV's partial answers and counters; empty, never read, with one partition. The
    # counters are zeroed by a memset, which a CUDA graph records as a memset, not a kernel.
    partial_out = cupy.empty((seqs, nq, parts, d) if parts > 1 else 0, cupy.float32)
    partial_max, partial_sum = cupy.empty((2, seqs, nq, parts) if parts > 1 else (2, 0),
                                          cupy.float32)
    done = cupy.zeros((seqs, nkv), cupy.int32) if parts > 1 else cupy.empty(0, cupy.int32)
    kernel("paged_attention.cu", f"paged_attention_kernel<{d}, {group}, {types}>")(
        (nkv, seqs, parts), (128,),
        (out, partial_out, partial_max, partial_sum, q, cache.k, cache.v, k_scale, v_scale,
         block_tables, context_lens, done, np.int32(max_blocks), np.int32(log2_block_size),
         np.int32(size), np.int32(window), np.float32(scale)))
    return out


def prefill_attention(q, cache, cu_seqlens_q, block_tables, context_lens, scale, window=None):
    """Prefill attention (cuda/prefill_attention.cu) over one layer's LayerKV, of q's type or
    int8. Grid (ceil(T / tokens per block), nkv, S), a warp per 16 rows of PREFILL_ROWS,
    tokens per block = rows // group. The x extent is sized for the longest possible chunk
    (all T tokens) because chunk lengths live on the GPU; blocks past their chunk's end exit
    at once."""
    tokens, nq, d = q.shape
    group, log2_block_size, types, (k_scale, v_scale) = _check_attention(q, cache, nq, d,
                                                                         "prefill_attention")
    check_dtype(cupy.int32, cu_seqlens_q=cu_seqlens_q, block_tables=block_tables,
           context_lens=context_lens)
    q, cu_seqlens_q, block_tables, context_lens = (
        cupy.ascontiguousarray(x) for x in (q, cu_seqlens_q, block_tables, context_lens))
    out = cupy.empty_like(q)
    seqs = cu_seqlens_q.size - 1
    if tokens == 0 or seqs == 0:
        return out
    per_block = PREFILL_ROWS[d] // group
    kernel("prefill_attention.cu", f"prefill_attention_kernel<{d}, {group}, {types}>")(
        (-(-tokens // per_block), cache.k.shape[1], seqs), (2 * PREFILL_ROWS[d],),
        (out, q, cache.k, cache.v, k_scale, v_scale, cu_seqlens_q, block_tables, context_lens,
         np.int32(block_tables.shape[1]), np.int32(log2_block_size), np.int32(window or INT32_MAX),
         np.float32(scale)))
    return out


def attention(q, cache, batch, scale, window=None):
    """A step's attention (ops.step_attention) through these two kernels."""
    return ops.step_attention(q, cache, batch, scale, window, paged=paged_attention,
                              prefill=prefill_attention, concatenate=cupy.concatenate)


# The LoRA product's wrapper is nano/lora's (nano/lora/kernels.py), which puts it in a GPU
# engine's op set when adapters are attached: the core runs none by itself.
CUDA = ops.OpSet(linear, attention, fixed_threads=False, embedding=embedding,
                 add_rms_norm=add_rms_norm,
                 rope_store_kvcache=rope_store_kvcache, silu_mul=silu_mul,
                 gelu_tanh_mul=gelu_tanh_mul, sample=sample,
                 edit_logits=edit_logits, mask_logits=mask_logits, gather_blocks=gather_blocks,
                 scatter_blocks=scatter_blocks, add_lora=None)
