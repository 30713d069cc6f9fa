// lora.c: the elementwise pieces of a LoRA adapter (kernels.h): adding its
// update into, and taking its gradient out of, a block of columns of the
// wider GEMM output it adapts (q and v inside the fused qkv), and dropout on
// its input. Rows are independent, so threads split them: deterministic.
#include "fitlm/kernels.h"

#include "simd.h"

enum { LORA_CHUNK = 1024 }; // columns converted at a time

void lora_add_columns(fl_dtype dt, void *out, int ld, const void *x, float scale, int N, int cols) {
#pragma omp parallel for
    for (int n = 0; n < N; n++)
        for (int c0 = 0; c0 < cols; c0 += LORA_CHUNK) {
            int nc = cols - c0 < LORA_CHUNK ? cols - c0 : LORA_CHUNK;
            float o32[LORA_CHUNK], x32[LORA_CHUNK];
            void *dst = fl_at(dt, out, (size_t)n * ld + c0);
            float *o = fp32_rmw(dt, dst, nc, o32);
            const float *xs = fl_load_f32(dt, fl_at_const(dt, x, (size_t)n * cols + c0), nc, x32);
            for (int i = 0; i < nc; i++) o[i] += scale * xs[i];
            fp32_flush(dt, dst, o, nc);
        }
}

void lora_gather_columns(fl_dtype dt, void *x, const void *src, int ld, float scale, int N,
                         int cols) {
#pragma omp parallel for
    for (int n = 0; n < N; n++)
        for (int c0 = 0; c0 < cols; c0 += LORA_CHUNK) {
            int nc = cols - c0 < LORA_CHUNK ? cols - c0 : LORA_CHUNK;
            float s32[LORA_CHUNK], y[LORA_CHUNK];
            const float *s = fl_load_f32(dt, fl_at_const(dt, src, (size_t)n * ld + c0), nc, s32);
            for (int i = 0; i < nc; i++) y[i] = scale * s[i];
            fl_store_f32(dt, fl_at(dt, x, (size_t)n * cols + c0), y, nc);
        }
}

// element i is dropped when u_i = (top 24 bits of its hash) / 2^24 < p
static int dropped(uint64_t key, size_t i, float p) {
    return (float)(fl_sr_bits(key, i) >> 40) * (1.0f / 16777216.0f) < p;
}

void dropout_apply(fl_dtype dt, void *out, const void *inp, size_t n, float p, uint64_t key) {
    float keep = 1.0f / (1.0f - p);
    size_t chunks = (n + LORA_CHUNK - 1) / LORA_CHUNK;
#pragma omp parallel for
    for (size_t k = 0; k < chunks; k++) {
        size_t i0 = k * LORA_CHUNK, len = n - i0 < LORA_CHUNK ? n - i0 : LORA_CHUNK;
        float x32[LORA_CHUNK], y[LORA_CHUNK];
        const float *x = fl_load_f32(dt, fl_at_const(dt, inp, i0), len, x32);
        for (size_t i = 0; i < len; i++) y[i] = dropped(key, i0 + i, p) ? 0.0f : x[i] * keep;
        fl_store_f32(dt, fl_at(dt, out, i0), y, len);
    }
}

void lora_add_columns_ref(float *out, int ld, const float *x, float scale, int N, int cols) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < cols; i++) out[(size_t)n * ld + i] += scale * x[(size_t)n * cols + i];
}

void dropout_apply_ref(float *out, const float *inp, size_t n, float p, uint64_t key) {
    for (size_t i = 0; i < n; i++)
        out[i] = dropped(key, i, p) ? 0.0f : inp[i] * (1.0f / (1.0f - p));
}
