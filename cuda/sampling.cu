// Next-token sampling on the device: one thread block of 1024 threads per row of logits.
//
// Each kernel is a template over the logits' element type T (__half or __nv_bfloat16).
// sample: logits (R, V) T -> out (R,) int32, with per-row temperature (R,) float32,
//   top_k (R,) int32 (<= 0 or >= V: off), top_p (R,) float32 (1: off), log_min_p (R,) float32
//   (log of min_p, -inf: off), seeds (R,) uint64, counters (R,) int32 (the sequence's output
//   tokens so far). Grid R, block 1024.
// Before it, for the rows of requests that have a logits processor (nano/sampler.py):
// edit_logits: sparse edits in place, x -> x + bias, then (x > 0 ? x / penalty : x * penalty) +
//   shift, for each (row, token) listed (E,), a thread each; mask_logits: x -> -inf where a row's allowed-token
//   bitmask (M, ceil(V / 32)) int32 has the token's bit clear, grid (M, ceil(V / 256)).
//
// The algorithm, mirrored step for step by the NumPy reference ops.sample (nano/ops.py),
// which is also what the CPU engine runs; x = the row's logits as float32:
//   temperature 0: the index of the largest x, ties to the lowest index (greedy).
//   else, with keys key(x) that order like the floats (an order-preserving float->uint32 map):
//   0. min_p: t = key(max(x) + T * log(min_p)), the logits whose probability is at least
//      min_p times the largest one's.
//   1. top-k: t = the larger of t and the largest key with count(key >= it) >= k, found by
//      bisection on the 32-bit key range (at most 32 block reductions); exact: it is the k-th
//      largest key, so every logit tied with the k-th largest stays allowed.
//   2. top-p: e = exp(x / T - max(x) / T); Z = sum of e over keys >= t; then t = the largest
//      key >= t with sum(e over keys >= it) >= p * Z (bisection again): the nucleus.
//   3. Gumbel-max: the token is the allowed i with the largest x_i / T - log(-log(u_i)),
//      u_i = a hash of (seed, counter, i) mapped to (0, 1). argmax(x/T + Gumbel noise) is a
//      draw from softmax(x/T) over the allowed set: no sort, no prefix sum, one pass.
// Kernel and reference agree exactly except (a) two allowed tokens whose noisy scores are
// within float32 rounding of each other (logf / expf here vs NumPy's: ~1 ulp apart) and
// (b) a top-p nucleus whose mass is within float32 summation-order rounding of p * Z.
// Shared memory: 32 floats, 32 unsigned ints and 32 ints for the block reductions.
#include "common.cuh"

constexpr int THREADS = 1024;  // 32 warps: block_argmax below relies on it

// murmur3's 32-bit finalizer: a bijection whose output bits each depend on every input bit.
__device__ unsigned int fmix32(unsigned int h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

// Uniform in (0, 1): the top 23 bits of hash(row_key, i), offset by half a step so that
// neither 0 nor 1 can come out (both would make log(-log(u)) infinite). Exact in float32.
__device__ float uniform(unsigned int row_key, unsigned int i) {
    const unsigned int h = fmix32(row_key + i * 0x9E3779B9u);
    return ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
}

// Order-preserving map of a float to an unsigned int: a < b <=> key(a) < key(b).
__device__ unsigned int float_key(float x) {
    const unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Within a warp: the (value, index) pair with the largest value, ties to the lower index.
__device__ void warp_argmax(float& best, int& index) {
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffff, best, o);
        const int i = __shfl_xor_sync(0xffffffff, index, o);
        if (v > best || (v == best && i < index)) {
            best = v;
            index = i;
        }
    }
}

// The (value, index) pair with the largest value, ties to the lower index; every thread gets it.
__device__ int block_argmax(float best, int index, float* values, int* indices) {
    warp_argmax(best, index);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // `values` may be block_reduce's `shared`, still being read
    if (lane == 0) {
        values[warp] = best;
        indices[warp] = index;
    }
    __syncthreads();
    best = values[lane];
    index = indices[lane];
    warp_argmax(best, index);
    return index;
}

// How many logits of the row have key >= t (every thread gets it).
template <typename T>
__device__ unsigned int count_at_least(const T* row, int vocab, unsigned int t, unsigned int* shared) {
    unsigned int n = 0;
    for (int i = threadIdx.x; i < vocab; i += THREADS) n += float_key(to_float(row[i])) >= t;
    return block_reduce(n, Sum(), shared);
}

// Softmax mass (unnormalised: exp(x / T - s_max)) of the logits with key >= t.
template <typename T>
__device__ float mass_at_least(const T* row, int vocab, unsigned int t, float temperature,
                               float s_max, float* shared) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        const float x = to_float(row[i]);
        if (float_key(x) >= t) m += expf(x / temperature - s_max);
    }
    return block_reduce(m, Sum(), shared);
}

