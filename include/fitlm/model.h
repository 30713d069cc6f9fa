// model.h: the model driver. An architecture (GPT-2, LLaMA) supplies its
// parameter table, its activation slots and its embedding, block and head
// passes; the driver owns allocation (from the slot lists, so the planner is
// exact), input checks, the loss, the backward loop, recomputation
// (activation checkpointing), the hooks and generation.
//
// The seams later strategies plug into:
// - hooks.pre_unit(unit, pass) before a unit runs (ZeRO-3 gathers the unit's
//   weights and rebinds them with fl_model_bind_params);
// - hooks.grad_ready(first_row, n_rows) when a unit's gradients are complete
//   (LOMO updates, ZeRO-2 reduce-scatters);
// - fl_model_bind_grads(unit, buffer): a unit's gradients may live in scratch;
// - the linear unit (fl_linear_*): LoRA, NF4 dequantisation and tensor-parallel
//   collectives wrap it.
// A unit is the embedding (FL_UNIT_EMBED), a block 0..L-1, or the head
// (FL_UNIT_HEAD(L)); its parameter rows are contiguous in the flat buffer.
#ifndef FITLM_MODEL_H
#define FITLM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"
#include "fitlm/device.h"
#include "fitlm/dtype.h"
#include "fitlm/lora.h"
#include "fitlm/params.h"
#include "fitlm/shape.h"
#include "fitlm/tp.h"

// Pipeline parallelism (pipeline.h): the blocks a rank holds, as v chunks
// of contiguous blocks (chunk c is virtual stage c * size + rank), and how
// many micro-batches' activations each chunk keeps at once. The first
// virtual stage also holds the embedding, the last the final norm, the LM
// head and the loss (and, when the head is tied, a copy of the token
// embedding: FL_PARAM_TIED_COPY).
enum { FL_PP_MAX_CHUNKS = 64 };
typedef struct {
    int size, rank, chunks; // p, this rank's place, v (size 1: the whole model)
    int first[FL_PP_MAX_CHUNKS], count[FL_PP_MAX_CHUNKS]; // chunk c: blocks [first, first+count)
    int sets[FL_PP_MAX_CHUNKS]; // activation sets of chunk c (micro-batches in flight)
} fl_pp_stage;
// The whole model as one stage (p = 1, v = 1, one set).
void fl_pp_stage_whole(fl_pp_stage *s, int n_layer);
// Whether chunk c of the stage holds the embedding / the head.
static inline int fl_pp_has_embed(const fl_pp_stage *s, int c) {
    return s->rank == 0 && c == 0;
}
static inline int fl_pp_has_head(const fl_pp_stage *s, int c) {
    return s->rank == s->size - 1 && c == s->chunks - 1;
}

// Fills the architecture's defaults for fields left 0 (n_kv_head,
// intermediate_size, norm_eps, rope_theta), rounds the vocabulary up to a
// multiple of 128 and checks the shape. Dies with a message naming the field.
void fl_model_config_finish(fl_model_config *cfg);

// Fills a model shape (and its architecture) from a preset name
// (src/model/presets.c); dies on an unknown name.
void fl_model_preset(fl_model_config *out, const char *name);
// Whether the preset's shape is for either architecture (tiny, demo).
int fl_model_preset_takes_arch(const char *name);

// Number of parameters (padded vocabulary included), without allocating.
size_t fl_model_num_params(const fl_model_config *cfg);
// The largest row's elements and one block's, without allocating (the
// planner's ZeRO communication buffers).
void fl_model_sizes(const fl_model_config *cfg, size_t *largest_row, size_t *block);
// The parameter table of that shape, without allocating the parameters:
// model-file readers check names and shapes against it before allocating.
void fl_model_table(fl_param_table *t, const fl_model_config *cfg);
// Dies naming the numbers unless a t-way tensor-parallel split can take
// the finished shape c: t divides n_head, n_kv_head (fewer KV heads than t,
// Megatron's gathered-QKV case, refused) and intermediate_size.
void fl_model_tp_check(const fl_model_config *c, int t);
// Rank `rank`'s table: the whole one, or under tensor parallelism
// (cfg->tp_size > 1) that rank's slices (fl_params_slice).
void fl_model_rank_table(fl_param_table *t, const fl_model_config *cfg, int rank);
// The rows a pipeline stage holds of a rank's table t (its chunks' blocks,
// the embedding on the first, the final norm and head on the last, with a
// copy of a tied embedding's row marked FL_PARAM_TIED_COPY), into *local;
// row_global (NULL, or local->count entries) receives each row's index in t.
void fl_model_stage_table(fl_param_table *local, const fl_param_table *t,
                          const fl_model_config *cfg, const fl_pp_stage *s, int *row_global);

