// test_llama_ref.c: the whole LLaMA model against a PyTorch reference:
// the parameter table, forward, backward, training through the engine's own
// step (fl_optimizer AdamW with clipping, fl_train_step), token-weighted
// gradient accumulation and activation checkpointing.
//
// The references are tests/fixtures/llama_tiny.bin (untied lm_head, L 2,
// NH 4, NKV 2: grouped-query attention, C 16, I 24, 10 steps) and
// llama_tiny_tied.bin (lm_head tied to embed_tokens, L 1, NKV 1, 3 steps),
// written by scripts/make_llama_reference.py (run it with /usr/bin/python3,
// which has torch; its docstring describes the model and the records); this
// test needs no Python. Some targets are -1, so the loss is the mean over the
// others. The format, reader and the checks shared with test_gpt2_ref are in
// testref.h.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "testlib.h"
#include "testref.h"

// Tolerances, as test_gpt2_ref's (the same values): the engine computes in
// float32, the reference in float64 rounded once to float32, so the
// differences are the engine's accumulated float32 rounding. The max |diff|
// observed on these fixtures (x86-64 with AVX-512, OpenBLAS; 1, 2 and 4
// threads and FITLM_NO_SIMD=1; untied / tied fixture) is noted for each:
// every tolerance keeps a margin of 5x or more over it, yet a real bug
// misses it by far: a wrong rotary convention or theta, GELU for SiLU or a
// wrong attention scale moves the logits by 1e3..1e5 times LOGITS_ATOL (the
// script's comment at W_STD), and one weight off by 1e-3 (the sanity check
// below) moves them by 4e-4 and puts most of them outside.
// LOGITS_ATOL 5e-6, LOGITS_RTOL 1e-5 (testref.h): logits up to 2.0 / 2.7;
// observed 6.0e-7 / 5.4e-7.
#define LOSS_ATOL      1e-5 // loss ~4.4, float32 ulp 4.8e-7; observed 0 / 0
#define GRAD_ATOL      1e-6 // gradients up to 0.24 / 0.21; observed 8.2e-8 / 8.9e-8
#define GRAD_RTOL      1e-4
#define STEP_LOSS_ATOL 1e-5 // observed 2.4e-7 / 2.4e-7 over the steps
// norms 1..1.8 / 1.2..1.5, summed in double by the engine
#define NORM_RTOL 1e-5 // observed 5.5e-7 / 1.7e-7 relative
// Final weights after the AdamW steps (each moves a weight by up to ~lr =
// 1e-2): AdamW divides m by sqrt(v), so a small absolute gradient error of
// a weight with a small gradient becomes a larger relative step error, and
// errors compound along the trajectory. Observed 2.4e-7 / 3.7e-7. (There
// is no bias here, so nothing like GPT-2's key bias with its zero gradient.)
#define FINAL_ATOL 2e-5
#define FINAL_RTOL 1e-4
// Accumulation over two micro-batches against the same batch in one: the
// same sums in another order (a GEMM per micro-batch, gradients summed in
// fp32), so only float rounding differs. Observed: step losses 2.4e-7,
// norms 4.7e-7 relative, final weights 1.2e-7. A mean of the two
// micro-batch means instead (15 and 13 targets) would weigh the tokens by
// 1/30 and 1/26 instead of 1/28, moving every gradient by ~7%.
#define ACCUM_LOSS_ATOL  2e-6
#define ACCUM_NORM_RTOL  5e-6
#define ACCUM_FINAL_ATOL 4e-6
#define ACCUM_FINAL_RTOL 1e-5
// The perturbation of one weight in the sanity check (weights ~0.14).
#define PERTURB 1e-3f

// c->steps steps of fl_train_step from the fixture's initial weights on its
// batch, as `micro` micro-batches of B / micro sequences each, through an
// fl_optimizer (AdamW with the fixture's hyperparameters and clipping, at a
// constant lr). losses and norms: (steps).
static void train(fl_model *m, fixture *fx, const fx_config *c, int micro, float *losses,
                  float *norms) {
    int *tokens = fx_ints(fx, "tokens"), *targets = fx_ints(fx, "targets");
    long n = 0;
    for (int i = 0; i < c->B * c->T; i++) n += targets[i] != -1;
    fl_optimizer_config oc = {.kind = FL_OPT_ADAMW,
                              .beta1 = c->beta1,
                              .beta2 = c->beta2,
                              .eps = c->eps,
                              .weight_decay = c->weight_decay,
                              .max_grad_norm = c->max_grad_norm,
                              .grad_accum = micro};
    fx_load_params(m, fx, "param/");
    fl_optimizer o;
    fl_optimizer_init(&o, &oc, &m->table, FL_F32, m->params, m->grads);
    int bad = 0;
    for (int s = 0; s < c->steps; s++) {
        fl_train_result r = fl_train_step(m, &o, tokens, targets, micro, c->B / micro, c->T, c->lr);
        losses[s] = r.loss;
        norms[s] = r.grad_norm;
        bad |= r.n_targets != n || r.skipped;
    }
    t_check(!bad, "fl_train_step: a step counted other than %ld targets or was skipped", n);
    fl_optimizer_free(&o);
    free(tokens), free(targets);
}

