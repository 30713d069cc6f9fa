// mma.h of the CUDA emulator (tests/cuda_emu/, C++ only): the warp matrix
// functions (namespace nvcuda::wmma) with the CUDA Programming Guide's
// contract, so that a tensor-core kernel is checked on the CPU.
//
// Every call but fill_fragment is warp-collective: it starts with a
// barrier of the whole warp (fl_emu::wmma_enter), so a call that some lane
// does not reach stops the run, and the lanes must pass the same pointer,
// ldm and layout; the pointer 32-byte aligned, ldm a multiple of 16 bytes,
// the matrix inside one device allocation or shared array.
// Which matrix element a lane's x[e] holds is unspecified in CUDA; here it
// is a scrambled bijection, another for each of matrix_a, matrix_b and the
// accumulator, so a kernel that assumes a layout gets wrong results while
// elementwise operations on x[] stay right. Loads and stores touch the
// matrix's elements only, and a store ends without a barrier: another lane
// sees it after a __syncwarp or __syncthreads, as on a GPU. mma_sync sums
// in fp32, c + a0*b0 + a1*b1 + ... in k order (no contraction), through a
// staging area of the warp's outside shared memory (2 barriers).
#ifndef FITLM_CUDA_EMU_MMA_H
#define FITLM_CUDA_EMU_MMA_H

#include <string.h>

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

// tags, incomplete as CUDA's
struct matrix_a;
struct matrix_b;
struct accumulator;
struct row_major;
struct col_major;
enum layout_t { mem_row_major, mem_col_major };

template <class T, int size> struct alignas(8) __frag_base {
    typedef T element_type;
    typedef T storage_element_type;
    enum { num_elements = size };
    T x[size];
};

template <class Use, int m, int n, int k, class T, class Layout = void> class fragment;

// the shapes and element counts of CUDA's crt/mma.h (a 16-bit fragment with
// more elements than its matrix over 32 lanes holds each element twice or more)
#define FL_EMU_FRAGMENT(use, m, n, k, T, layout, size)                                             \
    template <> class fragment<use, m, n, k, T, layout> : public __frag_base<T, size> {}
#define FL_EMU_FRAGMENTS(m, n, k, a_half, b_half, a_bf16, b_bf16)                                  \
    FL_EMU_FRAGMENT(matrix_a, m, n, k, __half, row_major, a_half);                                 \
    FL_EMU_FRAGMENT(matrix_a, m, n, k, __half, col_major, a_half);                                 \
    FL_EMU_FRAGMENT(matrix_b, m, n, k, __half, row_major, b_half);                                 \
    FL_EMU_FRAGMENT(matrix_b, m, n, k, __half, col_major, b_half);                                 \
    FL_EMU_FRAGMENT(matrix_a, m, n, k, __nv_bfloat16, row_major, a_bf16);                          \
    FL_EMU_FRAGMENT(matrix_a, m, n, k, __nv_bfloat16, col_major, a_bf16);                          \
    FL_EMU_FRAGMENT(matrix_b, m, n, k, __nv_bfloat16, row_major, b_bf16);                          \
    FL_EMU_FRAGMENT(matrix_b, m, n, k, __nv_bfloat16, col_major, b_bf16);                          \
    FL_EMU_FRAGMENT(accumulator, m, n, k, float, void, 8)
FL_EMU_FRAGMENTS(16, 16, 16, 16, 16, 8, 8);
FL_EMU_FRAGMENTS(32, 8, 16, 16, 16, 16, 4);
FL_EMU_FRAGMENTS(8, 32, 16, 16, 16, 4, 16);
#undef FL_EMU_FRAGMENTS
#undef FL_EMU_FRAGMENT

template <class T, int size, class V> void fill_fragment(__frag_base<T, size> &f, const V &v) {
    for (int e = 0; e < size; e++) f.x[e] = v;
}

} // namespace wmma
} // namespace nvcuda