enum { FL_PASS_FWD, FL_PASS_BWD };

typedef struct fl_model fl_model;

typedef struct {
    // before a unit's forward or backward (incl. its recomputation) runs
    void (*pre_unit)(void *ctx, fl_model *m, int unit, int pass);
    // a unit's gradients (rows [first_row, first_row + n_rows)) are complete
    void (*grad_ready)(void *ctx, fl_model *m, int first_row, int n_rows);
    void *ctx;
} fl_model_hooks;

typedef struct fl_arch fl_arch;

// LoRA adapters on a model (fl_model_add_lora; see lora.h).
typedef struct {
    fl_lora_config cfg; // cfg.r == 0: no adapters
    float scaling;      // fl_lora_scaling
    fl_param_table table;
    void *params, *grads; // flat buffers of table.numel values of the model's dtype
                          // (FL_MEM_PARAMS; grads FL_MEM_GRADS, from fl_model_alloc_acts)
    int *a_row;           // per base row: its lora_A row in table (lora_B follows), or -1
    // workspace of the largest adapted GEMM (fl_model_alloc_acts): A's output
    // and its gradient (N, r), the update's columns (N, out), and with
    // dropout the dropped-out input (N, in)
    void *h, *dh, *dy, *xd;
    uint64_t dropout_seed; // a mask is drawn from (seed, step, row, element)
    uint64_t dropout_step; // advanced by each training forward
} fl_lora_set;

// Base rows stored in NF4 (fl_model_init_from; see lora.h).
typedef struct {
    fl_quant_config cfg; // cfg.enabled == 0: none
    uint8_t *store;      // FL_MEM_PARAMS: each quantised row's codes and statistics
    size_t *row_at;      // per base row: byte offset of its storage in store; SIZE_MAX: dense
    void *dequant;       // workspace: the largest GEMM's weights dequantised to the model's dtype
    float *absmax;       // workspace: one row's absmax, double quantisation undone
    // a device other than the cpu: the host's side of quantising and
    // dequantising a row (its absmax and statistics; FL_MEM_OTHER), else NULL
    float *host;
    // the quantisation error of the rows stored so far (fl_model_quant_error)
    double err_sum, err_max, w_sumsq;
    size_t err_n;
} fl_quant_set;

enum { FL_MAX_SLOTS = 16 };

