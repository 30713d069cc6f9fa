// hf_tokenizer.c: name "hf", a Hugging Face tokenizer.json of one of two
// BPE families:
// - byte-level (GPT-2, LLaMA-3): a ByteLevel pre-tokenizer, alone with
//   use_regex (GPT-2's pattern) or after a Split by GPT-2's or LLaMA-3's
//   pattern; tokens written in GPT-2's byte alphabet;
// - SentencePiece-style (LLaMA-1/2, TinyLlama, Mistral): merges over
//   characters with <0xNN> byte fallback, the text normalised by Prepend "▁"
//   and Replace " " -> "▁", or by a Metaspace pre-tokenizer.
// Either may have the NFC normaliser.
// It reads exactly what those files use and refuses anything else, naming
// the key and the type: what it cannot do exactly, it does not do at all.
#include "bpe.h"

#include <stdlib.h>
#include <cJSON.h>

#include "fitlm/core.h"
#include "fitlm/io.h"

static const char LLAMA3_REGEX[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char BAR[] = "\xe2\x96\x81"; // "▁", SentencePiece's space

// What the file's parts say, gathered before the tables are built.
typedef struct {
    const char *path;
    int byte_level;  // a ByteLevel pre-tokenizer
    int pattern;     // FL_PRE_*
    int split;       // a Split pre-tokenizer
    int prepend;     // the Prepend "▁" normaliser
    int replace;     // the Replace " " -> "▁" normaliser
    int nfc;         // the NFC normaliser
    int meta;        // a Metaspace pre-tokenizer: FL_PREPEND_META_* or NONE; -1: none
    const char *bos; // the post-processor's leading special token
    int strip_space; // a Strip or Metaspace decoder
} hf_loader;

typedef char where_buf[160];

static const cJSON *item(const cJSON *obj, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(obj, key);
}

static int is_null(const cJSON *v) {
    return !v || cJSON_IsNull(v);
}

static const char *str_at(const hf_loader *L, const cJSON *obj, const char *key,
                          const char *where) {
    const cJSON *v = item(obj, key);
    if (!cJSON_IsString(v))
        fl_die("tokenizer file %s: %s.%s must be a string", L->path, where, key);
    return v->valuestring;
}

// A true/false key; absent or null: dflt.
static int flag_at(const hf_loader *L, const cJSON *obj, const char *key, const char *where,
                   int dflt) {
    const cJSON *v = item(obj, key);
    if (is_null(v)) return dflt;
    if (!cJSON_IsBool(v))
        fl_die("tokenizer file %s: %s.%s must be true or false", L->path, where, key);
    return cJSON_IsTrue(v);
}

static const cJSON *array_at(const hf_loader *L, const cJSON *obj, const char *key,
                             const char *where) {
    const cJSON *v = item(obj, key);
    if (!cJSON_IsArray(v)) fl_die("tokenizer file %s: %s.%s must be an array", L->path, where, key);
    return v;
}

static const char *type_of(const hf_loader *L, const cJSON *obj, const char *where) {
    if (!cJSON_IsObject(obj))
        fl_die("tokenizer file %s: %s must be an object or null", L->path, where);
    return str_at(L, obj, "type", where);
}

__attribute__((noreturn)) static void unsupported(const hf_loader *L, const char *where,
                                                  const char *type, const char *supported) {
    fl_die("tokenizer file %s: %s: type \"%s\" is not supported (supported: %s)", L->path, where,
           type, supported);
}

static void must_be(const hf_loader *L, const cJSON *obj, const char *key, const char *where,
                    const char *want) {
    if (strcmp(str_at(L, obj, key, where), want) != 0)
        fl_die("tokenizer file %s: %s.%s \"%s\" is not supported (only \"%s\")", L->path, where,
               key, str_at(L, obj, key, where), want);
}

// ----------------------------------------------------------------------------
// normalizer, pre_tokenizer, post_processor, decoder

static void normalizer(hf_loader *L, const cJSON *n, const char *where) {
    if (is_null(n)) return;
    const char *type = type_of(L, n, where);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = array_at(L, n, "normalizers", where), *it;
        int i = 0;
        cJSON_ArrayForEach(it, list) {
            where_buf w;
            snprintf(w, sizeof w, "%s.normalizers[%d]", where, i++);
            normalizer(L, it, w);
        }
    } else if (!strcmp(type, "Prepend")) {
        must_be(L, n, "prepend", where, BAR);
        L->prepend = 1;
    } else if (!strcmp(type, "Replace")) {
        const cJSON *pattern = item(n, "pattern");
        const cJSON *s = cJSON_IsObject(pattern) ? item(pattern, "String") : NULL;
        if (!cJSON_IsString(s) || strcmp(s->valuestring, " ") != 0)
            fl_die("tokenizer file %s: %s.pattern: only {\"String\": \" \"} is supported", L->path,
                   where);
        must_be(L, n, "content", where, BAR);
        L->replace = 1;
    } else if (!strcmp(type, "NFC")) {
        L->nfc = 1;
    } else {
        unsupported(L, where, type, "Sequence, Prepend, Replace, NFC");
    }
}

