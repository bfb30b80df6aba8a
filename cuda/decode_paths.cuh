// The decode attention kernel's parts that depend on the cache type (DecodePath), and what
// they share with the kernel: its block size, tile and output store. Only cuda/paged_attention.cu includes this
// file; its header comment describes the kernel, the steps and the shared memory.
#pragma once
#include "common.cuh"

constexpr int NUM_THREADS = 128;
constexpr int WARPS = NUM_THREADS / 32;
// Context tokens staged in shared memory per step (TILE in the paths and the kernel): 64,
// but 32 at head dim 256, whose 64 float16 K and 64 V rows alone would take 66 KB, past the
// 48 KB of static shared memory a block may have. nano/kernels.py cuts partitions in whole
// multiples of 64 tokens (DECODE_TILE), so of either tile.
template <int HEAD_DIM>
constexpr int TILE_TOKENS = HEAD_DIM <= 128 ? 64 : 32;

// The weight of a score: exp(score - max), 0 for a skipped row.
__device__ __forceinline__ float softmax_weight(float score, float max) {
    return score == NEG_INF ? 0.0f : __expf(score - max);
}

// Dims dim .. dim + N - 1 (N 2 or 4) of query row `row`, divided by the row's sum-exp: as
// elements T to `out` when the context is one partition, else as floats to this partition's
// slot of partial_out.
template <int HEAD_DIM, int N, typename T>
__device__ __forceinline__ void store_output(T* out, float* partial_out, long long row, int dim,
                                             const float* acc, float sum, int num_parts, int part) {
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (num_parts == 1) {
        T* o = out + row * HEAD_DIM + dim;
#pragma unroll
        for (int i = 0; i < N / 2; i++) store2(o + 2 * i, acc[2 * i] * inv, acc[2 * i + 1] * inv);
    } else {
        float* o = partial_out + (row * num_parts + part) * HEAD_DIM + dim;
        if constexpr (N == 2) {
            *reinterpret_cast<float2*>(o) = make_float2(acc[0] * inv, acc[1] * inv);
        } else {
            *reinterpret_cast<float4*>(o) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
        }
    }
}

// What a cache type changes in the kernel (T is the run's element type: q and out; CacheT is
// T or int8_t): its shared buffers (shared() declares them,
// Shared refers to them), this thread's output accumulators, and
//   load_q(s, q_group, scale)              q * scale of the block's GROUP heads into s
//   scores(s, s_block, s_p)                step 3: s_p[g][r] = q_g . k_r, -inf for skipped rows
//   weights(s, s_p[g], g, lane, new_max)   step 4 for head g, one warp: this lane's rows'
//                                          p = exp(score - new_max) where step 5 reads them;
//                                          returns the lane's sum of p
//   accumulate(s, s_p, s_alpha, rows)      step 5: acc = acc * alpha + P @ V
//   store(s, s_sum, out, partial_out, ...) the outputs divided by their sum-exp
// Shared also holds the K/V tile (k, v, rows K_ROW / V_ROW elements apart) and its rows'
// scales (kscale, vscale) in the layout stage_kv_tile (common.cuh) writes. The buffers are
// separate __shared__ arrays, not one __shared__ struct: with a struct ptxas gives the
// float16 instances more registers.
template <int HEAD_DIM, int GROUP, typename T, typename CacheT>
struct DecodePath;

// A cache of the element type: everything in float32 from T, no scales.
template <int HEAD_DIM, int GROUP, typename T>
struct DecodePath<HEAD_DIM, GROUP, T, T> {
    static constexpr int TILE = TILE_TOKENS<HEAD_DIM>;
    static constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per K/V row
    // Rows padded by 16 bytes: an odd number of 16-byte units per row means the 8 threads of
    // a quarter warp reading the same chunk of 8 different rows hit 8 different bank groups
    // (no bank conflicts in scores).
    static constexpr int K_ROW = HEAD_DIM + 8, V_ROW = HEAD_DIM + 8;
    static constexpr int PAIRS = GROUP * HEAD_DIM / 2;  // (head, dim pair) outputs of the block
    static constexpr int PAIRS_PER_THREAD = (PAIRS + NUM_THREADS - 1) / NUM_THREADS;

