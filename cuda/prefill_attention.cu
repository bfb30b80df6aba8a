// Prefill attention: a chunk of query tokens per sequence attends to that sequence's cached
// context, causally. The chunk's own K/V were written to the cache (rope_store_kvcache) before
// the call, so every key comes from the cache. A chunk may start mid-sequence (a later
// chunk, or after a prefix-cache hit): with chunk length n and context length ctx, its
// queries sit at positions ctx - n .. ctx - 1 and query i sees keys 0 .. ctx - n + i, or
// with a sliding window of W keys the last W of them (from ctx - n + i - W + 1).
//
// The engine calls paged_attention (cuda/paged_attention.cu) for the first num_decodes rows
// of a step and this kernel for the rest: one launch per kind.
//
// Template: prefill_attention_kernel<HEAD_DIM, GROUP, CacheT>, CacheT __half (float16 cache)
// or int8_t (int8 cache, nano/kv_cache.py).
// Arguments (float16 unless noted):
//   q             (T, nq, d)          the step's prefill query rows, chunk after chunk
//   k_cache/v_cache (num_blocks, nkv, block_size, d) CacheT  one layer of the cache
//   k_scales/v_scales (num_blocks, nkv, block_size)  int8 cache: one scale per (token, KV
//                                     head), value = int8 * scale; float16: empty, never read
//   cu_seqlens_q  (S+1,) int32        chunk i is q[cu_seqlens_q[i] : cu_seqlens_q[i+1]]
//   block_tables  (S, max_blocks) int32, -1 past the end
//   context_lens  (S,) int32          tokens in cache, the chunk included
//   window        int                 keys a query sees, its own included (>= 1; INT_MAX: all)
//   out           (T, nq, d)
// KV cache layout: one sequence's block for one KV head is block_size * d contiguous values
// (halfs or int8), so neighbouring threads load neighbouring 16-byte chunks of K/V rows
// (coalesced); a token's scales sit at the same (block, head, offset) index of the scales.
//
// Design (CUDA cores, no tensor cores): a thread block of 256 threads takes 64 query
// rows = 64 / GROUP query tokens x the GROUP query heads of one KV head, so each K/V tile is
// read once for the whole group. Grid (ceil(T / tokens per block), nkv, S); blocks past
// the end of their chunk exit at once. Per tile of KEYS keys (32; 8 at head dim 256, see
// KEYS_PER_TILE):
//   1. physical block of each key (-1: key skipped), 2. stage K, V in shared memory with
//   16-byte loads, 3. scores: each thread computes 8 rows x 1 key in float32, masked
//   causally, 4. online softmax, one thread per row (running max and sum-exp in
//   registers), 5. acc = acc * alpha + P @ V, each thread owning a dim pair of 8 or 16 rows.
// Key tiles past the block's last query position are never visited (fully masked), nor keys
// before its first query's window: the tiles start at that window's first key.
// int8 cache: step 2 converts the int8 values to halfs in shared memory (exact) and stages
// each key's two scales; step 3 multiplies a key's scores by its K scale, step 4 its
// probabilities by its V scale (after the sum-exp, which is of p): nothing is dequantized
// in global memory, and steps 3 and 5 run the float16 code. Prefill is compute-bound (each
// K/V tile serves 64 query rows), so the conversion's cost is small next to the products.
// Static shared memory: the block's 64 q rows and a tile's KEYS K and KEYS V rows, d + 8
// halfs each (padded, see step 3); scores 64 x (KEYS + 1) floats; alpha and sum-exp per row
// (2 x 64 floats); KEYS block ids; int8 cache also 2 x KEYS float scales.
#include "common.cuh"

constexpr int NUM_THREADS = 256;
constexpr int ROWS = 64;  // query rows (token, head) per thread block
// Keys per tile: 32, but 8 at head dim 256, where the 64 q rows alone take 33 KB of the 48 KB
// of static shared memory a block may have (and 32 K and 32 V rows would take 34 more).
template <int HEAD_DIM>
constexpr int KEYS_PER_TILE = HEAD_DIM <= 128 ? 32 : 8;

// Blocks per SM that the int8 instances' registers must allow (__launch_bounds__'s second
// argument, see paged_attention.cu); 0 (none) for float16.
template <int HEAD_DIM, typename CacheT>
constexpr int MIN_BLOCKS = sizeof(CacheT) == 2 ? 0 : HEAD_DIM == 64 ? 3 : 2;

