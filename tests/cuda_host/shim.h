// CUDA C++ on the host: force-included (g++ -include shim.h) before each unchanged cuda/*.cu
// so that the tests can run the kernels on a machine with no GPU. runtime.cpp holds the other
// half; emulator.py builds both and launches kernels the way nano/kernels.py asks CuPy to.
//
// What is emulated, and how:
//   threads      every CUDA thread of a block is a fiber (a stack of its own, switched by
//                runtime.cpp); a fiber runs until it reaches __syncthreads, __syncwarp or a
//                warp shuffle, or returns. Blocks run one at a time on each OS worker thread.
//   built-ins    threadIdx, blockIdx, blockDim, gridDim read the running fiber's copy.
//   __shared__   thread_local: the worker's copy is the running block's shared memory. The
//                runtime fills it with a poison byte before every block, so a read of shared
//                memory that no thread wrote gives garbage instead of the previous block's data.
//                `extern __shared__` (dynamic) arrays get CUDA_HOST_DYNAMIC_SHARED bytes.
//   barriers     __syncthreads and __syncwarp are real rendezvous: a thread waits until every
//                thread that must arrive has. A barrier some threads skip or leave by
//                returning, or reach on another line, is reported with the threads and lines.
//   shuffles     __shfl_sync / _up / _down / _xor are rendezvous of the lanes in the mask,
//                with PTX's lane arithmetic for `width`. Reported: a lane outside its own
//                mask, lanes that disagree on mask, width or line, a mask naming a lane that
//                has exited, a read from a lane outside the mask.
//   __half       the toolkit's own cuda_fp16.h host code, except the conversions the kernels
//                use all the time: those go through the CPU's F16C instructions (exact IEEE,
//                round to nearest even, NaN made CUDA's canonical 0x7fff), see below.
//   __nv_bfloat16 cuda_bf16.h's type, with the conversions written here as the hardware's
//                cvt.rn.bf16x2.f32 does them: float32 rounded to nearest even into its top 16
//                bits, NaN made the canonical 0x7fff; widening is exact (the bits shifted up).
//   wmma         nvcuda::wmma from include/mma.h (16 x 16 x 16, half or bfloat16 inputs,
//                float32 sums), each lane computing its own accumulator elements; see that file.
//   atomics      atomicAdd, __threadfence and __ldcg are the host's atomic add, fence and load:
//                blocks of one launch run at once on several worker threads.
//   math         __expf, expf, logf, rsqrtf, ... from libm in float32. The GPU's fast
//                approximations differ in the last bits; the tests' tolerances cover both.
// Not emulated: timing, the memory model between blocks or between threads that a barrier
// does not order (the fibers interleave only at the points above), bank conflicts, registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// Before the toolkit headers, which keep definitions they find (crt/host_defines.h).
#define __host__
#define __device__
#define __global__
#define __shared__ thread_local
#define __noinline__ __attribute__((noinline))

#include <cuda_bf16.h>
#include <cuda_fp16.h>  // also brings vector_types.h (uint4, float2, dim3) and make_*()
#include <immintrin.h>
#include <math_constants.h>

#undef __launch_bounds__  // the runtime checks block sizes against it (emulator.py reads it)
#define __launch_bounds__(...)

#ifndef CUDA_HOST_DYNAMIC_SHARED
#define CUDA_HOST_DYNAMIC_SHARED (48 * 1024)  // CUDA's default limit without an opt-in
#endif

constexpr int warpSize = 32;

namespace cuda_host {

struct Builtins {
    uint3 thread_idx, block_idx;
    dim3 block_dim, grid_dim;
};
// The runtime's entry points. Kernel modules are built with hidden visibility (so that calls
// between a kernel's own functions inline instead of going through the PLT); these are not.
#define CUDA_HOST_API __attribute__((visibility("default")))

// The running fiber's built-ins, set by the runtime at every switch.
extern thread_local CUDA_HOST_API const Builtins* current;

enum ShuffleMode { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, SYNCWARP };

CUDA_HOST_API void syncthreads(const char* file, int line);
// Ends the block with an error a kernel's device library found (tests/cuda_host/include/mma.h).
CUDA_HOST_API [[noreturn]] void kernel_error(const char* what, const char* file, int line);
CUDA_HOST_API unsigned long long warp_op(ShuffleMode mode, unsigned mask, unsigned long long bits, int arg,
                           int width, const char* file, int line);

template <typename T>
T shuffle(ShuffleMode mode, unsigned mask, T value, int arg, int width, const char* file, int line) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move up to 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    bits = warp_op(mode, mask, bits, arg, width, file, line);
    std::memcpy(&value, &bits, sizeof(T));
    return value;
}

