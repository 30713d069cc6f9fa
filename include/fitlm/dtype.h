// dtype.h: storage dtypes and conversions. fp32 is the compute type of every
// kernel; bf16 and fp16 are storage types, converted to fp32 on load and
// rounded to nearest even on store.
#ifndef FITLM_DTYPE_H
#define FITLM_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum { FL_F32, FL_BF16, FL_F16 } fl_dtype;

size_t fl_dtype_size(fl_dtype dt);
const char *fl_dtype_name(fl_dtype dt); // "fp32", "bf16", "fp16"

// Scalar conversions. f32 -> bf16/fp16 round to nearest even; NaN stays NaN,
// quieted with the top payload bits kept (as vcvtneps2bf16 and F16C do),
// out-of-range values become +-inf, fp16 subnormals are kept. fp16 -> f32
// quiets NaN too (F16C's vcvtph2ps); bf16 -> f32 is a shift, exact.
uint16_t fl_f32_to_bf16(float x);
float fl_bf16_to_f32(uint16_t h);
uint16_t fl_f32_to_f16(float x);
float fl_f16_to_f32(uint16_t h);

// Converts n values between any two dtypes (identical bits when dst == src
// type), single-threaded and vectorised where the CPU allows: kernels call it
// per row inside their own parallel loops.
void fl_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n);
// For the tests and benchmarks: fl_convert through one code path (isa: an
// fl_isa of core.h, all paths give the same bits). Dies if fl_cpu() lacks it.
void fl_convert_isa(int isa, fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                    size_t n);
// fl_convert of `rows` rows of `cols` values, ld_src and ld_dst values
// apart (a head of a fused qkv buffer to a contiguous copy, and back): one
// dispatch for all rows.
void fl_convert_rows(fl_dtype dst_dt, void *dst, size_t ld_dst, fl_dtype src_dt, const void *src,
                     size_t ld_src, size_t rows, size_t cols);

// Row access for kernels that compute in fp32 on any storage dtype:
// fl_load_f32 returns src itself for fp32 data (no copy) and otherwise
// converts into scratch (n floats) and returns scratch.
const float *fl_load_f32(fl_dtype dt, const void *src, size_t n, float *scratch);
// Stores n fp32 values into dst of dtype dt.
void fl_store_f32(fl_dtype dt, void *dst, const float *src, size_t n);
// Stores n fp32 values into dst of dtype bf16 or fp16 by stochastic rounding:
// each value becomes one of its two neighbouring 16-bit values (the one
// below or above in magnitude), the farther one with probability
// proportional to the distance to the nearer, so the rounding is unbiased on
// average. Values exact in the dtype are stored unchanged; NaN stays NaN
// (quiet), inf stays inf, fp16 subnormals are included and magnitudes past
// the largest finite value round between it and inf. Element k draws its
// random bits from splitmix64's output at position (first_index + k) of the
// stream seeded with `seed`: the result depends only on (seed, element
// index), never on how a buffer is split into calls or threads. fp32: a copy.
void fl_store_f32_stochastic(fl_dtype dt, void *dst, const float *src, size_t n, uint64_t seed,
                             uint64_t first_index);
// The 64 random bits element `index` of stream `seed` uses (splitmix64).
uint64_t fl_sr_bits(uint64_t seed, uint64_t index);
// Adds n fp32 values into dst of dtype dt (the += of backward kernels).
void fl_accumulate_f32(fl_dtype dt, void *dst, const float *src, size_t n);

// Pointer to element i of a buffer of dtype dt.
static inline void *fl_at(fl_dtype dt, void *base, size_t i) {
    return (char *)base + i * (dt == FL_F32 ? 4 : 2);
}
static inline const void *fl_at_const(fl_dtype dt, const void *base, size_t i) {
    return (const char *)base + i * (dt == FL_F32 ? 4 : 2);
}

// True when any of the n values is inf or NaN (fp16 overflow detection).
int fl_has_inf_or_nan(fl_dtype dt, const void *x, size_t n);

#endif
