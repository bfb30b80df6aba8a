// Decode attention over a paged KV cache: each sequence's one new query token attends to
// its whole cached context.
//
// The engine calls this kernel for the first num_decodes rows of a step and
// prefill_attention (cuda/prefill_attention.cu) for the rest: one launch per kind.
//
// Arguments (float16 unless noted):
//   q             (S, nq, d)                    query head h*GROUP+g belongs to KV head h
//   k_cache/v_cache (num_blocks, nkv, block_size, d)  one layer of the cache
//   block_tables  (S, max_blocks) int32         physical block of each logical block, -1 past the end
//   context_lens  (S,) int32                    tokens in cache, this step's token included (>= 1)
//   out           (S, nq, d)
// KV cache layout: one sequence's block for one KV head is block_size * d contiguous halfs,
// so a run of tokens inside a block is one contiguous stretch of memory: neighbouring
// threads load neighbouring 16-byte chunks (coalesced), a row of d halfs per d/8 threads.
//
// Design: one thread block of 128 threads per (KV head, sequence, partition) computes all
// GROUP query heads that share the KV head, so each K/V row is read from memory once per
// group, not once per query head. Per tile of 64 tokens:
//   1. look up each row's physical block (-1: row skipped),
//   2. stage K and V rows in shared memory with 16-byte loads,
//   3. scores for every (row, head) pair, float32,
//   4. online softmax per head (running max and sum-exp, float32), one warp per head,
//   5. acc = acc * exp(old_max - new_max) + P @ V; each thread owns (head, dim pair) outputs.
// Split-KV ("flash decoding"): with few sequences the grid is too small to fill the GPU, so
// nano/kernels.py also splits each context into partitions (grid z). Each partition
// writes its normalised partial output, max and sum-exp (float32); paged_attention_merge
// then combines them with log-sum-exp weights. gridDim.z == 1 writes `out` directly.
//
// Version v1: head dim 64: 54-63 registers, 19-23 KB shared; head dim 128: 88-103 registers,
// 36-41 KB shared; merge 32 registers; no spills (tests/kernel_resources.py). Not yet
// measured on a GPU.
#include "common.cuh"

constexpr int NUM_THREADS = 128;
constexpr int TILE = 64;  // context tokens staged in shared memory per step

template <int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_kernel(
        __half* __restrict__ out, float* __restrict__ partial_out,
        float* __restrict__ partial_max, float* __restrict__ partial_sum,
        const __half* __restrict__ q, const __half* __restrict__ k_cache,
        const __half* __restrict__ v_cache, const int* __restrict__ block_tables,
        const int* __restrict__ context_lens, int max_blocks, int log2_block_size,
        int partition_size, float scale) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per K/V row
    // Shared rows are padded by 16 bytes: an odd number of 16-byte units per row means the
    // 8 threads of a quarter warp reading the same chunk of 8 different rows hit 8
    // different bank groups (no bank conflicts in step 3).
    constexpr int ROW = HEAD_DIM + 8;
    constexpr int PAIRS = GROUP * HEAD_DIM / 2;  // (head, dim pair) outputs of the block
    constexpr int PAIRS_PER_THREAD = (PAIRS + NUM_THREADS - 1) / NUM_THREADS;

    __shared__ __align__(16) float s_q[GROUP][HEAD_DIM];
    __shared__ __align__(16) __half s_k[TILE * ROW];
    __shared__ __align__(16) __half s_v[TILE * ROW];
    __shared__ float s_p[GROUP][TILE];  // scores, then probabilities
    __shared__ int s_block[TILE];
    __shared__ float s_max[GROUP], s_sum[GROUP], s_alpha[GROUP];

    const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int nkv = gridDim.x, nq = nkv * GROUP, num_parts = gridDim.z;
    const int ctx = context_lens[seq];
    const int begin = part * partition_size;
    if (begin >= ctx) return;  // this sequence is shorter than the longest one
    const int end = min(ctx, begin + partition_size);
    const int* table = block_tables + (long long)seq * max_blocks;

    const __half* q_group = q + ((long long)seq * nq + kv_head * GROUP) * HEAD_DIM;
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_THREADS)
        s_q[i / HEAD_DIM][i % HEAD_DIM] = __half2float(q_group[i]) * scale;
    if (threadIdx.x < GROUP) {
        s_max[threadIdx.x] = NEG_INF;
        s_sum[threadIdx.x] = 0.0f;
    }
    float2 acc[PAIRS_PER_THREAD];
    for (int j = 0; j < PAIRS_PER_THREAD; j++) acc[j] = make_float2(0.0f, 0.0f);

    for (int tile = begin; tile < end; tile += TILE) {
        const int rows = min(TILE, end - tile);
        // 1-2. Physical block of each row, then K and V rows into shared memory.
        stage_kv_tile<TILE, HEAD_DIM, ROW, NUM_THREADS>(s_k, s_v, s_block, k_cache, v_cache, table,
                                                        max_blocks, tile, rows, kv_head, nkv,
                                                        log2_block_size);

        // 3. Scores (q was pre-scaled); -inf for skipped rows.
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
        __syncthreads();

        // 4. Online softmax, one warp per head.
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        for (int g = warp; g < GROUP; g += NUM_THREADS / 32) {
            float tile_max = NEG_INF;
            for (int r = lane; r < TILE; r += 32) tile_max = fmaxf(tile_max, s_p[g][r]);
            const float old_max = s_max[g];
            const float new_max = fmaxf(old_max, warp_reduce(tile_max, Max()));
            float sum = 0.0f;
            for (int r = lane; r < TILE; r += 32) {
                const float s = s_p[g][r];
                const float p = s == NEG_INF ? 0.0f : __expf(s - new_max);
                s_p[g][r] = p;
                sum += p;
            }
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

        // 5. acc = acc * alpha + P @ V for this thread's (head, dim pair) outputs.
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
        __syncthreads();  // the next tile overwrites s_block, s_k, s_v and s_p
    }

    // Normalise. Without split this is the answer; with split it is one partition's
    // partial answer, to be weighted by its sum-exp and max in paged_attention_merge.
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