struct fl_model {
    fl_model_config config;
    const fl_arch *arch;
    // where its buffers live and its kernels run (fl_device_default() when it
    // was initialised): every buffer of a tag the placement rule puts on the
    // device (params, grads, acts, workspace) is the device's, and the model
    // reaches it only through the table (device.h)
    const fl_device *dev;
    fl_dtype dtype; // of weights, gradients and activations (compute is fp32)
    // the rows this process holds: the whole model's, or under tensor
    // parallelism its rank's slices (fl_params_slice), with the whole
    // model's table in `whole` (the names and shapes files hold)
    fl_param_table table, whole;
    fl_tp tp; // tensor parallelism: size 1 none
    // pipeline parallelism: the stage (size 1: the whole model), and each
    // row of the whole table's index here (-1: another stage's) and back
    fl_pp_stage pp;
    int *row_local, *row_global;
    size_t *row_offset;   // each row's offset in the rank's table of the whole model
    void *params, *grads; // flat buffers of table.numel values of dtype (grads: NULL when
                          // gradients live per unit, below)
    // the flat elements params holds: all, or (fl_model_init_from) one ZeRO-3
    // rank's shard, whose rows' weights are bound when their unit is gathered
    size_t params_begin, params_end;
    // unit gradients (fl_model_alloc_acts): no whole-model buffer; a unit's
    // gradients are bound to unit_grads while it runs backward, the
    // embedding's to embed_grads (the tied LM head adds to it before the
    // embedding's own backward, so it needs a buffer of its own); NULL else
    void *unit_grads, *embed_grads;
    // pipeline parallelism, a tied LM head: the last stage's head leaves its
    // output's gradient and its input (this set's) in tied_dout and tied_inp
    // for stage 0, which receives them into tied_dlogits and tied_x and
    // computes the tied weight's gradient there, in one process's order
    const void *tied_dout, *tied_inp;
    void *tied_dlogits, *tied_x;
    // where each row's weights and gradient are now: into params/grads unless
    // a unit was rebound (fl_model_bind_params / fl_model_bind_grads)
    void **wp, **gp;
    int *unit_row; // (L+3): unit u's rows are [unit_row[u+1], unit_row[u+2]); u = -1..L
    fl_model_hooks hooks;
    fl_lora_set lora;   // adapters (lora.cfg.r == 0: none)
    fl_quant_set quant; // NF4 base rows (quant.cfg.enabled == 0: none)
    // elements fl_model_store_row wrote: each row's once, none drawn first (a
    // checkpoint's rows are read in place, uncounted)
    size_t stored;
    // activations and scratch, sized by fl_model_alloc_acts
    int max_B, max_T;
    fl_recompute recompute;
    // (each per micro-batch in flight: a chunk's sets, fl_model_use_set)
    void *resid; // (n+1, B,T,C) the residual stream: the chunk's input, each block's output
    void *block_act[FL_MAX_SLOTS]; // per slot: L copies, or 1 when recomputed
    void *block_work[FL_MAX_SLOTS];
    void *head_act[FL_MAX_SLOTS];
    void *logits;             // (B,T,Vp), overwritten by its own gradient in backward
    float *losses, *xent_lse; // (B,T)
    void *dres;               // (B,T,C) the residual stream's gradient
    float *dlosses;           // (B,T)
    float *att_workspace;
    int att_workspace_threads; // the thread count att_workspace was sized for
    void *matmul_workspace;    // for the largest GEMM of the step
    void *dev_scratch;         // the device's own (device.h's scratch_lend), or NULL
    float *rope_table;         // LLaMA: (maxT, HS/2, 2) cos/sin
    int *inputs, *targets;     // (B,T) copies of the last batch
    int *tp_targets;           // tensor parallelism: (B,T) the targets' columns here, or -1
    float *tp_sums;            // (B,T,2) the vocabulary-parallel loss's partial sums
    // sequence parallelism: (B,T,C) gathered positions, (B,T,C) a partial
    // sum, and a unit's norm-weight gradients before their sum over TP
    void *tp_gather, *tp_partial, *tp_norm_grads;
    // pipeline parallelism: the activation set in use (chunk, set), where
    // each set-held buffer's sets start, and each set's forward state
    int chunk, set;
    void *set_base[3 * FL_MAX_SLOTS + 16];
    struct fl_set_state *set_state;
    // state of the last forward
    int B, T;
    int n_targets; // positions with a loss (targets != -1)
    float loss;    // mean loss of the last forward (-1 when no targets were given;
                   // NAN when a training forward left it in loss_sink)
    // a training step's (step.c), NULL otherwise: where (device memory) a
    // training forward leaves its sum of token losses instead of bringing
    // the mean loss to the host (fl_optimizer_loss_sink), and whether the
    // tokens go up without the host waiting for the copy (the step's
    // caller keeps them until the step returns)
    double *loss_sink;
    int async_tokens;
    // a forward for training made the logits their own gradient, for
    // dlogits_dloss (else the backward does); with config.logits_chunk, it
    // took them through the head's backward too, chunk by chunk
    int dlogits_ready;
    float dlogits_dloss;
    size_t logits_first; // the first position whose logits m->logits holds
};

