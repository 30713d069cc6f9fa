// io.h: reading data and writing/reading checkpoints. Every reader checks
// what it reads and fails with a message naming the file and what is wrong;
// every writer goes through a temporary file and a rename, so a crash never
// leaves a half-written file where a good one was.
#ifndef FITLM_IO_H
#define FITLM_IO_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"
#include "fitlm/model.h"

// ----------------------------------------------------------------------------
// text data, tokenized by the byte tokenizer (token = byte value, vocab 256)

typedef struct {
    uint8_t *bytes;
    size_t n;
} fl_text;

// Loads a UTF-8 text file; an empty file or invalid UTF-8 is an error naming
// the file and the byte offset.
void fl_text_load(fl_text *text, const char *path);
void fl_text_free(fl_text *text);
// B windows of T+1 tokens at offsets drawn from rng: inputs (B,T), targets
// (B,T) shifted by one.
void fl_text_random_batch(const fl_text *text, fl_rng *rng, int *inputs, int *targets, int B,
                          int T);
// Batch `index` of `count` evaluation batches: B*count windows spread evenly
// over the whole text, the same every time.
void fl_text_eval_batch(const fl_text *text, int index, int count, int *inputs, int *targets, int B,
                        int T);
// Cross-entropy (nats/byte) of `eval` under the byte-unigram distribution of
// `train` (add-one smoothed): the baseline a language model must beat.
double fl_text_unigram_xent(const fl_text *train, const fl_text *eval);

// ----------------------------------------------------------------------------
// checkpoints: DIR/model.ckpt holds the model shape, the tokenizer name, the
// step and the fp32 weights, with a CRC-32 over everything.

// weights: the model's fp32 weights (the master copy under mixed precision),
// table.numel floats.
void fl_ckpt_save(const char *dir, const fl_gpt2 *model, const float *weights,
                  const char *tokenizer, int step);
// Initialises *model from the checkpoint (shape, and the weights rounded to dt).
void fl_ckpt_load(const char *dir, fl_gpt2 *model, fl_dtype dt, char *tokenizer,
                  size_t tokenizer_size, int *step);

uint32_t fl_crc32(uint32_t crc, const void *data, size_t n);

// ----------------------------------------------------------------------------
// files: crash-safe writes (PATH.tmp, fsync, rename over PATH, fsync the
// directory) and whole-file reads. All die with a message naming the file.

typedef struct {
    int fd;
    char path[4096], tmp[4104];
} fl_file_writer;

void fl_file_create(fl_file_writer *w, const char *path); // opens PATH.tmp
void fl_file_write(fl_file_writer *w, const void *data, size_t n);
void fl_file_commit(fl_file_writer *w); // fsync, rename over PATH, fsync the directory
void fl_file_write_all(const char *path, const void *data, size_t n);
// The whole file, NUL-terminated (fl_free it); refuses files over max_bytes.
char *fl_file_read(const char *path, size_t max_bytes, size_t *n);

#endif
