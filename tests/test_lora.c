// test_lora.c: LoRA, QLoRA and LoRA + LOMO as strategies, tested by
// equivalence (the PyTorch reference is test_lora_ref's): adapters that
// start as the base, gradients against finite differences, accumulation,
// recomputation and dropout, a frozen base that never moves and holds no
// gradient, QLoRA = LoRA on the dequantised base, LoRA + LOMO = LoRA when
// the base's learning rate is 0 and = LOMO when the adapters' is, and the
// memory the planner predicts.
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/kernels.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "testlib.h"

static const fl_model_config tiny_gpt2 = {
    .max_seq_len = 16, .vocab_size = 50, .n_layer = 2, .n_head = 4, .n_embd = 32};
static const fl_model_config tiny_llama = {.arch = FL_ARCH_LLAMA,
                                           .max_seq_len = 16,
                                           .vocab_size = 50,
                                           .n_layer = 2,
                                           .n_head = 4,
                                           .n_kv_head = 2,
                                           .n_embd = 64,
                                           .intermediate_size = 96};
enum { B = 4, T = 16, BT = B * T };

// A model drawn from seed, its linear layers stored in NF4 (qc enabled).
static void init_quant(fl_model *m, const fl_model_config *c, fl_dtype dt, uint64_t seed,
                       const fl_quant_config *qc) {
    fl_weight_source s;
    fl_weight_source_random(&s, c, seed);
    fl_model_init_from(m, &s, dt, qc, 0, SIZE_MAX);
}

static void random_batch(int *tokens, int *targets, unsigned seed) {
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (int i = 0; i < BT; i++) {
        tokens[i] = (int)fl_rng_below(&rng, 50);
        targets[i] = (int)fl_rng_below(&rng, 50);
    }
}

static fl_lora_config lora_config(int r, const char *targets, float dropout) {
    fl_lora_config c;
    fl_lora_config_defaults(&c);
    c.r = r;
    c.alpha = 2.0f * r;
    c.dropout = dropout;
    snprintf(c.target_modules, sizeof c.target_modules, "%s", targets);
    return c;
}

// B drawn too (PEFT's B = 0 would make A's gradient zero and hide bugs)
static void randomize_adapters(fl_model *m, unsigned seed) {
    size_t n = m->lora.table.numel;
    float *v = malloc(n * sizeof(float));
    t_fill(v, n, seed, 0.1f);
    fl_store_f32(m->dtype, m->lora.params, v, n);
    free(v);
}

static float *copy_f32(fl_dtype dt, const void *src, size_t n) {
    float *out = malloc(n * sizeof(float));
    fl_convert(FL_F32, out, dt, src, n);
    return out;
}

static float *logits_of(const fl_model *m) {
    size_t n = (size_t)BT * m->config.padded_vocab_size;
    return copy_f32(m->dtype, m->logits, n);
}

// ----------------------------------------------------------------------------

