// KV-cache writes (fused with RoPE, and int8 quantization) and swap staging.
//
// KV cache layout (nano/kv_cache.py): data (L, 2, num_blocks, nkv, block_size, d), [:, 0]
// keys, [:, 1] values, the run's element type or int8; one layer's k_cache / v_cache is (num_blocks, nkv,
// block_size, d). An int8 cache also has scales (L, 2, num_blocks, nkv, block_size) float16:
// one per (token, KV head), for K and for V, value = int8 * scale. One sequence's block for
// one KV head is block_size * d contiguous values, so attention reads whole 16-byte-aligned
// runs of memory, and one physical block of one layer's K (or V) is nkv * block_size * d
// contiguous values (and nkv * block_size contiguous scales), which is what a swap copies.
//
// rope_store_kvcache<T, CacheT> (T __half or __nv_bfloat16, the run's element type: q, k, v,
//   the norms' weights and q_out; CacheT T or int8_t): rotate-half RoPE on q and k, then k
//   and v into their cache slots, in one launch per layer. q (T, nq, d), k, v (T, nkv,
//   d) are views into the fused QKV output: rows strided (q_stride, kv_stride elements),
//   heads and dims contiguous. positions (T,) int32; cos_sin (max_pos, d) float32 = [cos |
//   sin]; slot_mapping (T,) int32, slot = block * block_size + offset, -1 = token already
//   cached (K/V not written). When qk_norm is set (Qwen3), each q and k head is first
//   RMS-normalized: x * rsqrt(mean(x^2) + eps) * weight, weight q_norm or k_norm (d,)
//   T, in float32 like the rest (d a power of two: its sum is a shuffle reduction).
//   When rotate is set, K and q are multiplied by H, the orthonormal Hadamard matrix
//   (ops.hadamard; d a power of two): q . k is unchanged.
//   q_out (T, nq, d) contiguous gets the rotated q.
//   int8: K and V are quantized per (token, KV head) exactly as ops.quantize: scale =
//   float16(max |x| / 127), value = rint(x / scale) clamped to +-127 (scale 0 -> 0), from
//   the float32 rotated values: nothing is rounded twice. k_scales /
//   v_scales: one layer's (num_blocks, nkv, block_size) float16, whatever T is (empty for a
//   T cache).
//   Grid T blocks (one per token), 128 threads. Work item = 8 (x[i], x[i + d/2]) pairs of one
//   head (q, k or v; two 16-byte loads); a head's d/16 items sit on neighbouring lanes of one
//   warp (d/16 divides 32 for d 64, 128 and 256, the int8 head dims, and for every
//   power-of-two d the norm and the rotation allow), so its sum of squares and max |x|
//   are shuffle reductions over them, and the rotation's butterflies across those lanes
//   are shuffles too. The loop runs whole rounds of 128 items, so every lane reaches every
//   shuffle.
// gather_blocks<Unit> / scatter_blocks<Unit>: between a pool (L, 2, num_blocks, *rest), any
//   element type (K/V data or scales), and a contiguous staging buffer (L, 2, n, *rest);
//   block_ids (n,) int32. Arrays are passed as bytes; Unit is the copy unit: uint4 when a
//   block's chunk (prod(rest) * itemsize bytes) is a multiple of 16, else unsigned short (a
//   block's scales are nkv * block_size * 2 bytes, under 16 for small blocks). Grid (n,
//   L * 2), block 256: one thread block per (block, layer*2 + k/v) copies `chunk` units.
//
// Requires d % 16 == 0 and 16-byte aligned rows (checked in nano/kernels.py). Offsets are
// 64-bit: a large cache has more than 2^31 elements. No kernel here uses shared memory.
#include "common.cuh"

