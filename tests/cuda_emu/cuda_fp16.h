// cuda_fp16.h of the CUDA emulator (tests/cuda_emu/, C++ only): IEEE
// binary16 (`__half`, CUDA's typedef `half`) and the conversions src/cuda/
// may use, with CUDA's meaning. As in CUDA the bits are protected (kernels
// go through the intrinsics) and the type converts to and from float
// implicitly; arithmetic operators are left out.
#ifndef FITLM_CUDA_EMU_FP16_H
#define FITLM_CUDA_EMU_FP16_H

#include <string.h>

struct alignas(2) __half {
  protected:
    unsigned short __x;

  public:
    // trivial, as CUDA's (a fragment or a shared array of them starts as garbage)
    // cppcheck-suppress uninitMemberVar
    __half() = default;
    inline __half(float f);        // NOLINT: implicit, as CUDA's
    inline operator float() const; // NOLINT: implicit, as CUDA's
};
typedef __half half;

inline unsigned short __half_as_ushort(__half h) {
    unsigned short u;
    memcpy(&u, (const void *)&h, 2);
    return u;
}

inline __half __ushort_as_half(unsigned short u) {
    __half h;
    memcpy((void *)&h, &u, 2);
    return h;
}

// round to nearest even, subnormals kept, overflow to infinity; a NaN
// becomes CUDA's canonical 0x7fff
inline __half __float2half(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    unsigned int sign = u >> 16 & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return __ushort_as_half(0x7fff);
    if (a >= 0x477ff000u) return __ushort_as_half((unsigned short)(sign | 0x7c00u)); // >= 65520
    unsigned int mant = (a & 0x7fffffu) | 0x800000u, exp = a >> 23, h, rem, halfway;
    if (exp >= 113) { // a normal half: drop 13 bits
        h = (exp - 112) << 10 | (a & 0x7fffffu) >> 13;
        rem = a & 0x1fffu;
        halfway = 0x1000u;
    } else { // a subnormal one, in units of 2^-24 (a carry makes the least normal)
        unsigned int shift = 126 - exp;
        if (shift > 24) return __ushort_as_half((unsigned short)sign);
        h = mant >> shift;
        rem = mant & ((1u << shift) - 1);
        halfway = 1u << (shift - 1);
    }
    if (rem > halfway || (rem == halfway && (h & 1))) h++;
    return __ushort_as_half((unsigned short)(sign | h));
}

inline __half __float2half_rn(float f) {
    return __float2half(f);
}

// exact; a NaN becomes the canonical 0x7fffffff, as CUDA's host code has it
inline float __half2float(__half x) {
    unsigned int h = __half_as_ushort(x), sign = (h & 0x8000u) << 16, exp = h >> 10 & 0x1f,
                 mant = h & 0x3ffu, u;
    if (exp == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; // 2^-24, exact
        return sign ? -f : f;
    }
    u = exp < 31 ? sign | (exp + 112) << 23 | mant << 13 : mant ? 0x7fffffffu : sign | 0x7f800000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline __half::__half(float f) : __x(__half_as_ushort(__float2half(f))) {}
inline __half::operator float() const {
    return __half2float(*this);
}

#endif