// With B = 0 the adapted model is the base, bitwise; the base is frozen:
// no gradient buffer, and the gradient tag holds the adapters' alone.
static void starts_as_base(const char *name, const fl_model_config *c, const char *targets) {
    int tokens[BT], targets_[BT];
    random_batch(tokens, targets_, 1);
    fl_model base, ad;
    fl_model_init(&base, c, FL_F32, 3);
    fl_model_init(&ad, c, FL_F32, 3);
    fl_lora_config lc = lora_config(4, targets, 0.0f);
    fl_model_add_lora(&ad, &lc, 9);
    size_t g0 = fl_mem_current(FL_MEM_GRADS);
    fl_model_alloc_acts(&ad, B, T, FL_RECOMPUTE_NONE, 0);
    size_t grads = fl_mem_current(FL_MEM_GRADS) - g0;
    fl_model_alloc_acts(&base, B, T, FL_RECOMPUTE_NONE, 0);
    float la = fl_model_forward(&base, tokens, targets_, B, T);
    float lb = fl_model_forward(&ad, tokens, targets_, B, T);
    size_t n = (size_t)BT * ad.config.padded_vocab_size;
    t_check(la == lb && !memcmp(base.logits, ad.logits, n * sizeof(float)),
            "%s: adapters with B = 0 leave the logits bitwise the base's", name);
    int frozen = 1;
    for (int r = 0; r < ad.table.count; r++)
        frozen &= (ad.table.views[r].flags & FL_PARAM_FROZEN) != 0 && ad.gp[r] == NULL;
    t_check(frozen && ad.grads == NULL && grads == ad.lora.table.numel * sizeof(float),
            "%s: a frozen base holds no gradient (%zu gradient bytes for %zu adapter values)", name,
            grads, ad.lora.table.numel);
    // PEFT's initialisation: A Kaiming-uniform within 1/sqrt(in), B zero
    int in_bound = 1, b_zero = 1;
    for (int a = 0; a < ad.lora.table.count; a += 2) {
        const fl_param_view *va = &ad.lora.table.views[a], *vb = &ad.lora.table.views[a + 1];
        float bound = 1.0f / sqrtf((float)va->shape[1]);
        const float *A = (const float *)ad.lora.params + va->offset;
        const float *Bm = (const float *)ad.lora.params + vb->offset;
        for (size_t i = 0; i < va->numel; i++) in_bound &= fabsf(A[i]) <= bound && A[i] != 0.0f;
        for (size_t i = 0; i < vb->numel; i++) b_zero &= Bm[i] == 0.0f;
    }
    t_check(in_bound && b_zero, "%s: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0", name);
    fl_model_free(&base);
    fl_model_free(&ad);
}

// d loss / d adapters against central differences of the loss (fp32, so
// the step and tolerance are fp32's), with dropout on: the masks are keyed
// by the step, the same in every forward and in the backward.
static void finite_differences(const char *name, const fl_model_config *c, const char *targets,
                               float dropout) {
    int tokens[BT], targets_[BT];
    random_batch(tokens, targets_, 2);
    fl_model m;
    fl_model_init(&m, c, FL_F32, 4);
    fl_lora_config lc = lora_config(3, targets, dropout);
    fl_model_add_lora(&m, &lc, 5);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_SELECTIVE, 0);
    randomize_adapters(&m, 6);
    m.lora.dropout_step = 7;
    fl_model_zero_grad(&m);
    fl_model_forward(&m, tokens, targets_, B, T);
    fl_model_backward(&m, 1.0f / m.n_targets);
    float *p = m.lora.params, *g = m.lora.grads;
    size_t n = m.lora.table.numel, checked = 0, bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i += n / 40 + 1) { // a spread of A and B entries
        float keep = p[i], h = 1e-2f;
        p[i] = keep + h;
        double up = fl_model_forward(&m, tokens, targets_, B, T);
        p[i] = keep - h;
        double down = fl_model_forward(&m, tokens, targets_, B, T);
        p[i] = keep;
        double fd = (up - down) / (2.0 * h), err = fabs(fd - g[i]);
        if (err > worst) worst = err;
        bad += err > 2e-4 + 2e-2 * fabs(fd);
        checked++;
    }
    t_check(bad == 0, "%s: %zu adapter gradients match central differences (worst %.2g)", name,
            checked, worst);
    fl_model_free(&m);
}