template <int HEAD_DIM, int GROUP, typename CacheT>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS<HEAD_DIM, CacheT>) prefill_attention_kernel(
        __half* __restrict__ out, const __half* __restrict__ q,
        const CacheT* __restrict__ k_cache, const CacheT* __restrict__ v_cache,
        const __half* __restrict__ k_scales, const __half* __restrict__ v_scales,
        const int* __restrict__ cu_seqlens_q, const int* __restrict__ block_tables,
        const int* __restrict__ context_lens, int max_blocks, int log2_block_size, int window, float scale) {
    constexpr bool INT8 = sizeof(CacheT) == 1;
    constexpr int KEYS = KEYS_PER_TILE<HEAD_DIM>;
    constexpr int TOKENS = ROWS / GROUP;  // query tokens per block; rows past TOKENS*GROUP idle
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int ROW = HEAD_DIM + 8;     // padded: conflict-free 16-byte reads, see step 3
    constexpr int SCORE_ROWS = ROWS / (NUM_THREADS / KEYS);  // score rows per thread: 8 (2 at 256)
    constexpr int PAIR_COLS = HEAD_DIM / 2;                   // dim pairs per row: 32, 64 or 128
    constexpr int ROW_STEP = NUM_THREADS / PAIR_COLS;          // 8, 4 or 2
    constexpr int OUT_ROWS = ROWS / ROW_STEP;                  // output rows per thread: 8, 16 or 32
    static_assert(ROWS * CHUNKS % NUM_THREADS == 0, "the q staging loop assumes whole rounds");

    __shared__ __align__(16) __half s_q[ROWS * ROW];
    __shared__ __align__(16) __half s_k[KEYS * ROW];
    __shared__ __align__(16) __half s_v[KEYS * ROW];
    __shared__ float s_p[ROWS][KEYS + 1];  // +1: the row-per-thread softmax reads a column
    __shared__ float s_alpha[ROWS], s_sum[ROWS];
    __shared__ int s_block[KEYS];
    __shared__ float s_kscale[INT8 ? KEYS : 1], s_vscale[INT8 ? KEYS : 1];  // int8 cache only

    const int kv_head = blockIdx.y, seq = blockIdx.z;
    const int nkv = gridDim.y, nq = nkv * GROUP;
    const int q_begin = cu_seqlens_q[seq];
    const int q_len = cu_seqlens_q[seq + 1] - q_begin;
    const int first = blockIdx.x * TOKENS;  // this block's first token within the chunk
    if (first >= q_len) return;
    const int tokens = min(TOKENS, q_len - first);
    const int pos0 = context_lens[seq] - q_len + first;  // position of that token
    const int last_key = pos0 + tokens - 1;              // no row sees a later key
    const int first_key = max(0, pos0 - window + 1);     // nor an earlier one
    const int* table = block_tables + (long long)seq * max_blocks;

    // Row r is token r / GROUP, head r % GROUP; a token's GROUP heads are contiguous in q.
#pragma unroll
    for (int j = 0; j < ROWS * CHUNKS / NUM_THREADS; j++) {
        const int i = threadIdx.x + j * NUM_THREADS;
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int t = r / GROUP, g = r % GROUP;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (t < tokens)
            val = *reinterpret_cast<const uint4*>(
                q + ((long long)(q_begin + first + t) * nq + kv_head * GROUP + g) * HEAD_DIM + c * 8);
        *reinterpret_cast<uint4*>(&s_q[r * ROW + c * 8]) = val;
    }

    // Softmax state of row threadIdx.x (threads < ROWS), and this thread's output slice:
    // dim pair `d2` of rows r0, r0 + ROW_STEP, ...
    float row_max = NEG_INF, row_sum = 0.0f;
    const int d2 = threadIdx.x % PAIR_COLS, r0 = threadIdx.x / PAIR_COLS;
    float2 acc[OUT_ROWS];
    for (int i = 0; i < OUT_ROWS; i++) acc[i] = make_float2(0.0f, 0.0f);
    // Score slice: key `kr` of rows sr0 .. sr0 + SCORE_ROWS - 1 (with 32 keys a warp shares
    // its rows; with 8, four sets of rows).
    const int kr = threadIdx.x % KEYS, sr0 = threadIdx.x / KEYS * SCORE_ROWS;

    for (int key0 = first_key; key0 <= last_key; key0 += KEYS) {
        // 1-2. Physical block of each key, then K and V rows into shared memory.
        // An int8 cache's values are staged as halfs (exact); its scales are folded in below.
        stage_kv_tile<KEYS, HEAD_DIM, ROW, ROW, NUM_THREADS>(
            s_k, s_v, s_kscale, s_vscale, s_block, k_cache, v_cache, k_scales, v_scales, table,
            max_blocks, key0, last_key - key0 + 1, kv_head, nkv, log2_block_size);

        // 3. Scores. Lanes read KEYS different K rows at the same chunk: rows are an odd
        // number of 16-byte units apart, so no bank conflicts; q rows are broadcast.
        float score[SCORE_ROWS];
        for (int i = 0; i < SCORE_ROWS; i++) score[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            const uint4 ku = *reinterpret_cast<const uint4*>(&s_k[kr * ROW + c * 8]);
            const __half2* k2 = reinterpret_cast<const __half2*>(&ku);
#pragma unroll
            for (int i = 0; i < SCORE_ROWS; i++) {
                const uint4 qu = *reinterpret_cast<const uint4*>(&s_q[(sr0 + i) * ROW + c * 8]);
                const __half2* q2 = reinterpret_cast<const __half2*>(&qu);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 kf = __half22float2(k2[e]), qf = __half22float2(q2[e]);
                    score[i] += qf.x * kf.x + qf.y * kf.y;
                }
            }
        }
        const int key = key0 + kr;
        const bool key_ok = s_block[kr] >= 0;
        float key_scale = scale;  // int8: times the key's scale
        if constexpr (INT8) key_scale *= s_kscale[kr];
#pragma unroll
        for (int i = 0; i < SCORE_ROWS; i++) {
            const int t = (sr0 + i) / GROUP;  // t >= tokens: padding row, fully masked
            const bool visible = key_ok && t < tokens && key <= pos0 + t && key > pos0 + t - window;
            s_p[sr0 + i][kr] = visible ? score[i] * key_scale : NEG_INF;
        }
        __syncthreads();

        // 4. Online softmax, one thread per row. int8: s_p gets p * (the key's V scale); the
        // sum is of p.
        if (threadIdx.x < ROWS) {
            const int r = threadIdx.x;
            float tile_max = NEG_INF;
            for (int k = 0; k < KEYS; k++) tile_max = fmaxf(tile_max, s_p[r][k]);
            const float new_max = fmaxf(row_max, tile_max);
            float sum = 0.0f;
            for (int k = 0; k < KEYS; k++) {
                const float s = s_p[r][k];
                const float p = s == NEG_INF ? 0.0f : __expf(s - new_max);
                if constexpr (INT8) s_p[r][k] = p * s_vscale[k];
                else s_p[r][k] = p;
                sum += p;
            }
            const float alpha = row_max == NEG_INF ? 0.0f : __expf(row_max - new_max);
            row_sum = row_sum * alpha + sum;
            row_max = new_max;
            s_alpha[r] = alpha;
        }
        __syncthreads();

        // 5. acc = acc * alpha + P @ V. A warp shares its rows (p is broadcast) and reads
        // consecutive dim pairs of a V row.
#pragma unroll
        for (int i = 0; i < OUT_ROWS; i++) {
            const float alpha = s_alpha[r0 + i * ROW_STEP];
            acc[i].x *= alpha;
            acc[i].y *= alpha;
        }
        for (int k = 0; k < KEYS; k++) {
            const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&s_v[k * ROW + 2 * d2]));
#pragma unroll
            for (int i = 0; i < OUT_ROWS; i++) {
                const float p = s_p[r0 + i * ROW_STEP][k];
                acc[i].x += p * v.x;
                acc[i].y += p * v.y;
            }
        }
        __syncthreads();  // the next tile overwrites s_block, s_k, s_v and s_p
    }

    if (threadIdx.x < ROWS) s_sum[threadIdx.x] = row_sum;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < OUT_ROWS; i++) {
        const int r = r0 + i * ROW_STEP, t = r / GROUP, g = r % GROUP;
        if (t < tokens) {
            const float inv = s_sum[r] > 0.0f ? 1.0f / s_sum[r] : 0.0f;
            const long long dst =
                ((long long)(q_begin + first + t) * nq + kv_head * GROUP + g) * HEAD_DIM + 2 * d2;
            *reinterpret_cast<__half2*>(out + dst) = __floats2half2_rn(acc[i].x * inv, acc[i].y * inv);
        }
    }
}