static void set_pattern(hf_loader *L, int pattern, const char *where) {
    if (L->pattern != FL_PRE_NONE)
        fl_die("tokenizer file %s: %s: a second splitting pattern is not supported", L->path,
               where);
    L->pattern = pattern;
}

static void pre_tokenizer(hf_loader *L, const cJSON *p, const char *where) {
    if (is_null(p)) return;
    const char *type = type_of(L, p, where);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = array_at(L, p, "pretokenizers", where), *it;
        int i = 0;
        cJSON_ArrayForEach(it, list) {
            where_buf w;
            snprintf(w, sizeof w, "%s.pretokenizers[%d]", where, i++);
            pre_tokenizer(L, it, w);
        }
    } else if (!strcmp(type, "ByteLevel")) {
        if (flag_at(L, p, "add_prefix_space", where, 0))
            fl_die("tokenizer file %s: %s.add_prefix_space true is not supported", L->path, where);
        if (flag_at(L, p, "use_regex", where, 1)) set_pattern(L, FL_PRE_GPT2, where);
        L->byte_level = 1;
    } else if (!strcmp(type, "Split")) {
        const cJSON *pattern = item(p, "pattern");
        const cJSON *re = cJSON_IsObject(pattern) ? item(pattern, "Regex") : NULL;
        if (!cJSON_IsString(re))
            fl_die("tokenizer file %s: %s.pattern: only {\"Regex\": ...} is supported", L->path,
                   where);
        if (!strcmp(re->valuestring, LLAMA3_REGEX))
            set_pattern(L, FL_PRE_LLAMA3, where);
        else if (!strcmp(re->valuestring, GPT2_REGEX))
            set_pattern(L, FL_PRE_GPT2, where);
        else
            fl_die("tokenizer file %s: %s.pattern: the regex \"%.300s\" is not supported (only "
                   "GPT-2's and LLaMA-3's)",
                   L->path, where, re->valuestring);
        must_be(L, p, "behavior", where, "Isolated");
        if (flag_at(L, p, "invert", where, 0))
            fl_die("tokenizer file %s: %s.invert true is not supported", L->path, where);
        L->split = 1;
    } else if (!strcmp(type, "Metaspace")) {
        must_be(L, p, "replacement", where, BAR);
        if (flag_at(L, p, "split", where, 1)) // absent: true, in the old layout
            fl_die("tokenizer file %s: %s.split must be false (splitting at every \"▁\" is not "
                   "supported)",
                   L->path, where);
        const cJSON *scheme = item(p, "prepend_scheme");
        const char *s = cJSON_IsString(scheme) ? scheme->valuestring : "";
        L->meta = !strcmp(s, "first")    ? FL_PREPEND_META_FIRST
                  : !strcmp(s, "always") ? FL_PREPEND_META_ALWAYS
                  : !strcmp(s, "never")  ? FL_PREPEND_NONE
                                         : -1;
        if (L->meta < 0)
            fl_die(
                "tokenizer file %s: %s.prepend_scheme must be \"first\", \"always\" or \"never\"",
                L->path, where);
    } else {
        unsupported(L, where, type, "Sequence, ByteLevel, Split, Metaspace");
    }
}

