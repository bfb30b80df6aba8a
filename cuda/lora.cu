// Multi-LoRA: y[t] += scale[s] * B[s] (A[s] x[t]) for each row t whose sequence has an adapter
// slot s (-1 = none), every adapter of the step in one pass (the Punica and S-LoRA kernels'
// scheme). Pools of L slots, each adapter's rank zero-padded to the pool's R (nano/lora/pool.py):
//   x (T, K), y (T, N), A (L, R, K), B (L, N, R): the element type T (common.cuh); scales
//   (L,) float32; slots (S,) int32, one per sequence: the decode sequences first, one row
//   each (rows 0..D-1), then the prefill chunks, chunk c on rows D + cu[c] .. D + cu[c + 1] - 1
//   (cu: (S - D + 1,) int32, as for prefill attention).
// Two stages, a kernel each:
//   lora_shrink: v (T, R) float32 = A[s] x[t]   (scratch; rows without an adapter unwritten)
//   lora_expand: y[t] = round(y[t] + scale[s] * B[s] v[t])
// each in two instances, by ROWS, the rows a block serves with one slot:
//   ROWS == 1, BGMV (batched gather matrix-vector): decode row z = blockIdx.z, its own slot.
//   ROWS == 16, SGMV (segmented): prefill chunk z, rows blockIdx.y * 16 .. of it: each weight
//     element loaded once serves 16 rows. Grid y is sized for the longest possible chunk (all
//     prefill rows), since chunk lengths live on the GPU; a block past its chunk's end exits.
// Block 256 threads = 8 warps, a warp per output column (r of v, n of y): grid x = ceil(R / 8)
// or ceil(N / 8). Its lanes stride the reduction axis (K, or R), so a weight row's loads are
// coalesced; sums are float32, added across the warp at the end. No shared memory. Every
// launch shape comes from array shapes, so a decode step's CUDA graph captures both kernels.
#include "common.cuh"

constexpr int WARPS = 8;

// The rows [*begin, *end) this block serves and their slot; false when it serves none (past
// its chunk's end, or a sequence without an adapter).
template <int ROWS>
__device__ __forceinline__ bool block_rows(const int* slots, const int* cu, int decodes,
                                           int* begin, int* end, int* slot) {
    const int z = blockIdx.z;
    if (ROWS == 1) {
        *begin = z;
        *end = z + 1;
        *slot = slots[z];
    } else {
        *begin = decodes + cu[z] + (int)blockIdx.y * ROWS;
        *end = min(decodes + cu[z + 1], *begin + ROWS);
        *slot = slots[decodes + z];
    }
    return *slot >= 0 && *begin < *end;
}

// out[t, j] = (scale[s] or 1) * sum_i w[s, j, i] * in[t, i] (+ y[t, j] when expanding) for the
// block's rows t and the warp's column j; IN is the input's element type (T, or float for v).
template <typename T, int ROWS, typename IN, typename OUT>
__device__ __forceinline__ void gather_matvec(const IN* __restrict__ in, const T* __restrict__ w,
                                              const float* __restrict__ scales,
                                              OUT* __restrict__ out,
                                              const int* slots, const int* cu, int decodes,
                                              int in_width, int out_width) {
    int begin, end, slot;
    const int j = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (!block_rows<ROWS>(slots, cu, decodes, &begin, &end, &slot) || j >= out_width) return;
    const T* row = w + ((long long)slot * out_width + j) * in_width;
    float acc[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; i++) acc[i] = 0.0f;
    for (int c = lane; c < in_width; c += 32) {
        const float weight = to_float(row[c]);
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            if (begin + i < end) {
                const IN value = in[(long long)(begin + i) * in_width + c];
                if constexpr (sizeof(IN) == sizeof(float)) acc[i] += weight * value;
                else acc[i] += weight * to_float(value);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        const float sum = warp_reduce(acc[i], Sum());
        if (lane != 0 || begin + i >= end) continue;
        OUT* o = out + (long long)(begin + i) * out_width + j;
        if constexpr (sizeof(OUT) == sizeof(float)) *o = sum;
        else *o = from_float<T>(to_float(*o) + scales[slot] * sum);
    }
}

template <typename T, int ROWS>
__global__ void __launch_bounds__(256) lora_shrink(const T* __restrict__ x,
                                                   const T* __restrict__ a,
                                                   const float* __restrict__ scales,
                                                   float* __restrict__ v,
                                                   const int* __restrict__ slots,
                                                   const int* __restrict__ cu, int decodes,
                                                   int k_dim, int r_dim) {
    gather_matvec<T, ROWS>(x, a, scales, v, slots, cu, decodes, k_dim, r_dim);
}

template <typename T, int ROWS>
__global__ void __launch_bounds__(256) lora_expand(const float* __restrict__ v,
                                                   const T* __restrict__ b,
                                                   const float* __restrict__ scales,
                                                   T* __restrict__ y,
                                                   const int* __restrict__ slots,
                                                   const int* __restrict__ cu, int decodes,
                                                   int r_dim, int n_dim) {
    gather_matvec<T, ROWS>(v, b, scales, y, slots, cu, decodes, r_dim, n_dim);
}
