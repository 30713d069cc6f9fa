// tokenizer.h: text to token ids and back. Two tokenizers: "byte" (a token
// is a byte) and "gpt2" (OpenAI's GPT-2 byte-level BPE, identical to its
// encoder.py). Decoding is concatenating token bytes, exact for any input.
// Any bytes can be encoded: a byte of invalid UTF-8 is a character of its
// own that is neither letter, number nor space (what encoder.py's regex sees
// when the bytes are decoded with Python's 'surrogateescape').
#ifndef FITLM_TOKENIZER_H
#define FITLM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct fl_tokenizer fl_tokenizer;

// name "byte": 256 byte tokens + <|endoftext|> = 256 (vocab 257), needs no files.
// name "gpt2": OpenAI's GPT-2 BPE from dir/encoder.json and dir/vocab.bpe
// (dir NULL: data/gpt2, fetched by scripts/setup.sh); vocab 50257,
// <|endoftext|> = 50256.
// Unknown name or bad/missing files: fl_die naming the file (and line/key)
// and what is wrong.
fl_tokenizer *fl_tokenizer_load(const char *name, const char *dir);
void fl_tokenizer_free(fl_tokenizer *tok);
const char *fl_tokenizer_name(const fl_tokenizer *tok);
int fl_tokenizer_vocab_size(const fl_tokenizer *tok);
// The end of a document: GPT-2's <|endoftext|>, LLaMA's </s>.
int fl_tokenizer_eot(const fl_tokenizer *tok);
// The id the tokenizer's post-processor puts before every sequence (LLaMA's
// <s>), or -1 when it puts none (byte, gpt2). A document in a token stream
// starts with it when there is one, else with fl_tokenizer_eot.
int fl_tokenizer_bos(const fl_tokenizer *tok);

// A growable array of token ids; {0} is an empty one.
typedef struct {
    int32_t *ids;
    size_t n, cap;
} fl_tokens;

// Appends the tokens of text[0..n) to *out (growing it). Safe to call from
// several threads at once on the same tokenizer: the tokenizer is read-only
// and each call has its own cache. "<|endoftext|>" in the text is encoded as
// plain text (as encoder.py does); callers insert fl_tokenizer_eot.
void fl_tokenizer_encode(const fl_tokenizer *tok, const uint8_t *text, size_t n, fl_tokens *out);
void fl_tokens_free(fl_tokens *t);

// The bytes of one token (a pointer into the tokenizer's table, valid while
// tok lives). Dies on an id out of range.
const uint8_t *fl_tokenizer_token_bytes(const fl_tokenizer *tok, int id, size_t *len);

#endif
