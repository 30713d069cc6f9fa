// arch.h: what an architecture supplies to the model driver (private to
// src/model). An architecture is its parameter table, the activation slots of
// a block and of the head, and the embedding, block and head passes written
// with the kernels and the linear unit; model.c does everything else.
#ifndef FITLM_MODEL_ARCH_H
#define FITLM_MODEL_ARCH_H

#include "fitlm/kernels.h"
#include "fitlm/model.h"
#include "fitlm/profile.h"
#include "fitlm/tp.h"

// One activation or workspace buffer of a block or the head, per position.
typedef struct {
    size_t per_token; // elements per (b, t)
    int f32;          // always fp32 (norm statistics, log-sum-exps), else the model's dtype
    int cheap;        // FL_RECOMPUTE_SELECTIVE drops it (one copy shared by all blocks) and the
                      // block's forward recomputes it with cheap_only set
    int seq;          // on the residual stream's side (norms, residual adds): under sequence
                      // parallelism it holds this rank's 1/t of the positions only
} fl_slot;

// What a block's passes see: its index, the batch, its input and output on
// the residual stream, and its slots (for this block under the policy).
typedef struct {
    fl_model *m;
    int l, B, T;
    const void *in; // (B,T,C)
    void *out;      // (B,T,C)
    void **act;     // the block's activation slots
    void **work;    // workspace slots, shared by every block and the head
} fl_block;

struct fl_arch {
    // defaults for fields left 0, then checks; dies naming the field
    void (*finish)(fl_model_config *c);
    size_t (*num_params)(const fl_model_config *c);
    void (*sizes)(const fl_model_config *c, size_t *largest_row, size_t *block);
    int (*table_rows)(const fl_model_config *c); // exact, for fl_params_reserve
    void (*build_table)(fl_param_table *t, const fl_model_config *c);
    // slot lists (return the count, <= FL_MAX_SLOTS)
    int (*block_slots)(const fl_model_config *c, fl_slot *out);
    int (*head_slots)(const fl_model_config *c, fl_slot *out);
    int (*work_slots)(const fl_model_config *c, fl_slot *out);
    // every GEMM shape of a step (the driver sizes the GEMM workspace for the largest)
    int (*linears)(const fl_model_config *c, fl_linear *out);
    // attention's scratch on device d for B x T positions (and `threads`
    // host threads), and tables computed once per allocation
    size_t (*attention_floats)(const fl_model_config *c, const fl_device *d, fl_dtype dt, int B,
                               int T, int threads);
    size_t (*rope_floats)(const fl_model_config *c, int T); // 0: none
    void (*embed_forward)(fl_model *m, void *out, const int *tokens, int B, int T);
    void (*embed_backward)(fl_model *m, const void *dout, const int *tokens, int B, int T);
    // cheap_only: recompute only the cheap slots from the kept ones
    void (*block_forward)(const fl_block *b, int cheap_only);
    // dres: d(block output) in, d(block input) out
    void (*block_backward)(const fl_block *b, void *dres);
    void (*head_forward)(const fl_block *h, void *logits);
    void (*head_backward)(const fl_block *h, void *dres, const void *dlogits);
};

extern const fl_arch fl_arch_gpt2, fl_arch_llama;

// A row's weights / gradient for unit u: row k of the unit.
static inline void *fl_unit_w(const fl_model *m, int u, int k) {
    return m->wp[m->unit_row[u + 1] + k];
}
static inline void *fl_unit_g(const fl_model *m, int u, int k) {
    return m->gp[m->unit_row[u + 1] + k];
}

