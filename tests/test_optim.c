// test_optim.c: optimizers, clipping and schedules against hand-written
// double-precision versions of torch.optim's update rules.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fitlm/config.h"
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
        fl_update_args a = {.params = p, .grads = g, .grads_dtype = FL_F32, .grad_scale = 1.0f};
        fl_adamw_step(&opt, &t, &a, (float)lr);
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
        fl_update_args a = {.params = p, .grads = g, .grads_dtype = FL_F32, .grad_scale = 1.0f};
        fl_sgd_step(&opt, &t, &a, (float)lr);
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
    fl_update_args a = {.params = q, .grads = g, .grads_dtype = FL_F32, .grad_scale = 1.0f};
    fl_sgd_step(&plain, &t, &a, 0.5f);
    t_close("plain sgd step", q, want_q, n, 0, 0);
    fl_sgd_free(&plain);
    fl_params_free(&t);
}

static void test_norm_and_clipping(void) {
    enum { N = 100003 }; // several chunks, odd size
    static float g[N];
    static uint16_t h[N];
    t_fill(g, N, 5, 1.0f);
    double sq = 0;
    for (int i = 0; i < N; i++) sq += (double)g[i] * g[i];
    float norm_want = (float)sqrt(sq);
    omp_set_num_threads(1);
    float n1 = fl_grad_norm(FL_F32, g, N);
    omp_set_num_threads(2);
    float n2 = fl_grad_norm(FL_F32, g, N);
    t_check(n1 == n2, "grad norm is bitwise the same on 1 and 2 threads (%.9g vs %.9g)", n1, n2);
    t_check(fabsf(n2 - norm_want) <= 1e-6f * norm_want, "grad norm %.7g want %.7g", n2, norm_want);
    fl_convert(FL_BF16, h, FL_F32, g, N);
    float nb = fl_grad_norm(FL_BF16, h, N);
    t_check(fabsf(nb - norm_want) <= 4e-3f * norm_want, "bf16 grad norm %.7g ~ %.7g", nb,
            norm_want);
    t_check(fl_clip_coef(0.5f, 1.0f) == 1.0f, "no clipping under max_norm");
    t_check(fl_clip_coef(4.0f, 0.0f) == 1.0f, "max_norm 0 disables clipping");
    t_check(fabsf(fl_clip_coef(4.0f, 1.0f) * 4.0f - 1.0f) < 1e-6f, "clipping scales to max_norm");
}

// DeepSpeed's DynamicLossScaler on crafted overflow sequences (defaults
// window 1000, hysteresis 2; small windows here to keep the sequences short).
static void test_loss_scaler(void) {
    fl_loss_scaler s;
    fl_loss_scaler_init(&s, 0.0f, 16, 1000, 2, 0, 1.0f);
    t_check(s.scale == 65536.0f && s.dynamic, "dynamic scaling starts at 2^16");

    fl_loss_scaler_init(&s, 0.0f, 4, 3, 2, 0, 1.0f); // 16, window 3, hysteresis 2
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 16.0f && s.cur_hysteresis == 1, "first overflow only uses up hysteresis");
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 8.0f, "second overflow halves the scale (%g)", s.scale);
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 0);
    t_check(s.scale == 8.0f, "no growth before a full window");
    fl_loss_scaler_update(&s, 0);
    t_check(s.scale == 16.0f && s.cur_hysteresis == 2,
            "a window of clean steps doubles the scale and refills the hysteresis (%g, %d)",
            s.scale, s.cur_hysteresis);
    fl_loss_scaler_update(&s, 1); // uses hysteresis, no halving
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 1); // hysteresis not refilled: halves now
    t_check(s.scale == 8.0f, "without consecutive_hysteresis one clean step does not refill it");

    fl_loss_scaler_init(&s, 0.0f, 4, 100, 2, 1, 1.0f);
    fl_loss_scaler_update(&s, 1);
    fl_loss_scaler_update(&s, 0);
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 16.0f, "consecutive_hysteresis refills after every clean step");

    fl_loss_scaler_init(&s, 0.0f, 2, 100, 1, 0, 1.0f); // 4, hysteresis 1
    int st = fl_loss_scaler_update(&s, 1) | fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 1.0f && st == 0, "backs off to the minimum");
    t_check(fl_loss_scaler_update(&s, 1) == -1, "an overflow at the minimum is reported as stuck");
    fl_loss_scaler_init(&s, 0.0f, 1, 100, 1, 0, 1.5f);
    fl_loss_scaler_update(&s, 1);
    t_check(s.scale == 1.5f, "never below min_loss_scale (%g)", s.scale);

    fl_loss_scaler_init(&s, 128.0f, 16, 2, 2, 0, 1.0f);
    for (int i = 0; i < 5; i++) fl_loss_scaler_update(&s, i == 2);
    t_check(s.scale == 128.0f && !s.dynamic, "a static scale never moves");
}

// A two-view model-like table with 16-bit weights, for the mixed-precision
// optimizer.
typedef struct {
    fl_param_table table;
    uint16_t params[22], grads[22];
} lowp_model;

static void lowp_init(lowp_model *m, fl_dtype dt) {
    memset(m, 0, sizeof *m);
    make_table(&m->table);
    float p[22];
    t_fill(p, 22, 9, 1.0f);
    fl_convert(dt, m->params, FL_F32, p, 22);
}

// `fitlm train`'s defaults: AdamW 0.9/0.95, eps 1e-8, wd 0.1, clip 1.0,
// fp16 scaling from 2^16 with window 1000 and hysteresis 2
static fl_optimizer_config adamw_config(int accum) {
    fl_train_config defaults;
    fl_config_defaults(&defaults);
    fl_optimizer_config c = fl_config_optimizer(&defaults);
    c.grad_accum = accum;
    return c;
}

