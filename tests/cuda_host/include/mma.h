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
//   matrix_a            x[] is what the lane's accumulator elements need of A: its row l / 2
//                       (16 elements, as many as the hardware's fragment holds);
//   matrix_b            x[] is B's columns 8 * (l % 2) .. + 7, row-major (16 rows of 8).
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
    static constexpr int num_elements = std::is_same_v<Use, matrix_a> ? 16
                                        : std::is_same_v<Use, matrix_b> ? 128 : 8;
    T x[num_elements];
};

namespace detail {
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

// Rows 0-7 of 8 columns of 16-bit elements (v[j] holds column j) become rows 0-7 of 8
// elements (v[r] holds row r), in three rounds of interleaving.
__attribute__((always_inline)) inline void transpose8x8(__m128i v[8]) {
    __m128i t[8];
    // 16 bits: t[i] holds columns 2i and 2i + 1 of rows 0-3, t[i + 4] of rows 4-7.
    for (int i = 0; i < 4; i++) {
        t[i] = _mm_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
        t[i + 4] = _mm_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
    }
    // 32 bits: v[4h + 2p + q] holds columns 4p .. 4p + 3 of rows 4h + 2q and 4h + 2q + 1.
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) {
            v[4 * h + 2 * p] = _mm_unpacklo_epi32(t[4 * h + 2 * p], t[4 * h + 2 * p + 1]);
            v[4 * h + 2 * p + 1] = _mm_unpackhi_epi32(t[4 * h + 2 * p], t[4 * h + 2 * p + 1]);
        }
    // 64 bits: columns 0-3 and 4-7 of a pair of rows make the two rows whole.
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 2; q++) {
            t[4 * h + 2 * q] = _mm_unpacklo_epi64(v[4 * h + q], v[4 * h + 2 + q]);
            t[4 * h + 2 * q + 1] = _mm_unpackhi_epi64(v[4 * h + q], v[4 * h + 2 + q]);
        }
    for (int i = 0; i < 8; i++) v[i] = t[i];
}
}  // namespace detail

template <typename Use, typename T, typename Layout, typename U>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const U& value) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = value;
}

// matrix_a / matrix_b: the lane's part of the tile, its layout from the fragment's type. The
// lane's row of A, or its rows of a row-major B, are copies; a column-major B's 8 columns are
// read whole and transposed 8 rows at a time (most of an emulated prefill's time went here).
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                      const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
    static_assert(sizeof(T) == 2, "the loads move 16-bit elements");
    detail::check(p, ldm, file, line);
    constexpr bool A = std::is_same_v<Use, matrix_a>, ROW_MAJOR = std::is_same_v<Layout, row_major>;
    const int lane = detail::lane();
    if constexpr (A && ROW_MAJOR) {
        std::memcpy(f.x, p + lane / 2 * ldm, 16 * sizeof(T));
    } else if constexpr (A) {
        for (int c = 0; c < 16; c++) f.x[c] = p[c * ldm + lane / 2];
    } else if constexpr (ROW_MAJOR) {
        const int c0 = 8 * (lane % 2);
        for (int r = 0; r < 16; r++) std::memcpy(&f.x[r * 8], p + r * ldm + c0, 8 * sizeof(T));
    } else {
        const int c0 = 8 * (lane % 2);
        for (int r0 = 0; r0 < 16; r0 += 8) {
            __m128i v[8];
            for (int j = 0; j < 8; j++)
                v[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (c0 + j) * ldm + r0));
            detail::transpose8x8(v);
            for (int r = 0; r < 8; r++)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(&f.x[(r0 + r) * 8]), v[r]);
        }
    }
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

// Each lane's 8 sums stay in one vector register through the 16 products (GCC's vector
// extension, contracted into FMAs as the module's flags say, like the scalar code it replaced).
template <typename T, typename LayoutA, typename LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    typedef float float8 __attribute__((vector_size(32)));
    float a_row[16];
    detail::as_floats8(a.x, a_row);
    detail::as_floats8(a.x + 8, a_row + 8);
    float8 sum, b_row;
    float b_floats[8];
    std::memcpy(&sum, c.x, sizeof sum);
    for (int k = 0; k < 16; k++) {
        detail::as_floats8(&b.x[k * 8], b_floats);
        std::memcpy(&b_row, b_floats, sizeof b_row);
        sum += a_row[k] * b_row;
    }
    std::memcpy(d.x, &sum, sizeof sum);
}

}  // namespace wmma
}  // namespace nvcuda
