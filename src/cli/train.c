// train.c: `fitlm train`: the training loop. With no options it is the demo:
// the default model on the Brown corpus, then a checkpoint and a sample.
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/optim.h"

typedef struct {
    const fl_train_config *cfg;
    fl_adamw adamw;
    fl_sgd sgd;
    fl_schedule schedule;
} trainer_optim;

static void optim_init(trainer_optim *o, const fl_train_config *cfg, size_t numel) {
    memset(o, 0, sizeof *o);
    o->cfg = cfg;
    if (!strcmp(cfg->optimizer, "adamw"))
        fl_adamw_init(&o->adamw, numel, cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay);
    else
        fl_sgd_init(&o->sgd, numel, cfg->momentum, cfg->weight_decay);
    fl_sched_kind kind = !strcmp(cfg->scheduler, "cosine")   ? FL_SCHED_COSINE
                         : !strcmp(cfg->scheduler, "linear") ? FL_SCHED_LINEAR
                                                             : FL_SCHED_CONSTANT;
    o->schedule = (fl_schedule){kind, cfg->lr, cfg->warmup_steps, cfg->steps, cfg->min_lr_ratio};
}

static void optim_step(trainer_optim *o, fl_gpt2 *model, float lr) {
    if (!strcmp(o->cfg->optimizer, "adamw"))
        fl_adamw_step(&o->adamw, &model->table, model->params, model->grads, lr);
    else
        fl_sgd_step(&o->sgd, &model->table, model->params, model->grads, lr);
}

static void optim_free(trainer_optim *o) {
    if (!strcmp(o->cfg->optimizer, "adamw"))
        fl_adamw_free(&o->adamw);
    else
        fl_sgd_free(&o->sgd);
}

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

    fl_text train, val = {0};
    fl_text_load(&train, cfg.data);
    if (*cfg.val_data) fl_text_load(&val, cfg.val_data);
    fl_gpt2 model;
    fl_gpt2_init(&model, &cfg.model, cfg.seed);
    fl_gpt2_alloc_acts(&model, B, T);
    trainer_optim optim;
    optim_init(&optim, &cfg, model.table.numel);
    int *inputs = fl_alloc(FL_MEM_OTHER, (size_t)B * T * sizeof(int));
    int *targets = fl_alloc(FL_MEM_OTHER, (size_t)B * T * sizeof(int));
    fl_rng data_rng;
    fl_rng_seed(&data_rng, cfg.seed ^ 0x5eed0da7a5eed0dull); // a stream apart from the init's

    fl_config_print(&cfg, stdout);
    printf("%zu parameters (%.2f M); train %s (%zu bytes)", model.table.numel,
           model.table.numel / 1e6, cfg.data, train.n);
    double baseline = 0.0;
    if (val.n) {
        baseline = fl_text_unigram_xent(&train, &val);
        printf(", val %s (%zu bytes); byte-unigram baseline %.4f nats/byte", cfg.val_data, val.n,
               baseline);
    }
    printf("\n");

    int tty = isatty(STDOUT_FILENO);
    float val_loss = -1.0f;
    double train_start = fl_now();
    for (int step = 0; step < cfg.steps; step++) {
        if (val.n && cfg.eval_interval && step % cfg.eval_interval == 0) {
            val_loss = evaluate(&model, &val, &cfg, inputs, targets);
            printf("%sstep %5d | val loss %.4f\n", tty ? "\r\033[K" : "", step, val_loss);
        }
        double t0 = fl_now();
        fl_gpt2_zero_grad(&model);
        double loss = 0.0;
        for (int micro = 0; micro < cfg.grad_accum; micro++) {
            fl_text_random_batch(&train, &data_rng, inputs, targets, B, T);
            loss += fl_gpt2_forward(&model, inputs, targets, B, T);
            fl_gpt2_backward(&model, 1.0f / cfg.grad_accum);
        }
        loss /= cfg.grad_accum;
        float norm = fl_clip_grad_norm(model.grads, model.table.numel, cfg.grad_clip);
        float lr = fl_lr_at(&optim.schedule, step);
        optim_step(&optim, &model, lr);
        double ms = (fl_now() - t0) * 1e3;
        double tok_s = (double)B * T * cfg.grad_accum / (ms / 1e3);
        printf("%sstep %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s%s",
               tty ? "\r\033[K" : "", step + 1, cfg.steps, loss, lr, norm, ms, tok_s,
               tty ? "" : "\n");
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
        fl_ckpt_save(cfg.out_dir, &model, cfg.tokenizer, cfg.steps);
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
    if (cfg.mem_report) fl_mem_report(stdout);
    fl_free(inputs);
    fl_free(targets);
    optim_free(&optim);
    fl_gpt2_free(&model);
    fl_text_free(&train);
    fl_text_free(&val);
    return 0;
}