static void post_processor(hf_loader *L, const cJSON *p, const char *where) {
    if (is_null(p)) return;
    const char *type = type_of(L, p, where);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = array_at(L, p, "processors", where), *it;
        int i = 0;
        cJSON_ArrayForEach(it, list) {
            where_buf w;
            snprintf(w, sizeof w, "%s.processors[%d]", where, i++);
            post_processor(L, it, w);
        }
    } else if (!strcmp(type, "TemplateProcessing")) {
        // "$A" or "<special> $A": what encoding a text for training needs
        const cJSON *single = array_at(L, p, "single", where);
        int n = cJSON_GetArraySize(single);
        const cJSON *first = cJSON_GetArrayItem(single, 0),
                    *last = cJSON_GetArrayItem(single, n - 1);
        const cJSON *special = n == 2 ? item(first, "SpecialToken") : NULL;
        const cJSON *seq = last ? item(last, "Sequence") : NULL;
        if (!(n == 1 || special) || !seq || !cJSON_IsString(item(seq, "id")) ||
            strcmp(item(seq, "id")->valuestring, "A") != 0)
            fl_die("tokenizer file %s: %s.single: only \"$A\" and \"<special> $A\" are supported",
                   L->path, where);
        if (special) {
            where_buf w;
            snprintf(w, sizeof w, "%s.single[0].SpecialToken", where);
            L->bos = str_at(L, special, "id", w);
        }
    } else if (strcmp(type, "ByteLevel") != 0) { // ByteLevel: offsets only
        unsupported(L, where, type, "Sequence, TemplateProcessing, ByteLevel");
    }
}

static void decoder(hf_loader *L, const cJSON *d, const char *where) {
    if (is_null(d)) return;
    const char *type = type_of(L, d, where);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = array_at(L, d, "decoders", where), *it;
        int i = 0;
        cJSON_ArrayForEach(it, list) {
            where_buf w;
            snprintf(w, sizeof w, "%s.decoders[%d]", where, i++);
            decoder(L, it, w);
        }
    } else if (!strcmp(type, "Strip")) {
        must_be(L, d, "content", where, " ");
        const cJSON *start = item(d, "start"), *stop = item(d, "stop");
        if (!cJSON_IsNumber(start) || !cJSON_IsNumber(stop) || start->valuedouble > 1 ||
            start->valuedouble < 0 || stop->valuedouble != 0)
            fl_die("tokenizer file %s: %s: only start 0 or 1 and stop 0 are supported", L->path,
                   where);
        L->strip_space = start->valuedouble == 1;
    } else if (!strcmp(type, "Metaspace")) {
        const cJSON *scheme = item(d, "prepend_scheme");
        L->strip_space = !cJSON_IsString(scheme) || strcmp(scheme->valuestring, "never") != 0;
    } else if (strcmp(type, "ByteLevel") != 0 && strcmp(type, "Replace") != 0 &&
               strcmp(type, "ByteFallback") != 0 && strcmp(type, "Fuse") != 0) {
        // ByteLevel, Replace "▁" -> " ", ByteFallback, Fuse: token bytes already are the text
        unsupported(L, where, type,
                    "Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip");
    }
}

// ----------------------------------------------------------------------------
// the vocabulary

// An upper-case hex digit's value (as in Hugging Face's "<0x{:02X}>"), or -1.
static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

// A vocabulary key's bytes (room for strlen(key) in out): byte-level keys
// are in GPT-2's alphabet; SentencePiece's have "▁" for a space, and
// "<0xNN>" is byte NN (*byte set to it, else -1). -1 when not in the alphabet.
static long key_bytes(int byte_level, const int16_t *byte_of, const char *key, uint8_t *out,
                      int *byte) {
    size_t n = strlen(key);
    *byte = -1;
    if (byte_level) return fl_tok_unmap(byte_of, key, n, out);
    if (n == 6 && !memcmp(key, "<0x", 3) && hex_digit(key[3]) >= 0 && hex_digit(key[4]) >= 0 &&
        key[5] == '>') {
        *byte = hex_digit(key[3]) << 4 | hex_digit(key[4]);
        out[0] = (uint8_t)*byte;
        return 1;
    }
    long len = 0;
    for (size_t i = 0; i < n; i++) {
        int bar = n - i >= 3 && !memcmp(key + i, BAR, 3);
        out[len++] = bar ? ' ' : (uint8_t)key[i];
        i += bar ? 2 : 0;
    }
    return len;
}

