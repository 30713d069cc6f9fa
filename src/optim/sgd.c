// sgd.c: SGD with optional momentum, as torch.optim.SGD (dampening 0, no
// Nesterov): g += wd*p (coupled decay, on FL_PARAM_DECAY rows only);
// buf = g at the first step, else momentum*buf + g; p -= lr*buf.
#include "fitlm/optim.h"

#include "fitlm/device.h"

#include "update.h"

typedef struct {
    float lr, wd, mu;
    float *buf; // at the range's first element, or NULL
    int first;
} sgd_range_ctx;

// One copy per ISA (FL_ISA_COPIES): no contraction, so every path gives the
// same bits. With and without momentum as separate loops, so both vectorise.
static inline __attribute__((always_inline)) void sgd_kernel_body(float *p, const float *g,
                                                                  float *buf, size_t n,
                                                                  float gscale, float lr, float wd,
                                                                  float mu, int first) {
    if (!buf) {
#pragma omp simd
        for (size_t k = 0; k < n; k++) p[k] -= lr * (g[k] * gscale + wd * p[k]);
        return;
    }
#pragma omp simd
    for (size_t k = 0; k < n; k++) {
        float d = g[k] * gscale + wd * p[k];
        d = first ? d : mu * buf[k] + d;
        buf[k] = d;
        p[k] -= lr * d;
    }
}
FL_ISA_COPIES(sgd_kernel,
              (float *p, const float *g, float *buf, size_t n, float gscale, float lr, float wd,
               float mu, int first),
              (p, g, buf, n, gscale, lr, wd, mu, first))

static void sgd_block(void *ctx, float *p, const float *g, size_t i, size_t n, float gscale) {
    const sgd_range_ctx *c = ctx;
    sgd_kernel_for(fl_cpu_isa())(p, g, c->buf ? c->buf + i : NULL, n, gscale, c->lr, c->wd, c->mu,
                                 c->first);
}

static void sgd_begin_step(fl_optim_rule *r, float lr) {
    fl_sgd *o = (fl_sgd *)r;
    o->t++;
    o->lr = lr;
}

static void sgd_update(fl_optim_rule *r, const fl_param_view *row, size_t offset, size_t count,
                       const fl_update_args *a) {
    const fl_sgd *o = (const fl_sgd *)r;
    sgd_range_ctx c = {o->lr, (row->flags & FL_PARAM_DECAY) ? o->weight_decay : 0.0f, o->momentum,
                       o->buf ? o->buf + (offset - r->window_begin) : NULL, o->t == 1};
    fl_update_range(a, count, sgd_block, NULL, &c);
}

static float **sgd_state_slot(fl_optim_rule *r, int k) {
    (void)k; // only the momentum buffer
    return &((fl_sgd *)r)->buf;
}

static int *sgd_step_count(fl_optim_rule *r) {
    return &((fl_sgd *)r)->t;
}

static void sgd_free(fl_optim_rule *r) {
    fl_sgd_free((fl_sgd *)r);
}

static const char *const sgd_state_names[] = {"momentum"};
static const fl_optim_ops sgd_ops = {.state_names = sgd_state_names,
                                     .begin_step = sgd_begin_step,
                                     .update = sgd_update,
                                     .state_slot = sgd_state_slot,
                                     .step_count = sgd_step_count,
                                     .free = sgd_free,
                                     .team_rows = 1};

void fl_sgd_setup(fl_sgd *opt, size_t begin, size_t end, float momentum, float weight_decay,
                  int alloc) {
    FL_ASSERT(begin <= end);
    int has_buf = momentum > 0.0f;
    *opt = (fl_sgd){.rule = {&sgd_ops, begin, end, begin, has_buf, fl_device_default()},
                    .momentum = momentum,
                    .weight_decay = weight_decay,
                    .numel = end - begin};
    const fl_device *d = opt->rule.dev;
    if (has_buf && alloc) opt->buf = d->alloc(d, FL_MEM_OPTIM, (end - begin) * sizeof(float));
}

void fl_sgd_init_range(fl_sgd *opt, size_t begin, size_t end, float momentum, float weight_decay) {
    fl_sgd_setup(opt, begin, end, momentum, weight_decay, 1);
}

void fl_sgd_init(fl_sgd *opt, size_t numel, float momentum, float weight_decay) {
    fl_sgd_init_range(opt, 0, numel, momentum, weight_decay);
}

void fl_sgd_free(fl_sgd *opt) {
    opt->rule.dev->free(opt->rule.dev, opt->buf);
    opt->buf = NULL;
}