// Placement (device.h): a model's buffers of tag params, grads, acts and
// workspace are its device's; the rest (bookkeeping) the host's.
static inline int fl_tag_on_device(fl_mem_tag tag) {
    return tag != FL_MEM_OTHER && tag != FL_MEM_COMM && tag != FL_MEM_OFFLOAD;
}
static inline void *fl_model_mem(const fl_model *m, fl_mem_tag tag, size_t bytes) {
    return fl_tag_on_device(tag) ? m->dev->alloc(m->dev, tag, bytes) : fl_alloc(tag, bytes);
}
static inline void fl_model_mem_free(const fl_model *m, fl_mem_tag tag, void *p) {
    if (fl_tag_on_device(tag))
        m->dev->free(m->dev, p);
    else
        fl_free(p);
}
// Kernel calls timed into the profile's op slots (fitlm/profile.h).
#define FL_FWD_OP(op, ...) FL_PROFILE(op, FL_FWD, 0.0, __VA_ARGS__)
#define FL_BWD_OP(op, ...) FL_PROFILE(op, FL_BWD, 0.0, __VA_ARGS__)
// A memory-bound kernel's call, with the least bytes it moves (fl_io).
#define FL_FWD_IO(op, bytes, ...) FL_PROFILE_IO(op, FL_FWD, 0.0, bytes, __VA_ARGS__)
#define FL_BWD_IO(op, bytes, ...) FL_PROFILE_IO(op, FL_BWD, 0.0, bytes, __VA_ARGS__)

// The bytes of `passes` passes over n values of dt (each stream read or
// written once): a kernel's floor at the memory's bandwidth. A `+=` output
// is read and written, two passes.
static inline double fl_io(size_t n, fl_dtype dt, int passes) {
    return (double)n * (double)fl_dtype_size(dt) * passes;
}

// A norm over `rows` rows of C: `passes` over the rows, and its `stats`
// fp32 values a row (LayerNorm's mean and rstd, RMSNorm's rstd) written or
// read once.
static inline double fl_norm_io(int rows, int C, fl_dtype dt, int passes, int stats) {
    return fl_io((size_t)rows * C, dt, passes) + 4.0 * stats * rows;
}

// An activation gradient that kernels add into (kernels.h's `+=`: the
// residual stream's, from the head down) starts at zero; the others are
// written by the op that produces them (device.h). Its own profile slot, as
// on a GPU it is a pass over memory.
static inline void fl_zero_dact(const fl_model *m, void *p, size_t bytes) {
    FL_BWD_IO(FL_OP_ZERO_ACTS, (double)bytes, m->dev->zero(m->dev, p, bytes));
}

// The attention half of a pre-norm block (block.c): out =
// o(attention(rope(qkv(normed)))), RoPE when the model has a rope table;
// the caller adds the skip connection (b->in) with the residual add fused
// into the norm after it (the device's residual_layernorm_forward or
// residual_rmsnorm_forward: the stream is read and written once).
typedef struct {
    void *normed; // (B,T,C) the block's first norm's output: the input here
    void *qkv;    // (B,T,(NH+2KV)HS) after RoPE
    void *atty;   // (B,T,C) attention output before the projection
    float *lse;   // (B,NH,T)
} fl_attention_acts;
void fl_attention_forward(const fl_block *b, const fl_linear *qkv_lin, const fl_linear *o_lin,
                          const fl_attention_acts *a, void *out);
// dres: d(out); dnormed (B,T,C) receives d(normed) (overwritten); dqkv is
// scratch of the QKV width.
void fl_attention_backward(const fl_block *b, const fl_linear *qkv_lin, const fl_linear *o_lin,
                           const fl_attention_acts *a, const void *dres, void *dnormed, void *dqkv);
// out = skip + lin(inp), the projection written into out and added in place.
void fl_residual_linear_forward(const fl_block *b, const fl_linear *lin, void *out, const void *inp,
                                const void *skip);

// LoRA inside the linear unit (lora.c): the adapters of a linear's rows
// add their update to out / their gradients and dinp's share.
void fl_lora_forward(fl_model *m, int unit, const fl_linear *lin, void *out, const void *inp,
                     int N);
void fl_lora_backward(fl_model *m, int unit, const fl_linear *lin, void *dinp, const void *dout,
                      const void *inp, int N);
// Elements of the adapters' workspace for N rows: h and dh (N, r) each, dy
// (N, widest adapted output), xd (N, widest adapted input; 0 without dropout).
void fl_lora_workspace(const fl_param_table *t, int r, float dropout, size_t N, size_t *h,
                       size_t *dy, size_t *xd);

