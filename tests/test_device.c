// test_device.c: the device seam on the test device (device.h), which
// runs the cpu's kernels on memory the host cannot touch outside the
// table. First the device itself: its memory is zeroed and counted, a host
// read of it faults, its copies round-trip. Then models on it against the
// same models on the cpu, bitwise: GPT-2 and LLaMA in fp32, bf16 and fp16
// under each recomputation policy (the loss, the gradients, the fused
// training forward, the last logits, generation), the planner's figures
// against what the model allocates on the device, and LoRA over NF4 base
// rows. Any model code that reads a device buffer without the table dies
// with SIGSEGV here.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitlm/device.h"
#include "fitlm/model.h"
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
                                           .n_embd = 32,
                                           .intermediate_size = 48};
enum { B = 2, T = 16, BT = B * T, NEW = 4, PROMPT = 3 };

// ----------------------------------------------------------------------------
// the test device itself

// Whether reading p from the host kills a child with SIGSEGV.
static int host_read_faults(const void *p) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); // the kernel's verdict, not a sanitizer's handler
        volatile const char *c = p;
        _exit(*c == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

static void test_device_memory(void) {
    const fl_device *d = fl_device_get("test");
    t_check(!d->host && !strcmp(d->name, "test"), "the test device is not the host's");
    size_t acts = fl_mem_device_current(FL_MEM_ACTS), host = fl_mem_current(FL_MEM_ACTS);
    enum { N = 1000 };
    unsigned char *a = d->alloc(d, FL_MEM_ACTS, N), *b = d->alloc(d, FL_MEM_ACTS, N);
    t_check(fl_mem_device_current(FL_MEM_ACTS) == acts + 2 * N &&
                fl_mem_current(FL_MEM_ACTS) == host,
            "device allocations are counted on the device under their tag (%zu -> %zu)", acts,
            fl_mem_device_current(FL_MEM_ACTS));
    unsigned char in[N], out[N], zero[N] = {0};
    fl_dev_download(d, out, a, N);
    t_check(!memcmp(out, zero, N), "device memory comes zeroed");
    for (int i = 0; i < N; i++) in[i] = (unsigned char)(i * 7 + 1);
    fl_dev_upload(d, a, in, N);
    d->copy_d2d(d, b, a, N);
    memset(out, 0, N);
    fl_dev_download(d, out, b, N);
    t_check(!memcmp(out, in, N), "host -> device -> device -> host round-trips");
    t_check(host_read_faults(a), "a host read of a device buffer outside the table faults");
    d->zero(d, b + 10, 20);
    fl_dev_download(d, out, b, N);
    int zeroed = 1;
    for (int i = 0; i < N; i++) zeroed &= out[i] == (i >= 10 && i < 30 ? 0 : in[i]);
    t_check(zeroed, "zero clears exactly its range");
    t_check(d->sum != NULL && d->sumsq != NULL, "the step's reductions are in the table");
    d->free(d, a);
    d->free(d, b);
    t_check(fl_mem_device_current(FL_MEM_ACTS) == acts, "free returns the device's count");
}

// Several ranks are the cpu's alone in this issue: a tensor-parallel or
// pipeline model on the test device is refused by name.
static void init_split(void *arg) {
    fl_device_use(fl_device_get("test"));
    fl_weight_source s;
    fl_weight_source_random(&s, &tiny_gpt2, 1);
    fl_tp tp = {2, 0, 0, NULL};
    fl_pp_stage pp;
    fl_pp_stage_whole(&pp, tiny_gpt2.n_layer);
    pp.size = 2;
    fl_model m;
    fl_model_init_tp(&m, &s, FL_F32, NULL, 0, SIZE_MAX, arg ? &tp : NULL, arg ? NULL : &pp);
}

static void test_split_refused(void) {
    int tp = 1;
    t_dies("tensor parallelism on the test device", init_split, &tp,
           "run on the cpu device only (not on 'test')");
    t_dies("pipeline parallelism on the test device", init_split, NULL,
           "run on the cpu device only (not on 'test')");
}

// ----------------------------------------------------------------------------
// a model on a device against the cpu

typedef struct {
    float loss, train_loss;
    void *weights, *grads, *train_grads; // downloaded (host)
    size_t weight_bytes, grad_bytes;
    float logits[64], row[64]; // the last logits; the first row as fp32
    int tokens[PROMPT + NEW];
} outcome;

static void outcome_free(outcome *o) {
    free(o->weights), free(o->grads), free(o->train_grads);
}

static void *download(const fl_model *m, const void *p, size_t bytes) {
    void *h = malloc(bytes);
    fl_dev_download(m->dev, h, p, bytes);
    return h;
}

// The planner's bytes per tag are what the model allocates, on the
// device for the placed tags and on the host for the rest.
static void check_planned(const char *name, const fl_device *d, const fl_model_config *c,
                          fl_dtype dt, fl_recompute r, const fl_lora_config *lc,
                          const fl_quant_config *qc, const size_t dev0[], const size_t host0[]) {
    size_t want[FL_MEM_NTAGS];
    fl_model_memory(d, c, dt, B, T, fl_threads(), r, 0, lc, qc, NULL, want);
    int same = 1;
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        size_t dv = fl_mem_device_current(t) - dev0[t], hv = fl_mem_current(t) - host0[t];
        int placed = t != FL_MEM_OTHER && t != FL_MEM_COMM && t != FL_MEM_OFFLOAD;
        size_t got = placed ? dv : hv, stray = placed ? hv : dv;
        if (got != want[t] || stray)
            printf("  %s: tag %s: %zu planned, %zu allocated where it belongs, %zu elsewhere\n",
                   name, fl_mem_tag_name(t), want[t], got, stray);
        same &= got == want[t] && !stray;
    }
    t_check(same, "%s: fl_model_memory = what the model allocates on the test device", name);
}

