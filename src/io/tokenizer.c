// tokenizer.c: loading the tokenizers (hf: hf_tokenizer.c), their public
// accessors and decoding. "gpt2" reads OpenAI's encoder.json (token -> id)
// and vocab.bpe (the merges, in rank order). Both write tokens in GPT-2's
// byte alphabet, one printable code point per byte (bytes_to_unicode in
// encoder.py); the tables here hold the raw bytes.
#include "bpe.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cJSON.h>

#include "fitlm/core.h"
#include "fitlm/io.h"

static int printable(int b) {
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
}

void fl_tok_byte_decoder(int16_t byte_of[FL_ALPHABET]) {
    for (int cp = 0; cp < FL_ALPHABET; cp++) byte_of[cp] = -1;
    int k = 0;
    for (int b = 0; b < 256; b++) byte_of[printable(b) ? b : 256 + k++] = (int16_t)b;
}

long fl_tok_unmap(const int16_t *byte_of, const char *str, size_t n, uint8_t *out) {
    const uint8_t *s = (const uint8_t *)str;
    long len = 0;
    for (size_t i = 0; i < n; i++) {
        int cp = s[i];
        if (cp >= 0xc2 && cp <= 0xdf && i + 1 < n && (s[i + 1] & 0xc0) == 0x80)
            cp = (cp & 0x1f) << 6 | (s[++i] & 0x3f);
        else if (cp >= 0x80)
            return -1;
        if (cp >= FL_ALPHABET || byte_of[cp] < 0) return -1;
        out[len++] = (uint8_t)byte_of[cp];
    }
    return len;
}

char *fl_tok_read_file(const char *path, size_t *size) {
    if (access(path, R_OK) != 0)
        fl_die("cannot open tokenizer file %s: %s%s", path, strerror(errno),
               errno == ENOENT ? " (scripts/setup.sh fetches the tokenizer files)" : "");
    char *text = (char *)fl_file_read_all(path, (size_t)1 << 30, size, "tokenizer file");
    if (*size == 0) fl_die("tokenizer file %s is empty", path);
    return text;
}

static int table_bits(size_t entries) { // a power of two at most half full
    int bits = 4;
    while (((size_t)1 << bits) < 2 * entries) bits++;
    return bits;
}

static int32_t *find_slot(const fl_tokenizer *tok, const uint8_t *s, size_t n) {
    const fl_vocab_index *t = &tok->find;
    for (uint64_t i = bpe_hash(s, n) >> t->shift;; i = (i + 1) & t->mask) {
        int32_t id = t->ids[i] - 1;
        if (id < 0) return &t->ids[i];
        if (tok->offs[id + 1] - tok->offs[id] == n && !memcmp(tok->bytes + tok->offs[id], s, n))
            return &t->ids[i];
    }
}

int32_t fl_tok_find(const fl_tokenizer *tok, const void *s, size_t n) {
    return *find_slot(tok, s, n) - 1;
}

int fl_tok_index(fl_tokenizer *tok, int count, const uint8_t *use) {
    int bits = table_bits((size_t)count);
    tok->find.ids = fl_alloc(FL_MEM_OTHER, ((size_t)1 << bits) * sizeof *tok->find.ids);
    tok->find.mask = ((uint64_t)1 << bits) - 1;
    tok->find.shift = 64 - bits;
    for (int id = 0; id < count; id++) {
        if (use && !use[id]) continue;
        int32_t *slot =
            find_slot(tok, tok->bytes + tok->offs[id], tok->offs[id + 1] - tok->offs[id]);
        if (*slot) return id;
        *slot = id + 1;
    }
    return -1;
}

void fl_tok_merges_alloc(fl_tokenizer *tok, size_t merges) {
    int bits = table_bits(merges);
    tok->merges = fl_alloc(FL_MEM_OTHER, ((size_t)1 << bits) * sizeof *tok->merges);
    tok->merge_mask = ((uint64_t)1 << bits) - 1;
    tok->merge_shift = 64 - bits;
}

