// adamw.c: AdamW with decoupled weight decay and bias correction, matching
// torch.optim.AdamW (amsgrad off):
//   p -= lr * wd * p
//   m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
//   p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
#include "fitlm/optim.h"

#include <math.h>

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
    o->bc1 = 1.0f - powf(o->beta1, (float)o->t);
    o->bc2 = 1.0f - powf(o->beta2, (float)o->t);
    o->keep = 1.0f - lr * o->weight_decay;
}

static void adamw_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                         const fl_update_args *a) {
    const fl_adamw *o = (const fl_adamw *)r;
    size_t s = offset - r->window_begin;
    adamw_range_ctx c = {o, o->m + s, o->v + s, (row->flags & FL_PARAM_DECAY) ? o->keep : 1.0f};
    fl_update_range(a, count, adamw_block, &c);
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
static const fl_optim_ops adamw_ops = {.state_names = adamw_state_names,
                                       .begin_step = adamw_begin_step,
                                       .update = adamw_update,
                                       .state_slot = adamw_state_slot,
                                       .step_count = adamw_step_count,
                                       .free = adamw_free};

void fl_adamw_setup(fl_adamw *opt, size_t begin, size_t end, float beta1, float beta2, float eps,
                    float weight_decay, int alloc) {
    FL_ASSERT(begin <= end);
    *opt = (fl_adamw){.rule = {&adamw_ops, begin, end, begin, 2},
                      .beta1 = beta1,
                      .beta2 = beta2,
                      .eps = eps,
                      .weight_decay = weight_decay,
                      .numel = end - begin};
    if (!alloc) return; // paged: the pager points m and v at a chunk
    opt->m = fl_alloc(FL_MEM_OPTIM, (end - begin) * sizeof(float));
    opt->v = fl_alloc(FL_MEM_OPTIM, (end - begin) * sizeof(float));
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
    fl_free(opt->m);
    fl_free(opt->v);
    opt->m = opt->v = NULL;
}