    struct Shared {
        float (&q)[GROUP][HEAD_DIM];  // q * scale
        T (&k)[TILE * K_ROW];
        T (&v)[TILE * V_ROW];
        static constexpr float *kscale = nullptr, *vscale = nullptr;  // never read without int8
    };
    __device__ __forceinline__ static Shared shared() {
        __shared__ __align__(16) float q[GROUP][HEAD_DIM];
        __shared__ __align__(16) T k[TILE * K_ROW];
        __shared__ __align__(16) T v[TILE * V_ROW];
        return {q, k, v};
    }

    float2 acc[PAIRS_PER_THREAD] = {};  // pair threadIdx.x + j * NUM_THREADS: (head, 2 dims)

    __device__ __forceinline__ static void load_q(const Shared s, const T* q_group, float scale) {
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_THREADS)
            s.q[i / HEAD_DIM][i % HEAD_DIM] = to_float(q_group[i]) * scale;
    }

    // Thread = (head, row) pairs, rows fastest: a warp reads 32 rows' same chunk.
    __device__ __forceinline__ static void scores(const Shared s, const int* s_block, float (*s_p)[TILE]) {
        for (int i = threadIdx.x; i < GROUP * TILE; i += NUM_THREADS) {
            const int g = i / TILE, r = i % TILE;
            float score = NEG_INF;
            if (s_block[r] >= 0) {
                score = 0.0f;
#pragma unroll
                for (int c = 0; c < CHUNKS; c++) {
                    const uint4 u = *reinterpret_cast<const uint4*>(&s.k[r * K_ROW + c * 8]);
                    const T* k8 = reinterpret_cast<const T*>(&u);
                    const float4* q4 = reinterpret_cast<const float4*>(&s.q[g][c * 8]);
                    const float4 qa = q4[0], qb = q4[1];
                    const float2 k0 = load2(k8), k1 = load2(k8 + 2);
                    const float2 k2f = load2(k8 + 4), k3 = load2(k8 + 6);
                    score += qa.x * k0.x + qa.y * k0.y + qa.z * k1.x + qa.w * k1.y +
                             qb.x * k2f.x + qb.y * k2f.y + qb.z * k3.x + qb.w * k3.y;
                }
            }
            s_p[g][r] = score;
        }
    }

    // p replaces the score in s_p.
    __device__ __forceinline__ static float weights(const Shared, float* p_row, int, int lane, float new_max) {
        float sum = 0.0f;
        for (int r = lane; r < TILE; r += 32) {
            const float p = softmax_weight(p_row[r], new_max);
            p_row[r] = p;
            sum += p;
        }
        return sum;
    }

    // Each thread owns its (head, dim pair) outputs and runs over the tile's rows.
    __device__ __forceinline__ void accumulate(const Shared s, const float (*s_p)[TILE], const float* s_alpha,
                                               int rows) {
#pragma unroll
        for (int j = 0; j < PAIRS_PER_THREAD; j++) {
            const int pair = threadIdx.x + j * NUM_THREADS;
            if (pair < PAIRS) {
                const int g = pair / (HEAD_DIM / 2), d = 2 * (pair % (HEAD_DIM / 2));
                const float alpha = s_alpha[g];
                float2 a = make_float2(acc[j].x * alpha, acc[j].y * alpha);
                for (int r = 0; r < rows; r++) {
                    const float p = s_p[g][r];
                    const float2 v = load2(&s.v[r * V_ROW + d]);
                    a.x += p * v.x;
                    a.y += p * v.y;
                }
                acc[j] = a;
            }
        }
    }

    __device__ __forceinline__ void store(const Shared, const float* s_sum, T* out, float* partial_out,
                                          long long row0, int num_parts, int part) const {
#pragma unroll
        for (int j = 0; j < PAIRS_PER_THREAD; j++) {
            const int pair = threadIdx.x + j * NUM_THREADS;
            if (pair < PAIRS) {
                const int g = pair / (HEAD_DIM / 2), d = 2 * (pair % (HEAD_DIM / 2));
                store_output<HEAD_DIM, 2>(out, partial_out, row0 + g, d, &acc[j].x, s_sum[g], num_parts, part);
            }
        }
    }
};