// Where a model's weights come from: its shape, read once when the source is
// opened, and a producer of its rows. Random initialisation
// (fl_weight_source_random) and the file formats (io.h:
// fl_weight_source_open) are sources; fl_model_init_from makes a model of
// one.
typedef struct fl_weight_source fl_weight_source;
struct fl_weight_source {
    fl_model_config config; // the model's shape
    uint64_t seed;          // random: the seed the init rules draw from
    void *state;            // a file source's open files and what it parsed of them
    // Checks the source against the table of its shape before anything is
    // allocated, and refuses what it cannot give (NF4 rows: q enabled);
    // dies naming the file. NULL: nothing to check.
    void (*check)(fl_weight_source *s, const fl_param_table *t, const fl_quant_config *q);
    // Writes every row of m's range once: through fl_model_store_row (an
    // NF4 row in order, in pieces whose first is a multiple of
    // FL_PARAMS_INIT_CHUNK), or, for dense rows, straight into m->params
    // (m->dev's memory: through its copy_h2d or fl_model_upload_f32).
    // Padded vocabulary rows may be left as allocated (zero).
    void (*fill)(fl_weight_source *s, fl_model *m);
    void (*close)(fl_weight_source *s); // NULL: nothing to release
};

// The rows' init rules (drawn in fp32 from `seed` in table order, rounded
// to the model's dtype) for a model of shape cfg.
void fl_weight_source_random(fl_weight_source *s, const fl_model_config *cfg, uint64_t seed);
// Releases what the source holds (its files); s is empty afterwards.
void fl_weight_source_close(fl_weight_source *s);
// Builds the parameter table of the source's shape once, lets the source
// check it, allocates the parameters of dtype dt (tagged; the gradients come
// with fl_model_alloc_acts) and fills each row once from the source. q
// enabled: the base's linear layers (fl_quant_row) are stored in NF4, each
// row quantised once from its real values, so the dense model never exists
// (q NULL: dense). [begin, end): the flat elements kept (a ZeRO-3 rank's
// shard, dense only; end SIZE_MAX: to the end). A shard binds no row's
// weights (m->wp NULL) until a strategy binds its unit's gathered weights
// (fl_model_bind_params); fl_model_store_row stores the part of a row
// inside it. The source stays open (fl_weight_source_close).
void fl_model_init_from(fl_model *m, fl_weight_source *src, fl_dtype dt, const fl_quant_config *q,
                        size_t begin, size_t end);
// fl_model_init_from of the whole model, then the source closed: what a
// loader of one file format (fl_hf_load, fl_llmc_load, fl_pretrained_load)
// and fl_model_init do after opening theirs.
void fl_model_init_whole(fl_model *m, fl_weight_source *src, fl_dtype dt, const fl_quant_config *q);
// The same for one rank of a tensor-parallel split (tp NULL or size 1:
// fl_model_init_from): the rows hold this rank's slices (m->table) of the
// whole rows the source gives (m->whole), which it stores through
// fl_model_store_row in the whole rows' coordinates, so a t-way model's
// slices are exactly the one-process model's (initialise whole, then slice).
// pp (NULL or size 1: the whole model): a pipeline stage keeps only its
// rows (fl_model_stage_table), dense and whole (begin 0, end SIZE_MAX).
void fl_model_init_tp(fl_model *m, fl_weight_source *src, fl_dtype dt, const fl_quant_config *q,
                      size_t begin, size_t end, const fl_tp *tp, const fl_pp_stage *pp);