// text: the file's size bytes (a NUL after them); path names it in messages.
static void load_encoder(fl_tokenizer *tok, const char *text, size_t size, const char *path,
                         const int16_t *byte_of) {
    char what[FL_FILE_PATH_MAX + 512];
    snprintf(what, sizeof what, "tokenizer file %s", path);
    cJSON *root = fl_json_load(text, size, what);
    if (!cJSON_IsObject(root) || !root->child)
        fl_die("tokenizer file %s: expected a JSON object {\"token\": id, ...}", path);
    int count = cJSON_GetArraySize(root);
    uint32_t *len = fl_alloc(FL_MEM_OTHER, (size_t)count * sizeof *len); // length + 1; 0: unseen
    uint8_t *buf = fl_alloc(FL_MEM_OTHER, size);
    size_t total = 0;
    for (const cJSON *it = root->child; it; it = it->next) {
        double v = it->valuedouble;
        if (!cJSON_IsNumber(it) || !(v >= 0 && v < count) || v != (int)v)
            fl_die("tokenizer file %s: key \"%.60s\": the id must be an integer in 0..%d", path,
                   it->string, count - 1);
        long n = fl_tok_unmap(byte_of, it->string, strlen(it->string), buf);
        if (n <= 0)
            fl_die("tokenizer file %s: key \"%.60s\" is not a token in GPT-2's byte alphabet", path,
                   it->string);
        if (len[(int)v]) fl_die("tokenizer file %s: id %d is used twice", path, (int)v);
        len[(int)v] = (uint32_t)n + 1;
        total += (size_t)n;
    }
    // ids 0..count-1 each used once: the vocabulary is dense
    tok->vocab = count;
    tok->offs = fl_alloc(FL_MEM_OTHER, ((size_t)count + 1) * sizeof *tok->offs);
    tok->bytes = fl_alloc(FL_MEM_OTHER, total);
    for (int id = 0; id < count; id++) tok->offs[id + 1] = tok->offs[id] + len[id] - 1;
    for (const cJSON *it = root->child; it; it = it->next)
        fl_tok_unmap(byte_of, it->string, strlen(it->string),
                     tok->bytes + tok->offs[(int)it->valuedouble]);

    int twice = fl_tok_index(tok, count, NULL);
    if (twice >= 0)
        fl_die("tokenizer file %s: ids %d and %d are the same token", path,
               fl_tok_find(tok, tok->bytes + tok->offs[twice], len[twice] - 1), twice);
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        tok->byte_id[b] = fl_tok_find(tok, &byte, 1);
        if (tok->byte_id[b] < 0) fl_die("tokenizer file %s has no token for byte 0x%02x", path, b);
    }
    tok->eot = fl_tok_find(tok, "<|endoftext|>", 13);
    if (tok->eot < 0) fl_die("tokenizer file %s has no <|endoftext|> token", path);
    cJSON_Delete(root);
    fl_free(buf);
    fl_free(len);
}

int fl_tok_merges_ordered(const fl_tokenizer *tok) {
    int32_t *made = fl_alloc(FL_MEM_OTHER, (size_t)tok->vocab * sizeof *made); // last rank + 1
    for (uint64_t i = 0; i <= tok->merge_mask; i++)
        if (tok->merges[i].key && made[tok->merges[i].id] <= tok->merges[i].rank)
            made[tok->merges[i].id] = tok->merges[i].rank + 1;
    int ordered = 1;
    for (uint64_t i = 0; i <= tok->merge_mask; i++) {
        const fl_bpe_merge *m = &tok->merges[i];
        int32_t left = (int32_t)(m->key >> 32) - 1, right = (int32_t)(uint32_t)m->key;
        if (m->key && (made[left] > m->rank || made[right] > m->rank)) ordered = 0;
    }
    fl_free(made);
    return ordered;
}

