// quant_config.c: the NF4 section of a run's config (bitsandbytes'
// BitsAndBytesConfig names): QLoRA's frozen 4-bit base, after the LoRA
// section (fl_lora_check_config) has said whether adapters train on it.
#include <string.h>

#include "fitlm/lora.h"

void fl_quant_check_config(fl_train_config *cfg) {
    if (!strcmp(cfg->quant_type, "fp4"))
        fl_die("quantization_config.bnb_4bit_quant_type fp4 is not supported: use nf4");
    cfg->quant.enabled = !strcmp(cfg->quant_type, "nf4");
    if (!cfg->quant.enabled &&
        (fl_config_given(cfg, "quantization_config.bnb_4bit_use_double_quant") ||
         fl_config_given(cfg, "quantization_config.blocksize")))
        fl_die("quantization_config.bnb_4bit_use_double_quant and blocksize apply to NF4 weights; "
               "set quantization_config.bnb_4bit_quant_type nf4 (--quantize nf4)");
    int b = cfg->quant.blocksize;
    if (b & (b - 1)) fl_die("quantization_config.blocksize must be a power of two (got %d)", b);
    if (cfg->quant.enabled && !cfg->lora_enabled)
        fl_die("NF4 base weights are frozen: QLoRA trains LoRA adapters on them (add --lora)");
    if (cfg->quant.enabled && cfg->lora.train_base)
        fl_die("lora.base_optimizer %s would update the base, but NF4 weights cannot be "
               "trained (drop --quantize or lora.base_optimizer)",
               cfg->lora_base_optimizer);
}
