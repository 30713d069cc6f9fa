// tokenize.h: what `fitlm tokenize`'s two input formats share: the options,
// the validation split and the shard set's files.
#ifndef FITLM_CLI_TOKENIZE_H
#define FITLM_CLI_TOKENIZE_H

#include <stddef.h>

#include "fitlm/data.h"
#include "fitlm/tokenizer.h"

typedef struct {
    const char *out, *tokenizer, *tokenizer_path;
    char separator[64];
    double val_fraction;
    uint64_t shard_tokens;
    int threads;
    int jsonl;
    int learn_vocab; // --format text: tokens of a BPE to learn (0: none)
    // --format jsonl
    fl_example_format example;
    const char *template_name;
    int seq_len, packed, skip_bad_lines;
    fl_seq_policy policy;
} tokenize_options;

// Document or example d goes to validation: the first one past each multiple
// of 1/fraction, so the split is the same on every run and spread out.
int tokenize_is_val(size_t d, double fraction);
// A shard set's files and their temporaries (what a new set replaces).
int tokenize_in_shard_set(const char *name);
// Removes dir's <split>_<k>.bin for k >= kept: written in place, shards of an
// earlier, longer run would join the new set.
void tokenize_remove_stale(const char *dir, const char *split, int kept);
// `--format jsonl`: instruction examples into version 2 shards.
void tokenize_jsonl(const tokenize_options *o, const char **inputs, int n_inputs,
                    const fl_tokenizer *tok);

#endif