static void run_model(const char *name, const fl_device *d, const fl_model_config *c, fl_dtype dt,
                      fl_recompute r, outcome *o) {
    size_t dev0[FL_MEM_NTAGS], host0[FL_MEM_NTAGS];
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        dev0[t] = fl_mem_device_current(t), host0[t] = fl_mem_current(t);
    fl_device_use(d);
    fl_model m;
    fl_model_init(&m, c, dt, 7);
    fl_model_alloc_acts(&m, B, T, r, 0);
    fl_device_use(fl_device_cpu());
    if (!d->host) check_planned(name, d, c, dt, r, NULL, NULL, dev0, host0);
    int in[BT], tg[BT];
    t_rule_batch(3, BT, c->vocab_size, in, tg);
    const void *span[3];
    size_t bytes[3];
    fl_model_weight_spans(&m, span, bytes);
    o->weights = download(&m, span[0], bytes[0]);
    o->weight_bytes = bytes[0];
    fl_model_row_f32(&m, m.unit_row[1], o->row); // block 0's first norm: a small row
    size_t gb = m.table.numel * fl_dtype_size(dt);
    o->grad_bytes = gb;
    // the forward and backward apart, then fused (the loss's gradient written
    // by the loss pass)
    fl_model_zero_grad(&m);
    o->loss = fl_model_forward(&m, in, tg, B, T);
    float dloss = 1.0f / (float)m.n_targets;
    fl_model_backward(&m, dloss);
    o->grads = download(&m, m.grads, gb);
    fl_model_zero_grad(&m);
    o->train_loss = fl_model_forward_train(&m, in, tg, B, T, dloss);
    fl_model_backward(&m, dloss);
    o->train_grads = download(&m, m.grads, gb);
    // inference: the last logits, then a few sampled tokens
    fl_model_forward(&m, in, NULL, 1, T);
    const float *l = fl_model_last_logits(&m, T, o->logits, NULL);
    if (l != o->logits) memcpy(o->logits, l, (size_t)c->vocab_size * sizeof(float));
    fl_rng rng;
    fl_rng_seed(&rng, 11);
    memcpy(o->tokens, in, PROMPT * sizeof(int));
    fl_model_generate(&m, o->tokens, PROMPT, NEW, 0.8f, 5, &rng, NULL, NULL);
    fl_model_free(&m);
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        if (t != FL_MEM_OTHER && fl_mem_device_current(t) != dev0[t])
            t_check(0, "%s: the model frees its device memory (tag %s)", name, fl_mem_tag_name(t));
}