// int8 cache: nothing is dequantized; the scales are folded in: score = scale_k * (q . k_int8),
// and P @ V = sum_t (p_t * scale_v,t) v_int8,t. The int8 values stay int8 in shared memory
// (half the bytes) and both products run on __dp4a (4 int8 multiply-adds into int32, no
// int -> float conversions): q * scale is put in 15-bit fixed point per head once per block,
// and p' = p * scale_v per head and tile, each split into a hi and a lo int8 (x = 256 hi +
// lo). Both sums are then exact; the only rounding is that of q and p' to 15 bits, relative
// 2^-16 of each one's largest element, far below float16 output rounding. Measured on the
// emulator against the float32 reference: decode error 3.4-4.9e-4 max / 2.2-2.4e-4 relative
// L2 for both key schemes, about prefill's (docs/perf_notes.md). A q whose elements differ
// widely in size would keep fewer bits in its small ones; a third q byte would cover that at
// 50% more __dp4a in the scores.
template <int HEAD_DIM, int GROUP, typename T>
struct DecodePath<HEAD_DIM, GROUP, T, int8_t> {
    // FIXED15 is the largest |x| whose hi and lo are int8: (x + 128) >> 8 and x - 256 hi.
    static constexpr int FIXED15 = 32639;
    static constexpr float MIN_PV = 0x1p-100f;  // the smallest tile maximum of p' that is kept
    __device__ __forceinline__ static int fixed15_hi(int x) { return (x + 128) >> 8; }
    __device__ __forceinline__ static int fixed15_lo(int x) { return x - fixed15_hi(x) * 256; }
    static constexpr int TILE = TILE_TOKENS<HEAD_DIM>;
    static constexpr int CHUNKS = HEAD_DIM / 16;  // 16-byte chunks per K/V row
    // K rows padded to an odd number of 16-byte units (scores read one chunk of 32 different
    // rows); V rows unpadded (accumulate reads two neighbouring rows).
    static constexpr int K_ROW = HEAD_DIM + 16, V_ROW = HEAD_DIM;
    static constexpr int QK_SETS = NUM_THREADS / TILE;                 // scores: thread = (row, head set)
    static constexpr int QK_HEADS = (GROUP + QK_SETS - 1) / QK_SETS;   // heads per thread
    static constexpr int QUADS = HEAD_DIM / 4;                         // accumulate: 4-dim output columns
    static constexpr int PV_SETS = GROUP <= 4 ? 1 : 2;                 // head sets
    static constexpr int PV_HEADS = (GROUP + PV_SETS - 1) / PV_SETS;   // heads per thread
    static constexpr int SPLITS = NUM_THREADS / (QUADS * PV_SETS);     // token splits
    static constexpr int TOKEN_QUADS = TILE / 4;                       // quad i: tokens i + TOKEN_QUADS e, e < 4
    static_assert(QUADS * PV_SETS * SPLITS == NUM_THREADS && TOKEN_QUADS % SPLITS == 0 &&
                  QK_SETS * TILE == NUM_THREADS, "int8 thread layout");