// Launch bounds (1024, 1): without the "1", ptxas may aim at two blocks per SM and cap the
// registers low enough to spill (docs/perf_notes.md); one block per SM is all the rows need.
template <typename T>
__global__ void __launch_bounds__(THREADS, 1) sample(
        const T* __restrict__ logits, int vocab, const float* __restrict__ temperatures,
        const int* __restrict__ top_ks, const float* __restrict__ top_ps,
        const float* __restrict__ log_min_ps, const unsigned long long* __restrict__ seeds,
        const int* __restrict__ counters, int* __restrict__ out) {
    __shared__ float f_shared[32];
    __shared__ unsigned int u_shared[32];
    __shared__ int i_shared[32];
    const int r = blockIdx.x;
    const T* row = logits + (long long)r * vocab;
    const float temperature = temperatures[r];

    if (temperature == 0.0f) {  // greedy
        float best = -CUDART_INF_F;
        int index = vocab;  // larger than any real index, so it loses every tie
        for (int i = threadIdx.x; i < vocab; i += THREADS) {
            const float x = to_float(row[i]);
            if (x > best || index == vocab) {
                best = x;
                index = i;
            }
        }
        index = block_argmax(best, index, f_shared, i_shared);
        if (threadIdx.x == 0) out[r] = index;
        return;
    }

    float x_max = -CUDART_INF_F;
    for (int i = threadIdx.x; i < vocab; i += THREADS) x_max = fmaxf(x_max, to_float(row[i]));
    x_max = block_reduce(x_max, Max(), f_shared);
    const unsigned int key_max = float_key(x_max);

    // Bisection for the largest key t in [lo, hi] that passes a test true at lo; 64-bit
    // arithmetic so hi - lo + 1 cannot wrap.
    // keys >= threshold are allowed; rounded as NumPy rounds it (no fused multiply-add)
    const float log_min_p = log_min_ps[r];
    unsigned int threshold =
        log_min_p > -CUDART_INF_F ? float_key(__fadd_rn(x_max, __fmul_rn(temperature, log_min_p))) : 0;
    const int top_k = top_ks[r];
    if (0 < top_k && top_k < vocab) {
        unsigned long long lo = 0, hi = key_max;
        while (lo < hi) {
            const unsigned long long mid = lo + (hi - lo + 1) / 2;
            if (count_at_least(row, vocab, (unsigned int)mid, u_shared) >= (unsigned int)top_k) lo = mid;
            else hi = mid - 1;
        }
        threshold = max(threshold, (unsigned int)lo);
    }
    const float top_p = top_ps[r];
    if (top_p < 1.0f) {
        const float s_max = x_max / temperature;
        const float target = top_p * mass_at_least(row, vocab, threshold, temperature, s_max, f_shared);
        unsigned long long lo = threshold, hi = key_max;
        while (lo < hi) {
            const unsigned long long mid = lo + (hi - lo + 1) / 2;
            if (mass_at_least(row, vocab, (unsigned int)mid, temperature, s_max, f_shared) >= target) lo = mid;
            else hi = mid - 1;
        }
        threshold = (unsigned int)lo;
    }

    const unsigned long long seed = seeds[r];
    const unsigned int row_key =
        fmix32((unsigned int)seed ^ fmix32((unsigned int)(seed >> 32) ^ fmix32((unsigned int)counters[r])));
    float best = -CUDART_INF_F;
    int index = vocab;
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        const float x = to_float(row[i]);
        if (float_key(x) < threshold) continue;
        const float g = x / temperature - logf(-logf(uniform(row_key, (unsigned int)i)));
        if (g > best || index == vocab) {
            best = g;
            index = i;
        }
    }
    index = block_argmax(best, index, f_shared, i_shared);
    if (threadIdx.x == 0) out[r] = index;
}

template <typename T>
__global__ void edit_logits(T* __restrict__ logits, int vocab, const int* __restrict__ rows,
                                       const int* __restrict__ tokens, const float* __restrict__ biases,
                                       const float* __restrict__ penalties, const float* __restrict__ shifts,
                                       int n) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    T* at = logits + (long long)rows[e] * vocab + tokens[e];
    const float x = __fadd_rn(to_float(*at), biases[e]);
    *at = from_float<T>(__fadd_rn(x > 0.0f ? __fdiv_rn(x, penalties[e]) : __fmul_rn(x, penalties[e]), shifts[e]));
}

template <typename T>
__global__ void mask_logits(T* __restrict__ logits, int vocab, const int* __restrict__ rows,
                                       const int* __restrict__ masks) {
    const int t = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= vocab) return;
    const int words = (vocab + 31) / 32;
    if (!((masks[(long long)blockIdx.x * words + t / 32] >> (t % 32)) & 1))
        logits[(long long)rows[blockIdx.x] * vocab + t] = from_float<T>(NEG_INF);
}
