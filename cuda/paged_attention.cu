// Decode attention over a paged KV cache: each sequence's one new query token attends to
// its cached context, or with a sliding window of W keys to the last W of it. The engine
// calls this kernel for the first num_decodes rows of a step and prefill_attention
// (cuda/prefill_attention.cu) for the rest: one launch per kind.
//
// paged_attention_kernel<HEAD_DIM, GROUP, T, CacheT>: for every query head,
//   out = softmax(scale * q K^T) V over the sequence's keys first .. ctx - 1, where ctx =
//   context_lens and first = max(0, ctx - window): the window's keys, the only ones read.
// T is the run's element type, __half or __nv_bfloat16 (common.cuh); CacheT is T (a cache of
// that type) or int8_t (int8 cache, nano/kv_cache.py).
// Arguments (T unless noted):
//   q             (S, nq, d)                    query head h*GROUP+g belongs to KV head h
//   k_cache/v_cache (num_blocks, nkv, block_size, d) CacheT  one layer of the cache
//   k_scales/v_scales (num_blocks, nkv, block_size) float16  int8 cache: one scale per
//                                               (token, KV head), value = int8 * scale; T
//                                               cache: empty, never read
//   block_tables  (S, max_blocks) int32         physical block of each logical block, -1 past the end
//   context_lens  (S,) int32                    tokens in cache, this step's token included (>= 1)
//   window        int                           keys the query sees, its own included (>= 1;
//                                               at least max_blocks * block_size: all)
//   out           (S, nq, d)                    the answer
//   partial_out   (S, nq, gridDim.z, d) float32 split-KV only (gridDim.z > 1): each
//   partial_max/partial_sum (S, nq, gridDim.z) float32  partition's normalised output,
//                                               running max and sum-exp, merged into out
//   partitions_done (S, nkv) int32              split-KV only: zeros (a memset before each
//                                               launch), counted up by each partition as it finishes
// One sequence's block for one KV head is block_size * d contiguous values, so a run of
// tokens inside a block is one contiguous stretch of memory: neighbouring threads load
// neighbouring 16-byte chunks (coalesced). A token's scales sit at the same (block, head,
// offset) index of k_scales / v_scales.
//
// Grid (nkv, S, partitions), block 128 threads: one thread block per (KV head, sequence,
// partition of partition_size tokens, counted from the window's first key) computes all
// GROUP query heads that share the KV head, so each K/V row is read from memory once per
// group, not once per query head. Static shared memory: the tile's scores (GROUP x TILE
// floats), block ids and softmax state (3 x GROUP floats), and the cache type's buffers
// (DecodePath, cuda/decode_paths.cuh): a T cache, q as floats (GROUP x d) and TILE K and TILE V rows of
// d + 8 elements; int8, TILE K rows of d + 16 bytes, TILE V rows of d bytes, q and p' in fixed point
// (GROUP x (d + 2 TILE) bytes) and 2 x (TILE + GROUP) float scales. TILE is 64 tokens, 32
// at head dim 256 (TILE_TOKENS).
// Per tile of TILE tokens:
//   1. look up each row's physical block (-1: row skipped),
//   2. stage K and V rows in shared memory with 16-byte loads,
//   3. scores for every (row, head) pair, float32,
//   4. online softmax per head (running max and sum-exp, float32), one warp per head,
//   5. acc = acc * exp(old_max - new_max) + P @ V.
// Then each output is divided by its sum-exp. Steps 1, 2 and 4's max and sums are the same
// for both cache types; loading q, step 3, step 4's weights, step 5 and the final store are
// DecodePath<HEAD_DIM, GROUP, T, CacheT>'s (cuda/decode_paths.cuh).
// Split-KV ("flash decoding"): with few sequences the grid is too small to fill the GPU, so
// nano/kernels.py also splits each context into partitions (grid z). Each partition writes its
// partial answer and counts itself done; the last of a (sequence, KV head) to finish merges
// them all with log-sum-exp weights (merge_partitions), so no second kernel is launched.
#include "decode_paths.cuh"  // NUM_THREADS, TILE_TOKENS and DecodePath

// Blocks per SM that an instance's registers must allow (__launch_bounds__'s second
// argument): 0 (none) for a 16-bit cache; for int8 it is needed, because given the block size alone
// ptxas picks a register count for an occupancy step of its own and spills to meet it. 7
// blocks for head dim 64 and 5 for 128 and 256 are near the float16 instances' occupancy and
// leave no spills (docs/perf_notes.md).
template <int HEAD_DIM, typename CacheT>
constexpr int MIN_BLOCKS = sizeof(CacheT) == 2 ? 0 : HEAD_DIM == 64 ? 7 : 5;

