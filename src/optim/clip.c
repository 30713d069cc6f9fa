// clip.c: the global gradient norm, as torch.nn.utils.clip_grad_norm_. It is
// summed in double per chunk, then over chunks in a fixed order, so it is
// bitwise the same for any thread count. Clipping itself is folded into the
// optimizer's update as a factor on the gradient (no extra pass).
#include "fitlm/optim.h"

#include <math.h>

#include "gate.h"

#define MAX_CHUNKS 4096

// Sum of squares of one fp32 block in double, one copy per ISA
// (FL_ISA_COPIES), in an order written out so that every path gives the same
// bits: 16 lanes, lane l summing x[16j + l] in order, the ragged end added to
// lane 0, then the lanes summed in order (the order GCC's AVX-512 `omp simd`
// code used). A float's square is exact in double, so FMA or not is the same.
#define SUMSQ_LANES 16
static inline __attribute__((always_inline)) double sum_squares_body(const float *x, size_t n) {
    double lane[SUMSQ_LANES] = {0};
    size_t whole = n / SUMSQ_LANES * SUMSQ_LANES;
    for (size_t i = 0; i < whole; i += SUMSQ_LANES)
        for (int l = 0; l < SUMSQ_LANES; l++) lane[l] += (double)x[i + l] * x[i + l];
    for (size_t i = whole; i < n; i++) lane[0] += (double)x[i] * x[i];
    double s = 0.0;
    for (int l = 0; l < SUMSQ_LANES; l++) s += lane[l];
    return s;
}
FL_ISA_COPIES_OF(double, sum_squares, (const float *x, size_t n), (x, n))

double fl_grad_sumsq(fl_dtype dt, const void *grads, size_t n) {
    double partial[MAX_CHUNKS];
    size_t chunk = n / MAX_CHUNKS + 1;
    if (chunk < 16384) chunk = 16384;
    chunk = (chunk + 4095) / 4096 * 4096; // whole conversion blocks
    size_t nchunks = (n + chunk - 1) / chunk;
    __typeof__(sum_squares_portable) *sum_squares = sum_squares_for(fl_cpu_isa());
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        double s = 0.0;
        float scratch[4096];
        for (size_t i = c * chunk; i < end; i += 4096) {
            size_t len = end - i < 4096 ? end - i : 4096;
            s += sum_squares(fl_load_f32(dt, fl_at_const(dt, grads, i), len, scratch), len);
        }
        partial[c] = s;
    }
    double total = 0.0;
    for (size_t c = 0; c < nchunks; c++) total += partial[c];
    return total;
}

float fl_grad_norm(fl_dtype dt, const void *grads, size_t n) {
    return (float)sqrt(fl_grad_sumsq(dt, grads, n));
}

float fl_clip_coef(float norm, float max_norm) {
    return fl_gate_clip_coef(norm, max_norm);
}
