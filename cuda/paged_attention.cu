// Decode attention over a paged KV cache: each sequence's one new query token attends to
// its whole cached context.
//
// The engine calls this kernel for the first num_decodes rows of a step and
// prefill_attention (cuda/prefill_attention.cu) for the rest: one launch per kind.
//
// Template: paged_attention_kernel<HEAD_DIM, GROUP, CacheT>, CacheT __half (float16 cache)
// or int8_t (int8 cache, nano/kv_cache.py).
// Arguments (float16 unless noted):
//   q             (S, nq, d)                    query head h*GROUP+g belongs to KV head h
//   k_cache/v_cache (num_blocks, nkv, block_size, d) CacheT  one layer of the cache
//   k_scales/v_scales (num_blocks, nkv, block_size)  int8 cache: one scale per (token, KV
//                                               head), value = int8 * scale; float16 cache:
//                                               empty, never read
//   block_tables  (S, max_blocks) int32         physical block of each logical block, -1 past the end
//   context_lens  (S,) int32                    tokens in cache, this step's token included (>= 1)
//   out           (S, nq, d)
// KV cache layout: one sequence's block for one KV head is block_size * d contiguous values
// (halfs or int8), so a run of tokens inside a block is one contiguous stretch of memory:
// neighbouring threads load neighbouring 16-byte chunks (coalesced), a row per d/8 (float16)
// or d/16 (int8) threads. A token's scales sit at the same (block, head, offset) index of
// k_scales / v_scales.
//
// Design: one thread block of 128 threads per (KV head, sequence, partition) computes all
// GROUP query heads that share the KV head, so each K/V row is read from memory once per
// group, not once per query head. Per tile of 64 tokens:
//   1. look up each row's physical block (-1: row skipped),
//   2. stage K and V rows in shared memory with 16-byte loads,
//   3. scores for every (row, head) pair, float32,
//   4. online softmax per head (running max and sum-exp, float32), one warp per head,
//   5. acc = acc * exp(old_max - new_max) + P @ V.
// float16: in step 3 a thread computes a (row, head) score from halfs converted to float; in
// step 5 each thread owns (head, dim pair) outputs.
// int8: nothing is dequantized; the scales are folded in: score = scale_k * (q . k_int8),
// and P @ V = sum_t (p_t * scale_v,t) v_int8,t. The int8 values stay int8 in shared memory
// (half the bytes) and both products run on __dp4a (4 int8 multiply-adds into int32, no
// int -> float conversions): q * softmax scale is put in 15-bit fixed point per head once
// per block, and p' = p * scale_v per head and tile, each split into a hi and a lo int8
// (x = 256 hi + lo). Both sums are then exact; the only rounding is that of q and p' to 15
// bits (relative 2^-16 of the largest, far below float16 output rounding). Step 3: thread =
// (row, half of the heads); step 5: thread = (4 output dims, heads, a split of the tile's
// 16 token quads), V words transposed with __byte_perm to 4 tokens x 1 dim; the splits'
// sums are added in shared memory at the end.
// Split-KV ("flash decoding"): with few sequences the grid is too small to fill the GPU, so
// nano/kernels.py also splits each context into partitions (grid z). Each partition
// writes its normalised partial output, max and sum-exp (float32); paged_attention_merge
// then combines them with log-sum-exp weights. gridDim.z == 1 writes `out` directly.
//
// Version v2 (int8 instances: int8 shared tiles, __dp4a products; the float16 instances are
// v1's code, with its registers and shared memory): float16, head dim 64: 54-63 registers,
// 19-23 KB shared; 128: 88-103 registers, 36-41 KB shared; int8, head dim 64: 52-72
// registers, 10.5-14 KB shared; 128: 60-93 registers, 19-23 KB shared; merge 32 registers;
// no spills (tests/kernel_resources.py). Not yet measured on a GPU.
#include "common.cuh"

constexpr int NUM_THREADS = 128;
constexpr int TILE = 64;  // context tokens staged in shared memory per step
// int8 cache: q and p' as 15-bit integers x = 256 * hi + lo, |x| <= FIXED15, so that hi and
// lo are int8 ((x + 128) >> 8 and the rest) and q . k, p' . v are exact __dp4a sums.
constexpr int FIXED15 = 32639;

