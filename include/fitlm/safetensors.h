// safetensors.h: the Hugging Face safetensors format, the HF GPT-2 and LLaMA
// layouts on top of it (config.json, sharded checkpoints) and llm.c's model
// files (GPT-2 only).
//
// Every parser exists in a non-dying form (returns 0 on success, -1 with a
// message in err) so fuzz targets can run it in-process; the functions that
// take a path die with a message naming the file, like the rest of io.h.
#ifndef FITLM_SAFETENSORS_H
#define FITLM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/dtype.h"
#include "fitlm/model.h"
#include "fitlm/tokenizer.h"

// ----------------------------------------------------------------------------
// safetensors: 8-byte little-endian header length N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}, then the tensors' little-endian bytes (offsets are relative
// to the end of the header). F32, F16 and BF16 tensors are supported.

#define FL_ST_MAX_DIMS   8
#define FL_ST_MAX_HEADER 100000000 // the reference implementation's limit

typedef struct {
    const char *name;
    fl_dtype dtype;
    int ndim;
    uint64_t shape[FL_ST_MAX_DIMS];
    size_t numel;
    size_t begin, end; // byte range in the data section
} fl_st_tensor;

typedef struct {
    fl_st_tensor *tensors; // in header order
    int count;
    char *names;         // storage of the tensors' names
    const uint8_t *data; // the data section (inside the parsed buffer)
    size_t data_size;
    void *map; // the file mapping, when opened from a path
    size_t map_size;
} fl_safetensors;

// Parses and validates buf[0, n): header length within the buffer, a JSON
// object, known dtypes, shapes whose byte size matches data_offsets, ranges
// that tile the data section exactly (no overlap, no hole), unique names.
// out->data points into buf. Free with fl_safetensors_free also on error.
int fl_safetensors_parse(const uint8_t *buf, size_t n, fl_safetensors *out, char *err,
                         size_t errlen);
// Maps the file read-only and parses it; dies naming the file on error.
void fl_safetensors_open(fl_safetensors *st, const char *path);
const fl_st_tensor *fl_safetensors_find(const fl_safetensors *st, const char *name);
void fl_safetensors_free(fl_safetensors *st);

// Writes n tensors (name, dtype, ndim, shape; begin/end are ignored) to
// path crash-safely, in the given order, with __metadata__ {"format":
// "pt"}. fill(ctx, i, dst) writes tensor i's bytes to dst. The header is
// padded with spaces so the data section starts 8-byte aligned.
typedef void (*fl_st_fill)(void *ctx, int i, void *dst);
void fl_safetensors_write(const char *path, const fl_st_tensor *tensors, int n, fl_st_fill fill,
                          void *ctx);

// ----------------------------------------------------------------------------
// Hugging Face GPT-2 (GPT2LMHeadModel) and LLaMA (LlamaForCausalLM): a
// directory with config.json and model.safetensors, or
// model-0000i-of-0000N.safetensors shards listed in
// model.safetensors.index.json, as transformers' save_pretrained writes it.

#define FL_HF_MAX_JSON_BYTES (64u << 20) // config.json and the index

// The shortest decimal that reads back as f, for JSON written as Python
// writes it (1e-05, not 9.99999974737875e-06).
double fl_json_float(float f);
// "[d0, d1, ...]": a shape in error messages.
void fl_shape_str(char *out, size_t size, int ndim, const uint64_t *shape);

// Reads a config.json into *out (arch, padded_vocab_size filled in; absent
// fields take transformers' defaults). model_type "gpt2" or "llama" decides
// the architecture; without it architectures[] (GPT2LMHeadModel,
// LlamaForCausalLM), without both GPT-2. Refuses, naming the key, what fitlm
// does not implement:
// - GPT2Config: another activation, layer_norm_epsilon other than 1e-5,
//   n_inner other than 4C, untied embeddings, unscaled or layer-scaled
//   attention, cross-attention;
// - LlamaConfig (n_kv_head from num_key_value_heads, default
//   num_attention_heads; norm_eps from rms_norm_eps, default 1e-6;
//   rope_theta default 10000; tie_word_embeddings default false):
//   rope_scaling other than null (or {"rope_type": "default"}),
//   attention_bias or mlp_bias true, hidden_act other than silu, head_dim
//   other than hidden_size / num_attention_heads, pretraining_tp > 1,
//   attention_dropout other than 0, num_key_value_heads not dividing
//   num_attention_heads, an odd head size.
// Another model_type is an error.
int fl_hf_config_parse(const char *json, size_t n, fl_model_config *out, char *err, size_t errlen);

typedef struct {
    const char *name; // tensor name
    int file;         // index into files
} fl_hf_index_entry;

typedef struct {
    char **files; // distinct shard file names, in order of first use
    int n_files;
    fl_hf_index_entry *entries;
    int n_entries;
} fl_hf_index;

// Reads model.safetensors.index.json: {"metadata": {...}, "weight_map":
// {tensor: file}}. Shard names must be plain file names ending in
// .safetensors (no directories). Free with fl_hf_index_free also on error.
int fl_hf_index_parse(const char *json, size_t n, fl_hf_index *out, char *err, size_t errlen);
void fl_hf_index_free(fl_hf_index *idx);

