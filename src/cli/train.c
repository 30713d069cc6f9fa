// train.c: `fitlm train`: the training loop. With no options it is the demo:
// the default model on the Brown corpus in GPT-2 tokens, then a checkpoint
// and a sample.
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "fitlm/config.h"
#include "fitlm/data.h"
#include "fitlm/io.h"
#include "fitlm/optim.h"
#include "fitlm/plan.h"
#include "fitlm/profile.h"
#include "fitlm/safetensors.h"
#include "fitlm/tokenizer.h"
#include "fitlm/train.h"

// Mean loss over cfg->eval_iters fixed batches spread over the validation data.
static float evaluate(fl_model *model, const fl_loader *val, const fl_train_config *cfg,
                      int *inputs, int *targets) {
    double sum = 0.0;
    for (int i = 0; i < cfg->eval_iters; i++) {
        fl_loader_eval_batch(val, i, cfg->eval_iters, inputs, targets, cfg->micro_batch);
        sum += fl_model_forward(model, inputs, targets, cfg->micro_batch, cfg->seq_len);
    }
    return (float)(sum / cfg->eval_iters);
}

static void help(void) {
    printf("usage: fitlm train [options]\n\n"
           "Trains a GPT-2 or LLaMA model on token shards (made by 'fitlm tokenize'). With no "
           "options: the demo\n"
           "(the 'demo' model on the Brown corpus in GPT-2 tokens, made by scripts/demo.sh).\n\n");
    fl_config_print_help(stdout);
}

// The value of --resume, looked up before the config is read: the
// checkpoint's config comes first, then the flags.
static const char *resume_arg(int argc, char **argv) {
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--resume") && i + 1 < argc) path = argv[i + 1];
        if (!strncmp(argv[i], "--resume=", 9)) path = argv[i] + 9;
    }
    return path && *path ? path : NULL;
}