// vocab.bpe: a "#version" line, then one merge "A B" per line, by rank.
static void load_merges(fl_tokenizer *tok, const char *text, size_t size, const char *path,
                        const int16_t *byte_of) {
    if (strncmp(text, "#version", 8) != 0)
        fl_die("tokenizer file %s line 1: expected the \"#version\" header", path);
    size_t lines = 0;
    for (size_t i = 0; i < size; i++) lines += text[i] == '\n';
    fl_tok_merges_alloc(tok, lines);
    uint8_t *buf = fl_alloc(FL_MEM_OTHER, size);
    const char *p = strchr(text, '\n'), *end = text + size;
    int line = 1, rank = 0;
    for (p = p ? p + 1 : end; p < end; p++) {
        line++;
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) eol = end; // a last line without its newline still counts
        const char *sp = memchr(p, ' ', (size_t)(eol - p));
        if (!sp || sp == p || sp + 1 == eol || memchr(sp + 1, ' ', (size_t)(eol - sp - 1)))
            fl_die("tokenizer file %s line %d: expected two tokens separated by one space", path,
                   line);
        long a = fl_tok_unmap(byte_of, p, (size_t)(sp - p), buf);
        long b = a < 0 ? -1 : fl_tok_unmap(byte_of, sp + 1, (size_t)(eol - sp - 1), buf + a);
        if (b < 0)
            fl_die("tokenizer file %s line %d: a character outside GPT-2's byte alphabet", path,
                   line);
        int32_t left = fl_tok_find(tok, buf, (size_t)a);
        int32_t right = fl_tok_find(tok, buf + a, (size_t)b);
        int32_t merged = fl_tok_find(tok, buf, (size_t)(a + b));
        if (left < 0 || right < 0 || merged < 0)
            fl_die("tokenizer file %s line %d: the merge \"%.*s\" uses or makes a token that is "
                   "not in encoder.json",
                   path, line, (int)(eol - p), p);
        // a pair listed twice keeps its last rank, as encoder.py's dict does
        fl_bpe_merge *m = bpe_merge_slot(tok, bpe_pair_key(left, right));
        *m = (fl_bpe_merge){bpe_pair_key(left, right), rank++, merged};
        p = eol;
    }
    fl_free(buf);
    tok->ordered = fl_tok_merges_ordered(tok);
}

static void load_gpt2(fl_tokenizer *tok, const fl_tokenizer_files *f) {
    int16_t byte_of[FL_ALPHABET];
    fl_tok_byte_decoder(byte_of);
    load_encoder(tok, (const char *)f->data[0], f->size[0], f->where[0], byte_of);
    if (f->n < 2) fl_die("%s", f->missing);
    load_merges(tok, (const char *)f->data[1], f->size[1], f->where[1], byte_of);
}

static void load_byte(fl_tokenizer *tok) {
    tok->vocab = 257;
    tok->eot = 256;
    tok->offs = fl_alloc(FL_MEM_OTHER, 258 * sizeof *tok->offs);
    tok->bytes = fl_alloc(FL_MEM_OTHER, 256 + 13);
    for (int b = 0; b < 256; b++) {
        tok->bytes[b] = (uint8_t)b;
        tok->offs[b] = (uint32_t)b;
        tok->byte_id[b] = b;
    }
    memcpy(tok->bytes + 256, "<|endoftext|>", 13);
    tok->offs[256] = 256;
    tok->offs[257] = 256 + 13;
}

static void known_name(const char *name) {
    if (strcmp(name, "byte") != 0 && strcmp(name, "gpt2") != 0 && strcmp(name, "hf") != 0)
        fl_die("unknown tokenizer \"%s\" (known: byte, gpt2, hf)", name);
}

void fl_tokenizer_files_add(fl_tokenizer_files *f, const char *file, uint8_t *data, size_t size,
                            const char *where) {
    FL_ASSERT(f->n < FL_TOKENIZER_FILES);
    if (size == 0) fl_die("tokenizer file %s is empty", where);
    f->file[f->n] = file;
    snprintf(f->where[f->n], sizeof f->where[f->n], "%s", where);
    f->data[f->n] = data;
    f->size[f->n++] = size;
}

static void read_into(fl_tokenizer_files *f, const char *file, const char *path) {
    size_t size;
    uint8_t *data = (uint8_t *)fl_tok_read_file(path, &size);
    fl_tokenizer_files_add(f, file, data, size, path);
}

