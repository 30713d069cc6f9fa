// spike_guard.c: the spike guard (optim.h), llm.c's outlier detector with
// the differences optim.h gives: the value judged is compared with the
// window of earlier normal values, and an outlier never joins it.
#include <math.h>
#include <string.h>

#include "fitlm/optim.h"

#include "gate.h"

void fl_spike_guard_init(fl_spike_guard *g, const fl_spike_config *cfg) {
    memset(g, 0, sizeof *g);
    g->cfg = *cfg;
    FL_ASSERT(cfg->window >= 0 && cfg->window <= FL_SPIKE_WINDOW_MAX);
}

int fl_spike_guard_on(const fl_spike_guard *g) {
    return (g->cfg.loss_z > 0.0f || g->cfg.grad_z > 0.0f) && g->cfg.window > 0;
}

fl_spike_stat fl_spike_stat_of(const fl_spike_series *s, int window, int min_count) {
    fl_spike_stat st = {0.0, 0.0, s->count >= min_count && s->count > 0};
    if (!st.ok) return st;
    // two passes over at most FL_SPIKE_WINDOW_MAX values, oldest first: the
    // same sums on every rank and after a resume (no running sum to drift)
    double mean = 0.0, var = 0.0;
    for (int i = 0; i < s->count; i++) mean += s->v[(s->next - s->count + i + window) % window];
    mean /= s->count;
    for (int i = 0; i < s->count; i++) {
        double d = s->v[(s->next - s->count + i + window) % window] - mean;
        var += d * d;
    }
    double sd = sqrt(var / s->count), floor = 0.01 * fabs(mean);
    st.mean = mean;
    st.sd = sd < floor ? floor : sd;
    return st;
}

double fl_spike_z(const fl_spike_series *s, int window, int min_count, double v) {
    fl_spike_stat st = fl_spike_stat_of(s, window, min_count);
    return fl_gate_z(&st, v);
}

void fl_spike_push(fl_spike_series *s, int window, double v) {
    if (!isfinite(v)) return; // non-finite steps are the non-finite check's
    s->v[s->next] = v;
    s->next = (s->next + 1) % window;
    if (s->count < window) s->count++;
}

void fl_spike_record(fl_spike_guard *g, const fl_spike_verdict *v, double loss, double grad_norm) {
    if (v->outlier) {
        g->in_row++;
        g->skipped++;
        return;
    }
    g->in_row = 0;
    fl_spike_push(&g->loss, g->cfg.window, loss);
    fl_spike_push(&g->norm, g->cfg.window, grad_norm);
}

fl_spike_verdict fl_spike_judge(fl_spike_guard *g, double loss, double grad_norm) {
    fl_spike_verdict r = {0, NAN, NAN};
    if (!fl_spike_guard_on(g)) return r;
    const fl_spike_config *c = &g->cfg;
    if (c->loss_z > 0.0f) r.loss_z = (float)fl_spike_z(&g->loss, c->window, c->min_count, loss);
    if (c->grad_z > 0.0f)
        r.grad_z = (float)fl_spike_z(&g->norm, c->window, c->min_count, grad_norm);
    r.outlier = r.loss_z > c->loss_z || r.grad_z > c->grad_z; // NAN compares false
    fl_spike_record(g, &r, loss, grad_norm);
    return r;
}
