// adamw.c: AdamW with decoupled weight decay and bias correction, matching
// torch.optim.AdamW (amsgrad off):
//   p -= lr * wd * p
//   m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
//   p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
#include "fitlm/optim.h"

#include <math.h>

#include "../core/dtype_simd.h"
#include "fitlm/core.h"
#include "fitlm/device.h"
#include "update.h"

// The elementwise update on fp32 gradients, one copy per ISA (FL_ISA_COPIES),
// picked at run time. The three FMAs are written out (the products folded
// into m, v and p's decay), so every path rounds alike and gives the same
// bits: those of the AVX-512 code GCC generated for this loop before.
static inline __attribute__((always_inline)) void
adamw_kernel_body(float *p, const float *g, float *m, float *v, size_t n, float gscale, float b1,
                  float b2, float eps, float bc1, float bc2, float lr, float keep) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale;
        float mi = fmaf(b1, m[i], (1.0f - b1) * gi);
        float vi = fmaf(b2, v[i], (1.0f - b2) * gi * gi);
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        p[i] = fmaf(p[i], keep, -(lr * mhat / (sqrtf(vhat) + eps)));
    }
}
FL_ISA_COPIES(adamw_kernel,
              (float *p, const float *g, float *m, float *v, size_t n, float gscale, float b1,
               float b2, float eps, float bc1, float bc2, float lr, float keep),
              (p, g, m, v, n, gscale, b1, b2, eps, bc1, bc2, lr, keep))

typedef struct {
    const fl_adamw *opt;
    float *m, *v; // at the range's first element
    float keep;
} adamw_range_ctx;

static void adamw_block(void *ctx, float *p, const float *g, size_t i, size_t n, float gscale) {
    const adamw_range_ctx *c = ctx;
    const fl_adamw *o = c->opt;
    adamw_kernel_for(fl_cpu_isa())(p, g, c->m + i, c->v + i, n, gscale, o->beta1, o->beta2, o->eps,
                                   o->bc1, o->bc2, o->lr, c->keep);
}

static void adamw_begin_step(fl_optim_rule *r, float lr) {
    fl_adamw *o = (fl_adamw *)r;
    o->t++;
    o->lr = lr;
    o->bc1 = o->no_bias_correction ? 1.0f : 1.0f - powf(o->beta1, (float)o->t);
    o->bc2 = o->no_bias_correction ? 1.0f : 1.0f - powf(o->beta2, (float)o->t);
    o->keep = 1.0f - lr * o->weight_decay;
}

// Mixed precision with AVX2 or AVX-512: one pass that reads the gradient in
// its dtype and refreshes the 16-bit weights, converted in registers, beside
// the fp32 master's update, rather than fl_update_range's fp32 copies of
// each 128-element block and three calls per block. In the LLaMA's training
// step (164 M parameters, Zen 4, alternated runs) the clip+AdamW phase took
// 124-167 against 126-180 ms in fp16 and 153-159 against 146-196 in bf16;
// alone, on one 164 M-element row, both ran at the same memory-bound 98 ms.
// The arithmetic is adamw_kernel_body's, operation for operation (the same
// bits); p16 NULL: no 16-bit copy.
typedef struct {
    float gscale, b1, b2, eps, bc1, bc2, lr, keep;
} adamw_consts;

#if defined(__x86_64__)
#define ADAMW_LOWP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ADAMW_LOWP_AVX2   __attribute__((target("avx2,fma,f16c")))

