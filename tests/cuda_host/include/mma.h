// Stand-in for the CUDA toolkit's mma.h on the host: nvcuda::wmma (the warp-level matrix
// multiply-accumulate API) for g++, found before the toolkit's header because emulator.py puts
// this directory first on the include path.
//
// WMMA leaves the map from a matrix's elements to the lanes' fragment elements unspecified:
// a program may only load, store, fill and multiply fragments, and apply one operation to
// every element x[i] (or combine element i of fragments of the same type). So the emulator
// picks its own map, one that needs no exchange between lanes:
//   accumulator         lane l holds elements l * 8 .. l * 8 + 7 of the row-major tile: row
//                       l / 2, columns 8 * (l % 2) .. + 7;
//   matrix_a, matrix_b  x[] is the whole 16 x 16 tile, row-major, of which a lane loads what
//                       its accumulator elements need: A's row l / 2, B's columns
//                       8 * (l % 2) .. + 7 (the rest of x[] is never read by mma_sync).
// mma_sync then computes, in each lane, its own 8 elements of D = A B + C in float32 (one
// fused multiply-add per product, in k order): the warp does the tensor core's work once.
// The loads and stores are not barriers, as on the GPU: a lane that reads a tile other lanes
// wrote needs __syncwarp() in between, or it reads the runtime's poison. Checked, as the
// hardware requires: pointers 32-byte aligned, ldm a multiple of 16 bytes.
// Emulated: the shape 16 x 16 x 16, __half or __nv_bfloat16 inputs, float accumulators.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator has the 16 x 16 x 16 shape only");
    static constexpr bool WHOLE_TILE = !std::is_same_v<Use, accumulator>;
    static constexpr int num_elements = WHOLE_TILE ? 256 : 8;
    T x[num_elements];
};

namespace detail {
inline float as_float(const __half& h) { return cuda_host::half_to_float(h); }
inline float as_float(const __nv_bfloat16& b) { return cuda_host::bf16_to_float(b); }

// 8 consecutive halfs to floats in one F16C instruction; bfloat16s are their bits shifted up.
inline void as_floats8(const __half* h, float* f) {
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
}
inline void as_floats8(const __nv_bfloat16* b, float* f) {
    for (int i = 0; i < 8; i++) f[i] = cuda_host::bf16_to_float(b[i]);
}

inline int lane() {
    const cuda_host::Builtins& b = *cuda_host::current;
    return (b.thread_idx.x + b.block_dim.x * (b.thread_idx.y + b.block_dim.y * b.thread_idx.z)) % 32;
}

template <typename T>
void check(const T* p, unsigned ldm, const char* file, int line) {
    if (reinterpret_cast<unsigned long long>(p) % 32)
        cuda_host::kernel_error("a WMMA load or store with a pointer not 32-byte aligned", file, line);
    if (ldm * sizeof(T) % 16)
        cuda_host::kernel_error("a WMMA load or store with ldm not a multiple of 16 bytes", file, line);
}

// Element (r, c) of a tile at p, stored row- or column-major with leading dimension ldm.
template <typename T>
T& at(T* p, unsigned ldm, bool row_major, int r, int c) {
    return row_major ? p[r * ldm + c] : p[c * ldm + r];
}
}  // namespace detail

template <typename Use, typename T, typename Layout, typename U>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const U& value) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = value;
}

// matrix_a / matrix_b: the lane's part of the tile, its layout from the fragment's type.
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                      const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
    detail::check(p, ldm, file, line);
    constexpr bool A = std::is_same_v<Use, matrix_a>, ROW_MAJOR = std::is_same_v<Layout, row_major>;
    const int lane = detail::lane();
    const int r0 = A ? lane / 2 : 0, r1 = A ? r0 + 1 : 16;
    const int c0 = A ? 0 : 8 * (lane % 2), c1 = A ? 16 : c0 + 8;
    for (int r = r0; r < r1; r++)
        for (int c = c0; c < c1; c++) f.x[r * 16 + c] = detail::at(p, ldm, ROW_MAJOR, r, c);
}

// accumulator: this lane's 8 elements.
template <typename T>
void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const T* p, unsigned ldm,
                      layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    detail::check(p, ldm, file, line);
    const int first = detail::lane() * 8;
    for (int i = 0; i < 8; i++)
        f.x[i] = detail::at(p, ldm, layout == mem_row_major, (first + i) / 16, (first + i) % 16);
}

template <typename T>
void store_matrix_sync(T* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm,
                       layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    detail::check(p, ldm, file, line);
    const int first = detail::lane() * 8;
    for (int i = 0; i < 8; i++)
        detail::at(p, ldm, layout == mem_row_major, (first + i) / 16, (first + i) % 16) = f.x[i];
}

template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    const int lane = detail::lane(), r = lane / 2, c0 = 8 * (lane % 2);
    float sum[8], b_row[8];
    for (int i = 0; i < 8; i++) sum[i] = c.x[i];
    for (int k = 0; k < 16; k++) {
        const float a_rk = detail::as_float(a.x[r * 16 + k]);
        detail::as_floats8(&b.x[k * 16 + c0], b_row);
        for (int i = 0; i < 8; i++) sum[i] += a_rk * b_row[i];
    }
    for (int i = 0; i < 8; i++) d.x[i] = sum[i];
}

}  // namespace wmma
}  // namespace nvcuda