// One kernel as the runtime sees it: `invoke` unpacks a cuLaunchKernel-style argument array
// (args[i] points at parameter i's bytes) and calls the kernel.
struct Kernel {
    const char* name;
    const char* signature;  // one type code per parameter, space-separated (emulator.py)
    int max_threads;        // __launch_bounds__, 0 without
    void (*invoke)(void* fn, void* const* args);
    void* fn;
};

template <typename T>
std::string type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) {
        return "p" + type_code<std::remove_pointer_t<U>>();
    } else if constexpr (std::is_same_v<U, __half>) {
        return "f2";
    } else if constexpr (std::is_same_v<U, __nv_bfloat16>) {
        return "u2";  // the uint16 arrays that hold bfloat16 bits (nano/device.py)
    } else if constexpr (std::is_floating_point_v<U>) {
        return "f" + std::to_string(sizeof(U));
    } else if constexpr (std::is_same_v<U, bool>) {
        return "b1";
    } else if constexpr (std::is_integral_v<U>) {
        return (std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
    } else {
        return "s" + std::to_string(sizeof(U));  // a struct such as uint4
    }
}

template <typename... A, std::size_t... I>
void invoke(void* fn, void* const* args, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
void invoke(void* fn, void* const* args) {
    invoke<A...>(fn, args, std::index_sequence_for<A...>{});
}

template <typename... A>
Kernel kernel(void (*fn)(A...), const char* name, int max_threads) {
    static const std::string signature = [] {
        std::string s;
        ((s += type_code<A>() + " "), ...);
        return s;
    }();
    return {name, signature.c_str(), max_threads, &invoke<A...>, reinterpret_cast<void*>(fn)};
}

// What a built kernel module exports (emulator.py generates the tables).
struct Module {
    const Kernel* kernels;
    int num_kernels;
    void* (*tls_anchor)();  // address of a __shared__ variable: makes this thread's copy exist
    int num_dynamic;
    void* (*dynamic_shared)(int i);  // this thread's copy of extern __shared__ array i
};

}  // namespace cuda_host

#define threadIdx (cuda_host::current->thread_idx)
#define blockIdx (cuda_host::current->block_idx)
#define blockDim (cuda_host::current->block_dim)
#define gridDim (cuda_host::current->grid_dim)

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    cuda_host::syncthreads(file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
    cuda_host::warp_op(cuda_host::SYNCWARP, mask, 0, 0, warpSize, file, line);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cuda_host::shuffle(cuda_host::SHFL_IDX, mask, var, src_lane, width, file, line);
}

template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cuda_host::shuffle(cuda_host::SHFL_UP, mask, var, (int)delta, width, file, line);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cuda_host::shuffle(cuda_host::SHFL_DOWN, mask, var, (int)delta, width, file, line);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return cuda_host::shuffle(cuda_host::SHFL_XOR, mask, var, lane_mask, width, file, line);
}

