// train.c: `fitlm train`: the training loop. With no options it is the demo:
// the default model on the Brown corpus, then a checkpoint and a sample.
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/optim.h"
#include "fitlm/plan.h"

// Mean loss over cfg->eval_iters fixed batches spread over the validation text.
static float evaluate(fl_gpt2 *model, const fl_text *val, const fl_train_config *cfg, int *inputs,
                      int *targets) {
    double sum = 0.0;
    for (int i = 0; i < cfg->eval_iters; i++) {
        fl_text_eval_batch(val, i, cfg->eval_iters, inputs, targets, cfg->micro_batch,
                           cfg->seq_len);
        sum += fl_gpt2_forward(model, inputs, targets, cfg->micro_batch, cfg->seq_len);
    }
    return (float)(sum / cfg->eval_iters);
}

// 0 for a missing file: loading it reports the error
static size_t file_size(const char *path) {
    struct stat st;
    return *path && stat(path, &st) == 0 ? (size_t)st.st_size : 0;
}

static void help(void) {
    printf("usage: fitlm train [options]\n\n"
           "Trains GPT-2 on a UTF-8 text with the byte tokenizer. With no options: the demo\n"
           "(the 'demo' model on the Brown corpus, prepared by scripts/setup.sh).\n\n");
    fl_config_print_help(stdout);
}

int cmd_train(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    fl_config_parse_args(&cfg, argc, argv);
    fl_config_finish(&cfg);
    fl_set_threads(cfg.threads);
    int B = cfg.micro_batch, T = cfg.seq_len;
    fl_optimizer_config ocfg = fl_config_optimizer(&cfg);

    // Plan before allocating anything: a run that cannot fit stops here with
    // advice, rather than being killed by the kernel halfway through.
    fl_plan_request req;
    fl_plan_request_from_config(&req, &cfg, file_size(cfg.data) + file_size(cfg.val_data));
    fl_plan plan;
    fl_plan_compute(&req, &plan);
    size_t limit =
        *cfg.mem_limit ? fl_parse_bytes(cfg.mem_limit, "mem_limit") : fl_plan_available_memory();
    fl_plan_check_fits(&req, &plan, limit);

    fl_text train, val = {0};
    fl_text_load(&train, cfg.data);
    if (*cfg.val_data) fl_text_load(&val, cfg.val_data);
    fl_gpt2 model;
    fl_gpt2_init(&model, &cfg.model, cfg.dtype, cfg.seed);
    fl_gpt2_alloc_acts(&model, B, T);
    fl_optimizer optim;
    fl_optimizer_init(&optim, &ocfg, &model.table, cfg.dtype, model.params, model.grads);
    fl_schedule schedule = {!strcmp(cfg.scheduler, "cosine")   ? FL_SCHED_COSINE
                            : !strcmp(cfg.scheduler, "linear") ? FL_SCHED_LINEAR
                                                               : FL_SCHED_CONSTANT,
                            cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio};
    int *inputs = fl_alloc(FL_MEM_OTHER, (size_t)B * T * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, (size_t)B * T * sizeof(int));
    fl_rng data_rng;
    fl_rng_seed(&data_rng, cfg.seed ^ 0x5eed0da7a5eed0dull); // a stream apart from the init's

    fl_config_print(&cfg, stdout);
    printf("%zu parameters (%.2f M); planned memory %.1f MiB; train %s (%zu bytes)",
           model.table.numel, model.table.numel / 1e6, plan.total / 1048576.0, cfg.data, train.n);
    double baseline = 0.0;
    if (val.n) {
        baseline = fl_text_unigram_xent(&train, &val);
        printf(", val %s (%zu bytes); byte-unigram baseline %.4f nats/byte", cfg.val_data, val.n,
               baseline);
    }
    printf("\n");

    int tty = isatty(STDOUT_FILENO), skipped = 0;
    float val_loss = -1.0f;
    double train_start = fl_now();
    for (int step = 0; step < cfg.steps; step++) {
        if (val.n && cfg.eval_interval && step % cfg.eval_interval == 0) {
            val_loss = evaluate(&model, &val, &cfg, inputs, targets);
            printf("%sstep %5d | val loss %.4f\n", tty ? "\r\033[K" : "", step, val_loss);
        }
        double t0 = fl_now();
        double loss = 0.0;
        for (int micro = 0; micro < cfg.grad_accum; micro++) {
            fl_text_random_batch(&train, &data_rng, inputs, targets, B, T);
            fl_optimizer_zero_grad(&optim);
            loss += fl_gpt2_forward(&model, inputs, targets, B, T);
            fl_gpt2_backward(&model, fl_optimizer_loss_scale(&optim));
            fl_optimizer_micro_done(&optim);
        }
        loss /= cfg.grad_accum;
        float lr = fl_lr_at(&schedule, step);
        fl_step_result r = fl_optimizer_step(&optim, lr);
        skipped += r.skipped;
        double ms = (fl_now() - t0) * 1e3;
        double tok_s = (double)B * T * cfg.grad_accum / (ms / 1e3);
        printf("%sstep %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s",
               tty ? "\r\033[K" : "", step + 1, cfg.steps, loss, lr, r.grad_norm, ms, tok_s);
        if (cfg.dtype == FL_F16)
            printf(" | scale %g%s | skipped %d", r.loss_scale, r.skipped ? " OVERFLOW" : "",
                   skipped);
        printf("%s", tty ? "" : "\n");
        if (cfg.mem_report_every && (step + 1) % cfg.mem_report_every == 0) {
            printf("%s", tty ? "\n" : "");
            fl_mem_report(stdout);
        }
        fflush(stdout);
    }
    if (tty) printf("\n");
    double seconds = fl_now() - train_start;
    if (val.n) {
        val_loss = evaluate(&model, &val, &cfg, inputs, targets);
        printf("final val loss %.4f nats/byte after %d steps (%.1f s); byte-unigram baseline "
               "%.4f\n",
               val_loss, cfg.steps, seconds, baseline);
    }
    if (*cfg.out_dir) {
        float *weights = optim.master;
        if (!weights) weights = model.params; // fp32: the model's own weights
        fl_ckpt_save(cfg.out_dir, &model, weights, cfg.tokenizer, cfg.steps);
        printf("checkpoint written to %s/model.ckpt\n", cfg.out_dir);
    }
    if (cfg.sample_tokens > 0) {
        int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(cfg.sample_tokens + 4) * sizeof(int));
        const char *prompt = "The ";
        for (int i = 0; prompt[i]; i++) tokens[i] = (unsigned char)prompt[i];
        fl_rng rng;
        fl_rng_seed(&rng, cfg.seed);
        printf("--- sample (temperature 0.8, top-k 40) ---\n%s", prompt);
        fl_gpt2_generate(&model, tokens, (int)strlen(prompt), cfg.sample_tokens, 0.8f, 40, &rng,
                         print_byte_token, NULL);
        printf("\n---\n");
        fl_free(tokens);
    }
    if (cfg.mem_report || cfg.mem_report_every) fl_mem_report(stdout);
    fl_free(inputs);
    fl_free(targets);
    fl_optimizer_free(&optim);
    fl_gpt2_free(&model);
    fl_text_free(&train);
    fl_text_free(&val);
    return 0;
}