static void compare(const char *name, const outcome *cpu, const outcome *dev, int V) {
    t_check(!memcmp(&cpu->loss, &dev->loss, sizeof(float)) &&
                !memcmp(&cpu->train_loss, &dev->train_loss, sizeof(float)),
            "%s: the losses equal the cpu's bitwise (%.7f, %.7f)", name, dev->loss,
            dev->train_loss);
    t_check(!memcmp(cpu->weights, dev->weights, cpu->weight_bytes) &&
                !memcmp(cpu->row, dev->row, sizeof cpu->row),
            "%s: the weights (uploaded as they were drawn) equal the cpu's", name);
    t_check(!memcmp(cpu->grads, dev->grads, cpu->grad_bytes),
            "%s: the gradients equal the cpu's bitwise", name);
    t_check(!memcmp(cpu->train_grads, dev->train_grads, cpu->grad_bytes) &&
                !memcmp(cpu->grads, dev->train_grads, cpu->grad_bytes),
            "%s: the fused training forward's gradients equal the cpu's and the unfused", name);
    t_check(!memcmp(cpu->logits, dev->logits, (size_t)V * sizeof(float)),
            "%s: the last logits equal the cpu's", name);
    t_check(!memcmp(cpu->tokens, dev->tokens, sizeof cpu->tokens),
            "%s: generation draws the cpu's tokens", name);
}

static void test_models(void) {
    const fl_device *test = fl_device_get("test");
    const struct {
        const char *name;
        const fl_model_config *c;
    } shapes[] = {{"gpt2", &tiny_gpt2}, {"llama", &tiny_llama}};
    const fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    const char *policies[] = {"none", "selective", "block"};
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 3; k++)
            for (int r = 0; r < 3; r++) {
                // the sanitizer build's quick list: each dtype once, each policy once
                if (t_quick() && r != k) continue;
                // under block recomputation the LM head and loss 7 positions at a time
                fl_model_config c = *shapes[s].c;
                c.logits_chunk = r == FL_RECOMPUTE_BLOCK ? 7 : 0;
                char name[128];
                snprintf(name, sizeof name, "%s %s recompute %s%s", shapes[s].name,
                         fl_dtype_name(dts[k]), policies[r],
                         c.logits_chunk ? ", logits in chunks of 7" : "");
                outcome cpu, dev;
                run_model(name, fl_device_cpu(), &c, dts[k], (fl_recompute)r, &cpu);
                run_model(name, test, &c, dts[k], (fl_recompute)r, &dev);
                compare(name, &cpu, &dev, c.vocab_size);
                outcome_free(&cpu);
                outcome_free(&dev);
            }
}

// ----------------------------------------------------------------------------
// LoRA over NF4 base rows (QLoRA) at model level

typedef struct {
    float loss;
    void *lora_grads, *store;
    size_t lora_bytes, store_bytes;
    float *merged;
} qlora_outcome;

static void run_qlora(const char *name, const fl_device *d, const fl_model_config *c, fl_dtype dt,
                      int double_quant, qlora_outcome *o) {
    size_t dev0[FL_MEM_NTAGS], host0[FL_MEM_NTAGS];
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        dev0[t] = fl_mem_device_current(t), host0[t] = fl_mem_current(t);
    fl_device_use(d);
    fl_quant_config qc = {.enabled = 1, .blocksize = 64, .double_quant = double_quant};
    fl_weight_source s;
    fl_weight_source_random(&s, c, 5);
    fl_model m;
    fl_model_init_whole(&m, &s, dt, &qc);
    fl_lora_config lc;
    fl_lora_config_defaults(&lc);
    lc.r = 4;
    lc.dropout = 0.1f;
    snprintf(lc.target_modules, sizeof lc.target_modules, "all-linear");
    fl_model_add_lora(&m, &lc, 9);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_SELECTIVE, 0);
    fl_device_use(fl_device_cpu());
    if (!d->host) check_planned(name, d, c, dt, FL_RECOMPUTE_SELECTIVE, &lc, &qc, dev0, host0);
    // lora_B starts at 0 (the adapters add nothing): weights of their own
    size_t n = m.lora.table.numel;
    float *w = malloc(n * sizeof(float));
    t_fill(w, n, 3, 0.05f);
    for (int r = 0; r < m.lora.table.count; r++) {
        const fl_param_view *v = &m.lora.table.views[r];
        fl_model_upload_f32(&m, fl_at(dt, m.lora.params, v->offset), w + v->offset, v->numel);
    }
    free(w);
    m.lora.dropout_step = 2; // a training forward's masks
    int in[BT], tg[BT];
    t_rule_batch(4, BT, c->vocab_size, in, tg);
    fl_model_zero_grad(&m);
    o->loss = fl_model_forward(&m, in, tg, B, T);
    fl_model_backward(&m, 1.0f / (float)m.n_targets);
    o->lora_bytes = n * fl_dtype_size(dt);
    o->lora_grads = download(&m, m.lora.grads, o->lora_bytes);
    const void *span[3];
    size_t bytes[3];
    int k = fl_model_weight_spans(&m, span, bytes);
    t_check(k == 3, "qlora: three weight spans (dense, NF4, adapters)");
    o->store_bytes = bytes[1];
    o->store = download(&m, span[1], bytes[1]);
    o->merged = malloc(m.table.numel * sizeof(float));
    fl_model_merged_f32(&m, o->merged);
    fl_model_free(&m);
}

