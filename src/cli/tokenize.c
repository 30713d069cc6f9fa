// tokenize.c: `fitlm tokenize`: text files to token shards (JSON Lines of
// instruction examples: tokenize_jsonl.c). Documents are separated by a
// blank line, LF or CRLF alike (or --doc-separator); each document's tokens
// are preceded by the tokenizer's BOS when it has one, else by
// <|endoftext|> (as GPT-2's training data and llm.c's shards are); every
// k-th document goes to the validation split (k = 1/fraction), so the split
// is the same on every run and spread over the whole input. A shard records
// the bytes of the tokens it holds: a document cut between two is counted
// in each by its part.
#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <errno.h>
#include <unistd.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/data.h"
#include "fitlm/io.h"
#include "fitlm/tokenizer.h"
#include "tokenize.h"

typedef struct {
    const uint8_t *text;
    size_t n;
    int val;
} document;

// One split's output: tokens gathered until a shard is full.
typedef struct {
    const char *name, *dir, *tokenizer;
    const fl_tokenizer *tok;
    uint32_t vocab;
    uint64_t shard_tokens;
    int32_t *buf;
    uint64_t n, source_bytes, total_tokens, total_bytes;
    int shards;
} split_writer;

static void flush(split_writer *w) {
    if (!w->n) return;
    char path[FL_FILE_PATH_MAX];
    snprintf(path, sizeof path, "%s/%s_%06d.bin", w->dir, w->name, w->shards++);
    fl_shard_write(path, w->tokenizer, w->vocab, w->buf, w->n, w->source_bytes);
    w->n = w->source_bytes = 0;
}

// A document's tokens; a shard records the bytes of the part it holds.
static void append(split_writer *w, const int32_t *ids, size_t n, size_t source_bytes) {
    w->total_bytes += source_bytes;
    w->total_tokens += n;
    while (n) {
        size_t room = (size_t)(w->shard_tokens - w->n), take = n < room ? n : room;
        size_t bytes = fl_tokenizer_prefix_bytes(w->tok, ids, n, take, source_bytes);
        memcpy(w->buf + w->n, ids, take * sizeof(int32_t));
        w->n += take;
        w->source_bytes += bytes;
        source_bytes -= bytes;
        ids += take;
        n -= take;
        if (w->n == w->shard_tokens) flush(w);
    }
}

// "<split>_<digits>.bin": a shard of the split; its number in *index.
static int is_shard_of(const char *name, const char *split, long *index) {
    size_t n = strlen(split);
    if (strncmp(name, split, n) || name[n] != '_' || !isdigit((unsigned char)name[n + 1])) return 0;
    char *end;
    *index = strtol(name + n + 1, &end, 10);
    return !strcmp(end, ".bin");
}

// Exactly the set's own names: a user's train_notes.txt beside them stays.
int tokenize_in_shard_set(const char *name) {
    long index;
    return is_shard_of(name, "train", &index) || is_shard_of(name, "val", &index);
}

// A set with its learnt tokenizer: the two go together.
static int in_learnt_set(const char *name) {
    return tokenize_in_shard_set(name) || !strcmp(name, "encoder.json") ||
           !strcmp(name, "vocab.bpe");
}

void tokenize_remove_stale(const char *dir, const char *split, int kept) {
    DIR *d = opendir(dir);
    if (!d) fl_die("cannot list %s: %s", dir, strerror(errno));
    const struct dirent *e;
    long index;
    char path[2 * FL_FILE_PATH_MAX];
    while ((e = readdir(d)))
        if (is_shard_of(e->d_name, split, &index) && index >= kept) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (unlink(path) != 0 && errno != ENOENT)
                fl_die("cannot remove %s: %s", path, strerror(errno));
        }
    closedir(d);
}

int tokenize_is_val(size_t d, double fraction) {
    return floor((double)(d + 1) * fraction) > floor((double)d * fraction);
}

