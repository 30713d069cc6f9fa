// test_optim.c: optimizers, clipping and schedules against hand-written
// double-precision versions of torch.optim's update rules.
#include <math.h>
#include <omp.h>
#include <string.h>

#include "fitlm/optim.h"
#include "testlib.h"

// A table of two views: a "matrix" that is decayed and a "bias" that is not.
static void make_table(fl_param_table *t) {
    size_t w[2] = {3, 5}, b[1] = {7};
    fl_params_add(t, "w", FL_PARAM_DECAY, 2, w);
    fl_params_add(t, "b", 0, 1, b);
}

static void test_adamw_matches_torch_rule(void) {
    fl_param_table t = {0};
    make_table(&t);
    size_t n = t.numel;
    float p[22], g[22];
    double pd[22], m[22] = {0}, v[22] = {0};
    t_fill(p, n, 1, 1.0f);
    for (size_t i = 0; i < n; i++) pd[i] = p[i];
    fl_adamw opt;
    double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    fl_adamw_init(&opt, n, (float)b1, (float)b2, (float)eps, (float)wd);
    for (int step = 1; step <= 5; step++) {
        t_fill(g, n, 100 + step, 0.5f);
        fl_adamw_step(&opt, &t, p, g, (float)lr);
        for (size_t i = 0; i < n; i++) { // torch.optim.AdamW, amsgrad=False
            if (i < 15) pd[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1 - b1) * g[i];
            v[i] = b2 * v[i] + (1 - b2) * (double)g[i] * g[i];
            double mhat = m[i] / (1 - pow(b1, step)), vhat = v[i] / (1 - pow(b2, step));
            pd[i] -= lr * mhat / (sqrt(vhat) + eps);
        }
    }
    float want[22];
    for (size_t i = 0; i < n; i++) want[i] = (float)pd[i];
    // float32 arithmetic over 5 steps of size ~lr: a few ulps of |p| ~ 1
    t_close("adamw params after 5 steps", p, want, n, 1e-6, 1e-5);
    t_check(opt.t == 5, "adamw counts its steps (t=%d)", opt.t);
    fl_adamw_free(&opt);
    fl_params_free(&t);
}

static void test_sgd_momentum_matches_torch_rule(void) {
    fl_param_table t = {0};
    make_table(&t);
    size_t n = t.numel;
    float p[22], g[22];
    double pd[22], buf[22] = {0};
    t_fill(p, n, 2, 1.0f);
    for (size_t i = 0; i < n; i++) pd[i] = p[i];
    double lr = 0.05, mu = 0.9, wd = 0.01;
    fl_sgd opt;
    fl_sgd_init(&opt, n, (float)mu, (float)wd);
    for (int step = 1; step <= 4; step++) {
        t_fill(g, n, 200 + step, 0.5f);
        fl_sgd_step(&opt, &t, p, g, (float)lr);
        for (size_t i = 0; i < n; i++) { // torch.optim.SGD, dampening 0
            double d = g[i] + (i < 15 ? wd * pd[i] : 0.0);
            buf[i] = step == 1 ? d : mu * buf[i] + d;
            pd[i] -= lr * buf[i];
        }
    }
    float want[22];
    for (size_t i = 0; i < n; i++) want[i] = (float)pd[i];
    t_close("sgd+momentum params after 4 steps", p, want, n, 1e-6, 1e-5);
    fl_sgd_free(&opt);

    fl_sgd plain; // no momentum: no buffer is allocated
    fl_sgd_init(&plain, n, 0.0f, 0.0f);
    t_check(plain.buf == NULL, "plain SGD keeps no momentum buffer");
    float q[22], want_q[22];
    t_fill(q, n, 3, 1.0f);
    t_fill(g, n, 4, 1.0f);
    for (size_t i = 0; i < n; i++) want_q[i] = q[i] - 0.5f * g[i];
    fl_sgd_step(&plain, &t, q, g, 0.5f);
    t_close("plain sgd step", q, want_q, n, 0, 0);
    fl_sgd_free(&plain);
    fl_params_free(&t);
}

static void test_clipping(void) {
    enum { N = 100003 }; // several chunks, odd size
    static float g[N], g1[N];
    t_fill(g, N, 5, 1.0f);
    double sq = 0;
    for (int i = 0; i < N; i++) sq += (double)g[i] * g[i];
    float norm_want = (float)sqrt(sq);
    memcpy(g1, g, sizeof g);
    omp_set_num_threads(1);
    float n1 = fl_grad_norm(g1, N);
    omp_set_num_threads(2);
    float n2 = fl_grad_norm(g, N);
    t_check(n1 == n2, "grad norm is bitwise the same on 1 and 2 threads (%.9g vs %.9g)", n1, n2);
    t_check(fabsf(n2 - norm_want) <= 1e-6f * norm_want, "grad norm %.7g want %.7g", n2, norm_want);

    float norm = fl_clip_grad_norm(g, N, 1.0f);
    t_check(norm == n2, "clip returns the norm before clipping");
    float after = fl_grad_norm(g, N);
    t_check(fabsf(after - 1.0f) < 1e-5f, "clipped norm is max_norm (got %.7f)", after);
    float before[4] = {0.3f, -0.4f, 0, 0}, small[4];
    memcpy(small, before, sizeof small);
    fl_clip_grad_norm(small, 4, 1.0f);
    t_close("norm under max_norm is untouched", small, before, 4, 0, 0);
    fl_clip_grad_norm(small, 4, 0.0f);
    t_close("max_norm 0 disables clipping", small, before, 4, 0, 0);
}

static void test_schedules(void) {
    fl_schedule s = {FL_SCHED_COSINE, 1.0f, 10, 110, 0.1f};
    t_check(fabsf(fl_lr_at(&s, 0) - 0.1f) < 1e-7f, "warmup step 0 = lr/warmup");
    t_check(fabsf(fl_lr_at(&s, 9) - 1.0f) < 1e-7f, "warmup ends at lr");
    t_check(fabsf(fl_lr_at(&s, 10) - 1.0f) < 1e-6f, "cosine starts at lr");
    t_check(fabsf(fl_lr_at(&s, 60) - 0.55f) < 1e-6f, "cosine midpoint = (lr+floor)/2 (%g)",
            fl_lr_at(&s, 60));
    t_check(fabsf(fl_lr_at(&s, 110) - 0.1f) < 1e-7f, "cosine ends at the floor");
    t_check(fabsf(fl_lr_at(&s, 500) - 0.1f) < 1e-7f, "stays at the floor after the end");
    s.kind = FL_SCHED_LINEAR;
    t_check(fabsf(fl_lr_at(&s, 35) - 0.775f) < 1e-6f, "linear quarter way (%g)", fl_lr_at(&s, 35));
    s.kind = FL_SCHED_CONSTANT;
    t_check(fl_lr_at(&s, 100) == 1.0f, "constant after warmup");
    fl_schedule nowarm = {FL_SCHED_CONSTANT, 0.5f, 0, 10, 0.0f};
    t_check(fl_lr_at(&nowarm, 0) == 0.5f, "no warmup: lr from step 0");
}

int main(void) {
    test_adamw_matches_torch_rule();
    test_sgd_momentum_matches_torch_rule();
    test_clipping();
    test_schedules();
    return t_report();
}
