// fl_emu_ptx.h of the CUDA emulator (tests/cuda_emu/, C++ only): the PTX
// instructions src/cuda/mma.cuh wraps, with the PTX ISA's contract and
// fragment layouts (written out in mma.cuh), so that a kernel that keeps
// its tiles in registers is checked on the CPU.
//
// Each is warp-collective: one barrier of the whole warp (fl_emu::ptx_enter),
// so an instruction that some lane does not reach stops the run. ldmatrix's
// row addresses must be 16-byte aligned inside the block's shared memory.
// mma.sync sums in fp32, c + a0*b0 + a1*b1 + ... in k order (no
// contraction; a GPU's order and rounding inside the instruction may
// differ, as with WMMA).
#ifndef FITLM_CUDA_EMU_PTX_H
#define FITLM_CUDA_EMU_PTX_H

#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace fl_emu {
namespace ptx {

inline int lane() {
    return (int)threadIdx.x % 32;
}

// the 16-bit row lane `src` gave ldmatrix, checked
inline const uint16_t *row_of(const ptx_slot *s, int src) {
    const void *p;
    memcpy(&p, s[src].bytes, sizeof p);
    return (const uint16_t *)p;
}

inline void ldmatrix(uint32_t r[4], const void *row, bool trans) {
    if ((uintptr_t)row % 16 || !in_shared_memory(row, 16))
        kernel_die("ldmatrix: lane %d's row at %p is not 16 bytes, 16-byte aligned, in the "
                   "block's shared memory",
                   lane(), row);
    const ptx_slot *s = ptx_enter(trans ? "ldmatrix.trans" : "ldmatrix", &row, sizeof row);
    int l = lane(), g = l / 4, t = l % 4;
    for (int i = 0; i < 4; i++) {
        if (trans) {
            const uint16_t *p0 = row_of(s, 8 * i + 2 * t), *p1 = row_of(s, 8 * i + 2 * t + 1);
            r[i] = (uint32_t)p0[g] | (uint32_t)p1[g] << 16;
        } else {
            const uint16_t *p = row_of(s, 8 * i + g);
            r[i] = (uint32_t)p[2 * t] | (uint32_t)p[2 * t + 1] << 16;
        }
    }
}

// every fp16 value as a float, once (a load, where __half2float branches)
inline const float *half_values() {
    static const std::vector<float> table = [] {
        std::vector<float> t(65536);
        for (uint32_t u = 0; u < 65536; u++) {
            uint16_t h = (uint16_t)u;
            __half x;
            memcpy((void *)&x, &h, 2);
            t[u] = __half2float(x);
        }
        return t;
    }();
    return table.data();
}

template <class E> float value(uint32_t pair, int high) {
    uint16_t h = (uint16_t)(high ? pair >> 16 : pair & 0xffffu);
    if (std::is_same<E, __nv_bfloat16>::value) return __bfloat162float(__ushort_as_bfloat16(h));
    return half_values()[h];
}

// a lane's operands of mma.sync
struct mma_operands {
    uint32_t a[4], b[2];
};

} // namespace ptx
} // namespace fl_emu

inline void fl_d_ldmatrix_x4(uint32_t r[4], const void *row) {
    fl_emu::ptx::ldmatrix(r, row, false);
}
inline void fl_d_ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    fl_emu::ptx::ldmatrix(r, row, true);
}

// cp.async (fl_emu::cp_async: made when a wait covers it)
inline void fl_d_cp_async16(void *dst, const void *src, int full) {
    fl_emu::cp_async(dst, src, full);
}
inline void fl_d_cp_async_commit() {
    fl_emu::cp_async_commit();
}
template <int N> void fl_d_cp_async_wait() {
    fl_emu::cp_async_wait(N);
}

// cvt.rn.bf16x2.f32 and cvt.rn.f16x2.f32: to nearest even, a NaN to the
// canonical one (CUDA's conversions, cuda_bf16.h and cuda_fp16.h)
template <class E> uint32_t fl_d_pack(float lo, float hi) {
    uint16_t l, h;
    if (std::is_same<E, __nv_bfloat16>::value) {
        l = __bfloat16_as_ushort(__float2bfloat16(lo)),
        h = __bfloat16_as_ushort(__float2bfloat16(hi));
    } else {
        __half x = __float2half(lo), y = __float2half(hi);
        memcpy(&l, (const void *)&x, 2);
        memcpy(&h, (const void *)&y, 2);
    }
    return (uint32_t)l | (uint32_t)h << 16;
}

// d (16 x 8) += a (16 x 16) b (16 x 8): element (r, k) of A is in lane
// 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2;
// element (k, c) of B in lane 4 c + (k % 8) / 2, register k >= 8, half k % 2.
// Each lane reads its two rows of A and two columns of B once.
template <class E> void fl_d_mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    using namespace fl_emu::ptx;
    mma_operands mine = {{a[0], a[1], a[2], a[3]}, {b0, b1}};
    const fl_emu::ptx_slot *s = fl_emu::ptx_enter("mma.sync", &mine, sizeof mine);
    int l = lane(), g = l / 4, t = l % 4;
    float arow[2][16], bcol[2][16];
    for (int k = 0; k < 16; k++) {
        mma_operands x, y[2];
        memcpy(&x, s[4 * g + (k % 8) / 2].bytes, sizeof x);
        memcpy(&y[0], s[4 * (2 * t) + (k % 8) / 2].bytes, sizeof x);
        memcpy(&y[1], s[4 * (2 * t + 1) + (k % 8) / 2].bytes, sizeof x);
        for (int h = 0; h < 2; h++) {
            arow[h][k] = value<E>(x.a[h + 2 * (k >= 8)], k % 2);
            bcol[h][k] = value<E>(y[h].b[k >= 8], k % 2);
        }
    }
    for (int e = 0; e < 4; e++) {
        const float *x = arow[e / 2], *y = bcol[e % 2];
        float sum = d[e];
        for (int k = 0; k < 16; k++) sum += x[k] * y[k];
        d[e] = sum;
    }
}

#endif
