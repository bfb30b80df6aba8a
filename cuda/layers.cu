// Per-token layers: RMSNorm (plain and fused with the residual add), the gated activations
// SiLU-and-multiply (SwiGLU) and GELU-and-multiply (GeGLU, Gemma) and embedding gather.
// Each a template over the element type T (__half or __nv_bfloat16, common.cuh): T in and out,
// float32 math. (RoPE lives in cache.cu, fused with the KV-cache write;
// greedy argmax in sampling.cu, as the temperature-0 case of sampling.)
//
// All arrays are row-major and contiguous.
// rms_norm:     x (T, H), weight (H,) -> out (T, H) = x * rsqrt(mean(x^2) + eps) * weight.
//               Grid T (a block per row), block 256; shared: 32 floats (block_reduce).
// add_rms_norm: x, residual (T, H) -> out = rms_norm(x + residual), new_residual = x + residual,
//               both (T, H), written in one pass. Grid T, block 256; shared: 32 floats.
// silu_mul:     gate_up (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up. One thread per
//               8 outputs: grid ceil(T * I / 8 / 256), block 256; no shared memory.
// gelu_tanh_mul: as silu_mul, out = gelu_tanh(gate) * up; both are gated() over an activation.
// embedding:    ids (T,) int32, table (V, H) -> out (T, H) = table[ids] * scale (Gemma 3's
//               sqrt(H), rounded to the element type as its checkpoints' code does; 1 is an
//               exact copy). Grid T, block 128; no shared memory.
//
// H and I must be multiples of 8 so rows can be moved as 16-byte uint4 chunks (checked in
// nano/kernels.py).
#include "common.cuh"

// out = src * inv_rms * weight over one row; each thread handles the same 8-value chunks it
// handled in its first pass, so it only re-reads what it wrote itself.
template <typename T>
__device__ void scale_row(const T* src, const T* __restrict__ weight, T* out,
                          int hidden, float inv_rms) {
    float f[8], w[8];
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        load8(src + c, f);
        load8(weight + c, w);
        for (int i = 0; i < 8; i++) f[i] = f[i] * inv_rms * w[i];
        store8(out + c, f);
    }
}

// out = x * rsqrt(mean(x^2) + eps) * weight. Reads the row twice; the second read hits cache.
template <typename T>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                         int hidden, float eps) {
    __shared__ float shared[32];
    const long long row = (long long)blockIdx.x * hidden;
    float f[8];
    float sum_sq = 0.0f;
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        load8(x + row + c, f);
        for (int i = 0; i < 8; i++) sum_sq += f[i] * f[i];
    }
    const float inv_rms = rsqrtf(block_reduce(sum_sq, Sum(), shared) / hidden + eps);
    scale_row(x + row, weight, out + row, hidden, inv_rms);
}

// new_residual = x + residual (rounded to T, as the next layer will read it);
// out = rms_norm(new_residual). Each thread re-reads only the chunks it wrote itself.
template <typename T>
__global__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ residual,
                             const T* __restrict__ weight, T* __restrict__ out,
                             T* __restrict__ new_residual, int hidden, float eps) {
    __shared__ float shared[32];
    const long long row = (long long)blockIdx.x * hidden;
    float f[8], r[8];
    float sum_sq = 0.0f;
    for (int c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        load8(x + row + c, f);
        load8(residual + row + c, r);
        for (int i = 0; i < 8; i++) f[i] = to_float(from_float<T>(f[i] + r[i]));
        store8(new_residual + row + c, f);
        for (int i = 0; i < 8; i++) sum_sq += f[i] * f[i];
    }
    const float inv_rms = rsqrtf(block_reduce(sum_sq, Sum(), shared) / hidden + eps);
    scale_row(new_residual + row, weight, out + row, hidden, inv_rms);
}

struct Silu {  // silu(g) = g * sigmoid(g)
    __device__ float operator()(float g) const { return g / (1.0f + __expf(-g)); }
};

struct GeluTanh {  // gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3)))
    __device__ float operator()(float g) const {
        return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
    }
};

// out[t, j] = act(gate[t, j]) * up[t, j], 8 outputs per thread; n8 = T * I / 8. A template
// over the activation, so each entry point below inlines its own.
template <typename T, typename Act>
__device__ void gated(const T* __restrict__ gate_up, T* __restrict__ out, int inter,
                      long long n8, Act act) {
    const long long i8 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i8 >= n8) return;
    const long long token = i8 * 8 / inter;
    const int j = (int)(i8 * 8 % inter);
    float g[8], u[8];
    load8(gate_up + token * 2 * inter + j, g);
    load8(gate_up + token * 2 * inter + inter + j, u);
    for (int i = 0; i < 8; i++) g[i] = act(g[i]) * u[i];
    store8(out + token * inter + j, g);
}

template <typename T>
__global__ void silu_mul(const T* __restrict__ gate_up, T* __restrict__ out, int inter, long long n8) {
    gated(gate_up, out, inter, n8, Silu());
}

template <typename T>
__global__ void gelu_tanh_mul(const T* __restrict__ gate_up, T* __restrict__ out, int inter,
                              long long n8) {
    gated(gate_up, out, inter, n8, GeluTanh());
}

// out[t] = table[ids[t]] * scale. An id outside [0, vocab) gives a zero row instead of reading
// out of bounds. A scale of 1 copies 16-byte chunks as they are.
template <typename T>
__global__ void embedding(const int* __restrict__ ids, const T* __restrict__ table,
                          T* __restrict__ out, int vocab, int hidden, float scale) {
    const int id = ids[blockIdx.x];
    uint4* dst = reinterpret_cast<uint4*>(out + (long long)blockIdx.x * hidden);
    const uint4* src = reinterpret_cast<const uint4*>(table + (long long)id * hidden);
    const bool valid = 0 <= id && id < vocab;
    const float s = to_float(from_float<T>(scale));
    for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
        uint4 u = valid ? src[c] : make_uint4(0, 0, 0, 0);
        if (s != 1.0f) {
            float f[8];
            load8(reinterpret_cast<const T*>(&u), f);
            for (int i = 0; i < 8; i++) f[i] *= s;
            store8(reinterpret_cast<T*>(&u), f);
        }
        dst[c] = u;
    }
}