    // q and p' in 15-bit fixed point ([0] hi bytes, [1] lo bytes) and the scales that turn
    // them back into floats; p' bytes of token t at 4 * (t % TOKEN_QUADS) + t / TOKEN_QUADS,
    // so that a token quad's 4 bytes are one word.
    struct Shared {
        int8_t (&k)[TILE * K_ROW];
        int8_t (&v)[TILE * V_ROW];
        unsigned (&qw)[GROUP][2][HEAD_DIM / 4];
        int8_t (&pw)[GROUP][2][TILE];
        float (&kscale)[TILE], (&vscale)[TILE];
        float (&qscale)[GROUP], (&pscale)[GROUP];
    };
    __device__ __forceinline__ static Shared shared() {
        __shared__ __align__(16) unsigned qw[GROUP][2][HEAD_DIM / 4];
        __shared__ __align__(16) int8_t pw[GROUP][2][TILE];
        __shared__ float kscale[TILE], vscale[TILE];
        __shared__ float qscale[GROUP], pscale[GROUP];
        __shared__ __align__(16) int8_t k[TILE * K_ROW];
        __shared__ __align__(16) int8_t v[TILE * V_ROW];
        return {k, v, qw, pw, kscale, vscale, qscale, pscale};
    }

    // Dims 4 quad .. + 3 of heads pv_set() + PV_SETS * h, over token quads split + SPLITS * m:
    // at(h, d). ptxas's register count depends on the order in which the tile loop's values
    // are created, not only on the arithmetic (docs/perf_notes.md), so two choices here are
    // measured ones. The accumulators are stored last-first (at(0, 0) is the last element):
    // LLVM then creates the tile loop's phis for them in the order the interleaved kernel had
    // (up to 4 registers fewer than first-first). The head set is computed once, here, except
    // in 64 x 5 (RECOMPUTE_SET), where accumulate and store recompute it from threadIdx.x:
    // 71 registers there instead of 72, while recomputing it in every instance costs 128 x 5
    // and 128 x 7 two registers each. Either way the value, and so the arithmetic, is the same.
    float acc[PV_HEADS][4] = {};
    __device__ __forceinline__ float& at(int h, int d) { return acc[PV_HEADS - 1 - h][3 - d]; }
    static constexpr bool RECOMPUTE_SET = HEAD_DIM == 64 && GROUP == 5;
    const int quad = threadIdx.x % QUADS, held_set = threadIdx.x / QUADS % PV_SETS;
    const int split = threadIdx.x / (QUADS * PV_SETS);
    __device__ __forceinline__ int pv_set() const {
        return RECOMPUTE_SET ? (int)(threadIdx.x / QUADS % PV_SETS) : held_set;
    }