// One weight of the fixture changed by PERTURB (in a copy of the file): the
// logits of the changed model must leave the tolerance, or the forward check
// could not fail.
static void test_perturbed(fl_model *m, const fixture *fx, const fx_config *c) {
    static const char name[] = "param/layers.0.self_attn.k_proj.weight";
    unsigned char *copy = malloc(fx->size);
    memcpy(copy, fx->data, fx->size);
    fixture bad = {0};
    fx_config bc;
    FL_ASSERT(fx_parse(&bad, copy, fx->size) && fx_validate(&bad, &bc));
    const fx_record *r = fx_find(&bad, name);
    float w;
    memcpy(&w, copy + r->offset, sizeof w);
    w += PERTURB;
    memcpy(copy + r->offset, &w, sizeof w);
    fx_load_params(m, &bad, "param/");
    int *tokens = fx_ints(&bad, "tokens");
    fl_model_forward(m, tokens, NULL, c->B, c->T);
    float *got = fx_logits(m), *want = fx_floats(&bad, "logits");
    size_t n = (size_t)c->B * c->T * c->V,
           outside = fx_count_outside(got, want, n, LOGITS_ATOL, LOGITS_RTOL);
    printf("  %s[0] + %g: %zu of %zu logits outside the tolerance\n", name + 6, PERTURB, outside,
           n);
    t_check(outside > 0, "a perturbed weight went unnoticed by the logits check");
    free(got), free(want), free(tokens), free(copy), free(bad.recs);
}

static int test_reference(fixture *fx, const fx_config *c) {
    fl_model model;
    fx_model_init(&model, c, FL_RECOMPUTE_NONE);
    printf("config: L=%d C=%d NH=%d NKV=%d I=%d V=%d (Vp=%d) maxT=%d, %s, eps %g, theta %g, "
           "batch %dx%d, %zu params\n",
           c->L, c->C, c->NH, c->NKV, c->I, c->V, model.config.padded_vocab_size, c->maxT,
           c->tie ? "tied" : "untied", c->norm_eps, c->rope_theta, c->B, c->T, model.table.numel);
    if (!fx_check_table(&model, c)) {
        fl_model_free(&model);
        return 0;
    }

    printf("forward:\n");
    fx_check_forward(&model, fx, c, LOSS_ATOL);
    printf("backward%s:\n", c->tie ? " (lm_head's gradient folded into embed_tokens)" : "");
    fl_model_zero_grad(&model);
    fl_model_backward(&model, 1.0f / model.n_targets);
    fx_compare_views(&model, fx, model.grads, "grad/", GRAD_ATOL, GRAD_RTOL, 0);
    printf("sanity check:\n");
    test_perturbed(&model, fx, c);

    printf("training, %d AdamW steps through fl_train_step (lr %g, betas %g %g, eps %g, wd %g, "
           "clip %g):\n",
           c->steps, c->lr, c->beta1, c->beta2, c->eps, c->weight_decay, c->max_grad_norm);
    size_t np = model.table.numel;
    float *losses = malloc(2 * c->steps * sizeof(float)),
          *norms = malloc(2 * c->steps * sizeof(float));
    float *one = malloc(np * sizeof(float));
    train(&model, fx, c, 1, losses, norms);
    fx_check_steps(fx, c, losses, norms, STEP_LOSS_ATOL, NORM_RTOL);
    fx_compare_views(&model, fx, model.params, "final/", FINAL_ATOL, FINAL_RTOL, 0);
    memcpy(one, model.params, np * sizeof(float));

    // The same batch as 2 micro-batches of B/2 sequences holding different
    // numbers of targets: token-weighted accumulation gives the one-batch
    // step (a mean of the two micro-batch means would not).
    if (c->B % 2 == 0) {
        int *targets = fx_ints(fx, "targets"), half = c->B / 2 * c->T, n0 = 0, n1 = 0;
        for (int i = 0; i < half; i++) n0 += targets[i] != -1, n1 += targets[half + i] != -1;
        free(targets);
        printf("gradient accumulation, 2 micro-batches of %dx%d with %d and %d targets:\n",
               c->B / 2, c->T, n0, n1);
        t_check(n0 != n1, "the micro-batches hold different numbers of targets");
        float *losses2 = losses + c->steps, *norms2 = norms + c->steps;
        train(&model, fx, c, 2, losses2, norms2);
        t_close("step_losses (2 micro-batches vs 1)", losses2, losses, c->steps, ACCUM_LOSS_ATOL,
                0);
        t_close("step_grad_norms (2 micro-batches vs 1)", norms2, norms, c->steps, 0,
                ACCUM_NORM_RTOL);
        t_close("final weights (2 micro-batches vs 1)", model.params, one, np, ACCUM_FINAL_ATOL,
                ACCUM_FINAL_RTOL);
        printf("  and against the reference:\n");
        fx_check_steps(fx, c, losses2, norms2, STEP_LOSS_ATOL, NORM_RTOL);
        fx_compare_views(&model, fx, model.params, "final/", FINAL_ATOL, FINAL_RTOL, 0);
    }
    free(losses), free(norms), free(one);
    fl_model_free(&model);
    return 1;
}

int main(void) {
    static const char *files[2] = {"tests/fixtures/llama_tiny.bin",
                                   "tests/fixtures/llama_tiny_tied.bin"};
    for (int k = 0; k < 2; k++) {
        fixture fx;
        fx_config c;
        unsigned char *data;
        if (fx_load(t_source_path(files[k]), &fx, &c, &data) &&
            t_check(c.arch == FL_ARCH_LLAMA && c.tie == k, "%s: a LLaMA fixture, %s", files[k],
                    k ? "tied" : "untied")) {
            printf("damaged copies:\n");
            fx_test_damaged(data, fx.size, &fx);
            // the other checks load the fixture's weights by name: only with
            // a matching parameter table
            if (test_reference(&fx, &c)) {
                printf("activation checkpointing:\n");
                fx_check_recompute(&fx, &c);
            }
        }
        free(data), free(fx.recs);
    }
    return t_report();
}