// The per-step log, OUT/log.txt: exact values (%.9g round-trips a float), one
// line per step. On resume the lines past the checkpoint's step are dropped.
static FILE *open_log(const char *out_dir, int resume_step) {
    if (!*out_dir) return NULL;
    if (mkdir(out_dir, 0755) != 0 && access(out_dir, W_OK) != 0)
        fl_die("cannot create output directory %s", out_dir);
    char path[FL_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/log.txt", out_dir);
    if (resume_step >= 0 && access(path, F_OK) == 0) {
        size_t n;
        char *text = (char *)fl_file_read_all(path, (size_t)1 << 30, &n, "training log");
        fl_file f;
        fl_file_begin(&f, path);
        for (char *line = text; line < text + n;) {
            char *end = memchr(line, '\n', (size_t)(text + n - line));
            size_t len = end ? (size_t)(end - line) + 1 : (size_t)(text + n - line);
            int step;
            if (sscanf(line, "step %d", &step) == 1 && step <= resume_step)
                fl_file_write(&f, line, len);
            line += len;
        }
        fl_file_commit(&f);
        fl_free(text);
    }
    FILE *log = fopen(path, resume_step >= 0 ? "a" : "w");
    if (!log) fl_die("cannot open %s for writing", path);
    return log;
}

int cmd_train(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    const char *resume = resume_arg(argc, argv);
    fl_ckpt *ck = NULL;
    if (resume) {
        ck = fl_ckpt_open(resume);
        char *json = fl_train_ckpt_config(ck);
        char where[FL_FILE_PATH_MAX + 32];
        snprintf(where, sizeof where, "config in checkpoint %s", fl_ckpt_path(ck));
        fl_config_load_json_text(&cfg, json, strlen(json), where);
        fl_free(json);
    }
    fl_config_parse_args(&cfg, argc, argv);
    // the checkpoint's config must be read before any other: a flag only
    if (*cfg.resume && !resume)
        fl_die("resume is a command-line option (--resume DIR), not a config-file key");
    char *config_json = fl_config_to_json(&cfg); // the run as given, for its checkpoints
    // A resumed or pretrained model brings its own shape.
    const char *shape_from = resume ? resume : *cfg.init_from ? cfg.init_from : NULL;
    if (shape_from) {
        fl_model_config shape;
        if (ck)
            fl_ckpt_model_config(ck, &shape);
        else
            fl_pretrained_config(shape_from, &shape);
        fl_config_set_shape(&cfg, &shape, shape_from);
    }
    fl_config_finish(&cfg);
    if (*cfg.adapter) { // the adapter's LoRA config, which the lora.* options must not contradict
        fl_lora_config adapter;
        fl_peft_read_config(cfg.adapter, &adapter);
        fl_config_set_lora(&cfg, &adapter, cfg.adapter);
    }
    fl_set_threads(cfg.threads);
    int B = cfg.micro_batch, T = cfg.seq_len;
    fl_optimizer_config ocfg = fl_config_optimizer(&cfg);
    int lora = cfg.lora_enabled, train_base = lora && cfg.lora.train_base;
    fl_optimizer_config bcfg = train_base ? fl_config_base_optimizer(&cfg) : ocfg;
    if (train_base && cfg.dtype == FL_F16)
        fl_die("lora.base_optimizer with fp16 is not supported (two loss scalers would have to "
               "agree): use --precision bf16");

    // Data first: the shards name their tokenizer and vocabulary. What the
    // loaders and the tokenizer keep (tag other) is measured for the plan.
    fl_loader train, val;
    fl_loader_open(&train, cfg.data, "train", T, cfg.seed, 1, 0, 1);
    if (strcmp(train.tokenizer, cfg.tokenizer))
        fl_die("the training data %s was tokenized with '%s', but the tokenizer is '%s' (set "
               "--tokenizer %s)",
               cfg.data, train.tokenizer, cfg.tokenizer, train.tokenizer);
    if ((int)train.vocab_size > cfg.model.vocab_size)
        fl_die("the training data %s has a vocabulary of %u, larger than the model's %d", cfg.data,
               train.vocab_size, cfg.model.vocab_size);
    int has_val = fl_loader_open_val(&val, cfg.data, cfg.val_data, T);
    if (has_val && (strcmp(val.tokenizer, train.tokenizer) || val.vocab_size != train.vocab_size))
        fl_die("the validation data (tokenizer %s) does not match the training data (tokenizer %s)",
               val.tokenizer, train.tokenizer);
    // before the model exists, so its scratch never adds to a memory peak
    double baseline = has_val ? fl_loader_unigram_xent(&train, &val) : 0.0;
    fl_tokenizer *tok =
        cfg.sample_tokens > 0 ? fl_tokenizer_load(cfg.tokenizer, cfg.tokenizer_path) : NULL;
    // tag other so far: the config's text, the loaders' tables, the tokenizer
    size_t data_bytes = fl_mem_current(FL_MEM_OTHER), data_peak = fl_mem_peak(FL_MEM_OTHER);

    // Plan before allocating the model: a run that cannot fit stops here
    // with advice, rather than being killed by the kernel halfway through.
    fl_plan_request req;
    fl_plan_request_from_config(&req, &cfg, data_bytes);
    req.data_peak = data_peak;
    fl_plan plan;
    fl_plan_compute(&req, &plan);
    size_t limit = *cfg.mem_limit ? fl_parse_bytes(cfg.mem_limit, "mem_limit") : fl_mem_available();
    fl_plan_check_fits(&req, &plan, limit);

    // The model: pretrained weights (a resume has its own, unless they are
    // a LoRA run's frozen base, which the checkpoint does not hold), NF4 rows
    // quantised as they load, then the adapters.
    fl_model model;
    const fl_quant_config *quant = cfg.quant.enabled ? &cfg.quant : NULL;
    if (*cfg.init_from && (!resume || (lora && !train_base)))
        fl_pretrained_load_quant(cfg.init_from, &model, cfg.dtype, quant);
    else
        fl_model_init_quant(&model, &cfg.model, cfg.dtype, cfg.seed, quant);
    if (lora) {
        fl_model_add_lora(&model, &cfg.lora, cfg.seed);
        if (*cfg.adapter) fl_peft_load(cfg.adapter, &model);
    }
    fl_model_alloc_acts(&model, B, T, cfg.recompute,
                        lora ? train_base && fl_optimizer_unit_grads(&bcfg)
                             : fl_optimizer_unit_grads(&ocfg));
    // what the optimizer trains: the adapters under LoRA (the base too, by
    // its own fused optimizer, under LoRA + LOMO), else the model
    fl_optimizer optim, base_optim;
    if (lora)
        fl_optimizer_init(&optim, &ocfg, &model.lora.table, cfg.dtype, model.lora.params,
                          model.lora.grads);
    else
        fl_optimizer_init(&optim, &ocfg, &model.table, cfg.dtype, model.params, model.grads);
    if (train_base)
        fl_optimizer_init(&base_optim, &bcfg, &model.table, cfg.dtype, model.params, model.grads);
    fl_optimizer *base = train_base ? &base_optim : NULL;
    float base_lr = cfg.lora_base_lr > 0.0f ? cfg.lora_base_lr : cfg.lr;
    int start = 0;
    if (ck) {
        fl_train_ckpt_restore(ck, &model, &optim, base, &train.state, train.tokenizer);
        start = fl_ckpt_step(ck);
        if (train.state.index > train.per_rank)
            fl_die("checkpoint %s is at window %llu of an epoch of %llu: the training data has "
                   "changed since it was saved",
                   fl_ckpt_path(ck), (unsigned long long)train.state.index,
                   (unsigned long long)train.per_rank);
        fl_ckpt_close(ck);
    }
    fl_schedule schedule = {!strcmp(cfg.scheduler, "cosine")   ? FL_SCHED_COSINE
                            : !strcmp(cfg.scheduler, "linear") ? FL_SCHED_LINEAR
                                                               : FL_SCHED_CONSTANT,
                            cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio};
    // a step's micro-batches, loaded before it: the step weights every target
    // token of the accumulated batch alike
    size_t micro_tokens = (size_t)B * T;
    int *inputs = fl_alloc(FL_MEM_OTHER, micro_tokens * cfg.grad_accum * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, micro_tokens * cfg.grad_accum * sizeof(int));

    fl_config_print(&cfg, stdout);
    printf("%zu parameters (%.2f M)", model.table.numel, model.table.numel / 1e6);
    if (lora)
        printf(" + %zu in LoRA adapters (%.3f%%)%s", model.lora.table.numel,
               100.0 * model.lora.table.numel / model.table.numel,
               train_base ? ", base trained too" : ", base frozen");
    printf("; planned memory %.1f MiB; train %s: %llu tokens (%s)", plan.total / 1048576.0,
           cfg.data, (unsigned long long)train.n_tokens, train.tokenizer);
    double bytes_per_token = 0.0;
    if (has_val) {
        bytes_per_token = (double)val.source_bytes / (double)val.n_tokens;
        printf(", val %llu tokens; unigram baseline %.4f nats/token",
               (unsigned long long)val.n_tokens, baseline);
    }
    printf("\n");
    if (quant) {
        double mean, most, rms;
        fl_model_quant_error(&model, &mean, &most, &rms);
        size_t nq;
        double per = fl_quant_bytes_per_param(&model.table, &cfg.quant, &nq);
        printf("NF4 base (block %d%s): %zu parameters at %.4f bytes each; quantisation error "
               "mean %.3g, max %.3g (%.2f%% and %.1f%% of the weights' RMS %.3g)\n",
               cfg.quant.blocksize, cfg.quant.double_quant ? ", double quantisation" : "", nq, per,
               mean, most, 100.0 * mean / rms, 100.0 * most / rms, rms);
    }
    if (ck) printf("resumed from step %d\n", start);
    FILE *log = open_log(cfg.out_dir, resume ? start : -1);

    int tty = isatty(STDOUT_FILENO), skipped = 0, saved_at = -1;
    float val_loss = -1.0f;
    double train_start = fl_now();
    fl_profile_reset();
    for (int step = start; step < cfg.steps; step++) {
        if (has_val && cfg.eval_interval && step % cfg.eval_interval == 0 &&
            (step > start || !ck)) {
            val_loss = evaluate(&model, &val, &cfg, inputs, targets);
            printf("%sstep %5d | val loss %.4f\n", tty ? "\r\033[K" : "", step, val_loss);
            if (log) fprintf(log, "step %d val %.9g\n", step, val_loss);
        }
        // Only the training step is profiled (not evaluation, logging or
        // checkpoints), and not the first one: warm-up (page faults, kernel setup).
        fl_profile_enable(cfg.profile && step > start);
        double t0 = fl_now();
        for (int micro = 0; micro < cfg.grad_accum; micro++)
            FL_PROFILE(FL_OP_LOADER, FL_STEP, 0.0,
                       fl_loader_next(&train, inputs + micro * micro_tokens,
                                      targets + micro * micro_tokens, B));
        float lr = fl_lr_at(&schedule, step);
        fl_train_result r =
            train_base ? fl_lora_lomo_step(&model, &optim, base, inputs, targets, B, T, lr,
                                           lr * (base_lr / cfg.lr))
                       : fl_train_step(&model, &optim, inputs, targets, cfg.grad_accum, B, T, lr);
        float loss = r.loss;
        skipped += r.skipped;
        double ms = (fl_now() - t0) * 1e3;
        if (fl_profile_on) fl_profile_step(ms / 1e3);
        fl_profile_enable(0);
        double tok_s = (double)B * T * cfg.grad_accum / (ms / 1e3);
        printf("%sstep %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s",
               tty ? "\r\033[K" : "", step + 1, cfg.steps, loss, lr, r.grad_norm, ms, tok_s);
        if (cfg.dtype == FL_F16)
            printf(" | scale %g%s | skipped %d", r.loss_scale, r.skipped ? " OVERFLOW" : "",
                   skipped);
        printf("%s", tty ? "" : "\n");
        if (log)
            fprintf(log, "step %d loss %.9g lr %.9g norm %.9g scale %.9g\n", step + 1, (float)loss,
                    lr, r.grad_norm, r.loss_scale);
        if (cfg.mem_report_every && (step + 1) % cfg.mem_report_every == 0) {
            printf("%s", tty ? "\n" : "");
            fl_mem_report(stdout);
        }
        if (*cfg.out_dir && cfg.save_every && (step + 1) % cfg.save_every == 0) {
            if (log) fflush(log);
            fl_train_ckpt_save(cfg.out_dir, step + 1, &model, &optim, base, &train.state,
                               train.tokenizer, config_json, cfg.keep_checkpoints);
            saved_at = step + 1;
        }
        fflush(stdout);
    }
    if (tty) printf("\n");
    double seconds = fl_now() - train_start;
    if (cfg.profile) fl_profile_print(stdout);
    if (has_val) {
        val_loss = evaluate(&model, &val, &cfg, inputs, targets);
        printf("final val loss %.4f nats/token (%.4f nats/byte) after %d steps (%.1f s); unigram "
               "baseline %.4f nats/token\n",
               val_loss, val_loss / bytes_per_token, cfg.steps, seconds, baseline);
        if (log) fprintf(log, "step %d val %.9g\n", cfg.steps, val_loss);
    }
    if (log) fclose(log);
    if (*cfg.out_dir && saved_at != cfg.steps && cfg.steps > start) {
        fl_train_ckpt_save(cfg.out_dir, cfg.steps, &model, &optim, base, &train.state,
                           train.tokenizer, config_json, cfg.keep_checkpoints);
        printf("checkpoint written to %s (step %d)\n", cfg.out_dir, cfg.steps);
    }
    if (*cfg.out_dir && lora) { // the adapters as PEFT saves them
        char dir[FL_PATH_MAX + 16];
        snprintf(dir, sizeof dir, "%s/adapter", cfg.out_dir);
        fl_peft_save(dir, &model, *cfg.init_from ? cfg.init_from : cfg.model_preset);
        printf("LoRA adapter written to %s (PEFT format)\n", dir);
    }
    if (tok) {
        int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(cfg.sample_tokens + 4) * sizeof(int));
        tokens[0] = fl_tokenizer_eot(tok); // a sample starts like a fresh document
        fl_rng rng;
        fl_rng_seed(&rng, cfg.seed);
        printf("--- sample (temperature 0.8, top-k 40) ---\n");
        fl_model_generate(&model, tokens, 1, cfg.sample_tokens, 0.8f, 40, &rng, print_token, tok);
        printf("\n---\n");
        fl_free(tokens);
    }
    if (cfg.mem_report || cfg.mem_report_every) fl_mem_report(stdout);
    fl_free(inputs);
    fl_free(targets);
    fl_free(config_json);
    fl_optimizer_free(&optim);
    if (base) fl_optimizer_free(base);
    fl_model_free(&model);
    if (tok) fl_tokenizer_free(tok);
    if (has_val) fl_loader_close(&val);
    fl_loader_close(&train);
    return 0;
}
