// Device helpers shared by the kernels in cuda/: 16-byte moves of 8 halfs, warp and block
// reductions, and staging one tile of a paged K/V cache into shared memory.
// nano/kernels.py compiles every .cu with this directory on the include path.
#pragma once
#include <cuda_fp16.h>
#include <math_constants.h>  // CUDART_INF_F: NVRTC has no <cmath> INFINITY

#define NEG_INF (-CUDART_INF_F)

// 8 halfs <-> 8 floats through one 16-byte load or store (p 16-byte aligned).
__device__ __forceinline__ void load8(const __half* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
    for (int i = 0; i < 4; i++) {
        const float2 t = __half22float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ void store8(__half* p, const float* f) {
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
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
//   2. K and V rows of the tile into s_k / s_v (rows ROW halfs apart) with 16-byte loads.
//      Neighbouring threads load neighbouring 16-byte chunks of a row: coalesced, since a
//      run of tokens inside a block is contiguous. A skipped row becomes zeros, so P @ V
//      can multiply it by p = 0.
// Ends with a barrier: the tile is ready for every thread.
template <int TILE, int HEAD_DIM, int ROW, int NUM_THREADS>
__device__ __forceinline__ void stage_kv_tile(
        __half* s_k, __half* s_v, int* s_block, const __half* __restrict__ k_cache,
        const __half* __restrict__ v_cache, const int* table, int max_blocks, int first, int rows,
        int kv_head, int nkv, int log2_block_size) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    static_assert(TILE <= NUM_THREADS && TILE * CHUNKS % NUM_THREADS == 0,
                  "one thread per row in step 1; whole rounds in step 2");
    if (threadIdx.x < TILE) {
        const int logical = (first + threadIdx.x) >> log2_block_size;
        s_block[threadIdx.x] = (int)threadIdx.x < rows && logical < max_blocks ? table[logical] : -1;
    }
    __syncthreads();
    const int block_size = 1 << log2_block_size;
#pragma unroll
    for (int j = 0; j < TILE * CHUNKS / NUM_THREADS; j++) {
        const int i = threadIdx.x + j * NUM_THREADS;
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int block = s_block[r];
        uint4 kval = make_uint4(0, 0, 0, 0), vval = kval;
        if (block >= 0) {
            const int offset = (first + r) & (block_size - 1);
            const long long src =
                (((long long)block * nkv + kv_head) * block_size + offset) * HEAD_DIM + c * 8;
            kval = *reinterpret_cast<const uint4*>(k_cache + src);
            vval = *reinterpret_cast<const uint4*>(v_cache + src);
        }
        *reinterpret_cast<uint4*>(&s_k[r * ROW + c * 8]) = kval;
        *reinterpret_cast<uint4*>(&s_v[r * ROW + c * 8]) = vval;
    }
    __syncthreads();
}