// 16 elements from i, lanes mk
ADAMW_LOWP_AVX512 __attribute__((always_inline)) static inline void
adamw_lowp16(float *p, fl_dtype gdt, const void *g, float *m, float *v, fl_dtype pdt, void *p16,
             size_t i, __mmask16 mk, const adamw_consts *k) {
    __m512 gi = _mm512_mul_ps(load16_f32(gdt, g, i, mk), _mm512_set1_ps(k->gscale));
    __m512 gm = _mm512_mul_ps(_mm512_set1_ps(1.0f - k->b1), gi);
    __m512 mi = _mm512_fmadd_ps(_mm512_set1_ps(k->b1), _mm512_maskz_loadu_ps(mk, m + i), gm);
    __m512 gv = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(1.0f - k->b2), gi), gi);
    __m512 vi = _mm512_fmadd_ps(_mm512_set1_ps(k->b2), _mm512_maskz_loadu_ps(mk, v + i), gv);
    _mm512_mask_storeu_ps(m + i, mk, mi);
    _mm512_mask_storeu_ps(v + i, mk, vi);
    __m512 mhat = _mm512_div_ps(mi, _mm512_set1_ps(k->bc1));
    __m512 vhat = _mm512_div_ps(vi, _mm512_set1_ps(k->bc2));
    __m512 den = _mm512_add_ps(_mm512_sqrt_ps(vhat), _mm512_set1_ps(k->eps));
    __m512 step = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k->lr), mhat), den);
    __m512 pi = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, p + i), _mm512_set1_ps(k->keep),
                                _mm512_sub_ps(_mm512_setzero_ps(), step));
    _mm512_mask_storeu_ps(p + i, mk, pi);
    if (p16) store16_f32(pdt, p16, i, mk, pi);
}

ADAMW_LOWP_AVX512 static void adamw_lowp_avx512(float *p, fl_dtype gdt, const void *g, float *m,
                                                float *v, fl_dtype pdt, void *p16, size_t n,
                                                const adamw_consts *k) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) adamw_lowp16(p, gdt, g, m, v, pdt, p16, i, 0xFFFF, k);
    if (i < n) adamw_lowp16(p, gdt, g, m, v, pdt, p16, i, (__mmask16)((1u << (n - i)) - 1), k);
}

// 8 elements from i
ADAMW_LOWP_AVX2 __attribute__((always_inline)) static inline void
adamw_lowp8(float *p, fl_dtype gdt, const void *g, float *m, float *v, fl_dtype pdt, void *p16,
            size_t i, const adamw_consts *k) {
    __m256 gi = _mm256_mul_ps(load8_f32(gdt, g, i), _mm256_set1_ps(k->gscale));
    __m256 gm = _mm256_mul_ps(_mm256_set1_ps(1.0f - k->b1), gi);
    __m256 mi = _mm256_fmadd_ps(_mm256_set1_ps(k->b1), _mm256_loadu_ps(m + i), gm);
    __m256 gv = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(1.0f - k->b2), gi), gi);
    __m256 vi = _mm256_fmadd_ps(_mm256_set1_ps(k->b2), _mm256_loadu_ps(v + i), gv);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    __m256 mhat = _mm256_div_ps(mi, _mm256_set1_ps(k->bc1));
    __m256 vhat = _mm256_div_ps(vi, _mm256_set1_ps(k->bc2));
    __m256 den = _mm256_add_ps(_mm256_sqrt_ps(vhat), _mm256_set1_ps(k->eps));
    __m256 step = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k->lr), mhat), den);
    __m256 pi = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(k->keep),
                                _mm256_sub_ps(_mm256_setzero_ps(), step));
    _mm256_storeu_ps(p + i, pi);
    if (p16) store8_f32(pdt, p16, i, pi);
}

// whole vectors of 8; returns how many elements it did
ADAMW_LOWP_AVX2 static size_t adamw_lowp_avx2(float *p, fl_dtype gdt, const void *g, float *m,
                                              float *v, fl_dtype pdt, void *p16, size_t n,
                                              const adamw_consts *k) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) adamw_lowp8(p, gdt, g, m, v, pdt, p16, i, k);
    return i;
}
#endif

