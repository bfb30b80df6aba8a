// A stand-in libcublas.so.13 for the emulator: the four functions nano/cublas.py loads, defined
// after cuBLAS's own header (cublas_api.h, from the nvidia-cublas wheel) inside extern "C", so
// that g++ refuses any prototype that differs from the published one, with cuBLAS's argument
// checks and status codes. The GEMM runs on the host: the emulator's device arrays are host
// memory. cupy_stub.py installs a hook that sees every GEMM before it runs: it checks that each
// operand lies inside one live device allocation, and records the call instead of running it
// while the handle's stream is being captured into a CUDA graph (replayed by cuda_host_gemm).
// Host code: the function decorations of the toolkit headers mean nothing here (shim.h does
// the same for the kernels; include/crt/host_defines.h the rest).
#define __host__
#define __device__
#include <cublas_api.h>
#include <immintrin.h>

#include <vector>

struct cublasContext {
    cudaStream_t stream = nullptr;
    void* workspace = nullptr;  // nullptr: cuBLAS's own pool (cudaMalloc on first use)
    size_t workspace_bytes = 0;
};

// One GEMM, as the hook and cuda_host_gemm see it (cupy_stub.py mirrors this layout).
struct GemmCall {
    cudaStream_t stream;
    void* workspace;
    int transa, transb, m, n, k;
    float alpha, beta;
    const void* a;
    int lda;
    const void* b;
    int ldb;
    void* c;
    int ldc;
    size_t a_bytes, b_bytes, c_bytes;  // the extent of each operand the GEMM touches
    cudaDataType type;                 // of all three: CUDA_R_16F or CUDA_R_16BF
};

// 0: run it now; 1: recorded (a graph capture); any other value: refused (the hook says why).
typedef int (*GemmHook)(const GemmCall*);
static GemmHook hook = nullptr;

// Element i of a float16 or bfloat16 operand as a float, exactly; a float rounded to one (to
// nearest even, as the GPU's conversions round; a NaN becomes CUDA's canonical 0x7fff).
static float load(const void* p, size_t i, cudaDataType type) {
    const unsigned short bits = static_cast<const unsigned short*>(p)[i];
    if (type == CUDA_R_16F) return _cvtsh_ss(bits);
    const unsigned u = (unsigned)bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static unsigned short round_to(float f, cudaDataType type) {
    if (type == CUDA_R_16F) return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    unsigned u;
    __builtin_memcpy(&u, &f, 4);
    return f != f ? 0x7fff : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" {

__attribute__((visibility("default"))) void cuda_host_gemm_hook(GemmHook h) { hook = h; }

// C (m x n) = alpha op(A) op(B) + beta C, column-major, float16 or bfloat16 operands (all three
// alike), float32 sums, one rounding of each result.
// Returns false, having written nothing, if an element it would read lies past an operand's
// extent (the extents are what the hook checked against the device allocations).
__attribute__((visibility("default"))) bool cuda_host_gemm(const GemmCall* g) {
    // op(A) row i and op(B) column j as contiguous float rows of k, then one dot product each.
    std::vector<float> a((size_t)g->m * g->k), b((size_t)g->n * g->k);
    for (int i = 0; i < g->m; i++)
        for (int l = 0; l < g->k; l++) {
            const size_t at = g->transa == CUBLAS_OP_N ? i + (size_t)l * g->lda : l + (size_t)i * g->lda;
            if (2 * at >= g->a_bytes) return false;
            a[(size_t)i * g->k + l] = load(g->a, at, g->type);
        }
    for (int j = 0; j < g->n; j++)
        for (int l = 0; l < g->k; l++) {
            const size_t at = g->transb == CUBLAS_OP_N ? l + (size_t)j * g->ldb : j + (size_t)l * g->ldb;
            if (2 * at >= g->b_bytes) return false;
            b[(size_t)j * g->k + l] = load(g->b, at, g->type);
        }
    auto* c = static_cast<unsigned short*>(g->c);
    for (int j = 0; j < g->n; j++)
        for (int i = 0; i < g->m; i++) {
            float sum = 0.0f;
            for (int l = 0; l < g->k; l++) sum += a[(size_t)i * g->k + l] * b[(size_t)j * g->k + l];
            const size_t at = i + (size_t)j * g->ldc;
            const float old = g->beta == 0.0f ? 0.0f : g->beta * load(c, at, g->type);  // beta 0: C not read
            c[at] = round_to(g->alpha * sum + old, g->type);
        }
    return true;
}

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new cublasContext();
    return CUBLAS_STATUS_SUCCESS;
}

// As cuBLAS documents: setting a stream puts the handle back on cuBLAS's own workspace pool.
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = streamId;
    handle->workspace = nullptr;
    handle->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspaceSizeInBytes && !workspace) return CUBLAS_STATUS_INVALID_VALUE;
    handle->workspace = workspace;
    handle->workspace_bytes = workspaceSizeInBytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                            int lda, const void* B, cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    const bool ops_ok = (transa == CUBLAS_OP_N || transa == CUBLAS_OP_T) &&
                        (transb == CUBLAS_OP_N || transb == CUBLAS_OP_T);
    const int a_rows = transa == CUBLAS_OP_N ? m : k, b_rows = transb == CUBLAS_OP_N ? k : n;
    if (!ops_ok || m < 0 || n < 0 || k < 0 || !alpha || !beta || lda < (a_rows > 1 ? a_rows : 1) ||
        ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1) ||
        !(algo == CUBLAS_GEMM_DEFAULT || (algo >= CUBLAS_GEMM_ALGO0 && algo <= CUBLAS_GEMM_ALGO23)))
        return CUBLAS_STATUS_INVALID_VALUE;
    // The only combinations this stand-in computes; cuBLAS has many more, nano uses these two.
    if ((Atype != CUDA_R_16F && Atype != CUDA_R_16BF) || Btype != Atype || Ctype != Atype ||
        computeType != CUBLAS_COMPUTE_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    const size_t a_cols = transa == CUBLAS_OP_N ? k : m, b_cols = transb == CUBLAS_OP_N ? n : k;
    GemmCall g{handle->stream, handle->workspace, transa, transb, m, n, k,
               *static_cast<const float*>(alpha), *static_cast<const float*>(beta), A, lda, B, ldb, C, ldc,
               k ? ((a_cols - 1) * lda + a_rows) * 2 : 0, k ? ((b_cols - 1) * ldb + b_rows) * 2 : 0,
               ((size_t)(n - 1) * ldc + m) * 2, Atype};
    const int action = hook ? hook(&g) : 0;
    const bool ok = action == 1 || (action == 0 && cuda_host_gemm(&g));
    return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // extern "C"