static void test_qlora(void) {
    const fl_device *test = fl_device_get("test");
    for (int s = 0; s < 2; s++)
        for (int dq = 0; dq < 2; dq++) {
            const fl_model_config *c = s ? &tiny_llama : &tiny_gpt2;
            fl_dtype dt = dq ? FL_BF16 : FL_F32;
            char name[64];
            snprintf(name, sizeof name, "qlora %s %s%s", s ? "llama" : "gpt2", fl_dtype_name(dt),
                     dq ? " double-quant" : "");
            qlora_outcome cpu, dev;
            run_qlora(name, fl_device_cpu(), c, dt, dq, &cpu);
            run_qlora(name, test, c, dt, dq, &dev);
            fl_model_config f = *c;
            fl_model_config_finish(&f);
            t_check(!memcmp(&cpu.loss, &dev.loss, sizeof(float)) &&
                        !memcmp(cpu.store, dev.store, cpu.store_bytes),
                    "%s: the NF4 store (quantised on the host, uploaded) and the loss equal the "
                    "cpu's (%.7f)",
                    name, dev.loss);
            t_check(!memcmp(cpu.lora_grads, dev.lora_grads, cpu.lora_bytes),
                    "%s: the adapters' gradients equal the cpu's bitwise", name);
            t_check(!memcmp(cpu.merged, dev.merged, fl_model_num_params(&f) * sizeof(float)),
                    "%s: the merged weights (downloaded, dequantised) equal the cpu's", name);
            free(cpu.lora_grads), free(cpu.store), free(cpu.merged);
            free(dev.lora_grads), free(dev.store), free(dev.merged);
        }
}

// ----------------------------------------------------------------------------
// training steps: the verdict (loss, norm, skips, the spike guard, the
// clip coefficient) formed on the device and read once per step

enum { STEPS = 5 };

typedef struct {
    const char *name;
    const fl_model_config *c;
    fl_dtype dt;
    fl_optimizer_config oc;
    int micro, fused;
} step_case;

typedef struct {
    fl_train_result r[STEPS];
    void *weights;
    size_t bytes;
    long stalls[STEPS]; // the test device's, per step
    long spikes, skips;
} step_outcome;

static void run_steps(const step_case *k, const fl_device *d, step_outcome *o) {
    fl_device_use(d);
    fl_model m;
    fl_model_init(&m, k->c, k->dt, 7);
    fl_model_alloc_acts(&m, B / k->micro, T, FL_RECOMPUTE_NONE, k->fused);
    fl_optimizer opt;
    fl_optimizer_init(&opt, &k->oc, &m.table, k->dt, m.params, m.grads);
    fl_device_use(fl_device_cpu());
    o->spikes = o->skips = 0;
    // the step's tokens go up asynchronously: from pinned memory, as run.c's
    int *in = d->host_alloc(d, FL_MEM_OTHER, 2 * BT * sizeof(int)), *tg = in + BT;
    for (int s = 0; s < STEPS; s++) {
        t_rule_batch(20 + (uint64_t)s % 3, BT, k->c->vocab_size, in, tg);
        long before = d->host_stalls ? d->host_stalls(d) : 0;
        o->r[s] = fl_train_step(&m, &opt, in, tg, k->micro, B / k->micro, T, 0.02f);
        o->stalls[s] = (d->host_stalls ? d->host_stalls(d) : 0) - before;
        o->spikes += o->r[s].spike.outlier;
        o->skips += o->r[s].skipped;
    }
    d->host_free(d, in);
    const void *span[3];
    size_t bytes[3];
    fl_model_weight_spans(&m, span, bytes);
    o->weights = download(&m, span[0], bytes[0]);
    o->bytes = bytes[0];
    fl_optimizer_free(&opt);
    fl_model_free(&m);
}