// One token's source while the tables are built.
typedef struct {
    const char *key; // NULL: not yet seen
    int in_vocab, added, special;
} token_src;

// An id: where[0] (with key, if any) names its place in the file.
static int id_of(const hf_loader *L, const cJSON *v, const char *where, const char *key,
                 int limit) {
    double d = v ? v->valuedouble : -1;
    if (!cJSON_IsNumber(v) || !(d >= 0 && d < limit) || d != (int)d)
        fl_die("tokenizer file %s: %s%s%.60s%s: the id must be an integer in 0..%d (ids are "
               "0..V-1 over model.vocab and added_tokens)",
               L->path, where, key ? " key \"" : "", key ? key : "", key ? "\"" : "", limit - 1);
    return (int)d;
}

typedef struct {
    int first, len, id;
} added_key;

static int added_cmp(const void *a, const void *b) {
    const added_key *x = a, *y = b;
    if (x->first != y->first) return x->first - y->first;
    if (x->len != y->len) return y->len - x->len; // longest first
    return x->id - y->id;
}

// The ids of the model's vocabulary and the added tokens, their bytes and
// the lookup tables.
static void build_vocab(fl_tokenizer *tok, const hf_loader *L, const cJSON *vocab,
                        const cJSON *added) {
    int n_vocab = cJSON_GetArraySize(vocab), n_added = cJSON_GetArraySize(added);
    int limit = n_vocab + n_added;
    token_src *src = fl_alloc(FL_MEM_OTHER, (size_t)limit * sizeof *src);
    size_t total = 0;
    for (const cJSON *it = vocab->child; it; it = it->next) {
        int id = id_of(L, it, "model.vocab", it->string, limit);
        if (src[id].key) fl_die("tokenizer file %s: model.vocab: id %d is used twice", L->path, id);
        src[id].key = it->string;
        src[id].in_vocab = 1;
        total += strlen(it->string);
    }
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, added) {
        where_buf w;
        snprintf(w, sizeof w, "added_tokens[%d]", i++);
        const char *content = str_at(L, it, "content", w);
        int id = id_of(L, item(it, "id"), w, NULL, limit);
        if (!*content) fl_die("tokenizer file %s: %s: the content is empty", L->path, w);
        static const char *const unsupported_flags[] = {"single_word", "lstrip", "rstrip"};
        for (int k = 0; k < 3; k++)
            if (flag_at(L, it, unsupported_flags[k], w, 0))
                fl_die("tokenizer file %s: %s.%s true is not supported", L->path, w,
                       unsupported_flags[k]);
        if (src[id].added || (src[id].key && strcmp(src[id].key, content) != 0))
            fl_die("tokenizer file %s: %s: id %d is already the token \"%.60s\"", L->path, w, id,
                   src[id].key);
        if (!src[id].key) total += strlen(content);
        src[id] = (token_src){content, src[id].in_vocab, 1, flag_at(L, it, "special", w, 0)};
    }
    int count = 0;
    while (count < limit && src[count].key) count++;
    for (int id = count; id < limit; id++)
        if (src[id].key)
            fl_die("tokenizer file %s: the ids are not contiguous: id %d is missing (ids must be "
                   "0..V-1 over model.vocab and added_tokens)",
                   L->path, count);

    // the bytes of each token; the index leaves out added and byte tokens
    int16_t byte_of[FL_ALPHABET];
    fl_tok_byte_decoder(byte_of);
    uint8_t *use = fl_alloc(FL_MEM_OTHER, (size_t)count);
    tok->vocab = count;
    tok->offs = fl_alloc(FL_MEM_OTHER, ((size_t)count + 1) * sizeof *tok->offs);
    tok->bytes = fl_alloc(FL_MEM_OTHER, total + 1);
    tok->special = fl_alloc(FL_MEM_OTHER, (size_t)count);
    for (int b = 0; b < 256; b++) tok->byte_id[b] = -1;
    int n_keys = 0;
    for (int id = 0; id < count; id++) {
        uint8_t *out = tok->bytes + tok->offs[id];
        long len;
        int byte = -1;
        if (src[id].added) {
            len = (long)strlen(src[id].key);
            memcpy(out, src[id].key, (size_t)len);
            tok->special[id] = (uint8_t)src[id].special;
            n_keys += 1;
        } else {
            len = key_bytes(L->byte_level, byte_of, src[id].key, out, &byte);
            if (len <= 0)
                fl_die("tokenizer file %s: model.vocab key \"%.60s\" %s", L->path, src[id].key,
                       L->byte_level ? "is not a token in GPT-2's byte alphabet" : "is empty");
        }
        // a token both in model.vocab and added_tokens is found by both ways
        use[id] = byte < 0 && src[id].in_vocab;
        if (byte >= 0 && tok->byte_id[byte] < 0) tok->byte_id[byte] = id;
        tok->offs[id + 1] = tok->offs[id] + (uint32_t)len;
    }
    int twice = fl_tok_index(tok, count, use);
    if (twice >= 0)
        fl_die("tokenizer file %s: model.vocab: ids %d and %d are the same token", L->path,
               fl_tok_find(tok, tok->bytes + tok->offs[twice],
                           tok->offs[twice + 1] - tok->offs[twice]),
               twice);

    // the added tokens by first byte, longest first
    added_key *keys = fl_alloc(FL_MEM_OTHER, ((size_t)n_keys + 1) * sizeof *keys);
    int k = 0;
    for (int id = 0; id < count; id++)
        if (src[id].added)
            keys[k++] = (added_key){tok->bytes[tok->offs[id]],
                                    (int)(tok->offs[id + 1] - tok->offs[id]), id};
    qsort(keys, (size_t)n_keys, sizeof *keys, added_cmp);
    tok->added = n_keys ? fl_alloc(FL_MEM_OTHER, (size_t)n_keys * sizeof *tok->added) : NULL;
    for (k = 0; k < n_keys; k++) tok->added[k] = keys[k].id;
    for (int b = 0, at = 0; b <= 256; b++) {
        while (at < n_keys && keys[at].first < b) at++;
        tok->added_at[b] = at;
    }
    fl_free(keys);
    fl_free(use);
    fl_free(src);
}

