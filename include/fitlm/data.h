// data.h: training data. Text is tokenized once, offline (`fitlm tokenize`),
// into token shards; training reads the shards through a memory map, so the
// data never counts against the model's memory and a resume can jump to any
// position at no cost.
#ifndef FITLM_DATA_H
#define FITLM_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/core.h"
#include "fitlm/tokenizer.h"

// ----------------------------------------------------------------------------
// token shards. A shard file, little-endian:
//   bytes  0-7   magic "FITLMTOK"
//   bytes  8-11  uint32 format version (1 or 2)
//   bytes 12-15  uint32 vocabulary size
//   bytes 16-19  uint32 token width in bytes: 2 when the vocabulary fits, else 4
//   bytes 20-23  uint32 CRC-32 of the token data (version 2: and the mask)
//   bytes 24-31  uint64 token count N
//   bytes 32-39  uint64 bytes of source text the tokens encode (for nats/byte)
//   bytes 40-59  tokenizer name, NUL-padded
//   bytes 60-63  uint32 CRC-32 of bytes 0-59
// Version 1 (text: one stream of documents) then holds N tokens of the given
// width. Version 2 (examples with a loss mask, `tokenize --format jsonl`)
// has a 128-byte header; bytes 0-63 as above (so an older fitlm reports the
// version rather than a corrupt header), then:
//   bytes 64-67  uint32 T: the tokens are windows of T+1, back to back
//   bytes 68-71  uint32 policy for examples longer than T+1 (fl_seq_policy)
//   bytes 72-75  uint32 flags: bit 0 packed (several examples per window)
//   bytes 76-83  uint64 examples
//   bytes 84-91  uint64 tokens whose mask bit is set (targets)
//   bytes 92-123 zero
//   bytes 124-127 uint32 CRC-32 of bytes 64-123
//   then N tokens (N a multiple of T+1), then ceil(N/8) mask bytes: bit
//   i%8 of byte i/8 set when token i is a target (the model is trained to
//   predict it); the unused high bits of the last byte are zero.

#define FL_SHARD_HEADER    64
#define FL_SHARD_HEADER_V2 128
#define FL_SHARD_NAME_SIZE 20

// What happens to an example longer than a window (T+1 tokens).
typedef enum {
    FL_SEQ_TRUNCATE = 1, // its first T+1 tokens are kept
    FL_SEQ_SPLIT = 2,    // cut into windows that overlap by one token (no target lost)
} fl_seq_policy;

// How a version 2 shard's examples were laid out into windows.
typedef struct {
    uint32_t seq_len; // T
    uint32_t policy;  // fl_seq_policy
    uint32_t packed;  // 1: whole examples packed into windows; 0: one per window
    uint64_t n_examples;
} fl_shard_layout;

typedef struct {
    char path[1024];
    char tokenizer[FL_SHARD_NAME_SIZE + 1];
    uint32_t version, vocab_size, width;
    uint64_t n_tokens, source_bytes;
    const uint8_t *tokens; // into the map; n_tokens * width bytes
    const uint8_t *mask;   // version 2: the target bits; NULL: every token is a target
    fl_shard_layout layout;
    uint64_t n_targets; // tokens that are targets (all of them without a mask)
    void *map;
    size_t map_size;
} fl_shard;

// Writes a version 1 shard crash-safely (temporary file, fsync, rename).
void fl_shard_write(const char *path, const char *tokenizer, uint32_t vocab_size,
                    const int32_t *tokens, uint64_t n_tokens, uint64_t source_bytes);
// Writes a version 2 shard: mask[i] != 0 when token i is a target; n_tokens
// is a multiple of layout->seq_len + 1.
void fl_shard_write_masked(const char *path, const char *tokenizer, uint32_t vocab_size,
                           const int32_t *tokens, const uint8_t *mask, uint64_t n_tokens,
                           uint64_t source_bytes, const fl_shard_layout *layout);
// Maps a shard and checks all of it: header, size, checksum and every token
// id < vocab size. Dies naming the file and the byte offset of the problem.
void fl_shard_open(fl_shard *shard, const char *path);
void fl_shard_close(fl_shard *shard);
static inline uint32_t fl_shard_token(const fl_shard *s, uint64_t i) {
    const uint8_t *p = s->tokens + i * s->width;
    return s->width == 2 ? (uint32_t)(p[0] | p[1] << 8)
                         : p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
// 1 when token i is a target: what the model learns to predict.
static inline int fl_shard_is_target(const fl_shard *s, uint64_t i) {
    return !s->mask || (s->mask[i >> 3] >> (i & 7) & 1);
}

// ----------------------------------------------------------------------------
// the loader: B x T batches of non-overlapping windows of T+1 tokens (inputs
// and targets shifted by one). In a stream (version 1 shards) window w
// starts at token w*T, so consecutive windows share a token and every token
// but the first is a target once. Version 2 shards are laid out in windows
// of T+1 already (their T must be the run's): window w starts at w*(T+1),
// and a target whose token is not in the mask is -1 (the loss skips it).
// Each epoch visits every window once, in an
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
    uint64_t stride;        // tokens from one window's start to the next: T or T+1
    int T, rank, world, shuffle;
    char tokenizer[FL_SHARD_NAME_SIZE + 1];
    uint32_t vocab_size;
    uint64_t n_tokens, n_targets, source_bytes;
    fl_loader_state state;
} fl_loader;

