// tokenize_jsonl.c: `fitlm tokenize --format jsonl`: JSON Lines of
// instruction examples into version 2 shards (data.h): each example rendered
// by a chat template (chat.c), its answers marked as targets, and the
// examples laid out in windows of T+1 tokens (pack.c). Every line is checked
// before anything is written: a bad one is an error naming FILE:LINE, or,
// with --skip-bad-lines, skipped and counted.
#include <stdio.h>
#include <string.h>
#include <utf8proc.h>

#include "fitlm/io.h"
#include "tokenize.h"

typedef struct {
    const char *file;
    size_t line;
    const char *text;
    size_t n;
} record;

enum { REASONS_SHOWN = 5 }; // skipped lines whose reason is printed

// The longest line read as an example: millions of tokens past any window,
// while a line takes ~9-14x its size in memory as it is rendered and
// tokenized (the JSON tree, the text; per token id, mask and text bytes).
#define LINE_MAX_BYTES ((size_t)16 << 20)

// The lines of a file that hold anything but white space; records NULL:
// only counts them.
static size_t split_lines(const char *file, const uint8_t *b, size_t n, record *records) {
    size_t count = 0, line = 0;
    for (size_t start = 0; start < n; line++) {
        const uint8_t *nl = memchr(b + start, '\n', n - start);
        size_t end = nl ? (size_t)(nl - b) : n;
        if (!fl_line_is_blank(b + start, end - start)) {
            if (records)
                records[count] = (record){file, line + 1, (const char *)b + start, end - start};
            count++;
        }
        start = end + 1;
    }
    return count;
}

// The byte offset of the first invalid UTF-8 sequence in s[0..n), or n.
static size_t utf8_invalid_at(const char *s, size_t n) {
    utf8proc_int32_t cp;
    for (size_t i = 0; i < n;) {
        utf8proc_ssize_t len =
            utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (len <= 0) return i;
        i += (size_t)len;
    }
    return n;
}

// One record into ex; NULL, or the reason it is not an example (fl_free it).
static char *parse_record(const fl_tokenizer *tok, const fl_example_format *f, const record *r,
                          fl_example *ex) {
    char err[256], where[FL_FILE_PATH_MAX + 32];
    snprintf(where, sizeof where, "%s:%zu", r->file, r->line);
    fl_mem_context(where); // an out-of-memory error names the line
    size_t bad;
    int rc = -1;
    if (r->n > LINE_MAX_BYTES)
        snprintf(err, sizeof err, "the line is %.1f MiB, longer than the %zu MiB an example may be",
                 (double)r->n / 1048576.0, LINE_MAX_BYTES >> 20);
    else if ((bad = utf8_invalid_at(r->text, r->n)) < r->n)
        snprintf(err, sizeof err, "invalid UTF-8 at column %zu", bad + 1);
    else
        rc = fl_example_parse(tok, f, r->text, r->n, ex, err, sizeof err);
    fl_mem_context(NULL);
    if (rc == 0) return NULL;
    char *copy = fl_alloc(FL_MEM_OTHER, strlen(err) + 1);
    strcpy(copy, err);
    return copy;
}

// One split's windows into shards of at most shard_tokens (whole windows).
static int write_split(const tokenize_options *o, const char *dir, const char *name,
                       const fl_packer *p, uint32_t vocab) {
    size_t W = (size_t)o->seq_len + 1;
    size_t per_shard = (o->shard_tokens / W) ? (size_t)(o->shard_tokens / W) : 1;
    int shards = 0;
    for (size_t w0 = 0; w0 < p->n_windows; w0 += per_shard) {
        size_t nw = p->n_windows - w0 < per_shard ? p->n_windows - w0 : per_shard;
        fl_shard_layout layout = {(uint32_t)o->seq_len, o->policy, (uint32_t)o->packed, 0};
        uint64_t bytes = 0;
        for (size_t w = w0; w < w0 + nw; w++) {
            layout.n_examples += p->examples[w];
            bytes += p->bytes[w];
        }
        char path[FL_FILE_PATH_MAX];
        snprintf(path, sizeof path, "%s/%s_%06d.bin", dir, name, shards++);
        fl_shard_write_masked(path, o->tokenizer, vocab, p->tokens + w0 * W, p->mask + w0 * W,
                              nw * W, bytes, &layout);
    }
    tokenize_remove_stale(dir, name, shards);
    return shards;
}

static void summary(const tokenize_options *o, const char *name, const fl_packer *p, int shards) {
    size_t W = (size_t)o->seq_len + 1;
    uint64_t tokens = p->n_windows * W, used = 0;
    for (size_t w = 0; w < p->n_windows; w++) used += p->used[w];
    printf("%s: %llu examples -> %zu windows of %zu tokens (%llu tokens: %.1f%% targets, %.1f%% "
           "padding) in %d shard(s) %s/%s_*.bin\n",
           name, (unsigned long long)p->n_examples, p->n_windows, W, (unsigned long long)tokens,
           tokens ? 100.0 * (double)p->n_targets / (double)tokens : 0.0,
           tokens ? 100.0 * (double)(tokens - used) / (double)tokens : 0.0, shards, o->out, name);
}

