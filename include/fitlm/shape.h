// shape.h: a model's architecture and dimensions, the activation
// checkpointing policy, and the LoRA and NF4 settings: plain types that the
// config (core) reads and the model driver (model.h) runs, with their names.
#ifndef FITLM_SHAPE_H
#define FITLM_SHAPE_H

typedef enum { FL_ARCH_GPT2, FL_ARCH_LLAMA } fl_arch_kind;

typedef struct {
    fl_arch_kind arch;
    int max_seq_len;       // position embeddings (GPT-2) / max_position_embeddings (LLaMA)
    int vocab_size;        // 50257 for GPT-2, 257 for the byte tokenizer
    int padded_vocab_size; // vocab rounded up to a multiple of 128 for GEMM speed
    int n_layer;
    int n_head;
    int n_kv_head; // LLaMA's num_key_value_heads (GQA); GPT-2: n_head
    int n_embd;
    int intermediate_size; // MLP width: GPT-2 4C; LLaMA's intermediate_size
    float norm_eps;        // GPT-2 LayerNorm 1e-5; LLaMA rms_norm_eps
    float rope_theta;      // LLaMA
    int tie_embeddings;    // LM head = token embedding (GPT-2 always; LLaMA's tie_word_embeddings)
    // tensor parallelism: the ways this process's model is split (0 or 1:
    // whole). Not a property of the model: no file stores it
    int tp_size;
    int sequence_parallel; // with tp_size > 1: norms and residual adds on 1/t of the tokens
    // the LM head and the loss over this many positions at a time (0: the
    // whole batch's), so that no more logits than theirs exist: a run
    // setting, as tp_size (logits_chunk)
    int logits_chunk;
} fl_model_config;
const char *fl_arch_name(fl_arch_kind arch);
int fl_arch_parse(const char *name, fl_arch_kind *out); // 0 on success, -1 unknown

// Activation checkpointing (recomputation in the backward pass).
typedef enum {
    FL_RECOMPUTE_NONE,      // keep every block's activations
    FL_RECOMPUTE_SELECTIVE, // keep the GEMM and attention outputs; recompute norms and
                            // GELU/SwiGLU (cheap, large) from them in the backward pass
    FL_RECOMPUTE_BLOCK,     // keep each block's input; re-run the block in the backward pass
} fl_recompute;
const char *fl_recompute_name(fl_recompute r);
int fl_recompute_parse(const char *name, fl_recompute *out); // 0 on success, -1 unknown

// LoRA adapters (PEFT's LoraConfig) and the NF4 storage of base weights
// (bitsandbytes' BitsAndBytesConfig): what they are is in fitlm/lora.h.
#define FL_LORA_TARGETS_MAX 256

typedef enum {
    FL_LORA_INIT_DEFAULT,  // PEFT's init_lora_weights true: A Kaiming-uniform (a = sqrt 5), B 0
    FL_LORA_INIT_GAUSSIAN, // "gaussian": A ~ N(0, 1/r), B 0
} fl_lora_init;

typedef struct {
    int r;         // rank, PEFT's default 8; 0 = no adapters
    float alpha;   // lora_alpha (8)
    float dropout; // lora_dropout (0): on the adapter's input only
    // module names, comma-separated: a module is targeted when its Hugging
    // Face name (e.g. "model.layers.0.self_attn.q_proj") equals an entry or
    // ends with "." + entry; "all-linear": every linear layer but the LM
    // head; "": the architecture's default (LLaMA q_proj,v_proj; GPT-2 c_attn)
    char target_modules[FL_LORA_TARGETS_MAX];
    int use_rslora; // scaling alpha / sqrt(r) instead of alpha / r
    fl_lora_init init;
    int train_base; // LoRA + LOMO: the base is trained by a fused optimizer, not frozen
} fl_lora_config;

typedef struct {
    int enabled;      // load_in_4bit with bnb_4bit_quant_type "nf4"
    int blocksize;    // 64 (bitsandbytes allows 32..4096, a power of two)
    int double_quant; // bnb_4bit_use_double_quant: the absmax quantised to 8 bits (block 256)
} fl_quant_config;

#endif
