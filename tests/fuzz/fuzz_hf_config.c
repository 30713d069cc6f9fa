// fuzz_hf_config.c: libFuzzer target for the Hugging Face JSON parsers:
// config.json (GPT-2 or LLaMA) and model.safetensors.index.json (the same
// input goes to both; neither needs a NUL terminator).
#include "fitlm/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[512] = {0};
    fl_model_config cfg;
    if (fl_hf_config_parse((const char *)data, size, &cfg, err, sizeof err) == 0) {
        if (cfg.n_embd % cfg.n_head != 0 || cfg.padded_vocab_size < cfg.vocab_size)
            __builtin_trap();
        // a LLaMA config fl_model_config_finish accepts
        if (cfg.arch == FL_ARCH_LLAMA &&
            (cfg.n_kv_head < 1 || cfg.n_head % cfg.n_kv_head != 0 ||
             (cfg.n_embd / cfg.n_head) % 2 != 0 || cfg.intermediate_size < 1 ||
             !(cfg.norm_eps > 0.0f && cfg.norm_eps < 1.0f) || !(cfg.rope_theta > 1.0f)))
            __builtin_trap();
    } else if (!err[0]) {
        __builtin_trap();
    }
    fl_hf_index idx;
    err[0] = 0;
    int rc = fl_hf_index_parse((const char *)data, size, &idx, err, sizeof err);
    if (rc != 0 && !err[0]) __builtin_trap();
    for (int i = 0; rc == 0 && i < idx.n_entries; i++)
        if (idx.entries[i].file < 0 || idx.entries[i].file >= idx.n_files) __builtin_trap();
    fl_hf_index_free(&idx);
    return 0;
}
