// model.h: architectures. A model is a parameter table (named views into one
// flat buffer), a matching gradient buffer, activations sized for a maximum
// (B, T), and forward/backward orchestration over the kernels.
#ifndef FITLM_MODEL_H
#define FITLM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"
#include "fitlm/dtype.h"

// ----------------------------------------------------------------------------
// parameter table: rows {name, shape, offset}. ZeRO shards, checkpoints,
// safetensors export, weight decay and memory reports are loops over rows.

enum {
    FL_PARAM_DECAY = 1 << 0, // AdamW applies weight decay (matrices, not biases/LN/wpe)
};

#define FL_MAX_DIMS       4
#define FL_PARAM_NAME_MAX 64

typedef struct {
    char name[FL_PARAM_NAME_MAX]; // Hugging Face GPT-2 names, without "transformer."
    int ndim;
    size_t shape[FL_MAX_DIMS];
    size_t offset; // in elements, into the flat buffer
    size_t numel;
    unsigned flags;
} fl_param_view;

typedef struct {
    fl_param_view *views;
    int count, capacity;
    size_t numel; // total elements of the flat buffer
} fl_param_table;

// Appends a view at the end of the buffer and returns its index.
int fl_params_add(fl_param_table *table, const char *name, unsigned flags, int ndim,
                  const size_t *shape);
// An empty table with room for exactly `capacity` views (no regrowth, so
// its memory is one allocation the planner can predict).
void fl_params_reserve(fl_param_table *table, int capacity);
int fl_params_find(const fl_param_table *table, const char *name); // -1 when absent
void fl_params_free(fl_param_table *table);

// Called after each parameter's gradient is complete for this backward pass
// (in reverse order of the forward use). LOMO's fused update and ZeRO's
// gradient reduction plug in here.
typedef void (*fl_grad_hook)(void *ctx, int view_index);

// ----------------------------------------------------------------------------
// GPT-2

typedef struct {
    int max_seq_len;       // maximum sequence length (position embeddings), 1024 for GPT-2
    int vocab_size;        // 50257 for GPT-2, 256 for the byte tokenizer
    int padded_vocab_size; // vocab rounded up to a multiple of 128 for GEMM speed
    int n_layer;
    int n_head;
    int n_embd;
} fl_gpt2_config;

// Rounds vocab up to a multiple of 128 and checks the shape (n_embd % n_head
// == 0, all positive). Dies with a message naming the bad field.
void fl_gpt2_config_finish(fl_gpt2_config *cfg);

// Number of parameters (padded vocabulary included), without allocating.
size_t fl_gpt2_num_params(const fl_gpt2_config *cfg);
// The parameter table of that shape, without allocating the parameters:
// model-file readers check names and shapes against it before allocating.
void fl_gpt2_table(fl_param_table *t, const fl_gpt2_config *cfg);

// Per-layer views into the flat buffers (params or grads, of the model's
// dtype): the same struct serves both, so backward reads like forward.
typedef struct {
    void *ln1w, *ln1b; // (C)
    void *qkvw, *qkvb; // (3C, C), (3C)
    void *attprojw;    // (C, C)
    void *attprojb;    // (C)
    void *ln2w, *ln2b; // (C)
    void *fcw, *fcb;   // (4C, C), (4C)
    void *fcprojw;     // (C, 4C)
    void *fcprojb;     // (C)
} fl_gpt2_layer;

typedef struct {
    void *wte;         // (Vp, C), tied with the LM head; rows V..Vp-1 stay zero
    void *wpe;         // (maxT, C)
    fl_gpt2_layer *h;  // (L)
    void *lnfw, *lnfb; // (C)
} fl_gpt2_weights;

// Activations kept for the backward pass, for a batch of up to B x T. Tensors
// are of the model's dtype; LayerNorm statistics, log-sum-exps and losses are
// always fp32. The attention projection and the MLP output are written
// straight into the residual stream, so they need no buffers of their own.
typedef struct {
    void *encoded;              // (B,T,C) embedding output = residual stream 0
    void *ln1;                  // (L,B,T,C)
    float *ln1_mean, *ln1_rstd; // (L,B,T)
    void *qkv;                  // (L,B,T,3C)
    void *atty;                 // (L,B,T,C) attention output before projection
    float *att_lse;             // (L,B,NH,T) softmax log-sum-exp
    void *residual2;            // (L,B,T,C) residual after attention
    void *ln2;                  // (L,B,T,C)
    float *ln2_mean, *ln2_rstd; // (L,B,T)
    void *fch;                  // (L,B,T,4C) MLP pre-activation
    void *fch_gelu;             // (L,B,T,4C)
    void *residual3;            // (L,B,T,C) residual after MLP = next layer's input
    void *lnf;                  // (B,T,C)
    float *lnf_mean, *lnf_rstd; // (B,T)
    void *logits;               // (B,T,Vp), overwritten by its own gradient in backward
    float *losses, *xent_lse;   // (B,T)
} fl_gpt2_acts;