// The adapters' gradients and the input gradient they add are the same
// under every recomputation policy, dropout included (bitwise).
static void recompute_bitwise(const char *name, const fl_model_config *c, fl_dtype dt) {
    int tokens[BT], targets_[BT];
    random_batch(tokens, targets_, 3);
    float *g[3];
    const fl_recompute policies[3] = {FL_RECOMPUTE_NONE, FL_RECOMPUTE_SELECTIVE,
                                      FL_RECOMPUTE_BLOCK};
    size_t n = 0;
    for (int k = 0; k < 3; k++) {
        fl_model m;
        fl_model_init(&m, c, dt, 4);
        fl_lora_config lc = lora_config(4, "all-linear", 0.2f);
        fl_model_add_lora(&m, &lc, 5);
        fl_model_alloc_acts(&m, B, T, policies[k], 0);
        randomize_adapters(&m, 6);
        m.lora.dropout_step = 3;
        fl_model_zero_grad(&m);
        fl_model_forward(&m, tokens, targets_, B, T);
        fl_model_backward(&m, 1.0f / m.n_targets);
        n = m.lora.table.numel;
        g[k] = copy_f32(dt, m.lora.grads, n);
        fl_model_free(&m);
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += fabs(g[0][i]);
    t_check(sum > 0 && !memcmp(g[0], g[1], n * 4) && !memcmp(g[0], g[2], n * 4),
            "%s: adapter gradients (dropout 0.2) identical under none, selective and block "
            "recomputation",
            name);
    for (int k = 0; k < 3; k++) free(g[k]);
}

// Trains `steps` AdamW steps of LoRA; returns the adapters (fp32) and checks
// the base never moved.
static float *train_lora(const fl_model_config *c, fl_dtype dt, int micro, int steps, float dropout,
                         size_t *n) {
    fl_model m;
    fl_model_init(&m, c, dt, 8);
    fl_lora_config lc = lora_config(4, "", dropout);
    fl_model_add_lora(&m, &lc, 2);
    fl_model_alloc_acts(&m, B / micro, T, FL_RECOMPUTE_NONE, 0);
    fl_optimizer_config oc = {.kind = FL_OPT_ADAMW,
                              .beta1 = 0.9f,
                              .beta2 = 0.95f,
                              .eps = 1e-8f,
                              .weight_decay = 0.1f,
                              .max_grad_norm = 1.0f,
                              .grad_accum = micro,
                              .initial_scale_power = 12, // fp16's dynamic loss scale
                              .loss_scale_window = 1000,
                              .hysteresis = 2,
                              .min_loss_scale = 1.0f};
    fl_optimizer o;
    fl_optimizer_init(&o, &oc, &m.lora.table, dt, m.lora.params, m.lora.grads);
    size_t nb = m.table.numel * fl_dtype_size(dt);
    void *base0 = malloc(nb);
    memcpy(base0, m.params, nb);
    int tokens[BT], targets_[BT];
    for (int s = 0; s < steps; s++) {
        random_batch(tokens, targets_, 40 + s);
        fl_train_step(&m, &o, tokens, targets_, micro, B / micro, T, 1e-2f);
    }
    t_check(!memcmp(base0, m.params, nb), "LoRA: %d steps leave the frozen base bitwise", steps);
    free(base0);
    *n = m.lora.table.numel;
    float *w = o.master ? copy_f32(FL_F32, o.master, *n) : copy_f32(dt, m.lora.params, *n);
    fl_optimizer_free(&o);
    fl_model_free(&m);
    return w;
}

static void accumulation(void) {
    size_t n;
    float *one = train_lora(&tiny_llama, FL_F32, 1, 3, 0.0f, &n);
    float *two = train_lora(&tiny_llama, FL_F32, 2, 3, 0.0f, &n);
    t_close("LoRA: 2 accumulated micro-batches = 1 batch (adapters after 3 AdamW steps)", two, one,
            n, 1e-6, 1e-4);
    free(one);
    free(two);
    // fp16 with loss scaling: the adapters' fp32 master weights follow fp32
    // training (bf16 against the PyTorch reference: test_lora_ref)
    float *ref = train_lora(&tiny_llama, FL_F32, 2, 3, 0.0f, &n);
    float *half = train_lora(&tiny_llama, FL_F16, 2, 3, 0.0f, &n);
    t_close("LoRA fp16 (loss scale 2^12) vs fp32: adapters after 3 steps", half, ref, n, 2e-3,
            2e-2);
    free(ref), free(half);
    float *a = train_lora(&tiny_gpt2, FL_BF16, 2, 2, 0.1f, &n);
    float *b = train_lora(&tiny_gpt2, FL_BF16, 2, 2, 0.1f, &n);
    t_check(!memcmp(a, b, n * 4), "LoRA bf16 with dropout and accumulation: deterministic");
    free(a);
    free(b);
}

// ----------------------------------------------------------------------------
// QLoRA

// A dense model holding the NF4 model's dequantised base weights.
static void dense_copy(fl_model *dense, const fl_model *q) {
    fl_model_init(dense, &q->config, q->dtype, 0);
    for (int r = 0; r < q->table.count; r++) {
        const fl_param_view *v = &q->table.views[r];
        float *w = malloc(v->numel * sizeof(float));
        fl_model_row_f32(q, r, w);
        fl_model_store_row(dense, r, 0, w, v->numel);
        free(w);
    }
}

static void qlora_is_lora_on_dequantised(const char *name, const fl_model_config *c, fl_dtype dt,
                                         int double_quant) {
    int tokens[BT], targets_[BT];
    random_batch(tokens, targets_, 5);
    fl_quant_config qc = {1, 64, double_quant};
    fl_model q, d;
    init_quant(&q, c, dt, 12, &qc);
    dense_copy(&d, &q);
    fl_lora_config lc = lora_config(4, "all-linear", 0.0f);
    fl_model *ms[2] = {&q, &d};
    float *logits[2], *grads[2];
    for (int k = 0; k < 2; k++) {
        fl_model_add_lora(ms[k], &lc, 13);
        fl_model_alloc_acts(ms[k], B, T, FL_RECOMPUTE_BLOCK, 0);
        randomize_adapters(ms[k], 14);
        fl_model_zero_grad(ms[k]);
        fl_model_forward(ms[k], tokens, targets_, B, T);
        logits[k] = logits_of(ms[k]);
        fl_model_backward(ms[k], 1.0f / ms[k]->n_targets);
        grads[k] = copy_f32(dt, ms[k]->lora.grads, ms[k]->lora.table.numel);
    }
    size_t nl = (size_t)BT * q.config.padded_vocab_size, ng = q.lora.table.numel;
    t_check(!memcmp(logits[0], logits[1], nl * 4) && !memcmp(grads[0], grads[1], ng * 4),
            "%s: QLoRA logits and adapter gradients = LoRA on the dequantised base, bitwise", name);
    // storage: the linear rows in NF4, the rest dense
    size_t bytes[FL_MEM_NTAGS], quantised = 0, dense = 0, rows = 0;
    for (int r = 0; r < q.table.count; r++) {
        const fl_param_view *v = &q.table.views[r];
        if (fl_quant_row(v))
            quantised += v->numel, rows++;
        else
            dense += v->numel;
    }
    fl_model_memory(NULL, c, dt, 0, 0, 1, FL_RECOMPUTE_NONE, 0, NULL, &qc, NULL, bytes);
    double per = (double)(bytes[FL_MEM_PARAMS] - dense * fl_dtype_size(dt)) / quantised;
    // the format's bytes (a nested block's fp32 absmax per 256 blocks and the
    // offset rounded up per row), and at most 64 bytes of row alignment
    double want = double_quant ? 0.5 + (1.0 + 4.0 / 256) / 64 : 0.5 + 4.0 / 64;
    double slack = (64.0 + 8.0) * rows / quantised;
    t_check(per >= want && per <= want + slack,
            "%s: %.4f bytes per NF4 parameter (%.4f by the format, plus at most %.4f of row "
            "alignment on these tiny rows)",
            name, per, want, slack);
    for (int k = 0; k < 2; k++) {
        free(logits[k]);
        free(grads[k]);
        fl_model_free(ms[k]);
    }
}

// ----------------------------------------------------------------------------
// LoRA + LOMO

// Steps of LoRA + LOMO (bf16, stochastic rounding, clipping: two passes);
// returns the adapters' and the base's weights.
static void train_lora_lomo(float lr, float base_lr, float **adapters, float **base,
                            float **plain_adapters, float **plain_base) {
    int tokens[BT], targets_[BT];
    fl_optimizer_config ac = {.kind = FL_OPT_ADAMW,
                              .beta1 = 0.9f,
                              .beta2 = 0.95f,
                              .eps = 1e-8f,
                              .weight_decay = 0.0f,
                              .max_grad_norm = 1.0f,
                              .grad_accum = 1};
    fl_optimizer_config bc = {.kind = FL_OPT_LOMO,
                              .max_grad_norm = 1.0f,
                              .grad_accum = 1,
                              .stochastic_rounding = 1,
                              .seed = 77};
    // the run, and what it must equal: LoRA alone or LOMO alone
    fl_model m, p;
    fl_lora_config lc = lora_config(4, "q_proj,v_proj", 0.0f);
    lc.train_base = 1;
    fl_model_init(&m, &tiny_llama, FL_BF16, 21);
    fl_model_add_lora(&m, &lc, 22);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 1);
    fl_optimizer oa, ob, op;
    fl_optimizer_init(&oa, &ac, &m.lora.table, FL_BF16, m.lora.params, m.lora.grads);
    fl_optimizer_init(&ob, &bc, &m.table, FL_BF16, m.params, NULL);
    int lora_only = base_lr == 0.0f;
    fl_model_init(&p, &tiny_llama, FL_BF16, 21);
    if (lora_only) {
        lc.train_base = 0;
        fl_model_add_lora(&p, &lc, 22);
    }
    fl_model_alloc_acts(&p, B, T, FL_RECOMPUTE_NONE, !lora_only);
    if (lora_only)
        fl_optimizer_init(&op, &ac, &p.lora.table, FL_BF16, p.lora.params, p.lora.grads);
    else
        fl_optimizer_init(&op, &bc, &p.table, FL_BF16, p.params, NULL);
    for (int s = 0; s < 3; s++) {
        random_batch(tokens, targets_, 60 + s);
        fl_lora_lomo_step(&m, &oa, &ob, tokens, targets_, B, T, lr, base_lr);
        fl_train_step(&p, &op, tokens, targets_, 1, B, T, lora_only ? lr : base_lr);
    }
    *adapters = copy_f32(FL_F32, oa.master, m.lora.table.numel);
    *base = copy_f32(FL_BF16, m.params, m.table.numel);
    *plain_adapters = lora_only ? copy_f32(FL_F32, op.master, p.lora.table.numel) : NULL;
    *plain_base = copy_f32(FL_BF16, p.params, p.table.numel);
    fl_optimizer_free(&oa);
    fl_optimizer_free(&ob);
    fl_optimizer_free(&op);
    fl_model_free(&m);
    fl_model_free(&p);
}