    // One warp per head: lane l holds dims 4l .. 4l + 3 (and 4l + 128 .. 4l + 131 at head dim
    // 256) and builds one word of hi bytes and one of lo bytes per 4 dims, relative to the
    // head's largest |q * scale|.
    __device__ __forceinline__ static void load_q(const Shared s, const T* q_group, float scale) {
        constexpr int LANE_QUADS = (HEAD_DIM / 4 + 31) / 32;  // 4-dim quads per lane
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GROUP; g += WARPS) {
            float v[LANE_QUADS][4] = {};
            float m = 0.0f;
#pragma unroll
            for (int j = 0; j < LANE_QUADS; j++) {
                const int quad = lane + 32 * j;
                if (quad < HEAD_DIM / 4) {
                    const uint2 u = *reinterpret_cast<const uint2*>(q_group + g * HEAD_DIM + 4 * quad);
                    const float2 a = load2(reinterpret_cast<const T*>(&u.x));
                    const float2 b = load2(reinterpret_cast<const T*>(&u.y));
                    v[j][0] = a.x * scale, v[j][1] = a.y * scale, v[j][2] = b.x * scale, v[j][3] = b.y * scale;
                }
                m = fmaxf(m, fmaxf(fmaxf(fabsf(v[j][0]), fabsf(v[j][1])), fmaxf(fabsf(v[j][2]), fabsf(v[j][3]))));
            }
            m = warp_reduce(m, Max());
            const float inv = m > 0.0f ? FIXED15 / m : 0.0f;
#pragma unroll
            for (int j = 0; j < LANE_QUADS; j++) {
                const int quad = lane + 32 * j;
                if (quad < HEAD_DIM / 4) {
                    unsigned hi = 0, lo = 0;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int x = max(-FIXED15, min(FIXED15, (int)rintf(v[j][e] * inv)));
                        hi |= (unsigned)(fixed15_hi(x) & 0xff) << (8 * e);
                        lo |= (unsigned)(fixed15_lo(x) & 0xff) << (8 * e);
                    }
                    s.qw[g][0][quad] = hi;
                    s.qw[g][1][quad] = lo;
                }
            }
            if (lane == 0) s.qscale[g] = m / FIXED15;
        }
    }

    // Thread = (row r, heads set, set + 2, ...): q . k as two exact __dp4a sums (hi and lo
    // bytes of q), times q's and the row's scales. Lanes read 32 different rows (padded: no
    // bank conflicts); q words are broadcast.
    __device__ __forceinline__ static void scores(const Shared s, const int* s_block, float (*s_p)[TILE]) {
        const int r = threadIdx.x % TILE, set = threadIdx.x / TILE;
        int hi[QK_HEADS], lo[QK_HEADS];
#pragma unroll
        for (int h = 0; h < QK_HEADS; h++) hi[h] = lo[h] = 0;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            const int4 k4 = *reinterpret_cast<const int4*>(&s.k[r * K_ROW + c * 16]);
#pragma unroll
            for (int h = 0; h < QK_HEADS; h++) {
                const int g = set + h * QK_SETS;
                if (g < GROUP) {
                    const int4 qh = *reinterpret_cast<const int4*>(&s.qw[g][0][c * 4]);
                    const int4 ql = *reinterpret_cast<const int4*>(&s.qw[g][1][c * 4]);
                    hi[h] = __dp4a(k4.x, qh.x, __dp4a(k4.y, qh.y, __dp4a(k4.z, qh.z, __dp4a(k4.w, qh.w, hi[h]))));
                    lo[h] = __dp4a(k4.x, ql.x, __dp4a(k4.y, ql.y, __dp4a(k4.z, ql.z, __dp4a(k4.w, ql.w, lo[h]))));
                }
            }
        }
        const bool valid = s_block[r] >= 0;
        const float kscale = s.kscale[r];
