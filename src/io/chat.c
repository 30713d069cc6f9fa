// chat.c: instruction examples (data.h): a JSON Lines record to messages, the
// messages to text segments by a chat template, the segments to tokens and a
// loss mask. Only the assistant's words and the markers that end them are
// targets: the model learns to answer and to stop, not to write prompts.
#include <cjson/cJSON.h>
#include <errno.h>
#include <string.h>

#include "fitlm/data.h"

static const char *const template_names[] = {"default", "chatml", "llama3", "llama2"};

int fl_chat_template_parse(const char *name) {
    for (int i = 0; i < (int)(sizeof template_names / sizeof *template_names); i++)
        if (!strcmp(name, template_names[i])) return i;
    return -1;
}

// ----------------------------------------------------------------------------
// records to messages

enum { SYSTEM, USER, ASSISTANT };

typedef struct {
    int role;
    const char *text; // a cJSON string, or the Alpaca prompt below
} message;

typedef struct {
    message *m; // room for the record's messages, or three
    int n;
    char *joined; // Alpaca: instruction + "\n\n" + input
} conversation;

static const char *string_field(const cJSON *obj, const char *key, int required, char *err,
                                size_t errlen, int *bad) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v && !required) return NULL;
    *bad = !v                   ? fl_errorf(err, errlen, "missing field \"%s\"", key)
           : !cJSON_IsString(v) ? fl_errorf(err, errlen, "field \"%s\" is not a string", key)
                                : 0;
    return *bad ? NULL : v->valuestring;
}

static int from_messages(const cJSON *list, const char *field, conversation *c, char *err,
                         size_t errlen) {
    if (!cJSON_IsArray(list)) return fl_errorf(err, errlen, "field \"%s\" is not a list", field);
    static const char *const roles[] = {"system", "user", "assistant"};
    int i = 0;
    c->m = fl_alloc(FL_MEM_OTHER, ((size_t)cJSON_GetArraySize(list) + 1) * sizeof *c->m);
    for (const cJSON *it = list->child; it; it = it->next, i++) {
        if (!cJSON_IsObject(it)) return fl_errorf(err, errlen, "%s[%d] is not an object", field, i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!cJSON_IsString(role))
            return fl_errorf(err, errlen, "%s[%d].role is missing or not a string", field, i);
        if (!cJSON_IsString(content))
            return fl_errorf(err, errlen, "%s[%d].content is missing or not a string", field, i);
        int r = -1;
        for (int k = 0; k < 3; k++)
            if (!strcmp(role->valuestring, roles[k])) r = k;
        if (r < 0)
            return fl_errorf(err, errlen,
                             "%s[%d].role \"%.40s\" is not \"system\", \"user\" or \"assistant\"",
                             field, i, role->valuestring);
        if (r == SYSTEM && i > 0)
            return fl_errorf(err, errlen, "%s[%d]: a system message must come first", field, i);
        if (r == ASSISTANT && !*content->valuestring)
            return fl_errorf(err, errlen, "%s[%d]: empty assistant message", field, i);
        c->m[c->n++] = (message){r, content->valuestring};
    }
    if (!c->n || c->m[c->n - 1].role != ASSISTANT)
        return fl_errorf(err, errlen, "%s does not end with an assistant message", field);
    return 0;
}

// prompt/response or Alpaca: [system], user, assistant.
static int from_fields(const cJSON *obj, const fl_example_format *f, conversation *c, char *err,
                       size_t errlen) {
    int bad = 0;
    const char *system = string_field(obj, "system", 0, err, errlen, &bad), *prompt, *response;
    if (bad) return -1;
    int alpaca = !cJSON_GetObjectItemCaseSensitive(obj, f->prompt_field) &&
                 !cJSON_GetObjectItemCaseSensitive(obj, f->response_field) &&
                 cJSON_GetObjectItemCaseSensitive(obj, "instruction");
    if (alpaca) {
        const char *instruction = string_field(obj, "instruction", 1, err, errlen, &bad);
        const char *input = bad ? NULL : string_field(obj, "input", 0, err, errlen, &bad);
        response = bad ? NULL : string_field(obj, "output", 1, err, errlen, &bad);
        if (bad) return -1;
        size_t a = strlen(instruction), b = input ? strlen(input) : 0;
        c->joined = fl_alloc(FL_MEM_OTHER, a + b + 3);
        memcpy(c->joined, instruction, a);
        if (b) { // Alpaca's own prompt puts the input in a paragraph of its own
            memcpy(c->joined + a, "\n\n", 2);
            memcpy(c->joined + a + 2, input, b);
        }
        prompt = c->joined;
    } else {
        if (!cJSON_GetObjectItemCaseSensitive(obj, f->prompt_field) &&
            !cJSON_GetObjectItemCaseSensitive(obj, f->response_field))
            return fl_errorf(err, errlen,
                             "no \"%s\" list, \"%s\"/\"%s\" or \"instruction\"/\"output\" fields",
                             f->messages_field, f->prompt_field, f->response_field);
        prompt = string_field(obj, f->prompt_field, 1, err, errlen, &bad);
        response = bad ? NULL : string_field(obj, f->response_field, 1, err, errlen, &bad);
        if (bad) return -1;
    }
    if (!*response) return fl_errorf(err, errlen, "empty response");
    c->m = fl_alloc(FL_MEM_OTHER, 3 * sizeof *c->m);
    if (system) c->m[c->n++] = (message){SYSTEM, system};
    c->m[c->n++] = (message){USER, prompt};
    c->m[c->n++] = (message){ASSISTANT, response};
    return 0;
}