static void help(void) {
    printf("usage: fitlm tokenize INPUT... -o DIR [options]\n\n"
           "Tokenizes UTF-8 text files (or JSON Lines of instruction examples) into token shards\n"
           "for `fitlm train --data DIR`: DIR/train_000000.bin, ... and DIR/val_000000.bin, ...\n\n"
           "  -o, --out DIR           output directory (created); an earlier shard set in it\n"
           "                          is replaced as a whole (written beside it, swapped in)\n"
           "  --format NAME           text: documents; jsonl: one example per line, trained on\n"
           "                          its answers only (default: text)\n"
           "  --tokenizer NAME        gpt2, byte or hf (default: gpt2)\n"
           "  --tokenizer-path PATH   gpt2: the directory of encoder.json and vocab.bpe; hf: a\n"
           "                          tokenizer.json or its directory (default: data/gpt2)\n"
           "  --val-fraction F        share of documents (examples) for validation, in [0, 0.5]\n"
           "                          (default: 0.05)\n"
           "  --shard-tokens N        tokens per shard file (default: 100000000)\n"
           "  --threads N             threads, 0 = all cores (default: 0)\n\n"
           "--format text:\n"
           "  --doc-separator TEXT    text between documents, with \\n, \\r and \\t escapes\n"
           "                          (default: a blank line, one of nothing but white space;\n"
           "                          LF and CRLF line ends alike)\n"
           "  --learn-vocab N         learn a byte-level BPE of N tokens (GPT-2's pre-tokenizer\n"
           "                          and byte alphabet, 257 <= N <= 1000000) from the training\n"
           "                          documents, write it beside the shards (DIR/encoder.json,\n"
           "                          DIR/vocab.bpe) and tokenize with it; train with\n"
           "                          --tokenizer gpt2 --tokenizer-path DIR (default: 0, none)\n\n"
           "--format jsonl: {\"messages\": [{\"role\": \"system|user|assistant\", \"content\": "
           "...}, ...]},\n"
           "{\"prompt\": ..., \"response\": ...} or {\"instruction\", \"input\", \"output\"} "
           "(optional \"system\"):\n"
           "  --template NAME         default (### User: / ### Assistant:), chatml, llama3 or "
           "llama2\n"
           "                          (default: default)\n"
           "  --prompt-field NAME     the prompt's field (default: prompt)\n"
           "  --response-field NAME   the answer's field (default: response)\n"
           "  --messages-field NAME   the chat's list of messages (default: messages)\n"
           "  --seq-len T             windows of T+1 tokens; train with the same --seq-len "
           "(default: 128)\n"
           "  --overflow POLICY       examples longer than T+1 tokens: truncate (keep the start)\n"
           "                          or split (into windows overlapping by one token) (default: "
           "truncate)\n"
           "  --no-packing            one example per window (default: examples packed whole "
           "into\n"
           "                          windows; later ones see earlier ones in the same window)\n"
           "  --skip-bad-lines        skip lines that are not valid examples, and count them\n"
           "                          (default: such a line is an error naming FILE:LINE)\n");
}

static void unescape(char *out, size_t size, const char *in) {
    size_t n = 0;
    for (; *in; in++) {
        char c = *in;
        if (c == '\\' && in[1]) {
            in++;
            c = *in == 'n' ? '\n' : *in == 't' ? '\t' : *in == 'r' ? '\r' : *in;
        }
        if (n + 1 >= size) fl_die("--doc-separator is too long");
        out[n++] = c;
    }
    out[n] = 0;
    if (!n) fl_die("--doc-separator must not be empty");
}

typedef struct {
    document *docs;
    size_t n, cap;
} document_list;

static void add_document(void *ctx, const uint8_t *text, size_t n) {
    document_list *l = ctx;
    if (l->docs && l->n < l->cap) l->docs[l->n] = (document){text, n, 0};
    l->n++;
}

// The text's documents into docs (NULL: only counted); separator "": at
// blank lines.
static size_t split_documents(const fl_text *t, const char *sep, document *docs, size_t cap) {
    document_list l = {docs, 0, cap};
    return fl_text_documents(t->bytes, t->n, *sep ? sep : NULL, add_document, &l);
}

// Learns o->learn_vocab tokens from the training documents into dir.
static fl_tokenizer *learn(const tokenize_options *o, const document *docs, size_t n_docs,
                           const char *dir) {
    const uint8_t **texts = fl_alloc(FL_MEM_OTHER, n_docs * sizeof *texts);
    size_t *lens = fl_alloc(FL_MEM_OTHER, n_docs * sizeof *lens), n = 0;
    for (size_t d = 0; d < n_docs; d++)
        if (!docs[d].val) texts[n] = docs[d].text, lens[n++] = docs[d].n;
    double t0 = fl_now();
    int vocab = fl_bpe_learn(texts, lens, n, o->learn_vocab, dir);
    printf("learnt a byte-level BPE of %d tokens from %zu training documents in %.1f s%s: "
           "%s/encoder.json and %s/vocab.bpe (train with --tokenizer-path %s)\n",
           vocab, n, fl_now() - t0, vocab < o->learn_vocab ? " (every pair left occurs once)" : "",
           o->out, o->out, o->out);
    fl_free(lens);
    fl_free(texts);
    return fl_tokenizer_load("gpt2", dir);
}