// Writes dir/config.json (GPT2Config or LlamaConfig, by model->config.arch)
// and dir/model.safetensors, or, when the tensors take more than
// max_shard_bytes (0: no limit), shards of at most that size (a larger
// tensor gets a shard of its own) and the index. Names carry the
// "transformer." (GPT-2) or "model." (LLaMA) prefix, except lm_head.weight;
// GPT-2's Conv1D weights are stored (in, out), LLaMA's nn.Linear weights
// (out, in) as they are; the vocabulary rows (wte, embed_tokens, lm_head)
// are stored unpadded and a tied lm_head is not stored. weights_fp32 is the
// model's table.numel fp32 values; out_dtype is the stored dtype.
void fl_hf_export(const char *dir, const fl_model *model, const float *weights_fp32,
                  fl_dtype out_dtype, size_t max_shard_bytes);
// The same with a tokenizer's files (tokenizer.json, tokenizer_config.json;
// NULL: none) written into the set, so they are swapped in with the weights.
void fl_hf_export_with(const char *dir, const fl_model *model, const float *weights_fp32,
                       fl_dtype out_dtype, size_t max_shard_bytes,
                       const fl_tokenizer_files *tokenizer);
// Opens a Hugging Face model as a weight source (model.h): a directory
// written by fl_hf_export or save_pretrained, or a .safetensors file with
// config.json beside it (path must outlive the source). config.json is
// read once, here; the safetensors are mapped and their headers (and the
// index) read once, when a model is made of the source. Names with or without "transformer." /
// "model."; F32, F16 or BF16 tensors, rounded to the model's dtype or quantised to NF4 as they are
// read; buffers are skipped (GPT-2's attn.bias and attn.masked_bias, LLaMA's rotary_emb.inv_freq);
// a LLaMA bias tensor is an error naming it; a stored lm_head the model ties must equal the
// embedding; every parameter must be there once with its shape (checked before the model
// allocates).
void fl_hf_source_open(fl_weight_source *s, const char *path);
// Initialises *model from such a source (dense, rounded to dt).
void fl_hf_load(const char *path, fl_model *model, fl_dtype dt);

// ----------------------------------------------------------------------------
// llm.c model files (gpt2_124M.bin; GPT-2 only): 256 int32 header {20240326, version
// (3: fp32, 5: bf16), maxT, V, L, NH, C, Vp}, then the parameters in
// llm.c's order, each layer-stacked: wte (Vp,C), wpe (maxT,C), ln1w, ln1b,
// qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb,
// lnfw, lnfb.

#define FL_LLMC_MAGIC        20240326
#define FL_LLMC_HEADER_BYTES 1024

typedef struct {
    int version;    // 3 or 5
    fl_dtype dtype; // FL_F32 or FL_BF16
    int max_T, V, L, NH, C, Vp;
    size_t num_params; // stored values (with llm.c's padded vocab)
} fl_llmc_header;

// Validates the header in buf[0, n) (n >= FL_LLMC_HEADER_BYTES) against the
// size of the whole file.
int fl_llmc_header_parse(const uint8_t *buf, size_t n, uint64_t file_size, fl_llmc_header *out,
                         char *err, size_t errlen);
// Opens an llm.c model file as a weight source (model.h; its header read
// once, here; path must outlive the source): V rows of wte are kept, the padded rows of our table
// are zero. Dense only: NF4 is refused.
void fl_llmc_source_open(fl_weight_source *s, const char *path);
// Initialises *model from an llm.c model file (rounded to dt).
void fl_llmc_load(const char *path, fl_model *model, fl_dtype dt);

// ----------------------------------------------------------------------------
// PEFT LoRA adapters, as peft's save_pretrained writes them: DIR/
// adapter_config.json (LoraConfig.to_dict with sorted keys: peft_type
// "LORA", r, lora_alpha, lora_dropout, target_modules, bias "none",
// use_rslora, init_lora_weights, fan_in_fan_out (true for GPT-2's Conv1D),
// task_type "CAUSAL_LM", base_model_name_or_path, rank_pattern {},
// alpha_pattern {}, ...) and DIR/adapter_model.safetensors (names
// fl_lora_peft_name: "base_model.model.<module>.lora_A.weight" (r, in) and
// ".lora_B.weight" (out, r), in the model's dtype).

// Reads adapter_config.json text into *out (fl_lora_config_defaults for
// absent keys; target_modules null: "", the architecture's default).
// Refuses, naming the key: a peft_type other than LORA, a task_type other
// than CAUSAL_LM, bias other than "none", use_dora / lora_bias true,
// non-empty rank_pattern, alpha_pattern, modules_to_save,
// layers_to_transform, exclude_modules, layer_replication,
// init_lora_weights other than true or "gaussian", target_modules missing,
// empty, too long or a string other than "all-linear" (PEFT's strings are
// regular expressions), values out of range.
int fl_peft_config_parse(const char *json, size_t n, fl_lora_config *out, char *err, size_t errlen);
// The same from DIR/adapter_config.json; dies naming the file.
void fl_peft_read_config(const char *dir, fl_lora_config *out);
// Writes the adapters of m (fl_model_add_lora) to DIR (created if missing;
// a run's own directory, so a symbolic link there is refused, not followed),
// each file crash-safely; base_model names the base (base_model_name_or_path;
// NULL: null). target_modules "" is written as the module names it
// resolved to, as PEFT writes them.
void fl_peft_save(const char *dir, const fl_model *m, const char *base_model);
// Loads DIR's adapter weights into m, whose adapters were made from DIR's
// config (r, lora_alpha and use_rslora are checked against it): every
// adapter tensor present once with its shape, no tensor m does not have
// (each is an error naming the file and the tensor); F32, BF16 or F16,
// rounded to the model's dtype.
void fl_peft_load(const char *dir, fl_model *m);

#endif
