// Device helpers shared by the kernels in cuda/: the element types and their conversions,
// 16-byte moves of 8 elements, warp and block reductions, and staging one tile of a paged K/V
// cache (the element type or int8) into shared memory. nano/kernels.py compiles every .cu with
// this directory on the include path.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>  // CUDART_INF_F: NVRTC has no <cmath> INFINITY

#ifdef __CUDACC_RTC__
typedef signed char int8_t;  // NVRTC has no <cstdint>; the int8 KV cache's element type
#endif

#define NEG_INF (-CUDART_INF_F)

// The element types T of a run (--dtype): __half (float16) and __nv_bfloat16 (bfloat16), for
// weights, activations and a full-precision KV cache. Every kernel computes in float32 and
// rounds to T once per stored value (round to nearest even); Pair<T> is T's two-element vector.
template <typename T> struct Pair;
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <typename T> __device__ __forceinline__ typename Pair<T>::type from_floats(float a, float b);
template <> __device__ __forceinline__ __half2 from_floats<__half>(float a, float b) {
    return __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ __nv_bfloat162 from_floats<__nv_bfloat16>(float a, float b) {
    return __floats2bfloat162_rn(a, b);
}

// Elements p[0], p[1] as floats, and two floats rounded into them (p 4-byte aligned).
template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
    return to_float2(*reinterpret_cast<const typename Pair<T>::type*>(p));
}
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
    *reinterpret_cast<typename Pair<T>::type*>(p) = from_floats<T>(a, b);
}

// 8 elements <-> 8 floats through one 16-byte load or store (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
    for (int i = 0; i < 4; i++) {
        const float2 t = load2(e + 2 * i);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* f) {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
    for (int i = 0; i < 4; i++) store2(e + 2 * i, f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
}

// Byte n (0..3) of w as a signed int8 value.
__device__ __forceinline__ int int8_at(unsigned w, int n) {
    return (int)(w << (24 - 8 * n)) >> 24;
}

// 16 int8 values (one 16-byte load) -> 16 elements T at p (16-byte aligned), exactly: every
// int8 value is an integer that float16 and bfloat16 both hold.
template <typename T>
__device__ __forceinline__ void int8x16_to(const uint4 u, T* p) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
    float f[16];
    for (int i = 0; i < 16; i++) f[i] = (float)int8_at(w[i / 4], i % 4);
    store8(p, f);
    store8(p + 8, f + 8);
}

// Reduction operators: op(a, b) and the value that changes nothing.
struct Sum {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
    template <typename T> __device__ static T identity() { return T(0); }
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
    template <typename T> __device__ static T identity() { return NEG_INF; }
};

// Reduce over the 32 lanes of a warp; every lane gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T value, Op op) {
    for (int o = 16; o > 0; o >>= 1) value = op(value, __shfl_xor_sync(0xffffffff, value, o));
    return value;
}

// Reduce over the thread block (blockDim.x a multiple of 32); every thread gets the result.
// `shared` holds one T per warp.
template <typename T, typename Op>
__device__ T block_reduce(T value, Op op, T* shared) {
    value = warp_reduce(value, op);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // `shared` may still be read by a previous call
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    value = lane < blockDim.x / 32 ? shared[lane] : Op::template identity<T>();
    return warp_reduce(value, op);
}

