// tokenizer.h: text to token ids and back. Three tokenizers: "byte" (a token
// is a byte), "gpt2" (OpenAI's GPT-2 byte-level BPE, identical to its
// encoder.py) and "hf" (a Hugging Face tokenizer.json: GPT-2's or LLaMA-3's
// byte-level BPE, or LLaMA-1/2's SentencePiece-style BPE with byte fallback;
// the ids of llama3-tokenizer-js and llama-tokenizer-js).
// Any bytes can be encoded. gpt2: a byte of invalid UTF-8 is a character of
// its own that is neither letter, number nor space (what encoder.py's regex
// sees when the bytes are decoded with Python's 'surrogateescape'), and
// decoding (concatenating token bytes) gives back any input exactly. hf: the
// text is first made valid UTF-8, each maximal invalid subpart replaced by
// U+FFFD (as Python's bytes.decode('utf-8', 'replace') and JavaScript's
// TextDecoder do), so the ids are those a Python or JavaScript user gets, and
// decoding gives back the replaced text.
#ifndef FITLM_TOKENIZER_H
#define FITLM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct fl_tokenizer fl_tokenizer;

// name "byte": 256 byte tokens + <|endoftext|> = 256 (vocab 257), needs no files.
// name "gpt2": OpenAI's GPT-2 BPE from dir/encoder.json and dir/vocab.bpe
// (dir NULL: data/gpt2, fetched by scripts/setup.sh); vocab 50257,
// <|endoftext|> = 50256. The same files learnt by fl_bpe_learn hold their
// own vocabulary, <|endoftext|> last.
// name "hf": dir is a tokenizer.json or a directory holding one. Its ids
// are 0..V-1 over model.vocab and added_tokens. The end of text is the
// eos_token of a tokenizer_config.json beside it, else the added token
// </s>, <|end_of_text|> or <|endoftext|>. Only the parts these families use
// are read (see hf_tokenizer.c); any other type is refused by name.
// Unknown name or bad/missing files: fl_die naming the file (and line/key)
// and what is wrong.
fl_tokenizer *fl_tokenizer_load(const char *name, const char *dir);
void fl_tokenizer_free(fl_tokenizer *tok);

// The files a tokenizer is made of, held in memory: read once (a run's at
// its start), stored in its checkpoints and loaded from there, so a model and
// its tokenizer stay together whatever becomes of the files on disk.
// byte: none; gpt2: encoder.json and vocab.bpe; hf: tokenizer.json and, when
// it is beside it, tokenizer_config.json. n 0 for gpt2 or hf: none is at
// hand, and `missing` says why (a load then dies with it).
enum { FL_TOKENIZER_FILES = 2, FL_TOKENIZER_WHERE = 4400 };
typedef struct {
    char name[8]; // byte | gpt2 | hf
    int n;
    const char *file[FL_TOKENIZER_FILES];               // the names above
    char where[FL_TOKENIZER_FILES][FL_TOKENIZER_WHERE]; // for messages: a path, or the checkpoint's
    uint8_t *data[FL_TOKENIZER_FILES];                  // with a NUL after size bytes
    size_t size[FL_TOKENIZER_FILES];
    char missing[FL_TOKENIZER_WHERE];
    char from[FL_TOKENIZER_WHERE]; // where they came from: the path read, or the checkpoint
} fl_tokenizer_files;

// Reads the files of tokenizer `name` at path (as fl_tokenizer_load takes
// it; gpt2 NULL: data/gpt2). Dies on an unknown name, an unreadable or empty
// file; a gpt2 directory without encoder.json gives n 0.
void fl_tokenizer_files_read(fl_tokenizer_files *f, const char *name, const char *path);
// Takes ownership of data (fl_alloc'ed, a NUL after size bytes) as f's file
// `file`, where naming it in messages.
void fl_tokenizer_files_add(fl_tokenizer_files *f, const char *file, uint8_t *data, size_t size,
                            const char *where);
