// sgd.c: SGD with optional momentum, as torch.optim.SGD (dampening 0, no
// Nesterov): g += wd*p (coupled decay, on FL_PARAM_DECAY views only);
// buf = g at the first step, else momentum*buf + g; p -= lr*buf.
#include "fitlm/optim.h"

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

void fl_sgd_step(fl_sgd *opt, const fl_param_table *table, float *params, const float *grads,
                 float lr) {
    FL_ASSERT(table->numel == opt->numel);
    opt->t++;
    float mu = opt->momentum;
    int first = opt->t == 1;
    for (int k = 0; k < table->count; k++) {
        const fl_param_view *v = &table->views[k];
        float wd = (v->flags & FL_PARAM_DECAY) ? opt->weight_decay : 0.0f;
        float *p = params + v->offset, *buf = opt->buf ? opt->buf + v->offset : NULL;
        const float *g = grads + v->offset;
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < v->numel; i++) {
            float d = g[i] + wd * p[i];
            if (buf) {
                d = first ? d : mu * buf[i] + d;
                buf[i] = d;
            }
            p[i] -= lr * d;
        }
    }
}