static void lora_lomo(void) {
    float *a, *b, *pa, *pb;
    size_t na = 0, nb = fl_model_num_params(&tiny_llama);
    {
        fl_param_table t, lt;
        fl_model_table(&t, &tiny_llama);
        fl_lora_config lc = lora_config(4, "q_proj,v_proj", 0.0f);
        fl_lora_table(&lt, &t, &tiny_llama, &lc, NULL);
        na = lt.numel;
        fl_params_free(&lt);
        fl_params_free(&t);
    }
    train_lora_lomo(1e-2f, 0.0f, &a, &b, &pa, &pb);
    t_check(!memcmp(a, pa, na * 4) && !memcmp(b, pb, nb * 4),
            "LoRA + LOMO with the base's lr 0 = LoRA alone (adapters and base, bitwise)");
    free(a), free(b), free(pa), free(pb);
    train_lora_lomo(0.0f, 5e-2f, &a, &b, &pa, &pb);
    t_check(!memcmp(b, pb, nb * 4),
            "LoRA + LOMO with the adapters' lr 0 = LOMO alone (base after 3 steps, bitwise)");
    free(a), free(b), free(pb);
}

// ----------------------------------------------------------------------------
// dropout and the plan

static void dropout(void) {
    enum { N = 1 << 16 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    float *r = malloc(N * sizeof(float));
    t_fill(x, N, 1, 1.0f);
    dropout_apply(FL_F32, y, x, N, 0.25f, 99);
    dropout_apply_ref(r, x, N, 0.25f, 99);
    size_t zeros = 0;
    for (int i = 0; i < N; i++) zeros += y[i] == 0.0f;
    t_check(!memcmp(y, r, N * 4), "dropout_apply = its reference, bitwise");
    t_check(fabs((double)zeros / N - 0.25) < 0.01, "dropout drops %.4f of the values (p 0.25)",
            (double)zeros / N);
    // bf16 in place: the same mask
    uint16_t *h = malloc(N * 2);
    fl_store_f32(FL_BF16, h, x, N);
    dropout_apply(FL_BF16, h, h, N, 0.25f, 99);
    int same = 1;
    for (int i = 0; i < N; i++) same &= (h[i] == 0) == (y[i] == 0.0f);
    t_check(same, "dropout: the same key drops the same elements in bf16, in place");
    // lora_add_columns against its reference
    float out[3 * 7], want[3 * 7], d[3 * 4];
    t_fill(out, 21, 2, 1.0f);
    memcpy(want, out, sizeof out);
    t_fill(d, 12, 3, 1.0f);
    lora_add_columns(FL_F32, out + 2, 7, d, 0.5f, 3, 4);
    lora_add_columns_ref(want + 2, 7, d, 0.5f, 3, 4);
    t_check(!memcmp(out, want, sizeof out), "lora_add_columns = its reference");
    free(x), free(y), free(r), free(h);
}

// The planner's figures for LoRA and QLoRA models are what they allocate.
static void memory_is_planned(const char *name, const fl_model_config *c, fl_dtype dt,
                              const char *targets, float dropout_p, const fl_quant_config *qc) {
    size_t want[FL_MEM_NTAGS], before[FL_MEM_NTAGS], got[FL_MEM_NTAGS];
    fl_lora_config lc = lora_config(8, targets, dropout_p);
    fl_model_memory(NULL, c, dt, B, T, 2, FL_RECOMPUTE_SELECTIVE, 0, &lc, qc, NULL, want);
    for (int t = 0; t < FL_MEM_NTAGS; t++) before[t] = fl_mem_current(t);
    fl_model m;
    init_quant(&m, c, dt, 1, qc);
    fl_model_add_lora(&m, &lc, 1);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_SELECTIVE, 0);
    int same = 1;
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        got[t] = fl_mem_current(t) - before[t];
        same &= got[t] == want[t];
        if (got[t] != want[t])
            printf("  %s: tag %s allocated %zu, planned %zu\n", name, fl_mem_tag_name(t), got[t],
                   want[t]);
    }
    t_check(same, "%s: fl_model_memory = what the model allocates, every tag", name);
    fl_model_free(&m);
}