// 8 floats through two 16-byte loads.
__device__ void load8f(const float* p, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 8 values as int8 at p (8-byte aligned): rint(x / scale) clamped to +-127, 0 when scale is 0.
__device__ __forceinline__ void store8_int8(int8_t* p, const float* x, float scale) {
    unsigned word[2] = {0, 0};
    for (int j = 0; j < 8; j++) {
        const float v = scale > 0.0f ? fminf(fmaxf(rintf(x[j] / scale), -127.0f), 127.0f) : 0.0f;
        word[j / 4] |= (unsigned)((int)v & 0xff) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(p) = make_uint2(word[0], word[1]);
}

template <typename T, typename CacheT>
__global__ void rope_store_kvcache(const T* __restrict__ q, const T* __restrict__ k,
                                   const T* __restrict__ v, long long q_stride,
                                   long long kv_stride, const int* __restrict__ positions,
                                   const float* __restrict__ cos_sin,
                                   const int* __restrict__ slot_mapping,
                                   const T* __restrict__ q_norm, const T* __restrict__ k_norm,
                                   int qk_norm, float eps, int rotate,
                                   T* __restrict__ q_out, CacheT* __restrict__ k_cache,
                                   CacheT* __restrict__ v_cache, __half* __restrict__ k_scales,
                                   __half* __restrict__ v_scales, int nq, int nkv,
                                   int block_size, int head_dim) {
    constexpr bool INT8 = sizeof(CacheT) == 1;
    const int token = blockIdx.x;
    const int half_dim = head_dim / 2;
    const int slot = slot_mapping[token];
    const long long block = slot / block_size;
    const int offset = slot % block_size;
    const float* cs = cos_sin + (long long)positions[token] * head_dim;
    const int pieces = half_dim / 8;  // 8-pair pieces per head
    // q heads always (attention needs them); k and v heads only when the token has a slot.
    const int items = (nq + (slot >= 0 ? 2 * nkv : 0)) * pieces;
    for (int first = 0; first < items; first += blockDim.x) {
        const int p = first + threadIdx.x;
        const int head = p / pieces, i = (p % pieces) * 8;
        const bool is_q = head < nq, is_v = head >= nq + nkv;
        const int kv = head - nq - (is_v ? nkv : 0);  // k or v: the KV head
        float y1[8] = {}, y2[8] = {};
        if (p < items) {
            const T* src = is_q ? q + token * q_stride + (long long)head * head_dim
                                     : (is_v ? v : k) + token * kv_stride + (long long)kv * head_dim;
            load8(src + i, y1);
            load8(src + half_dim + i, y2);
        }
        if (qk_norm) {
            // Sum of squares over the head: this item's 16 values (zeros past the end), then
            // its pieces' lanes; every lane takes part. V heads compute it and leave it.
            float sum_sq = 0.0f;
            for (int j = 0; j < 8; j++) sum_sq += y1[j] * y1[j] + y2[j] * y2[j];
            for (int o = 1; o < pieces; o <<= 1) sum_sq += __shfl_xor_sync(0xffffffff, sum_sq, o);
            if (p < items && !is_v) {
                const float inv_rms = rsqrtf(sum_sq / head_dim + eps);
                float w1[8], w2[8];
                load8((is_q ? q_norm : k_norm) + i, w1);
                load8((is_q ? q_norm : k_norm) + half_dim + i, w2);
                for (int j = 0; j < 8; j++) y1[j] *= inv_rms * w1[j], y2[j] *= inv_rms * w2[j];
            }
        }
        if (p < items && !is_v) {
            float x1[8], x2[8], cos[8], sin[8];
            for (int j = 0; j < 8; j++) x1[j] = y1[j], x2[j] = y2[j];
            load8f(cs + i, cos);
            load8f(cs + half_dim + i, sin);
            for (int j = 0; j < 8; j++) {
                y1[j] = x1[j] * cos[j] - x2[j] * sin[j];
                y2[j] = x2[j] * cos[j] + x1[j] * sin[j];
            }
        }
        if (rotate) {
            // x H for q and k heads (H the orthonormal Hadamard matrix, ops.hadamard): a
            // butterfly (a, b) -> (a + b, a - b) per bit of the channel index, then 1/sqrt(d).
            // Channel of y1[j] is 8 * piece + j, of y2[j] d/2 + 8 * piece + j: bits 0-2 are
            // j, the piece bits are lanes (shuffles; every lane takes part), the top bit is
            // y1 / y2.
            float r1[8], r2[8];
            for (int j = 0; j < 8; j++) r1[j] = y1[j], r2[j] = y2[j];
            for (int b = 1; b < 8; b <<= 1)
                for (int j = 0; j < 8; j++)
                    if (!(j & b)) {
                        const float a1 = r1[j], c1 = r1[j | b], a2 = r2[j], c2 = r2[j | b];
                        r1[j] = a1 + c1, r1[j | b] = a1 - c1, r2[j] = a2 + c2, r2[j | b] = a2 - c2;
                    }
            for (int o = 1; o < pieces; o <<= 1) {
                const bool upper = (p % pieces) & o;
                for (int j = 0; j < 8; j++) {
                    const float o1 = __shfl_xor_sync(0xffffffff, r1[j], o);
                    const float o2 = __shfl_xor_sync(0xffffffff, r2[j], o);
                    r1[j] = upper ? o1 - r1[j] : r1[j] + o1;
                    r2[j] = upper ? o2 - r2[j] : r2[j] + o2;
                }
            }
            if (!is_v) {
                const float norm = 1.0f / sqrtf((float)head_dim);
                for (int j = 0; j < 8; j++) {
                    y1[j] = (r1[j] + r2[j]) * norm;
                    y2[j] = (r1[j] - r2[j]) * norm;
                }
            }
        }
        float scale = 0.0f;
        if constexpr (INT8) {
            // max |x| over the head: this item's 16 values, then its pieces' lanes.
            float m = 0.0f;
            if (p < items && !is_q)
                for (int j = 0; j < 8; j++) m = fmaxf(m, fmaxf(fabsf(y1[j]), fabsf(y2[j])));
            for (int o = 1; o < pieces; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
            const __half stored = __float2half_rn(m / 127.0f);
            scale = __half2float(stored);
            if (p < items && !is_q && i == 0) {
                const long long row = (block * nkv + kv) * block_size + offset;
                (is_v ? v_scales : k_scales)[row] = stored;
            }
        }
        if (p >= items) continue;
        if (is_q) {
            T* dst = q_out + ((long long)token * nq + head) * head_dim;
            store8(dst + i, y1);
            store8(dst + half_dim + i, y2);
        } else {
            CacheT* dst = (is_v ? v_cache : k_cache) + ((block * nkv + kv) * block_size + offset) * head_dim;
            if constexpr (INT8) {
                store8_int8(dst + i, y1, scale);
                store8_int8(dst + half_dim + i, y2, scale);
            } else {
                store8(dst + i, y1);
                store8(dst + half_dim + i, y2);
            }
        }
    }
}

// Copies `chunk` units from src to dst.
template <typename Unit>
__device__ void copy_chunk(Unit* __restrict__ dst, const Unit* __restrict__ src, int chunk) {
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) dst[i] = src[i];
}

// pool[lk, block_ids[i]] -> staging[lk, i], where lk = layer * 2 + (0 keys | 1 values).
template <typename Unit>
__global__ void gather_blocks(const unsigned char* __restrict__ pool, unsigned char* __restrict__ staging,
                              const int* __restrict__ block_ids, int num_blocks, int n, int chunk) {
    const Unit* in = reinterpret_cast<const Unit*>(pool);
    Unit* out = reinterpret_cast<Unit*>(staging);
    const int i = blockIdx.x;
    const long long lk = blockIdx.y;
    const int block = block_ids[i];
    if (block < 0) return;
    copy_chunk(out + (lk * n + i) * chunk, in + (lk * num_blocks + block) * chunk, chunk);
}

// staging[lk, i] -> pool[lk, block_ids[i]]: the inverse of gather_blocks.
template <typename Unit>
__global__ void scatter_blocks(unsigned char* __restrict__ pool, const unsigned char* __restrict__ staging,
                               const int* __restrict__ block_ids, int num_blocks, int n, int chunk) {
    const Unit* in = reinterpret_cast<const Unit*>(staging);
    Unit* out = reinterpret_cast<Unit*>(pool);
    const int i = blockIdx.x;
    const long long lk = blockIdx.y;
    const int block = block_ids[i];
    if (block < 0) return;
    copy_chunk(out + (lk * num_blocks + block) * chunk, in + (lk * n + i) * chunk, chunk);
}