// The whole model's table: m->whole under tensor or pipeline parallelism,
// else m->table.
static inline const fl_param_table *fl_model_whole_table(const fl_model *m) {
    return m->whole.count ? &m->whole : &m->table;
}
// fl_model_init_from a random source: the whole model, dense.
void fl_model_init(fl_model *m, const fl_model_config *cfg, fl_dtype dt, uint64_t seed);
// Whether m->params holds a shard only (fl_model_init_from).
static inline int fl_model_sharded(const fl_model *m) {
    return m->params_end && (m->params_begin > 0 || m->params_end < m->table.numel);
}
// The memory that holds m's weights, as up to 3 spans (the dense rows of
// this rank's range, the NF4 rows' store, the LoRA adapters); returns how
// many: what two copies of a model must hold alike to be the same model.
// The spans are m->dev's memory: device pointers on a device other than the
// cpu (read them with m->dev->copy_d2h).
int fl_model_weight_spans(const fl_model *m, const void *data[3], size_t bytes[3]);
// Allocates what training (or, without using the gradients, inference)
// needs for batches of up to B x T (T <= max_seq_len), for the current
// thread count: the gradients, and the activations and scratch of a
// recomputation policy. unit_grads: no whole-model gradient buffer, the
// gradients of one unit at a time (for optimizers fused into the backward
// pass, LOMO and AdaLomo): fl_model_backward binds each unit's gradients to
// that buffer, zeroed, before the unit runs, and they are valid until its
// grad_ready hook returns; fl_model_zero_grad then does nothing.
// FL_GRADS_HOOK: no gradient memory at all; the pre_unit hook binds each
// unit's gradients (fl_model_bind_grads) before it runs backward, at the
// tied LM head the embedding's too (ZeRO-Offload's device ring,
// device_offload.c).
enum { FL_GRADS_WHOLE, FL_GRADS_UNIT, FL_GRADS_HOOK }; // unit_grads' values
void fl_model_alloc_acts(fl_model *m, int B, int T, fl_recompute recompute, int unit_grads);
// Bytes per tag that fl_model_init + fl_model_alloc_acts(B, T, recompute,
// unit_grads) allocate with `threads` threads: the same slot lists the
// allocation walks, so the prediction is exact. B = 0 leaves out the
// activations (the gradients are counted).
// lora, quant: the adapters and NF4 storage (NULL or disabled: none).
// pp: a pipeline stage's (NULL: the whole model). dev: the device the model
// is put on (its workspace sizes; NULL: the cpu); which tags are the
// device's is the placement rule's (device.h).
void fl_model_memory(const fl_device *dev, const fl_model_config *cfg, fl_dtype dt, int B, int T,
                     int threads, fl_recompute recompute, int unit_grads,
                     const fl_lora_config *lora, const fl_quant_config *quant,
                     const fl_pp_stage *pp, size_t bytes[FL_MEM_NTAGS]);
// Pipeline parallelism: the forward and backward below run chunk `chunk`
// of the stage (its embedding, blocks, head and loss, whichever it holds)
// on activation set `set` (0 .. pp.sets[chunk] - 1): the buffers and the
// forward's state one micro-batch keeps until its backward. The whole
// model is chunk 0 with one set.
void fl_model_use_set(fl_model *m, int chunk, int set);
// Where a chunk without the embedding takes its input (B,T,C: this rank's
// positions under sequence parallelism), received before its forward, and
// where a chunk without the head leaves its output, sent after it. Its
// backward takes the output's gradient in m->dres and leaves the input's
// there (unless it holds the embedding).
void *fl_model_chunk_input(fl_model *m);
void *fl_model_chunk_output(fl_model *m);
void fl_model_free(fl_model *m);