// fl_update_lowp_fn: elements [i, i+n) of the range, the vector pass; past
// AVX2's whole vectors (fewer than 8 elements) the fp32 kernel on a
// converted copy.
static void adamw_lowp_block(void *ctx, const fl_update_args *a, size_t i, size_t n) {
    const adamw_range_ctx *c = ctx;
    const fl_adamw *o = c->opt;
    adamw_consts k = {a->grad_scale, o->beta1, o->beta2, o->eps, o->bc1, o->bc2, o->lr, c->keep};
    const void *g = fl_at_const(a->grads_dtype, a->grads, i);
    void *p16 = a->params_lowp ? fl_at(a->lowp_dtype, a->params_lowp, i) : NULL;
    float *p = a->params + i, *m = c->m + i, *v = c->v + i;
    size_t done = 0;
#if defined(__x86_64__)
    if (fl_cpu_isa() == FL_ISA_AVX512) {
        adamw_lowp_avx512(p, a->grads_dtype, g, m, v, a->lowp_dtype, p16, n, &k);
        return;
    }
    done = adamw_lowp_avx2(p, a->grads_dtype, g, m, v, a->lowp_dtype, p16, n, &k);
#endif
    if (done == n) return;
    float g32[8];
    size_t rest = n - done;
    FL_ASSERT(rest <= 8);
    fl_convert(FL_F32, g32, a->grads_dtype, fl_at_const(a->grads_dtype, g, done), rest);
    adamw_block(ctx, p + done, g32, i + done, rest, a->grad_scale);
    if (p16) fl_store_f32(a->lowp_dtype, fl_at(a->lowp_dtype, p16, done), p + done, rest);
}

static void adamw_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                         const fl_update_args *a) {
    const fl_adamw *o = (const fl_adamw *)r;
    size_t s = offset - r->window_begin;
    adamw_range_ctx c = {o, o->m + s, o->v + s, (row->flags & FL_PARAM_DECAY) ? o->keep : 1.0f};
    fl_update_range(a, count, adamw_block, adamw_lowp_block, &c);
}

static float **adamw_state_slot(fl_optim_rule *r, int k) {
    fl_adamw *o = (fl_adamw *)r;
    return k == 0 ? &o->m : &o->v;
}

static int *adamw_step_count(fl_optim_rule *r) {
    return &((fl_adamw *)r)->t;
}

static void adamw_free(fl_optim_rule *r) {
    fl_adamw_free((fl_adamw *)r);
}

static const char *const adamw_state_names[] = {"m", "v"};
static const fl_optim_ops adamw_ops = {.kind = FL_OPT_ADAMW,
                                       .state_names = adamw_state_names,
                                       .begin_step = adamw_begin_step,
                                       .update = adamw_update,
                                       .state_slot = adamw_state_slot,
                                       .step_count = adamw_step_count,
                                       .free = adamw_free,
                                       .team_rows = 1};

void fl_adamw_setup(fl_adamw *opt, size_t begin, size_t end, float beta1, float beta2, float eps,
                    float weight_decay, int alloc) {
    FL_ASSERT(begin <= end);
    *opt = (fl_adamw){.rule = {&adamw_ops, begin, end, begin, 2, fl_device_default()},
                      .beta1 = beta1,
                      .beta2 = beta2,
                      .eps = eps,
                      .weight_decay = weight_decay,
                      .numel = end - begin};
    if (!alloc) return; // paged: the pager points m and v at a chunk
    const fl_device *d = opt->rule.dev;
    opt->m = d->alloc(d, FL_MEM_OPTIM, (end - begin) * sizeof(float));
    opt->v = d->alloc(d, FL_MEM_OPTIM, (end - begin) * sizeof(float));
}

void fl_adamw_init_range(fl_adamw *opt, size_t begin, size_t end, float beta1, float beta2,
                         float eps, float weight_decay) {
    fl_adamw_setup(opt, begin, end, beta1, beta2, eps, weight_decay, 1);
}

void fl_adamw_init(fl_adamw *opt, size_t numel, float beta1, float beta2, float eps,
                   float weight_decay) {
    fl_adamw_init_range(opt, 0, numel, beta1, beta2, eps, weight_decay);
}

void fl_adamw_free(fl_adamw *opt) {
    const fl_device *d = opt->rule.dev;
    d->free(d, opt->m);
    d->free(d, opt->v);
    opt->m = opt->v = NULL;
}