// A merge's two tokens: "a b" or ["a", "b"].
static void merge_parts(const hf_loader *L, const cJSON *m, int i, char *buf, const char **a,
                        const char **b) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring, *sp = strchr(s, ' ');
        if (sp && sp != s && sp[1] && !strchr(sp + 1, ' ')) {
            memcpy(buf, s, (size_t)(sp - s));
            buf[sp - s] = 0;
            *a = buf;
            *b = sp + 1;
            return;
        }
    } else if (cJSON_GetArraySize(m) == 2 && cJSON_IsString(cJSON_GetArrayItem(m, 0)) &&
               cJSON_IsString(cJSON_GetArrayItem(m, 1))) {
        *a = cJSON_GetArrayItem(m, 0)->valuestring;
        *b = cJSON_GetArrayItem(m, 1)->valuestring;
        return;
    }
    fl_die("tokenizer file %s: model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]", L->path, i);
}

static void build_merges(fl_tokenizer *tok, const hf_loader *L, const cJSON *merges) {
    int16_t byte_of[FL_ALPHABET];
    fl_tok_byte_decoder(byte_of);
    fl_tok_merges_alloc(tok, (size_t)cJSON_GetArraySize(merges));
    tok->word_split = tok->start == FL_BPE_CHARS;
    int rank = 0, byte;
    const cJSON *m;
    cJSON_ArrayForEach(m, merges) {
        const char *a, *b;
        char buf[1024];
        uint8_t bytes[2048];
        if (cJSON_IsString(m) && strlen(m->valuestring) >= sizeof buf)
            fl_die("tokenizer file %s: model.merges[%d] is too long", L->path, rank);
        merge_parts(L, m, rank, buf, &a, &b);
        if (strlen(a) + strlen(b) >= sizeof bytes)
            fl_die("tokenizer file %s: model.merges[%d] is too long", L->path, rank);
        int byte_b = -1;
        long na = key_bytes(L->byte_level, byte_of, a, bytes, &byte);
        long nb = na < 0 ? -1 : key_bytes(L->byte_level, byte_of, b, bytes + na, &byte_b);
        if (byte >= 0 || byte_b >= 0)
            fl_die("tokenizer file %s: model.merges[%d]: merging <0xNN> byte tokens is not "
                   "supported",
                   L->path, rank);
        int32_t left = na > 0 ? fl_tok_find(tok, bytes, (size_t)na) : -1;
        int32_t right = nb > 0 ? fl_tok_find(tok, bytes + na, (size_t)nb) : -1;
        int32_t merged = left >= 0 && right >= 0 ? fl_tok_find(tok, bytes, (size_t)(na + nb)) : -1;
        if (merged < 0)
            fl_die("tokenizer file %s: model.merges[%d]: \"%.60s\" + \"%.60s\" uses or makes a "
                   "token that is not in model.vocab",
                   L->path, rank, a, b);
        // a merge that joins a non-space to a space rules out word cuts
        if (bytes[na - 1] != ' ' && bytes[na] == ' ') tok->word_split = 0;
        // a pair listed twice keeps its last rank, as Hugging Face's map does
        fl_bpe_merge *slot = bpe_merge_slot(tok, bpe_pair_key(left, right));
        *slot = (fl_bpe_merge){bpe_pair_key(left, right), rank++, merged};
    }
    tok->ordered = fl_tok_merges_ordered(tok);
}

