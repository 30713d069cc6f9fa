// params.h: the parameter table. All parameters of a model live in one flat
// buffer per dtype; the table names its views (name, shape, offset). ZeRO
// shards, checkpoints, safetensors export, weight decay, initialisation and
// memory reports are loops over rows or ranges of the buffer.
#ifndef FITLM_PARAMS_H
#define FITLM_PARAMS_H

#include <stddef.h>

#include "fitlm/core.h"
#include "fitlm/dtype.h"

enum {
    FL_PARAM_DECAY = 1 << 0,  // AdamW/SGD apply weight decay (matrices, embeddings)
    FL_PARAM_FROZEN = 1 << 1, // no gradient, no update (adapters train, the base stays)
    FL_PARAM_LINEAR = 1 << 2, // the weight of a block's linear layer: LoRA's targets, NF4's rows
    // a norm's weight or bias: applied position by position on the residual
    // stream's side, so under sequence parallelism each rank's gradient is
    // its positions' share, summed over the TP group
    FL_PARAM_TOKENWISE = 1 << 3,
    // pipeline parallelism: the last stage's copy of a tied embedding, which
    // its LM head reads; stage 0's row is the one trained, checkpointed and
    // counted (the copy's gradient is summed into it, its weights copied back)
    FL_PARAM_TIED_COPY = 1 << 4,
};

// How a row is initialised: drawn in fp32 from the model's seeded RNG in
// table order, then rounded to the storage dtype.
typedef enum {
    FL_INIT_NORMAL, // N(0, std)
    FL_INIT_ZEROS,
    FL_INIT_ONES,
    FL_INIT_UNIFORM, // U(-std, std): std is the bound
} fl_init_rule;

// The unit a row belongs to: the embedding, a block (0..L-1) or the head.
// A unit's rows are contiguous, so a unit is one range of the flat buffer.
enum { FL_UNIT_EMBED = -1 };
#define FL_UNIT_HEAD(n_layer) (n_layer)

#define FL_MAX_DIMS       4
#define FL_PARAM_NAME_MAX 64

typedef struct {
    char name[FL_PARAM_NAME_MAX]; // the architecture's Hugging Face names, without the
                                  // "transformer."/"model." prefix
    int ndim;
    size_t shape[FL_MAX_DIMS];
    size_t offset; // in elements, into the flat buffer
    size_t numel;
    unsigned flags;
    fl_init_rule init;
    float std;        // FL_INIT_NORMAL; FL_INIT_UNIFORM's bound
    int unit;         // FL_UNIT_EMBED, a block index, or FL_UNIT_HEAD(L)
    size_t live_rows; // > 0: only the first live_rows of dim 0 are initialised (the
                      // rest, e.g. vocabulary padding, stay zero); 0: all
    // tensor parallelism (Megatron): how the row splits over t ranks.
    // tp_dim -1: replicated; 0: along dim 0 (a column-parallel linear's
    // output features, the vocabulary); 1: along dim 1 (a row-parallel
    // linear's input features). Dim tp_dim holds tp_parts equal blocks
    // ([Q | K | V] of GPT-2's c_attn: 3), each split t ways. In a rank's
    // table (fl_params_slice) tp_global is that dim's global extent.
    int tp_dim, tp_parts;
    size_t tp_global;
} fl_param_view;

typedef struct {
    fl_param_view *views;
    int count, capacity;
    size_t numel;         // total elements of the flat buffer
    int tp_size, tp_rank; // a tensor-parallel rank's table (fl_params_slice); size 0: whole
} fl_param_table;

// Appends a view at the end of the buffer and returns its index (init
// N(0, 0.02), unit FL_UNIT_EMBED until set).
int fl_params_add(fl_param_table *table, const char *name, unsigned flags, int ndim,
                  const size_t *shape);
// An empty table with room for exactly `capacity` views (no regrowth, so
// its memory is one allocation the planner can predict).
void fl_params_reserve(fl_param_table *table, int capacity);
int fl_params_find(const fl_param_table *table, const char *name); // -1 when absent
void fl_params_free(fl_param_table *table);

// The table as canonical "key=value\n" lines (dtype, totals, then each
// row's shape, offset, flags and initialisation), for the ranks of a run to
// agree on (fl_comm_agree). free() the result.
char *fl_params_canonical(const fl_param_table *table, fl_dtype dt);
// Initialises the flat buffer `params` (dtype dt) row by row from the rows'
// init rules, drawing from one RNG seeded with `seed` in table order.
void fl_params_init(const fl_param_table *table, fl_dtype dt, void *params, uint64_t seed);
// The same values handed to sink(ctx, row, first, values, n) in pieces, in
// table order (for storage that is not a flat buffer of one dtype, e.g. NF4
// rows, or a device's): each piece starts at a multiple of
// FL_PARAMS_INIT_CHUNK, of at most that many values when one thread draws,
// of up to fl_params_init_bytes() / 4 when the threads share the drawing.
#define FL_PARAMS_INIT_CHUNK 4096
typedef void (*fl_params_sink)(void *ctx, int row, size_t first, const float *values, size_t n);
// Tables of 1 M values or more are drawn by every thread (fl_threads()), each
// piece from the stream's state at its first draw: the same values.
void fl_params_init_each(const fl_param_table *table, uint64_t seed, fl_params_sink sink,
                         void *ctx);
// The host buffer (FL_MEM_WORKSPACE) fl_params_init_each holds while it
// draws a table of numel values with `threads` threads (0: none; the plan's).
size_t fl_params_init_bytes(size_t numel, int threads);

// Tensor parallelism. Marks row r as split along dim (0 or 1) in `parts`
// equal blocks (fl_param_view's tp_dim); rows start replicated.
void fl_params_split(fl_param_table *t, int row, int dim, int parts);
// Rank `rank`'s table of a t-way split of the whole table `whole` (same
// rows and names; each split row keeps 1/t of every block of its split
// dim, rows in table order in a flat buffer of their own). A vocabulary row
// (live_rows > 0, split along dim 0) is padded to a multiple of 128 * t
// rows first (Megatron's make-vocab-size-divisible-by), so a rank may hold
// padding rows the whole table has not: they stay zero and belong to no
// global element. Dies naming the row when a split does not divide.
void fl_params_slice(fl_param_table *local, const fl_param_table *whole, int t, int rank);
// The rows a vocabulary of V entries spans on each of t ranks (a multiple
// of 128).
size_t fl_params_vocab_rows(size_t V, int t);
// Where a rank's row lies in the whole row: fn(ctx, local, first, run,
// stride, count) per block of it inside local elements [lo, hi): local
// elements [local, local + count) are the whole row's elements first +
// k * stride + j (k < count / run, j < run), in order. Padding rows are in
// no block. A whole table's row is one block.
// The elements of a rank's row in the whole table (its own when whole).
size_t fl_params_whole_numel(const fl_param_table *t, int row);
// The rows r of `from` with keep[r] set, in order, in a flat buffer of
// their own (a pipeline stage's rows); tp_size and tp_rank as from's.
void fl_params_select(fl_param_table *local, const fl_param_table *from, const int *keep);
typedef void (*fl_params_block_fn)(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                                   size_t count);
void fl_params_blocks(const fl_param_table *t, int row, size_t lo, size_t hi, fl_params_block_fn fn,
                      void *ctx);

#endif