#pragma unroll
        for (int h = 0; h < QK_HEADS; h++) {
            const int g = set + h * QK_SETS;
            if (g < GROUP)
                s_p[g][r] = valid ? (float)(hi[h] * 256 + lo[h]) * (s.qscale[g] * kscale) : NEG_INF;
        }
    }

    // p' = p * (the row's V scale) goes to s.pw in 15-bit fixed point relative to the tile's
    // largest p' (s.pscale); the sum is of p.
    __device__ __forceinline__ static float weights(const Shared s, const float* p_row, int g, int lane,
                                                    float new_max) {
        float sum = 0.0f, pv_max = 0.0f, pv[TILE / 32];
#pragma unroll
        for (int i = 0; i < TILE / 32; i++) {
            const int r = lane + 32 * i;
            const float p = softmax_weight(p_row[r], new_max);
            pv[i] = p * s.vscale[r];
            sum += p;
        }
#pragma unroll
        for (int i = 0; i < TILE / 32; i++) pv_max = fmaxf(pv_max, pv[i]);
        pv_max = warp_reduce(pv_max, Max());
        // Below MIN_PV, FIXED15 / pv_max would overflow (from ~1e-34) and inf or NaN go to int.
        // Such a tile adds nothing: scale_v >= 2^-24 (the smallest float16) puts its every p
        // under 2^-76 of the running max's p = 1, so its weights are all 0.
        const float inv = pv_max > MIN_PV ? FIXED15 / pv_max : 0.0f;
#pragma unroll
        for (int i = 0; i < TILE / 32; i++) {
            const int r = lane + 32 * i, at = 4 * (r % TOKEN_QUADS) + r / TOKEN_QUADS;
            const int x = min(FIXED15, (int)rintf(pv[i] * inv));
            s.pw[g][0][at] = (int8_t)fixed15_hi(x);
            s.pw[g][1][at] = (int8_t)fixed15_lo(x);
        }
        if (lane == 0) s.pscale[g] = pv_max / FIXED15;
        return sum;
    }

    // 4 V words of a token quad, transposed with __byte_perm to one word per dim (4 tokens'
    // bytes), dotted with the quad's p' word by __dp4a, exactly, in int32 for the tile.
    __device__ __forceinline__ void accumulate(const Shared s, const float (*)[TILE], const float* s_alpha,
                                               int) {
        const int q4 = 4 * quad, set = pv_set();
        int sum[PV_HEADS][4];
#pragma unroll
        for (int h = 0; h < PV_HEADS; h++)
#pragma unroll
            for (int d = 0; d < 4; d++) sum[h][d] = 0;
#pragma unroll
        for (int m = 0; m < TOKEN_QUADS / SPLITS; m++) {
            const int tq = split + m * SPLITS;
            unsigned w[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                w[e] = *reinterpret_cast<const unsigned*>(&s.v[(tq + e * TOKEN_QUADS) * V_ROW + q4]);
            const unsigned t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
            const unsigned t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
            const int x[4] = {(int)__byte_perm(t0, t2, 0x5410), (int)__byte_perm(t0, t2, 0x7632),
                              (int)__byte_perm(t1, t3, 0x5410), (int)__byte_perm(t1, t3, 0x7632)};
#pragma unroll
            for (int h = 0; h < PV_HEADS; h++) {
                const int g = set + h * PV_SETS;
                if (g < GROUP) {
                    const int ph = *reinterpret_cast<const int*>(&s.pw[g][0][4 * tq]);
                    const int pl = *reinterpret_cast<const int*>(&s.pw[g][1][4 * tq]);
#pragma unroll
                    for (int d = 0; d < 4; d++) sum[h][d] = __dp4a(x[d], pl, sum[h][d]) + __dp4a(x[d], ph, 0) * 256;
                }
            }
        }
#pragma unroll
        for (int h = 0; h < PV_HEADS; h++) {
            const int g = set + h * PV_SETS;
            if (g < GROUP) {
                const float alpha = s_alpha[g], pscale = s.pscale[g];
#pragma unroll
                for (int d = 0; d < 4; d++) at(h, d) = at(h, d) * alpha + pscale * (float)sum[h][d];
            }
        }
    }

    // The token splits' sums, added in split order through shared memory (the K tile is free
    // by now); the last split writes.
    __device__ __forceinline__ void store(const Shared s, const float* s_sum, T* out, float* partial_out,
                                          long long row0, int num_parts, int part) {
        static_assert(GROUP * HEAD_DIM * sizeof(float) <= sizeof(s.k), "the K tile holds the split sums");
        float* total = reinterpret_cast<float*>(s.k);
        const int q4 = 4 * quad, set = pv_set(), mine = split;
        for (int turn = 0; turn < SPLITS; turn++) {
            if (mine == turn) {
#pragma unroll
                for (int h = 0; h < PV_HEADS; h++) {
                    const int g = set + h * PV_SETS;
                    if (g < GROUP) {
#pragma unroll
                        for (int d = 0; d < 4; d++) {
                            float* t = &total[g * HEAD_DIM + q4 + d];
                            if (turn > 0) at(h, d) += *t;
                            if (turn < SPLITS - 1) *t = at(h, d);
                        }
                    }
                }
            }
            __syncthreads();
        }
        if (mine == SPLITS - 1) {
#pragma unroll
            for (int h = 0; h < PV_HEADS; h++) {
                const int g = set + h * PV_SETS;
                if (g < GROUP) {
                    const float a[4] = {at(h, 0), at(h, 1), at(h, 2), at(h, 3)};
                    store_output<HEAD_DIM, 4>(out, partial_out, row0 + g, q4, a, s_sum[g], num_parts, part);
                }
            }
        }
    }
};