// Documents into version 1 shards: one stream per split. tok NULL: learn
// one (o->learn_vocab).
static void tokenize_text(const tokenize_options *o, const char **inputs, int n_inputs,
                          const fl_tokenizer *tok) {
    // the new set is written beside o->out and swapped in whole: training
    // never sees old and new shards mixed, whenever this run dies
    fl_dir_txn txn;
    const char *where =
        fl_dir_begin(&txn, o->out, o->learn_vocab ? in_learnt_set : tokenize_in_shard_set);

    double t0 = fl_now();
    fl_text *texts = fl_alloc(FL_MEM_OTHER, (size_t)n_inputs * sizeof(fl_text));
    size_t n_docs = 0, in_bytes = 0;
    for (int i = 0; i < n_inputs; i++) {
        fl_text_load(&texts[i], inputs[i]);
        n_docs += split_documents(&texts[i], o->separator, NULL, 0);
        in_bytes += texts[i].n;
    }
    if (!n_docs) fl_die("the input holds no documents");
    document *docs = fl_alloc(FL_MEM_OTHER, n_docs * sizeof(document));
    for (int i = 0, d = 0; i < n_inputs; i++)
        d += (int)split_documents(&texts[i], o->separator, docs + d, n_docs - (size_t)d);
    size_t n_val = 0;
    for (size_t d = 0; d < n_docs; d++) {
        docs[d].val = tokenize_is_val(d, o->val_fraction);
        n_val += (size_t)docs[d].val;
    }
    if (o->val_fraction > 0 && n_val == 0)
        fl_die("%zu documents are too few for a validation fraction of %g", n_docs,
               o->val_fraction);
    fl_tokenizer *learnt = tok ? NULL : learn(o, docs, n_docs, where);
    if (learnt) tok = learnt;

    fl_tokens *encoded = fl_alloc(FL_MEM_OTHER, n_docs * sizeof(fl_tokens));
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t d = 0; d < n_docs; d++)
        fl_tokenizer_encode(tok, docs[d].text, docs[d].n, &encoded[d]);

    uint32_t vocab = (uint32_t)fl_tokenizer_vocab_size(tok);
    int32_t start = fl_tokenizer_bos(tok) >= 0 ? fl_tokenizer_bos(tok) : fl_tokenizer_eot(tok);
    split_writer w[2] = {
        {"train", where, o->tokenizer, tok, vocab, o->shard_tokens, NULL, 0, 0, 0, 0, 0},
        {"val", where, o->tokenizer, tok, vocab, o->shard_tokens, NULL, 0, 0, 0, 0, 0}};
    uint64_t split_tokens[2] = {0, 0}; // a shard buffer no larger than its split
    for (size_t d = 0; d < n_docs; d++) split_tokens[docs[d].val] += 1 + encoded[d].n;
    for (int s = 0; s < 2; s++) {
        uint64_t n = split_tokens[s] < o->shard_tokens ? split_tokens[s] : o->shard_tokens;
        w[s].buf = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(int32_t));
    }
    for (size_t d = 0; d < n_docs; d++) {
        split_writer *out = &w[docs[d].val];
        append(out, &start, 1, 0);
        append(out, encoded[d].ids, encoded[d].n, docs[d].n);
        fl_tokens_free(&encoded[d]);
    }
    for (int s = 0; s < 2; s++) {
        flush(&w[s]);
        tokenize_remove_stale(w[s].dir, w[s].name, w[s].shards);
    }
    fl_dir_commit(&txn);
    double seconds = fl_now() - t0;
    for (int s = 0; s < 2; s++)
        if (w[s].shards)
            printf("%s: %zu documents, %llu bytes -> %llu tokens (%.2f bytes/token) in %d "
                   "shard(s) %s/%s_*.bin\n",
                   w[s].name, s ? n_val : n_docs - n_val, (unsigned long long)w[s].total_bytes,
                   (unsigned long long)w[s].total_tokens,
                   (double)w[s].total_bytes / (double)w[s].total_tokens, w[s].shards, o->out,
                   w[s].name);
    printf("tokenizer %s (vocab %u); %zu input bytes in %.2f s (%.1f MB/s)\n", o->tokenizer, vocab,
           in_bytes, seconds, (double)in_bytes / 1e6 / seconds);
    for (int s = 0; s < 2; s++) fl_free(w[s].buf);
    fl_tokenizer_free(learnt);
    fl_free(encoded);
    fl_free(docs);
    for (int i = 0; i < n_inputs; i++) fl_text_free(&texts[i]);
    fl_free(texts);
}