// x (|x| <= FIXED15) into byte n of hi and lo: x = 256 * hi + lo, hi and lo in [-128, 127].
__device__ __forceinline__ void split_fixed15(int x, int n, unsigned& hi, unsigned& lo) {
    const int h = (x + 128) >> 8;
    hi |= (unsigned)(h & 0xff) << (8 * n);
    lo |= (unsigned)((x - h * 256) & 0xff) << (8 * n);
}

// Blocks per SM that an instance's registers must allow (__launch_bounds__'s second
// argument): 0 (none) for float16; for int8 it is needed, because given the block size alone
// ptxas picks a register count for an occupancy step of its own and spills to meet it
// (4-36 bytes in several int8 instances). 7 blocks (<= 73 registers) for head dim 64, 5
// (<= 102) for 128, near the float16 instances' 8-9 and 4-5, and no spills.
template <int HEAD_DIM, typename CacheT>
constexpr int MIN_BLOCKS = sizeof(CacheT) == 2 ? 0 : HEAD_DIM == 64 ? 7 : 5;

template <int HEAD_DIM, int GROUP, typename CacheT>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS<HEAD_DIM, CacheT>) paged_attention_kernel(
        __half* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_max, float* __restrict__ partial_sum,
        const __half* __restrict__ q, const CacheT* __restrict__ k_cache,
        const CacheT* __restrict__ v_cache, const __half* __restrict__ k_scales,
        const __half* __restrict__ v_scales, const int* __restrict__ block_tables,
        const int* __restrict__ context_lens, int max_blocks, int log2_block_size,
        int partition_size, float scale) {
    constexpr bool INT8 = sizeof(CacheT) == 1;
    // float16 cache.
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per K/V row
    // Shared rows are padded by 16 bytes: an odd number of 16-byte units per row means the
    // 8 threads of a quarter warp reading the same chunk of 8 different rows hit 8
    // different bank groups (no bank conflicts in step 3).
    constexpr int ROW = HEAD_DIM + 8;
    constexpr int PAIRS = GROUP * HEAD_DIM / 2;  // (head, dim pair) outputs of the block
    constexpr int PAIRS_PER_THREAD = (PAIRS + NUM_THREADS - 1) / NUM_THREADS;
    // int8 cache. K rows padded to an odd number of 16-byte units (step 3 reads one chunk of
    // 32 different rows, as above); V rows unpadded (step 5 reads two neighbouring rows).
    constexpr int K_ROW = INT8 ? HEAD_DIM + 16 : ROW;
    constexpr int V_ROW = INT8 ? HEAD_DIM : ROW;
    constexpr int CHUNKS8 = HEAD_DIM / 16;                      // 16-byte chunks per int8 row
    constexpr int QK_SETS = NUM_THREADS / TILE;                 // step 3: thread = (row, head set)
    constexpr int QK_HEADS = (GROUP + QK_SETS - 1) / QK_SETS;   // heads per thread
    constexpr int QUADS = HEAD_DIM / 4;                         // step 5: 4-dim output columns
    constexpr int PV_SETS = GROUP <= 4 ? 1 : 2;                 // head sets
    constexpr int PV_HEADS = (GROUP + PV_SETS - 1) / PV_SETS;   // heads per thread
    constexpr int SPLITS = NUM_THREADS / (QUADS * PV_SETS);     // token splits
    constexpr int TOKEN_QUADS = TILE / 4;                       // quad i: tokens i + 16 e, e < 4
    static_assert(!INT8 || (QUADS * PV_SETS * SPLITS == NUM_THREADS && TOKEN_QUADS % SPLITS == 0 &&
                            QK_SETS * TILE == NUM_THREADS), "int8 thread layout");

    __shared__ __align__(16) float s_q[INT8 ? 1 : GROUP][HEAD_DIM];
    __shared__ __align__(16) CacheT s_k[TILE * K_ROW];
    __shared__ __align__(16) CacheT s_v[TILE * V_ROW];
    __shared__ float s_p[GROUP][TILE];  // scores, then probabilities
    __shared__ int s_block[TILE];
    __shared__ float s_max[GROUP], s_sum[GROUP], s_alpha[GROUP];
    // int8 cache only: q and p' in 15-bit fixed point ([0] hi bytes, [1] lo bytes) and the
    // scales that turn them back into floats; p' bytes of token t at 4 * (t % 16) + t / 16,
    // so that a token quad's 4 bytes are one word.
    __shared__ __align__(16) unsigned s_qw[INT8 ? GROUP : 1][2][HEAD_DIM / 4];
    __shared__ __align__(16) int8_t s_pw[INT8 ? GROUP : 1][2][TILE];
    __shared__ float s_kscale[INT8 ? TILE : 1], s_vscale[INT8 ? TILE : 1];
    __shared__ float s_qscale[INT8 ? GROUP : 1], s_pscale[INT8 ? GROUP : 1];

    const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int nkv = gridDim.x, nq = nkv * GROUP, num_parts = gridDim.z;
    const int ctx = context_lens[seq];
    const int begin = part * partition_size;
    if (begin >= ctx) return;  // this sequence is shorter than the longest one
    const int end = min(ctx, begin + partition_size);
    const int* table = block_tables + (long long)seq * max_blocks;

    const __half* q_group = q + ((long long)seq * nq + kv_head * GROUP) * HEAD_DIM;
    if constexpr (INT8) {
        // q * scale of head g in 15-bit fixed point, one warp per head: lane l holds dims
        // 4l .. 4l + 3 and builds one word of hi bytes and one of lo bytes.
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GROUP; g += NUM_THREADS / 32) {
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (lane < HEAD_DIM / 4) {
                const uint2 u = *reinterpret_cast<const uint2*>(q_group + g * HEAD_DIM + 4 * lane);
                const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
                const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
                v[0] = a.x * scale, v[1] = a.y * scale, v[2] = b.x * scale, v[3] = b.y * scale;
            }
            const float m = warp_reduce(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))),
                                        Max());
            const float inv = m > 0.0f ? FIXED15 / m : 0.0f;
            if (lane < HEAD_DIM / 4) {
                unsigned hi = 0, lo = 0;
                for (int e = 0; e < 4; e++)
                    split_fixed15(max(-FIXED15, min(FIXED15, (int)rintf(v[e] * inv))), e, hi, lo);
                s_qw[g][0][lane] = hi;
                s_qw[g][1][lane] = lo;
            }
            if (lane == 0) s_qscale[g] = m / FIXED15;
        }
    } else {
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_THREADS)
            s_q[i / HEAD_DIM][i % HEAD_DIM] = __half2float(q_group[i]) * scale;
    }
    if (threadIdx.x < GROUP) {
        s_max[threadIdx.x] = NEG_INF;
        s_sum[threadIdx.x] = 0.0f;
    }
    float2 acc[PAIRS_PER_THREAD];  // float16: (head, dim pair) outputs
    for (int j = 0; j < PAIRS_PER_THREAD; j++) acc[j] = make_float2(0.0f, 0.0f);
    // int8: dims 4 * quad .. + 3 of heads pv_set + PV_SETS * h, over this thread's token split
    const int quad = threadIdx.x % QUADS, pv_set = threadIdx.x / QUADS % PV_SETS;
    const int split = threadIdx.x / (QUADS * PV_SETS);
    float acc8[INT8 ? PV_HEADS : 1][4] = {};

    for (int tile = begin; tile < end; tile += TILE) {
        const int rows = min(TILE, end - tile);
        // 1-2. Physical block of each row, then K and V rows into shared memory.
        stage_kv_tile<TILE, HEAD_DIM, K_ROW, V_ROW, NUM_THREADS>(
            s_k, s_v, s_kscale, s_vscale, s_block, k_cache, v_cache, k_scales, v_scales, table,
            max_blocks, tile, rows, kv_head, nkv, log2_block_size);

        // 3. Scores (q was pre-scaled); -inf for skipped rows.
        if constexpr (INT8) {
            // Thread = (row r, heads set, set + 2, ...): q . k as two exact __dp4a sums (hi and
            // lo bytes of q), times q's and the row's scales. Lanes read 32 different rows
            // (padded: no bank conflicts); q words are broadcast.
            const int r = threadIdx.x % TILE, set = threadIdx.x / TILE;
            int hi[QK_HEADS], lo[QK_HEADS];
#pragma unroll
            for (int h = 0; h < QK_HEADS; h++) hi[h] = lo[h] = 0;
#pragma unroll
            for (int c = 0; c < CHUNKS8; c++) {
                const int4 k4 = *reinterpret_cast<const int4*>(&s_k[r * K_ROW + c * 16]);
#pragma unroll
                for (int h = 0; h < QK_HEADS; h++) {
                    const int g = set + h * QK_SETS;
                    if (g < GROUP) {
                        const int4 qh = *reinterpret_cast<const int4*>(&s_qw[g][0][c * 4]);
                        const int4 ql = *reinterpret_cast<const int4*>(&s_qw[g][1][c * 4]);
                        hi[h] = __dp4a(k4.x, qh.x, __dp4a(k4.y, qh.y, __dp4a(k4.z, qh.z, __dp4a(k4.w, qh.w, hi[h]))));
                        lo[h] = __dp4a(k4.x, ql.x, __dp4a(k4.y, ql.y, __dp4a(k4.z, ql.z, __dp4a(k4.w, ql.w, lo[h]))));
                    }
                }
            }
            const bool valid = s_block[r] >= 0;
            const float kscale = s_kscale[r];
#pragma unroll
            for (int h = 0; h < QK_HEADS; h++) {
                const int g = set + h * QK_SETS;
                if (g < GROUP)
                    s_p[g][r] = valid ? (float)(hi[h] * 256 + lo[h]) * (s_qscale[g] * kscale) : NEG_INF;
            }
        } else {
            for (int i = threadIdx.x; i < GROUP * TILE; i += NUM_THREADS) {
                const int g = i / TILE, r = i % TILE;
                float score = NEG_INF;
                if (s_block[r] >= 0) {
                    score = 0.0f;
#pragma unroll
                    for (int c = 0; c < CHUNKS; c++) {
                        const uint4 u = *reinterpret_cast<const uint4*>(&s_k[r * ROW + c * 8]);
                        const __half2* k2 = reinterpret_cast<const __half2*>(&u);
                        const float4* q4 = reinterpret_cast<const float4*>(&s_q[g][c * 8]);
                        const float4 qa = q4[0], qb = q4[1];
                        const float2 k0 = __half22float2(k2[0]), k1 = __half22float2(k2[1]);
                        const float2 k2f = __half22float2(k2[2]), k3 = __half22float2(k2[3]);
                        score += qa.x * k0.x + qa.y * k0.y + qa.z * k1.x + qa.w * k1.y +
                                 qb.x * k2f.x + qb.y * k2f.y + qb.z * k3.x + qb.w * k3.y;
                    }
                }
                s_p[g][r] = score;
            }
        }
        __syncthreads();

        // 4. Online softmax, one warp per head. int8: p' = p * (the row's V scale) goes to
        // s_pw in 15-bit fixed point relative to the tile's largest p' (s_pscale); the sum
        // is of p, as for float16.
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GROUP; g += NUM_THREADS / 32) {
            float tile_max = NEG_INF;
            for (int r = lane; r < TILE; r += 32) tile_max = fmaxf(tile_max, s_p[g][r]);
            const float old_max = s_max[g];
            const float new_max = fmaxf(old_max, warp_reduce(tile_max, Max()));
            float sum = 0.0f;
            float pv[INT8 ? TILE / 32 : 1];
            if constexpr (INT8) {
#pragma unroll
                for (int i = 0; i < TILE / 32; i++) {
                    const int r = lane + 32 * i;
                    const float s = s_p[g][r];
                    const float p = s == NEG_INF ? 0.0f : __expf(s - new_max);
                    pv[i] = p * s_vscale[r];
                    sum += p;
                }
            } else {
                for (int r = lane; r < TILE; r += 32) {
                    const float s = s_p[g][r];
                    const float p = s == NEG_INF ? 0.0f : __expf(s - new_max);
                    s_p[g][r] = p;
                    sum += p;
                }
            }
            sum = warp_reduce(sum, Sum());
            if constexpr (INT8) {
                float pv_max = 0.0f;
#pragma unroll
                for (int i = 0; i < TILE / 32; i++) pv_max = fmaxf(pv_max, pv[i]);
                pv_max = warp_reduce(pv_max, Max());
                const float inv = pv_max > 0.0f ? FIXED15 / pv_max : 0.0f;
#pragma unroll
                for (int i = 0; i < TILE / 32; i++) {
                    const int r = lane + 32 * i, at = 4 * (r % TOKEN_QUADS) + r / TOKEN_QUADS;
                    const int x = min(FIXED15, (int)rintf(pv[i] * inv));
                    const int h = (x + 128) >> 8;
                    s_pw[g][0][at] = (int8_t)h;
                    s_pw[g][1][at] = (int8_t)(x - h * 256);
                }
                if (lane == 0) s_pscale[g] = pv_max / FIXED15;
            }
            __syncwarp();  // every lane has read s_max[g] before lane 0 replaces it
            if (lane == 0) {
                const float alpha = old_max == NEG_INF ? 0.0f : __expf(old_max - new_max);
                s_alpha[g] = alpha;
                s_max[g] = new_max;
                s_sum[g] = s_sum[g] * alpha + sum;
            }
        }
        __syncthreads();

        // 5. acc = acc * alpha + P @ V.
        if constexpr (INT8) {
            // Thread = (4 dims, PV_HEADS heads, token quads split + SPLITS * m): 4 V words of a
            // token quad, transposed to one word per dim (4 tokens' bytes), dotted with the
            // quad's p' word by __dp4a, exactly, in int32 for the tile.
            int sum8[PV_HEADS][4];
#pragma unroll
            for (int h = 0; h < PV_HEADS; h++)
#pragma unroll
                for (int d = 0; d < 4; d++) sum8[h][d] = 0;
#pragma unroll
            for (int m = 0; m < TOKEN_QUADS / SPLITS; m++) {
                const int tq = split + m * SPLITS;
                unsigned w[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    w[e] = *reinterpret_cast<const unsigned*>(&s_v[(tq + e * TOKEN_QUADS) * V_ROW + 4 * quad]);
                const unsigned t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
                const unsigned t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
                const int x[4] = {(int)__byte_perm(t0, t2, 0x5410), (int)__byte_perm(t0, t2, 0x7632),
                                  (int)__byte_perm(t1, t3, 0x5410), (int)__byte_perm(t1, t3, 0x7632)};
#pragma unroll
                for (int h = 0; h < PV_HEADS; h++) {
                    const int g = pv_set + h * PV_SETS;
                    if (g < GROUP) {
                        const int ph = *reinterpret_cast<const int*>(&s_pw[g][0][4 * tq]);
                        const int pl = *reinterpret_cast<const int*>(&s_pw[g][1][4 * tq]);
#pragma unroll
                        for (int d = 0; d < 4; d++) {
                            sum8[h][d] = __dp4a(x[d], pl, sum8[h][d]) + __dp4a(x[d], ph, 0) * 256;
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < PV_HEADS; h++) {
                const int g = pv_set + h * PV_SETS;
                if (g < GROUP) {
                    const float alpha = s_alpha[g], pscale = s_pscale[g];
#pragma unroll
                    for (int d = 0; d < 4; d++)
                        acc8[h][d] = acc8[h][d] * alpha + pscale * (float)sum8[h][d];
                }
            }
        } else {
            // Each thread owns (head, dim pair) outputs.
#pragma unroll
            for (int j = 0; j < PAIRS_PER_THREAD; j++) {
                const int pair = threadIdx.x + j * NUM_THREADS;
                if (pair < PAIRS) {
                    const int g = pair / (HEAD_DIM / 2), d = 2 * (pair % (HEAD_DIM / 2));
                    const float alpha = s_alpha[g];
                    float2 a = make_float2(acc[j].x * alpha, acc[j].y * alpha);
                    for (int r = 0; r < rows; r++) {
                        const float p = s_p[g][r];
                        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&s_v[r * ROW + d]));
                        a.x += p * v.x;
                        a.y += p * v.y;
                    }
                    acc[j] = a;
                }
            }
        }
        __syncthreads();  // the next tile overwrites s_block, s_k, s_v and s_p
    }

    // Normalise. Without split this is the answer; with split it is one partition's
    // partial answer, to be weighted by its sum-exp and max in paged_attention_merge.
    if constexpr (INT8) {
        // The token splits' sums, added in split order through shared memory (s_k is free),
        // the last split writes.
        float* total = reinterpret_cast<float*>(s_k);
        static_assert(GROUP * HEAD_DIM * sizeof(float) <= sizeof(s_k), "s_k holds the split sums");
        for (int s = 0; s < SPLITS; s++) {
            if (split == s) {
#pragma unroll
                for (int h = 0; h < PV_HEADS; h++) {
                    const int g = pv_set + h * PV_SETS;
                    if (g < GROUP) {
#pragma unroll
                        for (int d = 0; d < 4; d++) {
                            float* t = &total[g * HEAD_DIM + 4 * quad + d];
                            if (s > 0) acc8[h][d] += *t;
                            if (s < SPLITS - 1) *t = acc8[h][d];
                        }
                    }
                }
            }
            __syncthreads();
        }
        if (split == SPLITS - 1) {
#pragma unroll
            for (int h = 0; h < PV_HEADS; h++) {
                const int g = pv_set + h * PV_SETS;
                if (g < GROUP) {
                    const float inv = s_sum[g] > 0.0f ? 1.0f / s_sum[g] : 0.0f;
                    const long long row = (long long)seq * nq + kv_head * GROUP + g;
                    const float* a = acc8[h];
                    if (num_parts == 1) {
                        __half2* o = reinterpret_cast<__half2*>(out + row * HEAD_DIM + 4 * quad);
                        o[0] = __floats2half2_rn(a[0] * inv, a[1] * inv);
                        o[1] = __floats2half2_rn(a[2] * inv, a[3] * inv);
                    } else {
                        *reinterpret_cast<float4*>(partial_out + (row * num_parts + part) * HEAD_DIM + 4 * quad) =
                            make_float4(a[0] * inv, a[1] * inv, a[2] * inv, a[3] * inv);
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < PAIRS_PER_THREAD; j++) {
            const int pair = threadIdx.x + j * NUM_THREADS;
            if (pair < PAIRS) {
                const int g = pair / (HEAD_DIM / 2), d = 2 * (pair % (HEAD_DIM / 2));
                const float inv = s_sum[g] > 0.0f ? 1.0f / s_sum[g] : 0.0f;
                const long long row = (long long)seq * nq + kv_head * GROUP + g;
                if (num_parts == 1) {
                    *reinterpret_cast<__half2*>(out + row * HEAD_DIM + d) =
                        __floats2half2_rn(acc[j].x * inv, acc[j].y * inv);
                } else {
                    *reinterpret_cast<float2*>(partial_out + (row * num_parts + part) * HEAD_DIM + d) =
                        make_float2(acc[j].x * inv, acc[j].y * inv);
                }
            }
        }
    }
    if (num_parts > 1 && threadIdx.x < GROUP) {
        const long long row = (long long)seq * nq + kv_head * GROUP + threadIdx.x;
        partial_max[row * num_parts + part] = s_max[threadIdx.x];
        partial_sum[row * num_parts + part] = s_sum[threadIdx.x];
    }
}

// Combines the partitions of one (sequence, query head): partition p's weight is
// sum_p * exp(max_p - max over partitions). Only the ceil(ctx / partition_size)
// partitions that exist for this sequence are read. Grid (nq, S), block 128.
extern "C" __global__ void paged_attention_merge(
        __half* __restrict__ out, const float* __restrict__ partial_out,
        const float* __restrict__ partial_max, const float* __restrict__ partial_sum,
        const int* __restrict__ context_lens, int num_parts, int partition_size, int head_dim) {
    const int head = blockIdx.x, seq = blockIdx.y, nq = gridDim.x;
    const int n = min(num_parts, (context_lens[seq] + partition_size - 1) / partition_size);
    const long long row = (long long)seq * nq + head;
    const float* maxes = partial_max + row * num_parts;
    const float* sums = partial_sum + row * num_parts;
    float global_max = NEG_INF;
    for (int p = 0; p < n; p++) global_max = fmaxf(global_max, maxes[p]);
    float total = 0.0f;
    for (int p = 0; p < n; p++)
        if (maxes[p] != NEG_INF) total += sums[p] * __expf(maxes[p] - global_max);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int p = 0; p < n; p++)
            if (maxes[p] != NEG_INF)
                o += sums[p] * __expf(maxes[p] - global_max) * partial_out[(row * num_parts + p) * head_dim + d];
        out[row * head_dim + d] = __float2half(o * inv);
    }
}