// float <-> half. cuda_fp16.h's host versions convert bit by bit and took 40% of an emulated
// attention launch; F16C does 4 at a time in hardware, with the same IEEE results.
namespace cuda_host {
// By reference and read as raw bits (the build has -fno-strict-aliasing): __half2 has a
// user-written copy constructor, so a by-value argument was built in memory two halves at a
// time and then read as 4 bytes, a store-forwarding stall.
inline float half_to_float(const __half& h) { return _cvtsh_ss(*reinterpret_cast<const unsigned short*>(&h)); }
inline __half float_to_half(float f) {
    return __ushort_as_half(f != f ? 0x7fff : _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
inline float2 half2_to_float2(const __half2& h) {
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int*>(&h)));
    return make_float2(_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_shuffle_ps(f, f, 1)));
}
inline __half2 floats_to_half2(float a, float b) {
    const __m128i h = _mm_cvtps_ph(_mm_set_ps(0.0f, 0.0f, b, a), _MM_FROUND_TO_NEAREST_INT);
    __half2 out;
    *reinterpret_cast<int*>(&out) = _mm_cvtsi128_si32(h);
    if (a != a) out.x = __ushort_as_half(0x7fff);  // CUDA's canonical NaN
    if (b != b) out.y = __ushort_as_half(0x7fff);
    return out;
}
}  // namespace cuda_host
// float <-> bfloat16 (cuda_bf16.h's host code rounds the same, branch by branch).
namespace cuda_host {
inline float bf16_to_float(const __nv_bfloat16& b) {
    const unsigned u = (unsigned)*reinterpret_cast<const unsigned short*>(&b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned short float_to_bf16_bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    if (f != f) return 0x7fff;  // CUDA's canonical NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline __nv_bfloat16 float_to_bf16(float f) {
    __nv_bfloat16 out;
    const unsigned short bits = float_to_bf16_bits(f);
    std::memcpy(&out, &bits, 2);
    return out;
}
inline float2 bf162_to_float2(const __nv_bfloat162& b) {
    return make_float2(bf16_to_float(b.x), bf16_to_float(b.y));
}
inline __nv_bfloat162 floats_to_bf162(float a, float b) {
    __nv_bfloat162 out;
    out.x = float_to_bf16(a);
    out.y = float_to_bf16(b);
    return out;
}
}  // namespace cuda_host
#define __bfloat162float(b) cuda_host::bf16_to_float(b)
#define __float2bfloat16(f) cuda_host::float_to_bf16(f)
#define __float2bfloat16_rn(f) cuda_host::float_to_bf16(f)
#define __bfloat1622float2(b) cuda_host::bf162_to_float2(b)
#define __floats2bfloat162_rn(a, b) cuda_host::floats_to_bf162(a, b)
#define __half2float(h) cuda_host::half_to_float(h)
#define __float2half(f) cuda_host::float_to_half(f)
#define __float2half_rn(f) cuda_host::float_to_half(f)
#define __half22float2(h) cuda_host::half2_to_float2(h)
#define __floats2half2_rn(a, b) cuda_host::floats_to_half2(a, b)

// IEEE operations rounded one at a time, never contracted into an FMA (noinline keeps
// g++'s -ffp-contract=fast from fusing across them, as CUDA's _rn intrinsics forbid).
__attribute__((noinline)) inline float __fadd_rn(float a, float b) { return a + b; }
__attribute__((noinline)) inline float __fmul_rn(float a, float b) { return a * b; }
__attribute__((noinline)) inline float __fdiv_rn(float a, float b) { return a / b; }

// Integer min/max are device built-ins in CUDA; the float ones come from <cmath>.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// Bit casts and math intrinsics.
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// Integer intrinsics (sm_61+), with PTX's semantics: prmt's default mode (each selector nibble's
// low 3 bits pick one of the 8 bytes of {y, x}), dp4a's signed 4-way byte dot product + c.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long bytes = (unsigned long long)y << 32 | x;
    unsigned out = 0;
    for (int n = 0; n < 4; n++) out |= (unsigned)(bytes >> (8 * ((s >> (4 * n)) & 7)) & 0xff) << (8 * n);
    return out;
}
inline int __dp4a(int a, int b, int c) {
    for (int n = 0; n < 4; n++) c += (int)(signed char)(a >> (8 * n)) * (int)(signed char)(b >> (8 * n));
    return c;
}

// Atomics, fences and loads past L1 (split-KV's partitions counting themselves done): blocks
// run at once on several worker threads, so these are the host's own atomic operations.
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T>
T __ldcg(const T* address) {
    T value;
    __atomic_load(address, &value, __ATOMIC_ACQUIRE);
    return value;
}
