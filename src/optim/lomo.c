// lomo.c: LOMO's update (lomo_optim/lomo.py, fused_backward's hook): SGD
// without momentum and without state, the gradient clipped by value, then
// by the global-norm coefficient, and decoupled weight decay:
//   g = clamp(grad * grad_scale, +-clip_value) * clip_coef
//   p = p * (1 - lr*wd) - lr * g
#include "fitlm/optim.h"

#include "fitlm/device.h"

#include "update.h"

typedef struct {
    float lr, keep, clip, coef;
} lomo_range_ctx;

// One copy per ISA (FL_ISA_COPIES), as sgd_kernel: no contraction on any
// path, so LOMO without decay and clipping is plain SGD bitwise on each.
static inline __attribute__((always_inline)) void lomo_kernel_body(float *p, const float *g,
                                                                   size_t n, float gscale, float lr,
                                                                   float keep, float clip,
                                                                   float coef) {
#pragma omp simd
    for (size_t k = 0; k < n; k++) {
        float d = g[k] * gscale;
        if (clip > 0.0f) d = d < -clip ? -clip : d > clip ? clip : d; // NaN stays NaN
        d *= coef;
        p[k] = p[k] * keep - lr * d;
    }
}
FL_ISA_COPIES(lomo_kernel,
              (float *p, const float *g, size_t n, float gscale, float lr, float keep, float clip,
               float coef),
              (p, g, n, gscale, lr, keep, clip, coef))

static void lomo_block(void *ctx, float *p, const float *g, size_t i, size_t n, float gscale) {
    (void)i;
    const lomo_range_ctx *c = ctx;
    lomo_kernel_for(fl_cpu_isa())(p, g, n, gscale, c->lr, c->keep, c->clip, c->coef);
}

static void lomo_begin_step(fl_optim_rule *r, float lr) {
    fl_lomo *o = (fl_lomo *)r;
    o->t++;
    o->lr = lr;
    o->keep = 1.0f - lr * o->weight_decay;
}

static void lomo_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                        const fl_update_args *a) {
    (void)offset;
    const fl_lomo *o = (const fl_lomo *)r;
    lomo_range_ctx c = {o->lr, (row->flags & FL_PARAM_DECAY) ? o->keep : 1.0f, o->clip_value,
                        a->clip_coef > 0.0f ? a->clip_coef : 1.0f};
    fl_update_range(a, count, lomo_block, NULL, &c);
}

static float *lomo_state_ptr(fl_optim_rule *r, int k, size_t offset) {
    (void)r, (void)k, (void)offset;
    return NULL; // no state: never called (nstate 0)
}

static int *lomo_step_count(fl_optim_rule *r) {
    return &((fl_lomo *)r)->t;
}

static void lomo_free(fl_optim_rule *r) {
    fl_lomo_free((fl_lomo *)r);
}

static const fl_optim_ops lomo_ops = {.state_names = NULL,
                                      .begin_step = lomo_begin_step,
                                      .update = lomo_update,
                                      .state_ptr = lomo_state_ptr,
                                      .step_count = lomo_step_count,
                                      .free = lomo_free,
                                      .team_rows = 1};

void fl_lomo_init_range(fl_lomo *opt, size_t begin, size_t end, float weight_decay,
                        float clip_value) {
    FL_ASSERT(begin <= end);
    *opt = (fl_lomo){.rule = {&lomo_ops, begin, end, begin, 0, fl_device_default()},
                     .weight_decay = weight_decay,
                     .clip_value = clip_value};
}

void fl_lomo_free(fl_lomo *opt) {
    (void)opt; // nothing allocated
}
