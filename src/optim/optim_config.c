// optim_config.c: the optimizer section of a run's config: options the
// chosen optimizers would ignore are errors, AdaLomo's own defaults, and
// settings that can only give NaN are refused before anything trains.
#include <string.h>

#include "fitlm/optim.h"

// optimizer_in_backward: the update of each unit as its gradient is ready
// (LOMO's scheme, clipping and fp16's overflow check by its two passes),
// so there is one micro-batch per step and no adapters to step after.
static void check_in_backward(const fl_train_config *cfg) {
    if (!cfg->optimizer_in_backward) return;
    if (cfg->grad_accum > 1)
        fl_die("optimizer_in_backward: each block is updated as soon as its gradient is ready, "
               "so a step has one micro-batch; gradient_accumulation_steps is %d (use 1, and a "
               "larger train_micro_batch_size_per_gpu)",
               cfg->grad_accum);
    if (cfg->lora_enabled)
        fl_die("optimizer_in_backward with LoRA is not supported: the adapters are small, their "
               "optimizer steps after the backward pass (lora.base_optimizer updates the base in "
               "it)");
}

// Whether the space-separated `names` include `name`.
static int names_include(const char *names, const char *name) {
    size_t n = strlen(name);
    for (const char *p = names; *p;) {
        size_t w = strcspn(p, " ");
        if (w == n && !strncmp(p, name, n)) return 1;
        p += w + (p[w] == ' ');
    }
    return 0;
}

// An option and the choices (space-separated) that read it.
typedef struct {
    const char *key, *for_whom;
} read_by;

// An option given that none of the chosen `a` and `b` reads is an error,
// not a no-op: "KEY applies to [WHAT ]FOR_WHOM, not SHOWN".
static void refuse_unread(const fl_train_config *cfg, const read_by *only, size_t n, const char *a,
                          const char *b, const char *what, const char *shown) {
    for (size_t i = 0; i < n; i++)
        if (fl_config_given(cfg, only[i].key) && !names_include(only[i].for_whom, a) &&
            !names_include(only[i].for_whom, b))
            fl_die("%s applies to %s%s, not %s", only[i].key, what, only[i].for_whom, shown);
}

// The schedule's parameters: each only with the schedules that read it;
// DeepSpeed's schedules' defaults (warmup 1000; WarmupLR's rate after
// warmup the optimizer's lr, WarmupDecayLR's 0.001; "auto": fitlm's warmup
// and lr), and that rate as lr. Where DeepSpeed would quietly train at
// another rate than the optimizer's lr given (its scheduler sets the
// rate), the two are refused instead.
static void check_scheduler(fl_train_config *cfg) {
    const char *ds = "WarmupLR WarmupDecayLR WarmupCosineLR", *sched = cfg->scheduler;
    const read_by only[] = {{"scheduler.params.min_lr_ratio", "constant cosine linear"},
                            {"scheduler.params.warmup_min_lr", "WarmupLR WarmupDecayLR"},
                            {"scheduler.params.warmup_max_lr", "WarmupLR WarmupDecayLR"},
                            {"scheduler.params.warmup_type", ds},
                            {"scheduler.params.total_num_steps", "WarmupDecayLR WarmupCosineLR"},
                            {"scheduler.params.warmup_min_ratio", "WarmupCosineLR"},
                            {"scheduler.params.cos_min_ratio", "WarmupCosineLR"}};
    refuse_unread(cfg, only, sizeof only / sizeof only[0], sched, sched, "scheduler.type ", sched);
    if (!names_include(ds, sched)) return;
    // "auto" (Hugging Face's Trainer fills it from its own arguments): fitlm's
    // warmup, and the optimizer's lr after it
    if (!fl_config_given(cfg, "scheduler.params.warmup_num_steps") &&
        !fl_config_auto(cfg, "scheduler.params.warmup_num_steps"))
        cfg->warmup_steps = 1000;
    else if (cfg->warmup_steps == 0)
        fl_die("scheduler.params.warmup_num_steps 0: DeepSpeed's schedules take a positive "
               "number of warmup steps");
    if (!strcmp(sched, "WarmupCosineLR")) return; // rates as fractions of lr
    int max_given = fl_config_given(cfg, "scheduler.params.warmup_max_lr");
    if ((!max_given && !strcmp(sched, "WarmupLR")) ||
        fl_config_auto(cfg, "scheduler.params.warmup_max_lr"))
        cfg->warmup_max_lr = cfg->lr;
    if (fl_config_given(cfg, "optimizer.params.lr") && cfg->warmup_max_lr != cfg->lr)
        fl_die("optimizer.params.lr %g and the scheduler %s's warmup_max_lr %g%s: DeepSpeed "
               "would train at the scheduler's; give the one rate as warmup_max_lr",
               cfg->lr, sched, cfg->warmup_max_lr, max_given ? "" : " (its default)");
    cfg->lr = cfg->warmup_max_lr;
}

