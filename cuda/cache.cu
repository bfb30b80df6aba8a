// KV-cache writes and swap staging.
//
// KV cache layout: kv_cache (L, 2, num_blocks, nkv, block_size, d) float16, [:, 0] keys,
// [:, 1] values; one layer's k_cache / v_cache is (num_blocks, nkv, block_size, d). One
// sequence's block for one KV head is block_size * d contiguous halfs, so attention
// reads whole 16-byte-aligned runs of memory, and one physical block of one layer's K
// (or V) is nkv * block_size * d contiguous halfs, which is what a swap copies.
//
// store_kvcache: k, v (T, nkv, d) contiguous; slot_mapping (T,) int32, slot =
//   block * block_size + offset, -1 = token already cached (skipped).
//   Grid T blocks (one per token), threads stride over nkv * d / 8 16-byte chunks.
// gather_blocks / scatter_blocks: between kv_cache and a contiguous staging buffer
//   (L, 2, n, nkv, block_size, d); block_ids (n,) int32. Grid (n, L * 2): one thread
//   block per (block, layer*2 + k/v) copies nkv * block_size * d halfs as 16-byte chunks.
//
// Requires d % 8 == 0 (checked in nano/kernels.py). Offsets are 64-bit: a large cache
// has more than 2^31 elements.
//
// Versions:
//   v1: store_kvcache 30 regs, gather/scatter 18 regs, 0 spills (nvcc 13.0, sm_90).
//       Not yet measured on a GPU.
#include <cuda_fp16.h>

extern "C" __global__ void store_kvcache(const __half* __restrict__ k,
                                         const __half* __restrict__ v,
                                         __half* __restrict__ k_cache,
                                         __half* __restrict__ v_cache,
                                         const int* __restrict__ slot_mapping,
                                         int nkv, int block_size, int head_dim) {
    const int token = blockIdx.x;
    const int slot = slot_mapping[token];
    if (slot < 0) return;  // this token's KV is already in the cache
    const long long block = slot / block_size;
    const int offset = slot % block_size;
    const int chunks_per_head = head_dim / 8;
    const int chunks = nkv * chunks_per_head;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int head = c / chunks_per_head;
        const int part = c % chunks_per_head;
        const long long src = ((long long)token * nkv + head) * head_dim + part * 8;
        const long long dst = ((block * nkv + head) * block_size + offset) * head_dim + part * 8;
        *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + src);
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