void fl_tokenizer_files_read(fl_tokenizer_files *f, const char *name, const char *path) {
    known_name(name);
    memset(f, 0, sizeof *f);
    snprintf(f->name, sizeof f->name, "%s", name);
    snprintf(f->from, sizeof f->from, "%s",
             !strcmp(name, "byte")   ? "(built in)"
             : path && *path         ? path
             : !strcmp(name, "gpt2") ? "data/gpt2"
                                     : "");
    char file[FL_TOKENIZER_WHERE - 256]; // room in `missing` for the reason
    if (!strcmp(name, "gpt2")) {
        const char *dir = path && *path ? path : "data/gpt2";
        if ((size_t)snprintf(file, sizeof file, "%s/encoder.json", dir) >= sizeof file)
            fl_die("tokenizer directory name is too long: %s", dir);
        if (access(file, R_OK) != 0) { // GPT-2's vocabulary is known; encoding needs the files
            snprintf(f->missing, sizeof f->missing, "cannot open tokenizer file %s: %s%s", file,
                     strerror(errno),
                     errno == ENOENT ? " (scripts/setup.sh fetches the tokenizer files)" : "");
            return;
        }
        read_into(f, "encoder.json", file);
        snprintf(file, sizeof file, "%s/vocab.bpe", dir);
        if (access(file, R_OK) == 0)
            read_into(f, "vocab.bpe", file);
        else // said after encoder.json is parsed, as the loader reads them
            snprintf(f->missing, sizeof f->missing, "cannot open tokenizer file %s: %s%s", file,
                     strerror(errno),
                     errno == ENOENT ? " (scripts/setup.sh fetches the tokenizer files)" : "");
    } else if (!strcmp(name, "hf")) {
        if (!path || !*path)
            fl_die("the hf tokenizer needs a path: a tokenizer.json or a directory holding one "
                   "(--tokenizer-path)");
        struct stat st;
        int is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
        if ((size_t)snprintf(file, sizeof file, is_dir ? "%s/tokenizer.json" : "%s", path) >=
            sizeof file - 32)
            fl_die("tokenizer path is too long: %s", path);
        read_into(f, "tokenizer.json", file);
        // tokenizer_config.json beside it names the end of text
        char *slash = strrchr(file, '/');
        snprintf(slash ? slash + 1 : file, sizeof file - (size_t)(slash ? slash + 1 - file : 0),
                 "tokenizer_config.json");
        if (stat(file, &st) == 0) read_into(f, "tokenizer_config.json", file);
    }
}

void fl_tokenizer_files_free(fl_tokenizer_files *f) {
    for (int i = 0; i < f->n; i++) fl_free(f->data[i]);
    f->n = 0;
}

int fl_tokenizer_files_equal(const fl_tokenizer_files *a, const fl_tokenizer_files *b) {
    if (strcmp(a->name, b->name) || a->n != b->n) return 0;
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->file[i], b->file[i]) || a->size[i] != b->size[i] ||
            memcmp(a->data[i], b->data[i], a->size[i]))
            return 0;
    return 1;
}

fl_tokenizer *fl_tokenizer_load_files(const fl_tokenizer_files *f) {
    known_name(f->name);
    if (strcmp(f->name, "byte") && !f->n) fl_die("%s", f->missing);
    fl_tokenizer *tok = fl_alloc(FL_MEM_OTHER, sizeof *tok);
    snprintf(tok->name, sizeof tok->name, "%s", f->name);
    tok->bos = -1;
    tok->unk = -1;
    tok->start = FL_BPE_BYTES;
    tok->pattern = FL_PRE_GPT2;
    if (!strcmp(f->name, "byte"))
        load_byte(tok);
    else if (!strcmp(f->name, "gpt2"))
        load_gpt2(tok, f);
    else
        fl_hf_tokenizer_load(tok, f);
    return tok;
}