void fl_tokenizer_files_free(fl_tokenizer_files *f);
// Whether a and b are the same tokenizer: name and bytes.
int fl_tokenizer_files_equal(const fl_tokenizer_files *a, const fl_tokenizer_files *b);
// Parses f as fl_tokenizer_load does its files; dies naming f->where.
fl_tokenizer *fl_tokenizer_load_files(const fl_tokenizer_files *f);
// The vocabulary a model for f needs (fl_tokenizer_vocab_of of its files;
// gpt2 with none: GPT-2's 50257).
int fl_tokenizer_files_vocab(const fl_tokenizer_files *f);
// Writes an hf tokenizer's files into out_dir under their names
// (tokenizer.json, tokenizer_config.json), each whole (temporary file,
// rename). Dies naming the file.
void fl_tokenizer_files_write(const fl_tokenizer_files *f, const char *out_dir);
const char *fl_tokenizer_name(const fl_tokenizer *tok);
int fl_tokenizer_vocab_size(const fl_tokenizer *tok);
// The vocabulary a model for tokenizer `name` needs, without keeping the
// tokenizer: 257 (byte); gpt2: the tokens of path/encoder.json, or GPT-2's
// 50257 when there is none to read (the files are needed only to encode);
// hf: the ids of the file at `path`. Dies as fl_tokenizer_load does.
int fl_tokenizer_vocab_of(const char *name, const char *path);
// Learns a byte-level BPE from texts[i][0..lens[i]), as GPT-2's was learnt:
// GPT-2's pre-tokenizer cuts the text into pieces, and each merge joins the
// adjacent pair of tokens that occurs most often in them (ties: the pair of
// lower ids), until the vocabulary has `vocab` tokens (>= 257: the 256
// bytes, the merged tokens, <|endoftext|> last) or no pair occurs twice.
// Writes dir/encoder.json and dir/vocab.bpe (each written whole), which
// fl_tokenizer_load("gpt2", dir) reads. Returns the vocabulary learnt.
int fl_bpe_learn(const uint8_t *const *texts, const size_t *lens, size_t n_texts, int vocab,
                 const char *dir);
// The end of a document: GPT-2's <|endoftext|>, LLaMA's </s>, LLaMA-3's
// <|end_of_text|>.
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
// and each call has its own cache. Never adds the post-processor's tokens:
// callers insert fl_tokenizer_bos and fl_tokenizer_eot (a reference's
// encode(text) is fl_tokenizer_bos, if any, then these ids). gpt2:
// "<|endoftext|>" in the text is plain text (as encoder.py has it); hf: an
// added token's text anywhere in the input is that token, never split (the
// longest one where several start at the same place), as Hugging Face's
// encode does.
void fl_tokenizer_encode(const fl_tokenizer *tok, const uint8_t *text, size_t n, fl_tokens *out);
void fl_tokens_free(fl_tokens *t);

// The bytes of one token (a pointer into the tokenizer's table, valid while
// tok lives). Dies on an id out of range. SentencePiece tokens have "▁" as
// the space it stands for and <0xNN> as byte NN; added tokens their text.
const uint8_t *fl_tokenizer_token_bytes(const fl_tokenizer *tok, int id, size_t *len);

// The bytes of text that ids[0..k) stand for when ids[0..n) encode a text
// of `total` bytes: their bytes in the vocabulary, less what the encoding
// added in front (SentencePiece's leading space); all n: total. For a text
// cut between two shards or windows.
size_t fl_tokenizer_prefix_bytes(const fl_tokenizer *tok, const int32_t *ids, size_t n, size_t k,
                                 size_t total);

// The text of ids[0..n) (*len bytes; fl_free it), as Hugging Face's
// decode(ids, skip_special_tokens=True): the token bytes concatenated,
// special added tokens left out, and, for a tokenizer whose decoder strips
// it (LLaMA-1/2's Strip, Metaspace), the space the encoding put first
// dropped. decode(encode(text)) is the text for any valid UTF-8 text
// without added tokens' texts (SentencePiece: nor "▁", which reads as a
// space). Dies on an id out of range.
uint8_t *fl_tokenizer_decode(const fl_tokenizer *tok, const int32_t *ids, size_t n, size_t *len);

#endif
