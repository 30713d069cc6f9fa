// cuda_bf16.h of the CUDA emulator (tests/cuda_emu/, C++ only): the bf16
// type and conversions src/cuda/ may use, with CUDA's meaning. As in CUDA
// the bits are protected (kernels go through the intrinsics) and the type
// converts to and from float implicitly; arithmetic operators are left out.
#ifndef FITLM_CUDA_EMU_BF16_H
#define FITLM_CUDA_EMU_BF16_H

#include <string.h>

struct alignas(2) __nv_bfloat16 {
  protected:
    unsigned short __x;

  public:
    // trivial, as CUDA's (a fragment or a shared array of them starts as garbage)
    // cppcheck-suppress uninitMemberVar
    __nv_bfloat16() = default;
    inline __nv_bfloat16(float f); // NOLINT: implicit, as CUDA's
    inline operator float() const; // NOLINT: implicit, as CUDA's
};

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) {
    unsigned short u;
    memcpy(&u, (const void *)&h, 2);
    return u;
}

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 h;
    memcpy((void *)&h, &u, 2);
    return h;
}

// round to nearest even; a NaN becomes CUDA's canonical 0x7fff
inline __nv_bfloat16 __float2bfloat16(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);
    return __ushort_as_bfloat16((unsigned short)((u + 0x7fffu + (u >> 16 & 1)) >> 16));
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __float2bfloat16(f);
}

// exact
inline float __bfloat162float(__nv_bfloat16 h) {
    unsigned int u = (unsigned int)__bfloat16_as_ushort(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16::__nv_bfloat16(float f) : __x(__bfloat16_as_ushort(__float2bfloat16(f))) {}
inline __nv_bfloat16::operator float() const {
    return __bfloat162float(*this);
}

#endif