int main(void) {
    omp_set_num_threads(2);
    starts_as_base("GPT-2 c_attn", &tiny_gpt2, "c_attn");
    starts_as_base("LLaMA all-linear", &tiny_llama, "all-linear");
    finite_differences("LLaMA q,v", &tiny_llama, "q_proj,v_proj", 0.0f);
    finite_differences("GPT-2 all-linear, dropout 0.3", &tiny_gpt2, "all-linear", 0.3f);
    finite_differences("LLaMA down_proj, dropout 0.5", &tiny_llama, "down_proj", 0.5f);
    recompute_bitwise("GPT-2 fp32", &tiny_gpt2, FL_F32);
    recompute_bitwise("LLaMA bf16", &tiny_llama, FL_BF16);
    accumulation();
    qlora_is_lora_on_dequantised("LLaMA fp32", &tiny_llama, FL_F32, 0);
    qlora_is_lora_on_dequantised("LLaMA bf16, double quantisation", &tiny_llama, FL_BF16, 1);
    qlora_is_lora_on_dequantised("GPT-2 fp32", &tiny_gpt2, FL_F32, 1);
    lora_lomo();
    dropout();
    fl_quant_config nf4 = {1, 64, 1};
    memory_is_planned("LLaMA bf16 LoRA q,v", &tiny_llama, FL_BF16, "", 0.0f, NULL);
    memory_is_planned("GPT-2 fp32 LoRA all-linear, dropout", &tiny_gpt2, FL_F32, "all-linear", 0.1f,
                      NULL);
    memory_is_planned("LLaMA bf16 QLoRA all-linear", &tiny_llama, FL_BF16, "all-linear", 0.0f,
                      &nf4);
    return t_report();
}
