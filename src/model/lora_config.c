// lora_config.c: the LoRA section of a run's config (PEFT's LoraConfig
// names): options that would do nothing without LoRA are errors, PEFT's
// choices fitlm lacks are refused, and the adapters' init and whether the
// base trains (LoRA + LOMO) are derived.
#include <string.h>

#include "fitlm/lora.h"

void fl_lora_check_config(fl_train_config *cfg) {
    static const char *const lora_keys[] = {
        "lora.r",          "lora.lora_alpha",        "lora.lora_dropout",   "lora.target_modules",
        "lora.use_rslora", "lora.init_lora_weights", "lora.base_optimizer", "lora.base_lr"};
    if (*cfg->adapter) cfg->lora_enabled = 1; // an adapter brings its LoRA config
    for (size_t i = 0; i < sizeof lora_keys / sizeof lora_keys[0]; i++)
        if (!cfg->lora_enabled && fl_config_given(cfg, lora_keys[i]))
            fl_die("%s applies to LoRA training; set lora.enabled (--lora)", lora_keys[i]);
    if (strcmp(cfg->lora_bias, "none"))
        fl_die("lora.bias %s is not supported: biases stay frozen (lora.bias none); PEFT's all "
               "and lora_only would train them",
               cfg->lora_bias);
    cfg->lora.init =
        !strcmp(cfg->lora_init, "gaussian") ? FL_LORA_INIT_GAUSSIAN : FL_LORA_INIT_DEFAULT;
    cfg->lora.train_base = strcmp(cfg->lora_base_optimizer, "none") != 0;
    if (fl_config_given(cfg, "lora.base_lr") && !cfg->lora.train_base)
        fl_die("lora.base_lr applies to a trained base; set lora.base_optimizer (lomo or adalomo)");
    if (cfg->lora.train_base && cfg->grad_accum > 1)
        fl_die("lora.base_optimizer %s updates the base inside the backward pass and cannot "
               "accumulate gradients (gradient_accumulation_steps is %d)",
               cfg->lora_base_optimizer, cfg->grad_accum);
}