// ----------------------------------------------------------------------------

// The id of an added token (else a vocabulary token) with this text, or -1.
static int32_t token_named(const fl_tokenizer *tok, const char *name) {
    size_t n = strlen(name);
    for (int32_t k = 0; k < tok->added_at[256]; k++) {
        int32_t id = tok->added[k];
        if (tok->offs[id + 1] - tok->offs[id] == n && !memcmp(tok->bytes + tok->offs[id], name, n))
            return id;
    }
    return fl_tok_find(tok, name, n);
}

// The end of a document: tokenizer_config.json's eos_token when f has the
// file (beside tokenizer.json), else the added token </s>, <|end_of_text|>
// or <|endoftext|>.
static void find_eot(fl_tokenizer *tok, const fl_tokenizer_files *f) {
    const char *path = f->where[0];
    if (f->n > 1) {
        const char *cfg = f->where[1], *text = (const char *)f->data[1];
        size_t size = f->size[1];
        char what[FL_FILE_PATH_MAX + 512];
        snprintf(what, sizeof what, "tokenizer file %s", cfg);
        cJSON *root = fl_json_load(text, size, what);
        if (!cJSON_IsObject(root)) fl_die("tokenizer file %s is not a valid JSON object", cfg);
        const cJSON *eos = item(root, "eos_token");
        if (cJSON_IsObject(eos)) eos = item(eos, "content"); // the older AddedToken layout
        int named = !is_null(eos);
        if (named) {
            if (!cJSON_IsString(eos)) fl_die("tokenizer file %s: eos_token must be a string", cfg);
            tok->eot = token_named(tok, eos->valuestring);
            if (tok->eot < 0)
                fl_die("tokenizer file %s: eos_token \"%.60s\" is not a token of %s", cfg,
                       eos->valuestring, path);
        }
        cJSON_Delete(root);
        if (named) return;
    }
    static const char *const names[] = {"</s>", "<|end_of_text|>", "<|endoftext|>"};
    for (int k = 0; k < 3; k++) {
        tok->eot = token_named(tok, names[k]);
        if (tok->eot >= 0) return;
    }
    fl_die("tokenizer file %s: no end-of-text token (no eos_token in a tokenizer_config.json "
           "beside it, and no added token </s>, <|end_of_text|> or <|endoftext|>)",
           path);
}

// The tokenizer's mode from its parts, checked for a combination this
// encoder runs exactly.
static void set_mode(fl_tokenizer *tok, const hf_loader *L, const cJSON *model) {
    tok->ignore_merges = flag_at(L, model, "ignore_merges", "model", 0);
    tok->byte_fallback = flag_at(L, model, "byte_fallback", "model", 0);
    tok->fuse_unk = flag_at(L, model, "fuse_unk", "model", 0);
    tok->strip_space = L->strip_space;
    tok->pattern = L->pattern;
    tok->nfc = L->nfc;
    if (L->byte_level) {
        tok->start = FL_BPE_BYTES;
        if (L->prepend || L->replace || L->meta >= 0)
            fl_die("tokenizer file %s: a ByteLevel pre-tokenizer with a Prepend or Replace "
                   "normalizer or a Metaspace pre-tokenizer is not supported",
                   L->path);
        return;
    }
    tok->start = FL_BPE_CHARS;
    if (L->split)
        fl_die("tokenizer file %s: pre_tokenizer: a Split without ByteLevel is not supported",
               L->path);
    if (!(L->replace || L->meta >= 0) || (L->meta >= 0 && (L->replace || L->prepend)))
        fl_die("tokenizer file %s: a BPE model over characters needs either the normalizer "
               "Replace \" \" -> \"▁\" (with or without Prepend \"▁\") or a Metaspace "
               "pre-tokenizer",
               L->path);
    tok->prepend = L->prepend ? FL_PREPEND_ALWAYS : L->meta >= 0 ? L->meta : FL_PREPEND_NONE;
}