// Elements [first, first + n) of a base row from fp32 values (the whole
// table's layout: under tensor parallelism the part in this rank's slice is
// kept): rounded to the model's dtype, or quantised when the row is
// stored in NF4. The weight sources write rows through it. An NF4 row comes
// in order, in pieces whose first is a multiple of 4096 (any block size
// divides it); its statistics are complete with its last element.
void fl_model_store_row(fl_model *m, int row, size_t first, const float *w, size_t n);
// n values of the model's dtype at dst (the model's device memory) from
// fp32 host values, rounded on the host and uploaded through a small
// staging buffer (on the cpu stored in place: the same bits); and back,
// widened to fp32 on the host.
void fl_model_upload_f32(const fl_model *m, void *dst, const float *w, size_t n);
void fl_model_download_f32(const fl_model *m, float *out, const void *src, size_t n);
// A base row as fp32 (dequantised when stored in NF4), downloaded from the
// model's device into host memory.
void fl_model_row_f32(const fl_model *m, int row, float *out);
// The NF4 rows' quantisation error so far, as stored (each value against its
// 4-bit code times its block's fp32 absmax; double quantisation of the
// absmax adds its own): mean and max absolute error, and the weights' RMS.
// Zeros without NF4 rows.
void fl_model_quant_error(const fl_model *m, double *mean_abs, double *max_abs, double *rms);
// Adds LoRA adapters (lora.h) to a model whose base weights are in place,
// before fl_model_alloc_acts: builds their table, allocates them, draws A
// from `seed` (B = 0) and freezes the base (FL_PARAM_FROZEN on every base
// row) unless cfg->train_base.
void fl_model_add_lora(fl_model *m, const fl_lora_config *cfg, uint64_t seed);
// The base weights as fp32 (table.numel values) with each adapter merged in:
// W + scaling * B @ A, computed in fp32 (what `fitlm export --merge` writes);
// out is host memory (the rows are downloaded from m->dev).
void fl_model_merged_f32(const fl_model *m, float *out);

// Rows of a unit: [*first, *first + *count).
void fl_model_unit_rows(const fl_model *m, int unit, int *first, int *count);
// Points a unit's gradients (or weights) at `buffer`, which holds the unit's
// rows contiguously in table order; NULL points them back into model->grads
// (model->params).
void fl_model_bind_grads(fl_model *m, int unit, void *buffer);
void fl_model_bind_params(fl_model *m, int unit, void *buffer);

// Forward pass over tokens (B,T). With targets (B,T) it computes the mean
// cross-entropy over positions whose target is not -1 and keeps what the
// backward needs; targets may be NULL for inference (m->loss = -1). Logits
// are in m->logits (B,T,Vp). Token or target ids out of range are fatal.
float fl_model_forward(fl_model *m, const int *tokens, const int *targets, int B, int T);
// After a backward, the forward again for a second backward: the backward
// overwrote only the logits (with their own gradient), so the head alone is
// re-run from the kept residual stream (what a policy recomputes, the
// backward recomputes itself); the loss is the same, bitwise.
float fl_model_forward_head(fl_model *m);
// The same for a training step whose backward's dloss is known already
// (llm.c's fused classifier): the loss pass also overwrites the logits with
// their gradient, row by row while each row is in cache (the backward then
// starts at the LM head), so the (B,T,Vp) logits are read from memory once,
// not twice. The same bits as the forward and backward apart. The backward
// that follows must be given the same dloss.
float fl_model_forward_train(fl_model *m, const int *tokens, const int *targets, int B, int T,
                             float dloss);
float fl_model_forward_head_train(fl_model *m, float dloss);
void fl_model_zero_grad(fl_model *m);
// Backward of the last forward: accumulates d(dloss * sum of the losses)
// /dparams into the gradients, i.e. dloss is the weight of each target
// token's loss (1/n_targets for the mean; scale/total for token-weighted
// accumulation under loss scaling).
void fl_model_backward(fl_model *m, float dloss);

// ----------------------------------------------------------------------------
// the linear unit: out (N,OC) = inp (N,C) @ W^T + b with W (OC,C) one row of
// the table, or several consecutive rows run as one GEMM (q/k/v, gate/up).
// It owns the GEMM, the bias, the profile slot and the workspace size.

// Under tensor parallelism (Megatron) a linear is column-parallel (its
// output features split: the input's gradient is all-reduced over the TP
// group), row-parallel (its input features split: the output is
// all-reduced, then the whole bias added once) or whole.
enum { FL_LINEAR_WHOLE, FL_LINEAR_COLUMN, FL_LINEAR_ROW };

