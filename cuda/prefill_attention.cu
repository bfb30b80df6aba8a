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
// Template: prefill_attention_kernel<HEAD_DIM, GROUP, T, CacheT>, T the run's element type
// (__half or __nv_bfloat16, common.cuh), CacheT T (a cache of that type) or int8_t (int8
// cache, nano/kv_cache.py).
// Arguments (T unless noted):
//   q             (T, nq, d)          the step's prefill query rows, chunk after chunk
//   k_cache/v_cache (num_blocks, nkv, block_size, d) CacheT  one layer of the cache
//   k_scales/v_scales (num_blocks, nkv, block_size) float16  int8 cache: one scale per (token,
//                                     KV head), value = int8 * scale; T cache: empty, never read
//   cu_seqlens_q  (S+1,) int32        chunk i is q[cu_seqlens_q[i] : cu_seqlens_q[i+1]]
//   block_tables  (S, max_blocks) int32, -1 past the end
//   context_lens  (S,) int32          tokens in cache, the chunk included
//   window        int                 keys a query sees, its own included (>= 1; INT_MAX: all)
//   out           (T, nq, d)
// KV cache layout: one sequence's block for one KV head is block_size * d contiguous values
// (T or int8), so neighbouring threads load neighbouring 16-byte chunks of K/V rows
// (coalesced); a token's scales sit at the same (block, head, offset) index of the scales.
//
// Design (tensor cores, FlashAttention-2's loop through the WMMA API): a thread block of 4
// warps (2 at head dim 256) takes ROWS = 64 (32) query rows = ROWS / GROUP query tokens x the
// GROUP query heads of one KV head, so each K/V tile is read once for the whole group; each
// warp owns 16 of the rows (one WMMA row tile), keeps their Q as fragments in registers (in
// shared memory at head dim 256, see WARPS) and accumulates their output O (16 x d, float32)
// in accumulator fragments. Grid (ceil(T / tokens per block), nkv, S); blocks past
// the end of their chunk exit at once. Per tile of KEYS keys (see KEYS_PER_TILE):
//   1. physical block of each key (-1: key skipped), 2. stage K, V in shared memory with
//   16-byte loads, 3. S = Q K^T on tensor cores (16 x KEYS per warp, float32) into the
//   warp's scratch, 4. online softmax, a lane pair per row (running max and sum-exp in
//   float32 registers, masked causally and by the window), P = exp(S - max) rounded to
//   T, 5. O = O * alpha + P V on tensor cores.
// WMMA does not say which lane holds which element of a fragment, so the per-row factor
// alpha = exp(old max - new max) reaches O through a fragment of the same type: step 4 writes
// a 16 x 16 matrix whose row r is alpha of row r, step 5 loads it and multiplies element i
// of each O fragment by its element i (same type, same load layout: the same position).
// The output goes the same way: each O fragment through the scratch, divided by its row's sum.
// Key tiles past the block's last query position are never visited (fully masked), nor keys
// before its first query's window: the tiles start at that window's first key.
// int8 cache: step 2 converts the int8 values to T in shared memory (exact) and stages
// each key's two scales; step 4 multiplies a key's scores by its K scale and its
// probabilities by its V scale (after the sum-exp, which is of p): nothing is dequantized
// in global memory, and steps 3 and 5 run the T cache's code.
// Static shared memory (at most 48 KB, see KEYS_PER_TILE): one tile buffer, first the block's
// q rows, then a tile's KEYS K and KEYS V rows (over the q rows, or after them at head dim
// 256), d + 8 elements T each (the padding staggers the rows over the banks for WMMA's
// loads); per warp, S (16 x (KEYS + 4) floats, later alpha and the output) and P (16 x
// (KEYS + 8) T); KEYS block ids; int8 also 2 x KEYS float scales.
#include <mma.h>

#include "common.cuh"

namespace wmma = nvcuda::wmma;

// The tile plan, by head dim: warps per block (each 16 query rows), keys per tile, and where
// Q lives. Q as fragments in registers takes d / 4 registers a lane and O d / 2; at head dim
// 256 the two (192) left too few for the rest (ptxas: 255 registers and spills), so there Q
// stays in shared memory, each use loads its fragment, and staging a tile keeps 2 rounds of
// loads in flight instead of 8 (168 registers); the q rows then take 17 KB of shared memory
// for good, so 2 warps. Keys per tile: as many as the 48 KB of static shared memory hold next
// to the other arrays (45 KB at 64, 31 KB at 128, 37 KB at 256). tests/test_kernels_compile.py
// holds the instances to this plan; nano/kernels.py's PREFILL_ROWS repeats the rows per block.
template <int HEAD_DIM> constexpr int WARPS = HEAD_DIM <= 128 ? 4 : 2;
template <int HEAD_DIM> constexpr int KEYS_PER_TILE = HEAD_DIM == 64 ? 64 : HEAD_DIM == 128 ? 32 : 16;
template <int HEAD_DIM> constexpr bool Q_IN_SHARED = HEAD_DIM > 128;
constexpr int MAX_THREADS = 128;  // 4 warps