// NF4 base rows (quant.c). The weights of a linear's rows for its GEMM, in
// the model's dtype: the rows themselves, or dequantised into quant.dequant
// (timed in the profile's phase FL_FWD or FL_BWD).
const void *fl_quant_weights(fl_model *m, int unit, const fl_linear *lin, int phase);
// Dies unless the block size is a power of two in [32, 4096].
void fl_quant_check(const fl_quant_config *q);
// Elements of the dense rows, bytes of the NF4 rows' storage, and floats of
// the largest row's absmax (the quantiser's and dequantiser's workspace).
void fl_quant_sizes(const fl_param_table *t, const fl_quant_config *q, size_t *dense, size_t *store,
                    size_t *absmax);
// Floats of quant.host on a device other than the cpu, for `absmax` floats
// of the largest row's absmax.
size_t fl_quant_host_floats(size_t absmax);
// Allocates m->params for the dense rows (packed in table order), the NF4
// storage and the row index (quant.row_at).
void fl_quant_alloc(fl_model *m, const fl_quant_config *q);

// Tensor parallelism (tp.c). The ways a model of shape c is split (1:
// whole): a rank's heads, KV heads, MLP width and LM-head columns are 1/t.
static inline int fl_tp_ways(const fl_model_config *c) {
    return c->tp_size > 1 ? c->tp_size : 1;
}
// Sequence parallelism (Korthikanti et al. 2022): the residual stream, the
// norms and the residual adds hold this rank's 1/t of the N positions.
static inline int fl_seq_parallel(const fl_model_config *c) {
    return c->tp_size > 1 && c->sequence_parallel;
}
static inline int fl_seq_rows(const fl_model_config *c, int N) {
    return fl_seq_parallel(c) ? N / c->tp_size : N;
}
// The LM head's output columns on one rank: the padded vocabulary, or its
// 1/t share padded to 128 x t (Megatron).
int fl_vocab_cols(const fl_model_config *c);
// buf[0, n) of the model's dtype summed over the TP group (Megatron's g
// forward, f backward); nothing at t = 1. Timed into the profile's
// communication slot under `pass` (FL_FWD, FL_BWD), as the two below.
void fl_tp_all_reduce(fl_model *m, void *buf, size_t n, int pass);
// Over the TP group, of the model's dtype: each rank's send[0, n) into
// recv[r*n, (r+1)*n); send[0, t*n) summed, rank r's part [r*n, (r+1)*n)
// into recv (sequence parallelism's gathers and scatters over positions).
void fl_tp_all_gather(fl_model *m, const void *send, void *recv, size_t n, int pass);
void fl_tp_reduce_scatter(fl_model *m, const void *send, void *recv, size_t n, int pass);
// The token embedding (wte, this rank's rows) plus the position embedding
// (wpe, NULL: none) for tokens (B,T): at t = 1 the encoder kernels; else
// the vocabulary-parallel lookup, its all-reduce, then the positions.
void fl_embed_forward(fl_model *m, void *out, const int *tokens, const void *wte, const void *wpe,
                      int B, int T);
void fl_embed_backward(fl_model *m, void *dwte, void *dwpe, const void *dout, const int *tokens,
                       int B, int T);
// The vocabulary-parallel cross-entropy of m->logits (this rank's columns)
// against m->targets (Megatron's cross_entropy.py: the max, then the
// target logit and the sum of exponentials, each reduced over the TP
// group; the logits are never gathered): m->losses and m->xent_lse, and
// with dloss the logits overwritten by their gradient.
void fl_vocab_xent(fl_model *m, const float *dloss);
void fl_vocab_xent_backward(fl_model *m, float dloss);

// fl_model_store_row in this rank's row coordinates (quant.c).
void fl_model_store_local(fl_model *m, int row, size_t first, const float *w, size_t n);

// Adds a row named fmt % l with its init rule and unit.
int fl_arch_add_row(fl_param_table *t, int unit, unsigned flags, fl_init_rule init, float std,
                    size_t d0, size_t d1, const char *fmt, int l);

#endif