int cmd_tokenize(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    tokenize_options o = {.tokenizer = "gpt2",
                          .tokenizer_path = "data/gpt2",
                          .separator = "", // blank lines
                          .val_fraction = 0.05,
                          .shard_tokens = 100000000,
                          .example = {"prompt", "response", "messages", FL_TEMPLATE_DEFAULT},
                          .template_name = "default",
                          .seq_len = 128,
                          .packed = 1,
                          .policy = FL_SEQ_TRUNCATE};
    const char **inputs = fl_alloc(FL_MEM_OTHER, ((size_t)argc + 1) * sizeof *inputs);
    int n_inputs = 0;
    const char *text_only = NULL, *jsonl_only = NULL; // a flag of one format, given
    int tokenizer_path_given = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "-", 1) != 0) {
            inputs[n_inputs++] = a;
            continue;
        }
        if (!strcmp(a, "--no-packing") || !strcmp(a, "--skip-bad-lines")) { // no value
            if (!strcmp(a, "--no-packing"))
                o.packed = 0;
            else
                o.skip_bad_lines = 1;
            jsonl_only = a;
            continue;
        }
        if (i + 1 >= argc) fl_die("option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "-o") || !strcmp(a, "--out")) {
            o.out = v;
        } else if (!strcmp(a, "--format")) {
            if (strcmp(v, "text") && strcmp(v, "jsonl"))
                fl_die("--format %s: expected text or jsonl", v);
            o.jsonl = !strcmp(v, "jsonl");
        } else if (!strcmp(a, "--tokenizer")) {
            o.tokenizer = v;
        } else if (!strcmp(a, "--tokenizer-path")) {
            o.tokenizer_path = v;
            tokenizer_path_given = 1;
        } else if (!strcmp(a, "--val-fraction")) {
            o.val_fraction = cli_number(a, v, 0, 0.5);
        } else if (!strcmp(a, "--learn-vocab")) {
            o.learn_vocab = (int)cli_number(a, v, 257, 1000000);
            text_only = a;
        } else if (!strcmp(a, "--doc-separator")) {
            unescape(o.separator, sizeof o.separator, v);
            text_only = a;
        } else if (!strcmp(a, "--shard-tokens")) {
            o.shard_tokens = (uint64_t)cli_number(a, v, 1024, 1e12);
        } else if (!strcmp(a, "--threads")) {
            o.threads = (int)cli_number(a, v, 0, 4096);
        } else if (!strcmp(a, "--template")) {
            int t = fl_chat_template_parse(v);
            if (t < 0) fl_die("--template %s: expected default, chatml, llama3 or llama2", v);
            o.example.chat_template = (fl_chat_template)t;
            o.template_name = v;
            jsonl_only = a;
        } else if (!strcmp(a, "--prompt-field") || !strcmp(a, "--response-field") ||
                   !strcmp(a, "--messages-field")) {
            if (!*v) fl_die("%s must not be empty", a);
            if (!strcmp(a, "--prompt-field"))
                o.example.prompt_field = v;
            else if (!strcmp(a, "--response-field"))
                o.example.response_field = v;
            else
                o.example.messages_field = v;
            jsonl_only = a;
        } else if (!strcmp(a, "--seq-len")) {
            o.seq_len = (int)cli_number(a, v, 1, 1 << 20);
            jsonl_only = a;
        } else if (!strcmp(a, "--overflow")) {
            if (strcmp(v, "truncate") && strcmp(v, "split"))
                fl_die("--overflow %s: expected truncate or split", v);
            o.policy = !strcmp(v, "split") ? FL_SEQ_SPLIT : FL_SEQ_TRUNCATE;
            jsonl_only = a;
        } else {
            fl_die("unknown option '%s' (see --help)", a);
        }
    }
    if (o.jsonl && text_only) fl_die("%s is an option of --format text, not jsonl", text_only);
    if (!o.jsonl && jsonl_only)
        fl_die("%s is an option of --format jsonl (the input is text unless --format jsonl is "
               "given)",
               jsonl_only);
    if (!n_inputs) fl_die("no input files (usage: fitlm tokenize INPUT... -o DIR)");
    if (!o.out) fl_die("no output directory: give -o DIR");
    // before anything is created: a directory or a FIFO is not text
    for (int i = 0; i < n_inputs; i++) fl_require_regular_file(inputs[i], "data file");
    if (o.learn_vocab && strcmp(o.tokenizer, "gpt2"))
        fl_die("--learn-vocab learns a GPT-2-style BPE (--tokenizer gpt2), not --tokenizer %s",
               o.tokenizer);
    if (o.learn_vocab && tokenizer_path_given)
        fl_die("--learn-vocab writes its tokenizer to -o %s; --tokenizer-path names an existing "
               "one: give one or the other",
               o.out);
    if (o.threads) fl_set_threads(o.threads);
    fl_tokenizer *tok = o.learn_vocab ? NULL : fl_tokenizer_load(o.tokenizer, o.tokenizer_path);
    if (o.jsonl)
        tokenize_jsonl(&o, inputs, n_inputs, tok);
    else
        tokenize_text(&o, inputs, n_inputs, tok);
    fl_free(inputs);
    fl_tokenizer_free(tok);
    return 0;
}
