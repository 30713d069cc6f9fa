// adamw.c: AdamW with decoupled weight decay and bias correction, matching
// torch.optim.AdamW (amsgrad off):
//   p -= lr * wd * p
//   m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
//   p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
#include "fitlm/optim.h"

#include <math.h>

#include "update.h"

void fl_adamw_init(fl_adamw *opt, size_t numel, float beta1, float beta2, float eps,
                   float weight_decay) {
    opt->beta1 = beta1;
    opt->beta2 = beta2;
    opt->eps = eps;
    opt->weight_decay = weight_decay;
    opt->numel = numel;
    opt->t = 0;
    opt->m = fl_alloc(FL_MEM_OPTIM, numel * sizeof(float));
    opt->v = fl_alloc(FL_MEM_OPTIM, numel * sizeof(float));
}

void fl_adamw_free(fl_adamw *opt) {
    fl_free(opt->m);
    fl_free(opt->v);
    opt->m = opt->v = NULL;
}

// The elementwise update on fp32 gradients, compiled for AVX-512, AVX2 and
// baseline x86-64; the loader picks the clone for the CPU at run time. Same
// arithmetic in every clone: one rounding per operation, no fast-math.
FL_TARGET_CLONES
static void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n, float gscale,
                         float b1, float b2, float eps, float bc1, float bc2, float lr,
                         float keep) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        p[i] = p[i] * keep - lr * mhat / (sqrtf(vhat) + eps);
    }
}

typedef struct {
    fl_adamw *opt;
    float bc1, bc2, lr, keep;
} adamw_step_ctx;

static void adamw_block(void *ctx, float *p, const float *g, size_t offset, size_t n,
                        float gscale) {
    adamw_step_ctx *c = ctx;
    fl_adamw *o = c->opt;
    adamw_kernel(p, g, o->m + offset, o->v + offset, n, gscale, o->beta1, o->beta2, o->eps, c->bc1,
                 c->bc2, c->lr, c->keep);
}

void fl_adamw_update(fl_adamw *opt, const fl_update_args *a, size_t offset, size_t n, int t,
                     float lr, int decay) {
    FL_ASSERT(t >= 1 && offset + n <= opt->numel);
    adamw_step_ctx c = {opt, 1.0f - powf(opt->beta1, (float)t), 1.0f - powf(opt->beta2, (float)t),
                        lr, decay ? 1.0f - lr * opt->weight_decay : 1.0f};
    fl_update_range(a, offset, n, adamw_block, &c);
}

void fl_adamw_step(fl_adamw *opt, const fl_param_table *table, const fl_update_args *a, float lr) {
    FL_ASSERT(table->numel == opt->numel);
    opt->t++;
    for (int i = 0; i < table->count; i++) {
        const fl_param_view *v = &table->views[i];
        fl_adamw_update(opt, a, v->offset, v->numel, opt->t, lr, (v->flags & FL_PARAM_DECAY) != 0);
    }
}