// The shards `pattern` names (a directory: its <split>_*.bin files; a glob
// pattern; a file), opened and checked (fl_shard_open) into an array of
// *count (fl_free it after closing each). They must share tokenizer,
// vocabulary, format version and (version 2) sequence length. `split`
// ("train", "val") is used for a directory and in messages.
fl_shard *fl_shards_open(const char *pattern, const char *split, int *count);
// Opens the shards `pattern` names: a directory (its <split>_*.bin files),
// a glob pattern or a file. All shards must share tokenizer, vocabulary and
// version; version 2 shards must have been laid out for this T.
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
// Cross-entropy (nats/token) of `eval`'s target tokens under the unigram
// distribution of `train`'s targets (add-one smoothed): the baseline a
// model must beat.
double fl_loader_unigram_xent(const fl_loader *train, const fl_loader *eval);

// ----------------------------------------------------------------------------
// instruction examples (chat.c): one JSON Lines record, rendered by a chat
// template into text segments and tokenized with a loss mask. Accepted
// records: {"messages": [{"role": "system"|"user"|"assistant", "content":
// "..."}, ...]}; {"prompt": "...", "response": "..."} (field names
// configurable); Alpaca's {"instruction", "input" (optional), "output"};
// the last two may carry a "system" string. Only assistant turns (with
// their end-of-turn marker and the final end of text) are targets.

typedef enum {
    FL_TEMPLATE_DEFAULT, // ### System: / ### User: / ### Assistant:, <eot> after each answer
    FL_TEMPLATE_CHATML,  // <|im_start|>role\n...<|im_end|>
    FL_TEMPLATE_LLAMA3,  // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
    FL_TEMPLATE_LLAMA2,  // <s>[INST] <<SYS>>...<</SYS>> user [/INST] answer </s>
} fl_chat_template;

// The template named `name`; -1 when there is none.
int fl_chat_template_parse(const char *name);

typedef struct {
    const char *prompt_field, *response_field, *messages_field;
    fl_chat_template chat_template;
} fl_example_format;

// An example's tokens: mask[i] = 1 when ids[i] is a target, text_bytes[i]
// the bytes of text a target stands for (0 for the markers a template
// inserts as tokens), so that the bytes of any kept part are known.
typedef struct {
    fl_tokens tokens;
    uint8_t *mask;
    uint32_t *text_bytes;
    size_t mask_cap, text_bytes_cap;
} fl_example;

// Parses one record (json[0..n), no newline), renders and tokenizes it into
// *ex (emptied first). Returns 0, or -1 with the reason in err (invalid
// JSON, a NUL in a string, a missing field, a wrong type, an unknown role,
// no or an empty answer); dies naming fl_mem_context when memory runs
// out. Segments are encoded one at a time and concatenated (as
// LLaMA-Factory does): a SentencePiece tokenizer's normaliser then puts its
// "▁" before each segment. Thread-safe.
int fl_example_parse(const fl_tokenizer *tok, const fl_example_format *f, const char *json,
                     size_t n, fl_example *ex, char *err, size_t errlen);
void fl_example_free(fl_example *ex);

// ----------------------------------------------------------------------------
// packing (pack.c): examples into windows of T+1 tokens. Packed, an example
// goes whole into the open window with the least room that holds it (best
// fit, so windows fill up without reordering much), else into a new one;
// unpacked, each example gets its own window. The rest of a window is
// padding (the end-of-text token, never a target). Longer examples are
// truncated or split (fl_seq_policy); a window's first token is never a
// target, and pieces without targets are dropped.

typedef struct {
    int T, packed;
    fl_seq_policy policy;
    int32_t pad;
    int32_t *tokens;     // (windows, T+1)
    uint8_t *mask;       // (windows, T+1)
    uint32_t *examples;  // (windows) examples whose first piece is there
    uint64_t *bytes;     // (windows) the text bytes of the targets in them
    uint32_t *used;      // (windows) tokens filled
    int64_t *room_head;  // (T+2) a window with that much room, -1: none
    int64_t *room_next;  // (windows) the next one in its room's list
    uint64_t *room_bits; // rooms whose list is not empty
    size_t n_windows, cap;
    uint64_t n_examples, n_truncated, n_split, n_dropped, n_targets;
} fl_packer;

void fl_packer_init(fl_packer *p, int T, fl_seq_policy policy, int packed, int32_t pad);
void fl_packer_add(fl_packer *p, const fl_example *ex);
void fl_packer_free(fl_packer *p);

#endif