// ----------------------------------------------------------------------------
// messages to tokens. Text is gathered into a run while the target flag
// stays the same, then encoded as one string: the template's markers and the
// content around them tokenize as they would in one piece of text.

typedef struct {
    const fl_tokenizer *tok;
    fl_example *ex;
    char *run;
    size_t n, cap;
    int target;
} renderer;

// The mask and text bytes of the tokens appended from `from` on.
static void mark(fl_example *ex, size_t from, int target) {
    size_t n = ex->tokens.n;
    ex->mask = fl_reserve(FL_MEM_OTHER, ex->mask, &ex->mask_cap, from, n, 1);
    ex->text_bytes = fl_reserve(FL_MEM_OTHER, ex->text_bytes, &ex->text_bytes_cap, from, n,
                                sizeof *ex->text_bytes);
    memset(ex->mask + from, target, n - from);
    memset(ex->text_bytes + from, 0, (n - from) * sizeof *ex->text_bytes);
}

// The bytes of text each target token from `from` on stands for: its bytes
// in the vocabulary (what decoding gives), less what the tokenizer added
// (SentencePiece's leading space) and with what it took away (NFC) settled
// on the run's last token, so the run's tokens add up to its n bytes and a
// cut through the run keeps the bytes of the tokens it keeps.
static void count_text(const fl_tokenizer *tok, fl_example *ex, size_t from, size_t n) {
    uint32_t *c = ex->text_bytes + from;
    size_t m = ex->tokens.n - from, sum = 0, len;
    for (size_t i = 0; i < m; i++) {
        fl_tokenizer_token_bytes(tok, ex->tokens.ids[from + i], &len);
        c[i] = (uint32_t)len;
        sum += len;
    }
    for (size_t i = 0; i < m && sum > n; i++) {
        size_t extra = c[i] < sum - n ? c[i] : sum - n;
        c[i] -= (uint32_t)extra;
        sum -= extra;
    }
    if (m && sum < n) c[m - 1] += (uint32_t)(n - sum);
}

// The run's tokens, encoded straight onto the example's.
static void flush_run(renderer *r) {
    if (!r->n) return;
    size_t from = r->ex->tokens.n;
    fl_tokenizer_encode(r->tok, (const uint8_t *)r->run, r->n, &r->ex->tokens);
    mark(r->ex, from, r->target);
    if (r->target) count_text(r->tok, r->ex, from, r->n);
    r->n = 0;
}

static void text(renderer *r, int target, const char *s) {
    size_t n = strlen(s);
    if (r->n && target != r->target) flush_run(r);
    r->target = target;
    r->run = fl_reserve(FL_MEM_OTHER, r->run, &r->cap, r->n, r->n + n, 1);
    memcpy(r->run + r->n, s, n);
    r->n += n;
}

// A template's marker as its token: no text of the example's.
static void special(renderer *r, int target, int32_t id) {
    flush_run(r);
    if (id < 0) return;
    fl_tokens *t = &r->ex->tokens;
    t->ids = fl_reserve(FL_MEM_OTHER, t->ids, &t->cap, t->n, t->n + 1, sizeof *t->ids);
    t->ids[t->n++] = id;
    mark(r->ex, t->n - 1, target);
}

// The end of the text: <eot>, unless the template's end-of-turn marker
// already is that token (LLaMA 3 instruct's <|eot_id|>, Qwen's <|im_end|>).
static void end_of_text(renderer *r) {
    flush_run(r);
    int32_t eot = fl_tokenizer_eot(r->tok);
    const fl_tokens *t = &r->ex->tokens;
    if (!t->n || t->ids[t->n - 1] != eot) special(r, 1, eot);
}