// Q or P, K^T and V as WMMA inputs: the 16 x 16 x 16 shape takes __half and __nv_bfloat16
// alike (sm_80 and later).
template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragK = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
template <typename T>
using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <int HEAD_DIM, int GROUP, typename T, typename CacheT>
__global__ void __launch_bounds__(MAX_THREADS) prefill_attention_kernel(
        T* __restrict__ out, const T* __restrict__ q,
        const CacheT* __restrict__ k_cache, const CacheT* __restrict__ v_cache,
        const __half* __restrict__ k_scales, const __half* __restrict__ v_scales,
        const int* __restrict__ cu_seqlens_q, const int* __restrict__ block_tables,
        const int* __restrict__ context_lens, int max_blocks, int log2_block_size, int window, float scale) {
    constexpr bool INT8 = sizeof(CacheT) == 1;
    constexpr int NUM_THREADS = WARPS<HEAD_DIM> * 32;
    constexpr int ROWS = WARPS<HEAD_DIM> * 16;  // query rows (token, head) per block
    constexpr int KEYS = KEYS_PER_TILE<HEAD_DIM>;
    constexpr bool Q_SHARED = Q_IN_SHARED<HEAD_DIM>;
    // Q's fragments in registers need every loop over them unrolled; from shared memory, an
    // unrolled loop would have ptxas load them all ahead, into registers O needs.
    constexpr int Q_UNROLL = Q_SHARED ? 2 : HEAD_DIM / 16;
    // Rounds of K/V loads in flight while staging a tile (0: all): 2 where Q stays in shared
    // memory (see WARPS), and 1 for an int8 cache at head dim 64, whose bfloat16 instances
    // ptxas otherwise fits into 128 registers by spilling 8 bytes.
    constexpr int STAGE_UNROLL = Q_SHARED ? 2 : INT8 && HEAD_DIM == 64 ? 1 : 0;
    constexpr int TOKENS = ROWS / GROUP;  // query tokens per block; rows past TOKENS*GROUP idle
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int ROW = HEAD_DIM + 8;     // padded row of the tile buffer, in elements T
    constexpr int DIM_TILES = HEAD_DIM / 16, KEY_TILES = KEYS / 16;
    constexpr int S_LD = KEYS + 4, P_LD = KEYS + 8;  // WMMA's ldm: multiples of 16 bytes
    // The tile buffer: q rows, then (over them, unless Q stays there) K and V rows.
    constexpr int Q_END = Q_SHARED ? ROWS : 0;
    constexpr int TILE_ROWS = ROWS > Q_END + 2 * KEYS ? ROWS : Q_END + 2 * KEYS;
    static_assert(ROWS * CHUNKS % NUM_THREADS == 0, "the q staging loop assumes whole rounds");

    __shared__ __align__(32) T s_tile[TILE_ROWS * ROW];
    __shared__ __align__(32) float s_s[ROWS / 16][16 * S_LD];
    __shared__ __align__(32) T s_p[ROWS / 16][16 * P_LD];
    __shared__ int s_block[KEYS];
    __shared__ float s_kscale[INT8 ? KEYS : 1], s_vscale[INT8 ? KEYS : 1];  // int8 cache only
    T* s_k = s_tile + Q_END * ROW;
    T* s_v = s_k + KEYS * ROW;

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
        *reinterpret_cast<uint4*>(&s_tile[r * ROW + c * 8]) = val;
    }
    __syncthreads();

    // This warp's rows warp * 16 .. + 15: O as float32 accumulators, Q as fragments (one,
    // loaded at each use, where Q stays in shared memory).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* s_q = &s_tile[warp * 16 * ROW];
    FragA<T> q_frag[Q_SHARED ? 1 : DIM_TILES];
    FragAcc o_frag[DIM_TILES];
