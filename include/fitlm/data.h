// data.h: training data. Text is tokenized once, offline (`fitlm tokenize`),
// into token shards; training reads the shards through a memory map, so the
// data never counts against the model's memory and a resume can jump to any
// position at no cost.
#ifndef FITLM_DATA_H
#define FITLM_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"

// ----------------------------------------------------------------------------
// token shards. A shard file, little-endian:
//   bytes  0-7   magic "FITLMTOK"
//   bytes  8-11  uint32 format version (1)
//   bytes 12-15  uint32 vocabulary size
//   bytes 16-19  uint32 token width in bytes: 2 when the vocabulary fits, else 4
//   bytes 20-23  uint32 CRC-32 of the token data
//   bytes 24-31  uint64 token count N
//   bytes 32-39  uint64 bytes of source text the tokens encode (for nats/byte)
//   bytes 40-59  tokenizer name, NUL-padded
//   bytes 60-63  uint32 CRC-32 of bytes 0-59
//   then N tokens of the given width

#define FL_SHARD_HEADER    64
#define FL_SHARD_NAME_SIZE 20

typedef struct {
    char path[1024];
    char tokenizer[FL_SHARD_NAME_SIZE + 1];
    uint32_t vocab_size, width;
    uint64_t n_tokens, source_bytes;
    const uint8_t *tokens; // into the map; n_tokens * width bytes
    void *map;
    size_t map_size;
} fl_shard;

// Writes a shard crash-safely (temporary file, fsync, rename).
void fl_shard_write(const char *path, const char *tokenizer, uint32_t vocab_size,
                    const int32_t *tokens, uint64_t n_tokens, uint64_t source_bytes);
// Maps a shard and checks all of it: header, size, checksum and every token
// id < vocab size. Dies naming the file and the byte offset of the problem.
void fl_shard_open(fl_shard *shard, const char *path);
void fl_shard_close(fl_shard *shard);
static inline uint32_t fl_shard_token(const fl_shard *s, uint64_t i) {
    const uint8_t *p = s->tokens + i * s->width;
    return s->width == 2 ? (uint32_t)(p[0] | p[1] << 8)
                         : p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

// ----------------------------------------------------------------------------
// the loader: B x T batches of non-overlapping windows of T+1 tokens (inputs
// and targets shifted by one). Each epoch visits every window once, in an
// order drawn from the loader's RNG (a keyed bijection, so no permutation
// table is stored); with N ranks, rank r takes every N-th window of that
// order, so ranks see disjoint windows. The position (epoch, index, RNG) is
// a few integers, saved in checkpoints.

typedef struct {
    uint64_t epoch;  // epochs completed
    uint64_t index;  // windows of this rank taken in the current epoch
    uint64_t key[2]; // the current epoch's order
    fl_rng rng;      // draws each new epoch's key
} fl_loader_state;

typedef struct {
    fl_shard *shards;
    int n_shards;
    uint64_t *first_window; // (n_shards + 1) prefix sums of windows per shard
    uint64_t n_windows;     // over all shards
    uint64_t per_rank;      // windows each rank takes per epoch
    int T, rank, world, shuffle;
    char tokenizer[FL_SHARD_NAME_SIZE + 1];
    uint32_t vocab_size;
    uint64_t n_tokens, source_bytes;
    fl_loader_state state;
} fl_loader;

// Opens the shards `pattern` names: a directory (its <split>_*.bin files),
// a glob pattern or a file. All shards must share tokenizer and vocabulary.
// `split` is "train" or "val" (used for a directory and in messages).
void fl_loader_open(fl_loader *l, const char *pattern, const char *split, int T, uint64_t seed,
                    int shuffle, int rank, int world);
// The validation loader of a run (in order, no shuffle): val_data, or when it
// is "" the val_*.bin beside a directory of training shards, if there are
// any; "none" means no validation. Returns 1 when one was opened.
int fl_loader_open_val(fl_loader *val, const char *data, const char *val_data, int T);
void fl_loader_close(fl_loader *l);
// The next B windows of this rank: inputs and targets (B, T).
void fl_loader_next(fl_loader *l, int *inputs, int *targets, int B);
// Window w (global numbering, 0 <= w < n_windows) into inputs/targets (T each).
void fl_loader_window(const fl_loader *l, uint64_t w, int *inputs, int *targets);
// Batch `index` of `count` evaluation batches: B*count windows spread evenly
// over all windows, in order, the same every time (the loader's position is
// untouched).
void fl_loader_eval_batch(const fl_loader *l, int index, int count, int *inputs, int *targets,
                          int B);
// Cross-entropy (nats/token) of `eval`'s tokens under the token unigram
// distribution of `train` (add-one smoothed): the baseline a model must beat.
double fl_loader_unigram_xent(const fl_loader *train, const fl_loader *eval);

#endif