typedef struct {
    int w, b;    // weight and bias rows relative to the unit's first row (b = -1: no bias)
    int in, out; // C, OC (this rank's under tensor parallelism)
    int op;      // profile slot (fl_op)
    int tp;      // FL_LINEAR_WHOLE, _COLUMN or _ROW
} fl_linear;

// The distinct GEMM shapes (C, OC) of a step of shape c, without a model:
// the calls of each a step (the LM head's once, the others' once a block)
// and the profile names of its linears, "+"-joined; returns the count
// (<= FL_MAX_SLOTS). For the benchmarks' GEMM-bound tables.
typedef struct {
    int C, OC, calls;
    char ops[96];
} fl_gemm_shape;
int fl_model_gemm_shapes(const fl_model_config *c, fl_gemm_shape *out);

size_t fl_linear_workspace_bytes(const fl_device *d, fl_dtype dt, const fl_linear *lin, int N);
void fl_linear_forward(fl_model *m, int unit, const fl_linear *lin, void *out, const void *inp,
                       int N);
// out = gelu(pre), pre = the linear's output (fl_linear_forward), in one
// GEMM where the device fuses the GELU into it (dev->matmul_gelu_forward)
// and the linear is a plain one: no adapters, no tensor parallelism, its
// GELU not recomputed from pre (selective recomputation would recompute
// it with gelu_forward's rounding); else the linear then gelu_forward.
void fl_linear_forward_gelu(fl_model *m, int unit, const fl_linear *lin, void *out, void *pre,
                            const void *inp, int N);
// dinp (N,C) accumulates (NULL: not needed); the weight and bias gradients
// accumulate. A column-parallel linear all-reduces dinp, which must hold
// nothing else: the caller zeroes it.
void fl_linear_backward(fl_model *m, int unit, const fl_linear *lin, void *dinp, const void *dout,
                        const void *inp, int N);
// The backward of a linear whose input is gelu(pre) (GPT-2's MLP
// projection): dpre = gelu_backward(pre, the linear's dinp), in one GEMM
// where the device fuses GELU's backward into it
// (dev->matmul_dgelu_backward) and the linear is a plain one (no adapters,
// no tensor parallelism); else fl_linear_backward into dh, then
// gelu_backward. dpre and dh (N,C) as the kernels' input gradients.
void fl_linear_backward_dgelu(fl_model *m, int unit, const fl_linear *lin, void *dpre, void *dh,
                              const void *dout, const void *inp, const void *pre, int N);

// ----------------------------------------------------------------------------
// sampling

// Draws a token from the first V logits: softmax at `temperature` over the
// top_k largest (top_k <= 0: all); temperature 0 picks the argmax.
int fl_sample_logits(const float *logits, int V, float temperature, int top_k, fl_rng *rng);

// Appends n_new sampled tokens to tokens[0..n_prompt) (capacity n_prompt +
// n_new), running the model on the last max_T tokens each time; calls
// on_token (if not NULL) with each new token as it is made.
void fl_model_generate(fl_model *m, int *tokens, int n_prompt, int n_new, float temperature,
                       int top_k, fl_rng *rng, void (*on_token)(int token, void *ctx), void *ctx);
// The logits a step of generation samples from: run the forward over
// context (T positions) and return the whole vocabulary's logits at
// position last (fp32, in row or the model's own), the same on every rank.
typedef const float *(*fl_next_logits)(void *ctx, const int *context, int T, int last, float *row,
                                       float *mine);
// fl_model_generate with another forward (a pipeline's: pipeline.h); row
// holds the vocabulary (t x its columns under tensor parallelism), mine a
// rank's columns.
void fl_model_generate_with(fl_model *m, fl_next_logits next, void *next_ctx, int *tokens,
                            int n_prompt, int n_new, float temperature, int top_k, fl_rng *rng,
                            void (*on_token)(int token, void *ctx), void *ctx);
// The last forward's logits at position last over the whole vocabulary as
// fp32 (row, or the model's own row): under tensor parallelism every rank's
// columns gathered, the same on every rank.
const float *fl_model_last_logits(fl_model *m, int last, float *row, float *mine);

#endif