static void render(renderer *r, fl_chat_template tpl, const conversation *c) {
    static const char *const role[] = {"system", "user", "assistant"};
    int32_t bos = fl_tokenizer_bos(r->tok), eot = fl_tokenizer_eot(r->tok);
    special(r, 0, bos);
    for (int i = 0; i < c->n; i++) {
        const message *m = &c->m[i];
        int answer = m->role == ASSISTANT;
        switch (tpl) {
        case FL_TEMPLATE_DEFAULT:
            if (m->role == SYSTEM) {
                text(r, 0, "### System:\n");
                text(r, 0, m->text);
                text(r, 0, "\n\n");
            } else if (m->role == USER) {
                text(r, 0, "### User:\n");
                text(r, 0, m->text);
                text(r, 0, "\n\n### Assistant:\n");
            } else {
                text(r, 1, m->text);
                special(r, 1, eot);
            }
            break;
        case FL_TEMPLATE_CHATML:
            if (i) text(r, 0, "\n");
            text(r, 0, "<|im_start|>");
            text(r, 0, role[m->role]);
            text(r, 0, "\n");
            text(r, answer, m->text);
            text(r, answer, "<|im_end|>");
            break;
        case FL_TEMPLATE_LLAMA3:
            text(r, 0, "<|start_header_id|>");
            text(r, 0, role[m->role]);
            text(r, 0, "<|end_header_id|>\n\n");
            text(r, answer, m->text);
            text(r, answer, "<|eot_id|>");
            break;
        case FL_TEMPLATE_LLAMA2: // Meta's chat_completion: the system prompt joins the first turn
            if (m->role == SYSTEM) {
                text(r, 0, "[INST] <<SYS>>\n");
                text(r, 0, m->text);
                text(r, 0, "\n<</SYS>>\n\n");
            } else if (m->role == USER) {
                if (!(i == 1 && c->m[0].role == SYSTEM)) {
                    if (i) special(r, 0, bos);
                    text(r, 0, "[INST] ");
                }
                text(r, 0, m->text);
                text(r, 0, " [/INST]");
            } else {
                // no space before the answer: LLaMA-2's SentencePiece normaliser
                // puts its "▁" before every segment, the "[/INST] answer" of
                // Meta's chat_completion (LLaMA-Factory relies on the same)
                text(r, 1, m->text);
                special(r, 1, eot);
            }
            break;
        }
    }
    end_of_text(r);
}

// ----------------------------------------------------------------------------

int fl_example_parse(const fl_tokenizer *tok, const fl_example_format *f, const char *json,
                     size_t n, fl_example *ex, char *err, size_t errlen) {
    ex->tokens.n = 0;
    // cJSON's strings end at a NUL: "ok\u0000SECRET" would train on "ok".
    // It has no length to keep it by, and a NUL is no text to learn from.
    char key[64];
    size_t nul = fl_json_nul_at(json, n, key, sizeof key);
    if (nul < n)
        return fl_errorf(err, errlen, "%s at column %zu%s%s%s is not allowed in text",
                         json[nul] ? "\\u0000 (a NUL character)" : "a NUL byte", nul + 1,
                         *key ? ", in field \"" : "", key, *key ? "\"," : "");
    const char *end = NULL;
    errno = 0;
    cJSON *root = cJSON_ParseWithLengthOpts(json, n, &end, 0);
    if (!root && errno == ENOMEM) fl_die_oom(n, FL_MEM_OTHER); // cJSON's malloc, not bad JSON
    if (!root) {
        size_t at = end && end >= json && end <= json + n ? (size_t)(end - json) : 0;
        return fl_errorf(err, errlen, "invalid JSON at column %zu", at + 1);
    }
    while (end < json + n && *end && strchr(" \t\r", *end)) end++;
    int rc = 0;
    conversation conv = {0}, *c = &conv;
    if (end != json + n)
        rc = fl_errorf(err, errlen, "text after the JSON value at column %zu",
                       (size_t)(end - json) + 1);
    else if (!cJSON_IsObject(root))
        rc = fl_errorf(err, errlen, "not a JSON object");
    else if (cJSON_GetObjectItemCaseSensitive(root, f->messages_field))
        rc = from_messages(cJSON_GetObjectItemCaseSensitive(root, f->messages_field),
                           f->messages_field, c, err, errlen);
    else
        rc = from_fields(root, f, c, err, errlen);
    if (rc == 0) {
        renderer r = {.tok = tok, .ex = ex};
        render(&r, f->chat_template, c);
        fl_free(r.run);
    }
    fl_free(c->m);
    fl_free(c->joined);
    cJSON_Delete(root);
    return rc;
}

void fl_example_free(fl_example *ex) {
    fl_tokens_free(&ex->tokens);
    fl_free(ex->mask);
    fl_free(ex->text_bytes);
    memset(ex, 0, sizeof *ex);
}