namespace fl_emu {
namespace wmma {

using namespace nvcuda::wmma;

// A fragment's matrix (rows x cols, row-major positions), its place in the
// warp's staging area and its scramble: element e of lane l holds position
// ((l * num_elements + e) mod P * mul + add) mod P, P = rows * cols, a power
// of two, mul odd.
template <class Use, int m, int n, int k> struct shape;
template <int m, int n, int k> struct shape<matrix_a, m, n, k> {
    enum { rows = m, cols = k, stage = 0, mul = 97, add = 13 };
};
template <int m, int n, int k> struct shape<matrix_b, m, n, k> {
    enum { rows = k, cols = n, stage = 512, mul = 61, add = 101 };
};
template <int m, int n, int k> struct shape<accumulator, m, n, k> {
    enum { rows = m, cols = n, stage = 1024, mul = 45, add = 7 };
};

template <class Use, int m, int n, int k> int position(int lane, int size, int e) {
    typedef shape<Use, m, n, k> s;
    const int p = s::rows * s::cols;
    static_assert((p & (p - 1)) == 0 && p <= 512, "a matrix of 2^i elements, 512 at most");
    return ((lane * size + e) % p * s::mul + s::add) % p;
}

// the elements from the matrix's first to its last in memory
template <class Use, int m, int n, int k> size_t span(unsigned ldm, bool row) {
    typedef shape<Use, m, n, k> s;
    return row ? (size_t)(s::rows - 1) * ldm + s::cols : (size_t)(s::cols - 1) * ldm + s::rows;
}

// where position p lies in memory
template <class Use, int m, int n, int k> size_t offset(int p, unsigned ldm, bool row) {
    typedef shape<Use, m, n, k> s;
    int r = p / s::cols, c = p % s::cols;
    return row ? (size_t)r * ldm + (size_t)c : (size_t)c * ldm + (size_t)r;
}

inline int lane() {
    return (int)((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) % 32;
}

inline float to_float(float v) {
    return v;
}
inline float to_float(__half v) {
    return __half2float(v);
}
inline float to_float(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <class Use, int m, int n, int k, class T, class L>
void load(fragment<Use, m, n, k, T, L> &f, const T *p, unsigned ldm, bool row, int layout) {
    wmma_enter("load_matrix_sync", p, ldm, layout, sizeof(T), span<Use, m, n, k>(ldm, row));
    int l = lane();
    for (int e = 0; e < f.num_elements; e++)
        f.x[e] = p[offset<Use, m, n, k>(position<Use, m, n, k>(l, f.num_elements, e), ldm, row)];
}

// the fragment's elements, as floats, into the warp's staging area
template <class Use, int m, int n, int k, class T, class L>
void stage(const fragment<Use, m, n, k, T, L> &f, float *staging) {
    int l = lane();
    for (int e = 0; e < f.num_elements; e++)
        staging[shape<Use, m, n, k>::stage + position<Use, m, n, k>(l, f.num_elements, e)] =
            to_float(f.x[e]);
}

// The copies of a position must agree: they differ only where the kernel
// wrote x[] as if it knew the layout.
template <class Use, int m, int n, int k, class T, class L>
void check_copies(const fragment<Use, m, n, k, T, L> &f, const float *staging) {
    typedef shape<Use, m, n, k> s;
    if (32 * f.num_elements == s::rows * s::cols) return;
    int l = lane();
    for (int e = 0; e < f.num_elements; e++) {
        float v = to_float(f.x[e]);
        if (memcmp(&v, &staging[s::stage + position<Use, m, n, k>(l, f.num_elements, e)], 4))
            kernel_die("wmma::mma_sync: lane %d's %s element %d differs from another copy of "
                       "the same matrix element (a layout assumed)",
                       l, std::is_same<Use, matrix_a>::value ? "matrix_a" : "matrix_b", e);
    }
}

} // namespace wmma
} // namespace fl_emu

namespace nvcuda {
namespace wmma {

template <class Use, int m, int n, int k, class T, class Layout>
void load_matrix_sync(fragment<Use, m, n, k, T, Layout> &a, const T *p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "an accumulator's load names its layout");
    fl_emu::wmma::load(a, p, ldm, std::is_same<Layout, row_major>::value,
                       std::is_same<Layout, row_major>::value ? mem_row_major : mem_col_major);
}

template <int m, int n, int k>
void load_matrix_sync(fragment<accumulator, m, n, k, float> &c, const float *p, unsigned ldm,
                      layout_t layout) {
    fl_emu::wmma::load(c, p, ldm, layout == mem_row_major, (int)layout);
}

template <int m, int n, int k>
void store_matrix_sync(float *p, const fragment<accumulator, m, n, k, float> &c, unsigned ldm,
                       layout_t layout) {
    fl_emu::wmma_enter("store_matrix_sync", p, ldm, (int)layout, sizeof(float),
                       fl_emu::wmma::span<accumulator, m, n, k>(ldm, layout == mem_row_major));
    int l = fl_emu::wmma::lane();
    for (int e = 0; e < c.num_elements; e++) {
        int pos = fl_emu::wmma::position<accumulator, m, n, k>(l, c.num_elements, e);
        p[fl_emu::wmma::offset<accumulator, m, n, k>(pos, ldm, layout == mem_row_major)] = c.x[e];
    }
}

// d = a * b + c; d may be c
template <int m, int n, int k, class T, class LA, class LB>
void mma_sync(fragment<accumulator, m, n, k, float> &d, const fragment<matrix_a, m, n, k, T, LA> &a,
              const fragment<matrix_b, m, n, k, T, LB> &b,
              const fragment<accumulator, m, n, k, float> &c) {
    float *s = fl_emu::wmma_enter("mma_sync", nullptr, 0, 0, 0, 0);
    fl_emu::wmma::stage(a, s);
    fl_emu::wmma::stage(b, s);
    fl_emu::wmma::stage(c, s);
    fl_emu::warp_barrier(0xffffffffu, 1); // every lane's elements staged
    fl_emu::wmma::check_copies(a, s);
    fl_emu::wmma::check_copies(b, s);
    const float *sa = s + fl_emu::wmma::shape<matrix_a, m, n, k>::stage,
                *sb = s + fl_emu::wmma::shape<matrix_b, m, n, k>::stage,
                *sc = s + fl_emu::wmma::shape<accumulator, m, n, k>::stage;
    int l = fl_emu::wmma::lane();
    for (int e = 0; e < d.num_elements; e++) {
        int pos = fl_emu::wmma::position<accumulator, m, n, k>(l, d.num_elements, e);
        int i = pos / n, j = pos % n;
        float sum = sc[pos];
        for (int kk = 0; kk < k; kk++) sum += sa[i * k + kk] * sb[kk * n + j];
        d.x[e] = sum;
    }
}

} // namespace wmma
} // namespace nvcuda

#endif