typedef struct {
    fl_gpt2_config config;
    fl_dtype dtype; // of weights, gradients and activations (compute is fp32)
    fl_param_table table;
    void *params, *grads; // flat buffers of table.numel values of dtype
    fl_gpt2_weights w, g; // views into params and grads
    // activations and scratch, sized by fl_gpt2_alloc_acts
    int max_B, max_T;
    fl_gpt2_acts acts;
    // backward scratch (workspace tag, dtype): the residual stream's gradient
    // (B,T,C), one (B,T,C) and two (B,T,4C) buffers reused layer after layer
    void *dres, *dbuf_c, *dbuf_4c_a, *dbuf_4c_b;
    float *dlosses;
    float *att_workspace;
    int att_workspace_threads; // the thread count att_workspace was sized for
    void *matmul_workspace;    // matmul_workspace_bytes for the largest GEMM
    int *inputs, *targets;     // (B,T) copies of the last batch
    // state of the last forward
    int B, T;
    int n_targets; // number of positions with a loss (targets != -1)
    float loss;    // mean loss of the last forward (-1 when no targets were given)
    fl_grad_hook grad_hook;
    void *grad_hook_ctx;
} fl_gpt2;

// Builds the parameter table, allocates params and grads of dtype dt
// (tagged), and initialises weights like GPT-2: N(0, 0.02), residual
// projections N(0, 0.02/sqrt(2L)), biases 0, LayerNorm weights 1, padded
// vocab rows 0 (drawn in fp32, then rounded to dt).
void fl_gpt2_init(fl_gpt2 *model, const fl_gpt2_config *cfg, fl_dtype dt, uint64_t seed);
// Allocates activations and scratch for batches of up to B x T (T <=
// max_seq_len), for the current thread count.
void fl_gpt2_alloc_acts(fl_gpt2 *model, int B, int T);
// Bytes per tag that fl_gpt2_init + fl_gpt2_alloc_acts(B, T) allocate with
// `threads` threads: computed by the same size list the allocation walks,
// so the prediction is exact. B = 0 leaves out the activations.
void fl_gpt2_memory(const fl_gpt2_config *cfg, fl_dtype dt, int B, int T, int threads,
                    size_t bytes[FL_MEM_NTAGS]);
void fl_gpt2_free(fl_gpt2 *model);

// Forward pass over tokens (B,T). With targets (B,T) it computes the mean
// cross-entropy over positions whose target is not -1 and keeps what the
// backward needs; targets may be NULL for inference (model->loss = -1).
// Logits are in model->acts.logits (B,T,Vp).
float fl_gpt2_forward(fl_gpt2 *model, const int *tokens, const int *targets, int B, int T);
void fl_gpt2_zero_grad(fl_gpt2 *model);
// Backward of the last forward: accumulates d(loss_scale * loss)/dparams into
// model->grads (loss_scale = 1/grad_accum_steps under accumulation).
void fl_gpt2_backward(fl_gpt2 *model, float loss_scale);

// ----------------------------------------------------------------------------
// sampling

// Draws a token from the first V logits: softmax at `temperature` over the
// top_k largest (top_k <= 0: all); temperature 0 picks the argmax.
int fl_sample_logits(const float *logits, int V, float temperature, int top_k, fl_rng *rng);

// Appends n_new sampled tokens to tokens[0..n_prompt) (capacity n_prompt +
// n_new), running the model on the last max_T tokens each time; calls
// on_token (if not NULL) with each new token as it is made. The context is
// the last model->max_T tokens (the activations' T).
void fl_gpt2_generate(fl_gpt2 *model, int *tokens, int n_prompt, int n_new, float temperature,
                      int top_k, fl_rng *rng, void (*on_token)(int token, void *ctx), void *ctx);

#endif