fl_tokenizer *fl_tokenizer_load(const char *name, const char *dir) {
    fl_tokenizer_files f;
    fl_tokenizer_files_read(&f, name, dir);
    fl_tokenizer *tok = fl_tokenizer_load_files(&f);
    fl_tokenizer_files_free(&f);
    return tok;
}

void fl_tokenizer_free(fl_tokenizer *tok) {
    if (!tok) return;
    fl_free(tok->bytes);
    fl_free(tok->offs);
    fl_free(tok->merges);
    fl_free(tok->find.ids);
    fl_free(tok->added);
    fl_free(tok->special);
    fl_free(tok);
}

const char *fl_tokenizer_name(const fl_tokenizer *tok) {
    return tok->name;
}

int fl_tokenizer_vocab_size(const fl_tokenizer *tok) {
    return tok->vocab;
}

int fl_tokenizer_files_vocab(const fl_tokenizer_files *f) {
    if (!strcmp(f->name, "byte")) return 257;
    // gpt2: GPT-2's 50257 unless there is a vocabulary (a learnt one)
    if (!strcmp(f->name, "gpt2") && !f->n) return 50257;
    fl_tokenizer *tok = fl_tokenizer_load_files(f); // the files decide
    int vocab = tok->vocab;
    fl_tokenizer_free(tok);
    return vocab;
}

int fl_tokenizer_vocab_of(const char *name, const char *path) {
    fl_tokenizer_files f;
    fl_tokenizer_files_read(&f, name, path);
    int vocab = fl_tokenizer_files_vocab(&f);
    fl_tokenizer_files_free(&f);
    return vocab;
}

int fl_tokenizer_eot(const fl_tokenizer *tok) {
    return tok->eot;
}

int fl_tokenizer_bos(const fl_tokenizer *tok) {
    return tok->bos;
}

const uint8_t *fl_tokenizer_token_bytes(const fl_tokenizer *tok, int id, size_t *len) {
    if (id < 0 || id >= tok->vocab)
        fl_die("token id %d is out of range for the %s tokenizer (vocabulary %d)", id, tok->name,
               tok->vocab);
    *len = tok->offs[id + 1] - tok->offs[id];
    return tok->bytes + tok->offs[id];
}

size_t fl_tokenizer_prefix_bytes(const fl_tokenizer *tok, const int32_t *ids, size_t n, size_t k,
                                 size_t total) {
    if (k >= n) return total;
    size_t prefix = 0, sum = 0, b;
    for (size_t i = 0; i < n; i++) {
        fl_tokenizer_token_bytes(tok, ids[i], &b);
        sum += b;
        prefix += i < k ? b : 0;
    }
    size_t added = sum > total ? sum - total : 0;
    prefix = prefix > added ? prefix - added : 0;
    return prefix < total ? prefix : total;
}

uint8_t *fl_tokenizer_decode(const fl_tokenizer *tok, const int32_t *ids, size_t n, size_t *len) {
    size_t total = 0, at = 0, b;
    for (size_t i = 0; i < n; i++) {
        fl_tokenizer_token_bytes(tok, ids[i], &b);
        total += b;
    }
    uint8_t *out = fl_alloc(FL_MEM_OTHER, total + 1);
    int strip = tok->strip_space;
    for (size_t i = 0; i < n; i++) {
        if (tok->special && tok->special[ids[i]]) continue;
        const uint8_t *p = fl_tokenizer_token_bytes(tok, ids[i], &b);
        // the Strip decoder: the space the encoding put first goes
        if (strip && b && p[0] == ' ') p++, b--;
        strip = 0;
        memcpy(out + at, p, b);
        at += b;
    }
    *len = at;
    return out;
}

void fl_tokenizer_files_write(const fl_tokenizer_files *f, const char *out_dir) {
    for (int i = 0; i < f->n; i++) {
        char out[FL_TOKENIZER_WHERE];
        if ((size_t)snprintf(out, sizeof out, "%s/%s", out_dir, f->file[i]) >= sizeof out)
            fl_die("output directory name is too long: %s", out_dir);
        fl_file_write_all(out, f->data[i], f->size[i]);
    }
}