// The first two steps of every tile of paged attention, for tokens first .. first + TILE - 1
// of one sequence and one KV head:
//   1. s_block[r] = the physical block of token first + r, or -1 for r >= rows (past the
//      tile's valid tokens) or past the block table;
//   2. K and V rows of the tile into s_k / s_v (rows K_ROW / V_ROW elements apart) with
//      16-byte loads: 8 elements, or 16 values of an int8 cache. Neighbouring threads load
//      neighbouring 16-byte chunks of a row: coalesced, since a run of tokens inside a block
//      is contiguous. A skipped row becomes zeros, so P @ V can multiply it by p = 0.
//      An int8 cache (CacheT int8_t) also stages each row's K and V scales, as float, in
//      s_kscale / s_vscale (0 for a skipped row), and its values go to shared memory either
//      as they are (TileT int8_t) or as the run's element type (TileT __half or
//      __nv_bfloat16; exact: an int8 value is an integer both hold). The scales are not applied here: the kernels fold them into the
//      scores (K) and the probabilities (V).
// Ends with a barrier: the tile is ready for every thread. UNROLL (0: all) bounds the rounds
// of loads in flight at once, for a caller whose registers are mostly taken.
template <int TILE, int HEAD_DIM, int K_ROW, int V_ROW, int NUM_THREADS, int UNROLL = 0, typename CacheT,
          typename TileT>
__device__ __forceinline__ void stage_kv_tile(
        TileT* s_k, TileT* s_v, float* s_kscale, float* s_vscale, int* s_block,
        const CacheT* __restrict__ k_cache, const CacheT* __restrict__ v_cache,
        const __half* __restrict__ k_scales, const __half* __restrict__ v_scales, const int* table,
        int max_blocks, int first, int rows, int kv_head, int nkv, int log2_block_size) {
    constexpr bool QUANTIZED = sizeof(CacheT) == 1;
    constexpr int PER_LOAD = 16 / sizeof(CacheT);  // cache values per 16-byte load
    constexpr int CHUNKS = HEAD_DIM / PER_LOAD;    // 16-byte chunks per row
    constexpr int WORK = TILE * CHUNKS;
    constexpr int ROUNDS = WORK / NUM_THREADS;
    static_assert(WORK % NUM_THREADS == 0, "every tile plan stages whole rounds of 16-byte loads");
    static_assert(TILE <= NUM_THREADS, "one thread per row in step 1");
    static_assert(sizeof(TileT) == sizeof(CacheT) || (QUANTIZED && sizeof(TileT) == 2),
                  "a copy, or int8 values to 16-bit elements");
    if (threadIdx.x < TILE) {
        const int logical = (first + threadIdx.x) >> log2_block_size;
        s_block[threadIdx.x] = (int)threadIdx.x < rows && logical < max_blocks ? table[logical] : -1;
    }
    __syncthreads();
    const int block_size = 1 << log2_block_size;
#pragma unroll(UNROLL ? UNROLL : ROUNDS)
    for (int j = 0; j < ROUNDS; j++) {
        const int i = threadIdx.x + j * NUM_THREADS;
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int block = s_block[r];
        uint4 kval = make_uint4(0, 0, 0, 0), vval = kval;
        float kscale = 0.0f, vscale = 0.0f;
        if (block >= 0) {
            const int offset = (first + r) & (block_size - 1);
            const long long row = ((long long)block * nkv + kv_head) * block_size + offset;
            kval = *reinterpret_cast<const uint4*>(k_cache + row * HEAD_DIM + c * PER_LOAD);
            vval = *reinterpret_cast<const uint4*>(v_cache + row * HEAD_DIM + c * PER_LOAD);
            if constexpr (QUANTIZED) {
                if (c == 0) {
                    kscale = __half2float(k_scales[row]);
                    vscale = __half2float(v_scales[row]);
                }
            }
        }
        if constexpr (QUANTIZED) {
            if (c == 0) {
                s_kscale[r] = kscale;
                s_vscale[r] = vscale;
            }
        }
        if constexpr (sizeof(TileT) == sizeof(CacheT)) {
            *reinterpret_cast<uint4*>(&s_k[r * K_ROW + c * PER_LOAD]) = kval;
            *reinterpret_cast<uint4*>(&s_v[r * V_ROW + c * PER_LOAD]) = vval;
        } else {
            int8x16_to(kval, &s_k[r * K_ROW + c * PER_LOAD]);
            int8x16_to(vval, &s_v[r * V_ROW + c * PER_LOAD]);
        }
    }
    __syncthreads();
}