void tokenize_jsonl(const tokenize_options *o, const char **inputs, int n_inputs,
                    const fl_tokenizer *tok) {
    double t0 = fl_now();
    uint8_t **files = fl_alloc(FL_MEM_OTHER, (size_t)n_inputs * sizeof *files);
    size_t *sizes = fl_alloc(FL_MEM_OTHER, (size_t)n_inputs * sizeof *sizes);
    size_t n_records = 0, in_bytes = 0;
    for (int i = 0; i < n_inputs; i++) {
        files[i] = fl_file_read_all(inputs[i], SIZE_MAX / 2, &sizes[i], "data file");
        n_records += split_lines(inputs[i], files[i], sizes[i], NULL);
        in_bytes += sizes[i];
    }
    if (!n_records) fl_die("the input holds no examples (no line that is not blank)");
    record *records = fl_alloc(FL_MEM_OTHER, n_records * sizeof *records);
    for (int i = 0, r = 0; i < n_inputs; i++)
        r += (int)split_lines(inputs[i], files[i], sizes[i], records + r);

    fl_example *ex = fl_alloc(FL_MEM_OTHER, n_records * sizeof *ex);
    char **why = fl_alloc(FL_MEM_OTHER, n_records * sizeof *why);
#pragma omp parallel for schedule(dynamic, 16)
    for (size_t r = 0; r < n_records; r++)
        why[r] = parse_record(tok, &o->example, &records[r], &ex[r]);

    // in line order: the first bad line is the one reported
    size_t n_bad = 0, n_good = 0, n_val = 0;
    for (size_t r = 0; r < n_records; r++) {
        if (!why[r]) continue;
        if (!o->skip_bad_lines)
            fl_die("%s:%zu: %s (--skip-bad-lines skips such lines)", records[r].file,
                   records[r].line, why[r]);
        if (n_bad++ < REASONS_SHOWN)
            fl_warn("skipping %s:%zu: %s", records[r].file, records[r].line, why[r]);
    }
    n_good = n_records - n_bad;
    if (!n_good) fl_die("none of the %zu lines is a valid example", n_records);
    for (size_t d = 0; d < n_good; d++) n_val += (size_t)tokenize_is_val(d, o->val_fraction);
    if (o->val_fraction > 0 && n_val == 0)
        fl_die("%zu examples are too few for a validation fraction of %g", n_good, o->val_fraction);

    fl_packer pack[2];
    int32_t pad = fl_tokenizer_eot(tok);
    for (int s = 0; s < 2; s++) fl_packer_init(&pack[s], o->seq_len, o->policy, o->packed, pad);
    for (size_t r = 0, d = 0; r < n_records; r++) {
        if (!why[r]) fl_packer_add(&pack[tokenize_is_val(d++, o->val_fraction)], &ex[r]);
        fl_example_free(&ex[r]);
        fl_free(why[r]);
    }

    uint64_t dropped = pack[0].n_dropped + pack[1].n_dropped;
    if (!pack[0].n_windows)
        fl_die("no training example keeps a target within %d tokens (%llu dropped): raise "
               "--seq-len or use --overflow split",
               o->seq_len + 1, (unsigned long long)dropped);
    if (dropped)
        fl_warn("%llu of %zu examples dropped: truncated to %d tokens, no answer was left (raise "
                "--seq-len or use --overflow split)",
                (unsigned long long)dropped, n_good, o->seq_len + 1);
    if (o->val_fraction > 0 && !pack[1].n_windows)
        fl_warn("no validation example keeps a target: no validation shards");

    // only now, with every line read: a bad input leaves the old set alone
    uint32_t vocab = (uint32_t)fl_tokenizer_vocab_size(tok);
    fl_dir_txn txn;
    const char *where = fl_dir_begin(&txn, o->out, tokenize_in_shard_set);
    int shards[2];
    for (int s = 0; s < 2; s++)
        shards[s] = write_split(o, where, s ? "val" : "train", &pack[s], vocab);
    fl_dir_commit(&txn);

    double seconds = fl_now() - t0;
    for (int s = 0; s < 2; s++)
        if (shards[s]) summary(o, s ? "val" : "train", &pack[s], shards[s]);
    uint64_t truncated = pack[0].n_truncated + pack[1].n_truncated,
             split = pack[0].n_split + pack[1].n_split;
    printf("template %s, %s; longer than %d tokens: %llu %s, %llu dropped (no target left); %zu "
           "bad line(s) skipped\n",
           o->template_name, o->packed ? "packed" : "one example per window", o->seq_len + 1,
           (unsigned long long)(o->policy == FL_SEQ_SPLIT ? split : truncated),
           o->policy == FL_SEQ_SPLIT ? "split" : "truncated", (unsigned long long)dropped, n_bad);
    printf("tokenizer %s (vocab %u); %zu lines, %zu input bytes in %.2f s\n", o->tokenizer, vocab,
           n_records, in_bytes, seconds);
    for (int s = 0; s < 2; s++) fl_packer_free(&pack[s]);
    fl_free(why);
    fl_free(ex);
    fl_free(records);
    for (int i = 0; i < n_inputs; i++) fl_free(files[i]);
    fl_free(files);
    fl_free(sizes);
}
