// sgd.c: SGD with optional momentum, as torch.optim.SGD (dampening 0, no
// Nesterov): g += wd*p (coupled decay, on FL_PARAM_DECAY views only);
// buf = g at the first step, else momentum*buf + g; p -= lr*buf.
#include "fitlm/optim.h"

#include "update.h"

void fl_sgd_init(fl_sgd *opt, size_t numel, float momentum, float weight_decay) {
    opt->momentum = momentum;
    opt->weight_decay = weight_decay;
    opt->numel = numel;
    opt->t = 0;
    opt->buf = momentum > 0.0f ? fl_alloc(FL_MEM_OPTIM, numel * sizeof(float)) : NULL;
}

void fl_sgd_free(fl_sgd *opt) {
    fl_free(opt->buf);
    opt->buf = NULL;
}

typedef struct {
    fl_sgd *opt;
    float lr, wd;
} sgd_step_ctx;

static void sgd_block(void *ctx, float *p, const float *g, size_t offset, size_t n, float gscale) {
    sgd_step_ctx *c = ctx;
    float mu = c->opt->momentum, *buf = c->opt->buf ? c->opt->buf + offset : NULL;
    int first = c->opt->t == 1;
    for (size_t i = 0; i < n; i++) {
        float d = g[i] * gscale + c->wd * p[i];
        if (buf) {
            d = first ? d : mu * buf[i] + d;
            buf[i] = d;
        }
        p[i] -= c->lr * d;
    }
}

void fl_sgd_step(fl_sgd *opt, const fl_param_table *table, const fl_update_args *a, float lr) {
    FL_ASSERT(table->numel == opt->numel);
    opt->t++;
    for (int k = 0; k < table->count; k++) {
        const fl_param_view *v = &table->views[k];
        sgd_step_ctx c = {opt, lr, (v->flags & FL_PARAM_DECAY) ? opt->weight_decay : 0.0f};
        fl_update_range(a, v->offset, v->numel, sgd_block, &c);
    }
}