// Combines the partitions of `rows` consecutive (sequence, query head) rows from `row0`: out =
// sum_p w_p partial_out_p / sum_p w_p with w_p = partial_sum_p * exp(partial_max_p - max over
// partitions), over the first n of each row's num_parts partitions (those that exist). Called
// by the last partition of a (sequence, KV head) to finish, a thread per output; the other
// partitions' results are read past the L1 cache (__ldcg), which may hold none of them.
template <typename T>
__device__ __forceinline__ void merge_partitions(T* __restrict__ out, const float* __restrict__ partial_out,
                                                 const float* __restrict__ partial_max,
                                                 const float* __restrict__ partial_sum, long long row0, int rows,
                                                 int n, int num_parts, int head_dim) {
    for (int i = threadIdx.x; i < rows * head_dim; i += blockDim.x) {
        const long long row = row0 + i / head_dim;
        const float* maxes = partial_max + row * num_parts;
        const float* sums = partial_sum + row * num_parts;
        float global_max = NEG_INF;
        for (int p = 0; p < n; p++) global_max = fmaxf(global_max, __ldcg(maxes + p));
        float total = 0.0f, o = 0.0f;
        for (int p = 0; p < n; p++) {
            const float m = __ldcg(maxes + p);
            if (m == NEG_INF) continue;
            const float w = __ldcg(sums + p) * __expf(m - global_max);
            total += w;
            o += w * __ldcg(partial_out + (row * num_parts + p) * head_dim + i % head_dim);
        }
        out[row * head_dim + i % head_dim] = from_float<T>(total > 0.0f ? o / total : 0.0f);
    }
}

template <int HEAD_DIM, int GROUP, typename T, typename CacheT>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS<HEAD_DIM, CacheT>) paged_attention_kernel(
        T* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_max, float* __restrict__ partial_sum,
        const T* __restrict__ q, const CacheT* __restrict__ k_cache,
        const CacheT* __restrict__ v_cache, const __half* __restrict__ k_scales,
        const __half* __restrict__ v_scales, const int* __restrict__ block_tables,
        const int* __restrict__ context_lens, int* __restrict__ partitions_done, int max_blocks,
        int log2_block_size, int partition_size, int window, float scale) {
    using Path = DecodePath<HEAD_DIM, GROUP, T, CacheT>;
    constexpr int TILE = Path::TILE;
    const typename Path::Shared s = Path::shared();
    __shared__ float s_p[GROUP][TILE];  // scores, then probabilities
    __shared__ int s_block[TILE];
    __shared__ float s_max[GROUP], s_sum[GROUP], s_alpha[GROUP];

    const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int nkv = gridDim.x, nq = nkv * GROUP, num_parts = gridDim.z;
    const int ctx = context_lens[seq];
    const int first = max(0, ctx - window);  // the window's first key: those before it are never read
    const int begin = first + part * partition_size;
    if (begin >= ctx) return;  // this sequence's window is shorter than the longest one
    const int end = min(ctx, begin + partition_size);
    const int* table = block_tables + (long long)seq * max_blocks;

    Path path;
    Path::load_q(s, q + ((long long)seq * nq + kv_head * GROUP) * HEAD_DIM, scale);
    if (threadIdx.x < GROUP) {
        s_max[threadIdx.x] = NEG_INF;
        s_sum[threadIdx.x] = 0.0f;
    }

    for (int tile = begin; tile < end; tile += TILE) {
        const int rows = min(TILE, end - tile);
        // 1-2. Physical block of each row, then K and V rows into shared memory.
        stage_kv_tile<TILE, HEAD_DIM, Path::K_ROW, Path::V_ROW, NUM_THREADS>(
            s.k, s.v, s.kscale, s.vscale, s_block, k_cache, v_cache, k_scales, v_scales, table,
            max_blocks, tile, rows, kv_head, nkv, log2_block_size);

        // 3. Scores (q was pre-scaled); -inf for skipped rows.
        Path::scores(s, s_block, s_p);
        __syncthreads();

        // 4. Online softmax, one warp per head.
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GROUP; g += WARPS) {
            float tile_max = NEG_INF;
            for (int r = lane; r < TILE; r += 32) tile_max = fmaxf(tile_max, s_p[g][r]);
            const float old_max = s_max[g];
            const float new_max = fmaxf(old_max, warp_reduce(tile_max, Max()));
            float sum = Path::weights(s, s_p[g], g, lane, new_max);
            sum = warp_reduce(sum, Sum());
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
        path.accumulate(s, s_p, s_alpha, rows);
        __syncthreads();  // the next tile overwrites s_block, the K/V tile and s_p
    }

    // Without split this is the answer; with split it is one partition's partial answer, to
    // be weighted by its sum-exp and max when the last partition merges them.
    const long long row0 = (long long)seq * nq + kv_head * GROUP;  // the group's first query row
    path.store(s, s_sum, out, partial_out, row0, num_parts, part);
    if (num_parts == 1) return;
    if (threadIdx.x < GROUP) {
        const long long row = row0 + threadIdx.x;
        partial_max[row * num_parts + part] = s_max[threadIdx.x];
        partial_sum[row * num_parts + part] = s_sum[threadIdx.x];
    }
    // The partitions of this window that exist: those that start before ctx.
    const int parts = min(num_parts, (ctx - first + partition_size - 1) / partition_size);
    __shared__ bool s_last;
    __threadfence();  // this partition's writes reach every SM before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0)
        s_last = atomicAdd(&partitions_done[seq * nkv + kv_head], 1) == parts - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();  // the other partitions' writes, counted before ours, are read after it
    merge_partitions(out, partial_out, partial_max, partial_sum, row0, GROUP, parts, num_parts, HEAD_DIM);
}