void fl_hf_tokenizer_load(fl_tokenizer *tok, const fl_tokenizer_files *f) {
    const char *file = f->where[0], *text = (const char *)f->data[0];
    size_t size = f->size[0];
    char what[FL_FILE_PATH_MAX + 512];
    snprintf(what, sizeof what, "tokenizer file %s", file);
    cJSON *root = fl_json_load(text, size, what);
    hf_loader L = {.path = file, .pattern = FL_PRE_NONE, .meta = -1};
    if (!cJSON_IsObject(root)) fl_die("tokenizer file %s: expected a JSON object", file);
    const cJSON *model = item(root, "model");
    if (!cJSON_IsObject(model)) fl_die("tokenizer file %s: model must be an object", file);
    const char *type = str_at(&L, model, "type", "model");
    if (strcmp(type, "BPE") != 0) unsupported(&L, "model", type, "BPE");
    if (!is_null(item(model, "dropout")))
        fl_die("tokenizer file %s: model.dropout is set (BPE dropout is not supported)", file);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++)
        if (!is_null(item(model, affixes[k])))
            fl_die("tokenizer file %s: model.%s is set (not supported)", file, affixes[k]);
    const cJSON *vocab = item(model, "vocab"), *added = item(root, "added_tokens");
    if (!cJSON_IsObject(vocab) || !vocab->child)
        fl_die("tokenizer file %s: model.vocab must be a non-empty object {\"token\": id}", file);
    if (!is_null(added) && !cJSON_IsArray(added))
        fl_die("tokenizer file %s: added_tokens must be an array", file);
    const cJSON *merges = array_at(&L, model, "merges", "model");

    normalizer(&L, item(root, "normalizer"), "normalizer");
    pre_tokenizer(&L, item(root, "pre_tokenizer"), "pre_tokenizer");
    post_processor(&L, item(root, "post_processor"), "post_processor");
    decoder(&L, item(root, "decoder"), "decoder");
    set_mode(tok, &L, model);
    tok->hf = 1;
    build_vocab(tok, &L, vocab, is_null(added) ? NULL : added);
    if (tok->start == FL_BPE_BYTES)
        for (int b = 0; b < 256; b++) {
            uint8_t byte = (uint8_t)b;
            tok->byte_id[b] = fl_tok_find(tok, &byte, 1);
            if (tok->byte_id[b] < 0)
                fl_die("tokenizer file %s: model.vocab has no token for byte 0x%02x", file, b);
        }
    build_merges(tok, &L, merges);
    for (int c = 0; c < 128; c++) {
        uint8_t ch = (uint8_t)c;
        tok->ascii_id[c] = fl_tok_find(tok, &ch, 1);
        tok->inert[c] = tok->start == FL_BPE_CHARS && tok->byte_fallback && tok->byte_id[c] >= 0 &&
                        tok->ascii_id[c] < 0;
    }
    const cJSON *unk = item(model, "unk_token");
    if (!is_null(unk)) {
        if (!cJSON_IsString(unk))
            fl_die("tokenizer file %s: model.unk_token must be a string", file);
        tok->unk = token_named(tok, unk->valuestring);
        if (tok->unk < 0)
            fl_die("tokenizer file %s: model.unk_token \"%.60s\" is not a token", file,
                   unk->valuestring);
    }
    if (L.bos) {
        tok->bos = token_named(tok, L.bos);
        if (tok->bos < 0)
            fl_die("tokenizer file %s: post_processor: the special token \"%.60s\" is not a token",
                   file, L.bos);
    }
    find_eot(tok, f);
    cJSON_Delete(root);
}
