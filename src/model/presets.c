// presets.c: model shapes by name: small ones for tests and the demo (for
// either architecture), and real models' for planning and benchmarks.
#include <strings.h>

#include "fitlm/model.h"

// The shapes of real models, for planning and benchmarks, and small ones
// for tests and the demo. vocab 0: the tokenizer's.
static const struct {
    const char *name;
    fl_model_config c;
} presets[] = {
    {"tiny", {.n_layer = 2, .n_head = 4, .n_embd = 64, .max_seq_len = 64}},
    {"demo", {.n_layer = 4, .n_head = 4, .n_embd = 128, .max_seq_len = 256}},
    {"gpt2", {.n_layer = 12, .n_head = 12, .n_embd = 768, .max_seq_len = 1024}},
    {"gpt2-medium", {.n_layer = 24, .n_head = 16, .n_embd = 1024, .max_seq_len = 1024}},
    {"gpt2-large", {.n_layer = 36, .n_head = 20, .n_embd = 1280, .max_seq_len = 1024}},
    {"gpt2-xl", {.n_layer = 48, .n_head = 25, .n_embd = 1600, .max_seq_len = 1024}},
    {"llama-tiny",
     {FL_ARCH_LLAMA, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 64, .max_seq_len = 64,
      .intermediate_size = 176}},
    // LLaMA 7B (Touvron et al. 2023)
    {"llama-7b",
     {FL_ARCH_LLAMA, .n_layer = 32, .n_head = 32, .n_kv_head = 32, .n_embd = 4096,
      .max_seq_len = 2048, .intermediate_size = 11008, .vocab_size = 32000, .norm_eps = 1e-6f}},
    // TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    {"tinyllama-1.1b",
     {FL_ARCH_LLAMA, .n_layer = 22, .n_head = 32, .n_kv_head = 4, .n_embd = 2048,
      .max_seq_len = 2048, .intermediate_size = 5632, .vocab_size = 32000}},
    // HuggingFaceTB/SmolLM-135M
    {"smollm-135m",
     {FL_ARCH_LLAMA, .n_layer = 30, .n_head = 9, .n_kv_head = 3, .n_embd = 576, .max_seq_len = 2048,
      .intermediate_size = 1536, .vocab_size = 49152, .tie_embeddings = 1}},
};

void fl_model_preset(fl_model_config *out, const char *name) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcasecmp(presets[i].name, name)) continue;
        *out = presets[i].c;
        return;
    }
    fl_die("unknown model preset '%s' (tiny, demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl, "
           "llama-tiny, llama-7b, tinyllama-1.1b, smollm-135m)",
           name);
}

int fl_model_preset_takes_arch(const char *name) { // demo and tiny
    return !strcasecmp(name, "tiny") || !strcasecmp(name, "demo");
}