#pragma unroll
    for (int d = 0; d < DIM_TILES; d++) {
        if constexpr (!Q_SHARED) wmma::load_matrix_sync(q_frag[d], &s_q[d * 16], ROW);
        wmma::fill_fragment(o_frag[d], 0.0f);
    }
    if constexpr (!Q_SHARED) __syncthreads();  // the buffer takes K and V next

    // Step 4's share of the work: lane pair `row` (the warp's row lane / 2), each lane the
    // columns of its parity (neighbouring lanes, neighbouring words). Both lanes of the pair
    // keep the row's softmax state.
    const int row = lane / 2, half = lane % 2;
    const int t = (warp * 16 + row) / GROUP;
    // The row's visible keys: last_visible - window < key <= last_visible (none for a padding
    // row, t >= tokens).
    const int last_visible = t < tokens ? pos0 + t : -1;
    float* scratch = s_s[warp];
    T* p_tile = s_p[warp];
    float row_max = NEG_INF, row_sum = 0.0f;

    for (int key0 = first_key; key0 <= last_key; key0 += KEYS) {
        // 1-2. Physical block of each key, then K and V rows into shared memory.
        // An int8 cache's values are staged as T (exact); its scales are folded in below.
        stage_kv_tile<KEYS, HEAD_DIM, ROW, ROW, NUM_THREADS, STAGE_UNROLL>(
            s_k, s_v, s_kscale, s_vscale, s_block, k_cache, v_cache, k_scales, v_scales, table,
            max_blocks, key0, last_key - key0 + 1, kv_head, nkv, log2_block_size);

        // 3. S = Q K^T, 16 keys at a time: K's rows are K^T's columns (col_major).
#pragma unroll
        for (int n = 0; n < KEY_TILES; n++) {
            FragAcc s_frag;
            wmma::fill_fragment(s_frag, 0.0f);
#pragma unroll Q_UNROLL
            for (int d = 0; d < DIM_TILES; d++) {
                if constexpr (Q_SHARED) wmma::load_matrix_sync(q_frag[0], &s_q[d * 16], ROW);
                FragK<T> k_frag;
                wmma::load_matrix_sync(k_frag, &s_k[n * 16 * ROW + d * 16], ROW);
                wmma::mma_sync(s_frag, q_frag[Q_SHARED ? 0 : d], k_frag, s_frag);
            }
            wmma::store_matrix_sync(&scratch[n * 16], s_frag, S_LD, wmma::mem_row_major);
        }
        __syncwarp();

        // 4. Online softmax of the row, masked, in two passes over the lane's columns (a
        // register per column would be KEYS / 2 more); they are read before the lane
        // overwrites its own columns with alpha.
        auto score = [&](int c) {
            const int key = key0 + c;
            const bool visible = s_block[c] >= 0 && key <= last_visible && key > last_visible - window;
            float key_scale = scale;  // int8: times the key's scale
            if constexpr (INT8) key_scale *= s_kscale[c];
            return visible ? scratch[row * S_LD + c] * key_scale : NEG_INF;
        };
        float tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < KEYS / 2; j++) tile_max = fmaxf(tile_max, score(2 * j + half));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        const float new_max = fmaxf(row_max, tile_max);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < KEYS / 2; j++) {
            const int c = 2 * j + half;
            const float s = score(c);
            const float p = s == NEG_INF ? 0.0f : __expf(s - new_max);
            sum += p;
            float weight = p;  // int8: times the key's V scale; the sum is of p
            if constexpr (INT8) weight *= s_vscale[c];
            p_tile[row * P_LD + c] = from_float<T>(weight);
        }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        const float alpha = row_max == NEG_INF ? 0.0f : __expf(row_max - new_max);
        row_sum = row_sum * alpha + sum;
        row_max = new_max;
#pragma unroll
        for (int j = 0; j < 8; j++) scratch[row * S_LD + 2 * j + half] = alpha;  // alpha's row
        __syncwarp();

        // 5. O = O * alpha + P V.
        FragAcc alpha_frag;
        wmma::load_matrix_sync(alpha_frag, scratch, S_LD, wmma::mem_row_major);
#pragma unroll
        for (int d = 0; d < DIM_TILES; d++)
            for (int i = 0; i < alpha_frag.num_elements; i++) o_frag[d].x[i] *= alpha_frag.x[i];
#pragma unroll
        for (int k = 0; k < KEY_TILES; k++) {
            FragA<T> p_frag;
            wmma::load_matrix_sync(p_frag, &p_tile[k * 16], P_LD);
#pragma unroll
            for (int d = 0; d < DIM_TILES; d++) {
                FragV<T> v_frag;
                wmma::load_matrix_sync(v_frag, &s_v[k * 16 * ROW + d * 16], ROW);
                wmma::mma_sync(o_frag[d], p_frag, v_frag, o_frag[d]);
            }
        }
        __syncthreads();  // the next tile overwrites s_block, s_k, s_v and the warp's scratch
    }

    // O / sum, 16 dims at a time through the scratch: a lane writes 8 dims of its row.
    const int g = (warp * 16 + row) % GROUP;
    const float inv = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    const long long dst = ((long long)(q_begin + first + t) * nq + kv_head * GROUP + g) * HEAD_DIM;
#pragma unroll
    for (int d = 0; d < DIM_TILES; d++) {
        wmma::store_matrix_sync(scratch, o_frag[d], S_LD, wmma::mem_row_major);
        __syncwarp();
        float o[8];
        for (int i = 0; i < 8; i++) o[i] = scratch[row * S_LD + half * 8 + i] * inv;
        if (t < tokens) store8(out + dst + d * 16 + half * 8, o);
        __syncwarp();  // read before the next fragment overwrites it
    }
}