// One micro-batch whose backward pass yields the gradients g (multiplied by
// the loss scale the optimizer asks for, as a real backward would be).
static void fake_micro_batch(fl_optimizer *o, lowp_model *m, const float *g) {
    fl_optimizer_zero_grad(o);
    float scaled[22];
    for (int i = 0; i < 22; i++) scaled[i] = g[i] * fl_optimizer_loss_scale(o);
    fl_accumulate_f32(o->dtype, m->grads, scaled, 22);
    fl_optimizer_micro_done(o);
}

static void test_mixed_precision_step(void) {
    lowp_model m;
    lowp_init(&m, FL_BF16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(2);
    fl_optimizer_init(&o, &cfg, &m.table, FL_BF16, m.params, m.grads);
    t_check(o.master && o.grad_accum, "bf16 with accumulation keeps fp32 master and grad sum");
    float master0[22], g1[22], g2[22];
    memcpy(master0, o.master, sizeof master0);
    t_fill(g1, 22, 11, 0.1f);
    t_fill(g2, 22, 12, 0.1f);
    for (int micro = 0; micro < 2; micro++) {
        fake_micro_batch(&o, &m, micro ? g2 : g1);
    }
    fl_step_result r = fl_optimizer_step(&o, 1e-2f);
    // reference: fp32 AdamW on the fp32 sum of the two bf16-rounded half gradients
    float sum[22], p[22];
    for (int i = 0; i < 22; i++) {
        float a = fl_bf16_to_f32(fl_f32_to_bf16(g1[i] * 0.5f));
        float b = fl_bf16_to_f32(fl_f32_to_bf16(g2[i] * 0.5f));
        sum[i] = a + b;
    }
    memcpy(p, master0, sizeof p);
    fl_adamw ref;
    fl_adamw_init(&ref, 22, 0.9f, 0.95f, 1e-8f, 0.1f);
    float norm = t_adamw_step_fp32(&ref, &m.table, p, sum, 1e-2f, 1.0f);
    t_check(r.grad_norm == norm && !r.skipped, "norm of the fp32 sum (%g vs %g)", r.grad_norm,
            norm);
    t_close("bf16 master after one step", o.master, p, 22, 0, 0);
    int rounded = 1;
    for (int i = 0; i < 22; i++) rounded &= m.params[i] == fl_f32_to_bf16(o.master[i]);
    t_check(rounded, "bf16 weights are the master rounded to nearest even");
    fl_adamw_free(&ref);
    fl_optimizer_free(&o);
    fl_params_free(&m.table);
}

static void test_fp16_overflow_skips_the_step(void) {
    lowp_model m;
    lowp_init(&m, FL_F16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(1);
    fl_optimizer_init(&o, &cfg, &m.table, FL_F16, m.params, m.grads);
    t_check(fl_optimizer_loss_scale(&o) == 65536.0f, "fp16 scales the loss by 2^16");
    float g[22];
    t_fill(g, 22, 13, 0.01f);
    fake_micro_batch(&o, &m, g);
    fl_step_result r = fl_optimizer_step(&o, 1e-3f);
    t_check(!r.skipped && o.adamw.t == 1, "a clean step updates");
    t_check(fabsf(r.grad_norm - fl_grad_norm(FL_F32, g, 22)) < 2e-3f * r.grad_norm,
            "the reported norm is unscaled (%g)", r.grad_norm);

    uint16_t params0[22];
    float master0[22], m0[22], v0[22];
    memcpy(params0, m.params, sizeof params0);
    memcpy(master0, o.master, sizeof master0);
    memcpy(m0, o.adamw.m, sizeof m0);
    memcpy(v0, o.adamw.v, sizeof v0);
    g[3] = 1e4f; // times 2^16 overflows fp16
    fake_micro_batch(&o, &m, g);
    r = fl_optimizer_step(&o, 1e-3f);
    t_check(r.skipped, "an inf gradient skips the step");
    t_check(!memcmp(params0, m.params, sizeof params0) && !memcmp(master0, o.master, sizeof m0) &&
                !memcmp(m0, o.adamw.m, sizeof m0) && !memcmp(v0, o.adamw.v, sizeof v0) &&
                o.adamw.t == 1,
            "a skipped step leaves weights, master and optimizer state bitwise unchanged");
    t_check(o.scaler.scale == 65536.0f && o.scaler.cur_hysteresis == 1,
            "the first overflow uses up hysteresis");
    fl_optimizer_free(&o);
    fl_params_free(&m.table);
}

static void stuck_scaler(void *arg) {
    (void)arg;
    lowp_model m;
    lowp_init(&m, FL_F16);
    fl_optimizer o;
    fl_optimizer_config cfg = adamw_config(1);
    cfg.initial_scale_power = 1;
    cfg.hysteresis = 1;
    fl_optimizer_init(&o, &cfg, &m.table, FL_F16, m.params, m.grads);
    float g[22] = {0};
    g[0] = INFINITY;
    for (int i = 0; i < 10; i++) {
        fake_micro_batch(&o, &m, g);
        fl_optimizer_step(&o, 1e-3f);
    }
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
    // first: a forked child cannot use OpenMP once the parent has (libgomp)
    t_dies("fp16 scale stuck at the minimum", stuck_scaler, NULL,
           "loss scale already at its minimum");
    test_adamw_matches_torch_rule();
    test_sgd_momentum_matches_torch_rule();
    test_norm_and_clipping();
    test_loss_scaler();
    test_mixed_precision_step();
    test_fp16_overflow_skips_the_step();

    test_schedules();
    return t_report();
}