void fl_optim_check_config(fl_train_config *cfg) {
    check_scheduler(cfg);
    if (cfg->skip_update_min_steps > cfg->skip_update_window)
        fl_die("skip_update_min_steps (%d) is larger than skip_update_window (%d): the guard "
               "would never judge a step",
               cfg->skip_update_min_steps, cfg->skip_update_window);
    // An option that the chosen optimizers would ignore is an error, not a
    // no-op (under LoRA + LOMO, the base's optimizer takes LOMO's options).
    char opt[2 * FL_NAME_MAX + 16];
    if (cfg->lora.train_base)
        snprintf(opt, sizeof opt, "%s (base: %s)", cfg->optimizer, cfg->lora_base_optimizer);
    else
        snprintf(opt, sizeof opt, "%s", cfg->optimizer);
    const read_by only[] = {{"optimizer.params.momentum", "sgd"},
                            {"optimizer.params.betas", "adamw"},
                            {"optimizer.params.bias_correction", "adamw"},
                            {"optimizer.params.eps", "adamw adalomo"},
                            {"optimizer.params.eps2", "adalomo"},
                            {"optimizer.params.clip_threshold", "adalomo"},
                            {"optimizer.params.decay_rate", "adalomo"},
                            {"optimizer.params.clip_grad_value", "lomo"},
                            {"optimizer.params.stochastic_rounding", "lomo adalomo"}};
    refuse_unread(cfg, only, sizeof only / sizeof only[0], cfg->optimizer, cfg->lora_base_optimizer,
                  "", opt);
    if (!strcmp(cfg->optimizer, "adalomo") && !fl_config_given(cfg, "optimizer.params.eps"))
        cfg->eps = 1e-30f; // AdaLomo's own default
    // AdaLomo normalises each update itself (clip_threshold) and needs no
    // global-norm pass: as its reference, no global clipping unless asked
    if (!strcmp(cfg->optimizer, "adalomo") && !fl_config_given(cfg, "gradient_clipping"))
        cfg->grad_clip = 0.0f;
    if (cfg->dtype == FL_F32 && fl_config_given(cfg, "optimizer.params.stochastic_rounding"))
        fl_die("optimizer.params.stochastic_rounding applies to bf16 and fp16 weights; precision "
               "is fp32");
    check_in_backward(cfg);
    // settings that can only give NaN: refused before anything trains
    if (cfg->eps == 0.0f &&
        (!strcmp(cfg->optimizer, "adamw") || !strcmp(cfg->optimizer, "adalomo")))
        fl_die("optimizer.params.eps 0: %s divides by a root of its second moment, which eps "
               "keeps above 0; a parameter whose gradient is 0 would get 0/0 = NaN (use e.g. %s)",
               cfg->optimizer, !strcmp(cfg->optimizer, "adamw") ? "1e-8" : "1e-30");
}