static void test_steps(void) {
    const fl_spike_config guard = {
        .loss_z = 0.5f, .grad_z = 0.5f, .window = 4, .min_count = 2, .max_in_row = 100};
    fl_spike_config loss_guard = guard;
    loss_guard.loss_z = 0.05f, loss_guard.grad_z = 0.0f;
    const step_case cases[] = {
        {"gpt2 fp32 adamw clip, 2 micro-batches",
         &tiny_gpt2,
         FL_F32,
         {.kind = FL_OPT_ADAMW,
          .grad_accum = 2,
          .beta1 = 0.9f,
          .beta2 = 0.95f,
          .eps = 1e-8f,
          .weight_decay = 0.1f,
          .max_grad_norm = 0.5f},
         2,
         0},
        {"gpt2 bf16 adamw clip, spike guard",
         &tiny_gpt2,
         FL_BF16,
         {.kind = FL_OPT_ADAMW,
          .grad_accum = 1,
          .beta1 = 0.9f,
          .beta2 = 0.95f,
          .eps = 1e-8f,
          .max_grad_norm = 1.0f,
          .spike = guard},
         1,
         0},
        {"gpt2 fp16 sgd momentum, overflowing scale, 2 micro-batches",
         &tiny_gpt2,
         FL_F16,
         {.kind = FL_OPT_SGD,
          .grad_accum = 2,
          .momentum = 0.9f,
          .initial_scale_power = 18,
          .loss_scale_window = 1000,
          .hysteresis = 1,
          .min_loss_scale = 1.0f},
         2,
         0},
        {"llama bf16 lomo clip (two passes)",
         &tiny_llama,
         FL_BF16,
         {.kind = FL_OPT_LOMO,
          .grad_accum = 1,
          .max_grad_norm = 1.0f,
          .clip_value = 0.5f,
          .stochastic_rounding = 1,
          .seed = 3},
         1,
         1},
        {"llama fp32 lomo, spike guard (one pass)",
         &tiny_llama,
         FL_F32,
         {.kind = FL_OPT_LOMO, .grad_accum = 1, .weight_decay = 0.1f, .spike = loss_guard},
         1,
         1},
        {"llama fp16 adalomo clip, overflowing scale",
         &tiny_llama,
         FL_F16,
         {.kind = FL_OPT_ADALOMO,
          .grad_accum = 1,
          .max_grad_norm = 1.0f,
          .eps = 1e-30f,
          .eps2 = 1e-3f,
          .clip_threshold = 1.0f,
          .decay_rate = -0.8f,
          .initial_scale_power = 18,
          .loss_scale_window = 1000,
          .hysteresis = 1,
          .min_loss_scale = 1.0f},
         1,
         1},
    };
    const fl_device *test = fl_device_get("test");
    long spikes = 0, skips = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const step_case *k = &cases[i];
        step_outcome cpu, dev;
        run_steps(k, fl_device_cpu(), &cpu);
        run_steps(k, test, &dev);
        int same = !memcmp(cpu.weights, dev.weights, cpu.bytes), one = 1;
        for (int s = 0; s < STEPS; s++) {
            const fl_train_result *a = &cpu.r[s], *b = &dev.r[s];
            same &= !memcmp(&a->loss, &b->loss, sizeof a->loss) &&
                    !memcmp(&a->grad_norm, &b->grad_norm, sizeof a->grad_norm) &&
                    a->skipped == b->skipped && a->loss_scale == b->loss_scale &&
                    a->spike.outlier == b->spike.outlier && a->spikes_skipped == b->spikes_skipped;
            one &= dev.stalls[s] == 1;
            if (getenv("FITLM_TEST_VERBOSE"))
                printf("  %s step %d: loss %.7g norm %.7g skipped %d outlier %d scale %g, "
                       "%ld wait(s)\n",
                       k->name, s, b->loss, b->grad_norm, b->skipped, b->spike.outlier,
                       b->loss_scale, dev.stalls[s]);
        }
        t_check(same, "%s: the steps' results and weights on the test device are the cpu's",
                k->name);
        t_check(one, "%s: each step waits on the device once (its verdict's read)", k->name);
        spikes += cpu.spikes, skips += cpu.skips;
        free(cpu.weights), free(dev.weights);
    }
    t_check(spikes > 0 && skips > 0,
            "the cases meet spikes (%ld) and overflow skips (%ld), decided on the device", spikes,
            skips);
}

int main(void) {
    test_device_memory(); // first: these fork
    test_split_refused();
    test_models();
    test_qlora();
    test_steps();
    return t_report();
}
