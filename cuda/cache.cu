// KV-cache writes (fused with RoPE) and swap staging.
//
// KV cache layout: kv_cache (L, 2, num_blocks, nkv, block_size, d) float16, [:, 0] keys,
// [:, 1] values; one layer's k_cache / v_cache is (num_blocks, nkv, block_size, d). One
// sequence's block for one KV head is block_size * d contiguous halfs, so attention
// reads whole 16-byte-aligned runs of memory, and one physical block of one layer's K
// (or V) is nkv * block_size * d contiguous halfs, which is what a swap copies.
//
// rope_store_kvcache: rotate-half RoPE on q and k, then k and v into their cache slots, in
//   one launch (it replaces two copies, a RoPE kernel and a cache-write kernel: 4 launches
//   per layer, 3 of them saved). q (T, nq, d), k, v (T, nkv, d) are views into the fused
//   QKV output: rows strided (q_stride, kv_stride elements), heads and dims contiguous.
//   positions (T,) int32; cos_sin (max_pos, d) float32 = [cos | sin]; slot_mapping (T,)
//   int32, slot = block * block_size + offset, -1 = token already cached (K/V skipped).
//   q_out (T, nq, d) contiguous gets the rotated q. Grid T blocks (one per token); a
//   thread rotates 8 (x[i], x[i + d/2]) pairs at a time with 16-byte loads, then the
//   threads copy V as 16-byte chunks.
// gather_blocks / scatter_blocks: between kv_cache and a contiguous staging buffer
//   (L, 2, n, nkv, block_size, d); block_ids (n,) int32. Grid (n, L * 2): one thread
//   block per (block, layer*2 + k/v) copies nkv * block_size * d halfs as 16-byte chunks.
//
// Requires d % 16 == 0 and 16-byte aligned rows (checked in nano/kernels.py). Offsets are
// 64-bit: a large cache has more than 2^31 elements.
//
// Version v2 (rope_store_kvcache: RoPE fused into the cache write): 64 registers, gather and
// scatter 18, no spills (tests/kernel_resources.py). Not yet measured on a GPU; earlier
// versions are in docs/perf_notes.md.
#include "common.cuh"

// 8 floats through two 16-byte loads.
__device__ void load8f(const float* p, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

extern "C" __global__ void rope_store_kvcache(const __half* __restrict__ q,
                                              const __half* __restrict__ k,
                                              const __half* __restrict__ v,
                                              long long q_stride, long long kv_stride,
                                              const int* __restrict__ positions,
                                              const float* __restrict__ cos_sin,
                                              const int* __restrict__ slot_mapping,
                                              __half* __restrict__ q_out,
                                              __half* __restrict__ k_cache,
                                              __half* __restrict__ v_cache,
                                              int nq, int nkv, int block_size, int head_dim) {
    const int token = blockIdx.x;
    const int half_dim = head_dim / 2;
    const int slot = slot_mapping[token];
    const long long block = slot / block_size;
    const int offset = slot % block_size;
    const float* cs = cos_sin + (long long)positions[token] * head_dim;
    const int pieces = half_dim / 8;  // 8-pair pieces per head
    // q heads always (attention needs them); k heads only when the token has a slot.
    const int heads = nq + (slot >= 0 ? nkv : 0);
    for (int p = threadIdx.x; p < heads * pieces; p += blockDim.x) {
        const int head = p / pieces, i = (p % pieces) * 8;
        const __half* src;
        __half* dst;
        if (head < nq) {
            src = q + token * q_stride + (long long)head * head_dim;
            dst = q_out + ((long long)token * nq + head) * head_dim;
        } else {
            src = k + token * kv_stride + (long long)(head - nq) * head_dim;
            dst = k_cache + ((block * nkv + head - nq) * block_size + offset) * head_dim;
        }
        float x1[8], x2[8], cos[8], sin[8];
        load8(src + i, x1);
        load8(src + half_dim + i, x2);
        load8f(cs + i, cos);
        load8f(cs + half_dim + i, sin);
        float y1[8], y2[8];
        for (int j = 0; j < 8; j++) {
            y1[j] = x1[j] * cos[j] - x2[j] * sin[j];
            y2[j] = x2[j] * cos[j] + x1[j] * sin[j];
        }
        store8(dst + i, y1);
        store8(dst + half_dim + i, y2);
    }
    if (slot < 0) return;
    const int chunks_per_head = head_dim / 8;
    for (int c = threadIdx.x; c < nkv * chunks_per_head; c += blockDim.x) {
        const int head = c / chunks_per_head, part = (c % chunks_per_head) * 8;
        const long long src = token * kv_stride + (long long)head * head_dim + part;
        const long long dst = ((block * nkv + head) * block_size + offset) * head_dim + part;
        *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + src);
    }
}

// Copies `chunk` halfs (a multiple of 8) from src to dst in 16-byte pieces.
__device__ void copy_chunk(__half* __restrict__ dst, const __half* __restrict__ src, int chunk) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < chunk / 8; i += blockDim.x) d[i] = s[i];
}

// kv_cache[lk, block_ids[i]] -> staging[lk, i], where lk = layer * 2 + (0 keys | 1 values).
extern "C" __global__ void gather_blocks(const __half* __restrict__ kv_cache,
                                         __half* __restrict__ staging,
                                         const int* __restrict__ block_ids,
                                         int num_blocks, int n, int chunk) {
    const int i = blockIdx.x;
    const long long lk = blockIdx.y;
    const int block = block_ids[i];
    if (block < 0) return;
    copy_chunk(staging + (lk * n + i) * chunk, kv_cache + (lk * num_blocks + block) * chunk, chunk);
}

// staging[lk, i] -> kv_cache[lk, block_ids[i]]: the inverse of gather_blocks.
extern "C" __global__ void scatter_blocks(__half* __restrict__ kv_cache,
                                          const __half* __restrict__ staging,
                                          const int* __restrict__ block_ids,
                                          int num_blocks, int n, int chunk) {
    const int i = blockIdx.x;
    const long long lk = blockIdx.y;
    const int block = block_ids[i];
    if (block < 0) return;
    copy_chunk(kv_cache + (lk * num_blocks + block) * chunk, staging + (lk * n + i) * chunk, chunk);
}
