// testref.h: the PyTorch reference fixtures, their reader and the checks the
// tests that compare the engine with them share (test_gpt2_ref,
// test_llama_ref; test_formats reads the GPT-2 one).
//
// tests/fixtures/gpt2_tiny.bin is written by scripts/make_reference.py,
// tests/fixtures/llama_tiny.bin and llama_tiny_tied.bin by
// scripts/make_llama_reference.py (run them with /usr/bin/python3, which has
// torch). Both compute in float64 from float32 initial weights, so the
// fixtures hold the exact values rounded once to float32.
//
// Fixture format (all little-endian):
//
//     8 bytes   magic "FITLMREF"
//     uint32    version = 1
//     then records until end of file, each:
//       uint32  name_len
//       bytes   name (name_len bytes, no NUL)
//       uint32  dtype (0 = float32, 1 = int32)
//       uint32  ndim
//       uint64  shape[ndim]
//       bytes   data: prod(shape) elements of 4 bytes, row-major
//
// Records: "config" int32, GPT-2 [maxT, V, L, NH, C, B, T, steps], LLaMA
// [maxT, V, L, NH, NKV, C, I, B, T, steps, tie] (its length tells the
// architecture); LLaMA only: "config_f" float32 [rms_norm_eps, rope_theta];
// "adamw" float32 [lr, beta1, beta2, eps, weight_decay, max_grad_norm];
// "tokens", "targets" int32 (B,T), a target -1 has no loss; "param/<name>"
// initial weights (the vocabulary rows wte, embed_tokens, lm_head are (V,C),
// the engine's (Vp,C)); "logits" (B,T,V); "loss" (1), the mean over the
// targets != -1; "grad/<name>"; "step_losses", "step_grad_norms" (steps);
// "final/<name>" weights after `steps` AdamW steps (zero_grad, forward,
// backward, clip, step) on the same batch. The last record of a file is a
// final/ one, so a file cut at a record boundary is caught by the missing
// records.
#ifndef FITLM_TESTREF_H
#define FITLM_TESTREF_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/model.h"

#define FX_MAX_NDIM 8
#define FX_MAX_NAME 127
#define FX_F32      0
#define FX_I32      1

typedef struct {
    char name[FX_MAX_NAME + 1];
    uint32_t dtype, ndim;
    uint64_t shape[FX_MAX_NDIM];
    size_t numel;
    size_t offset; // of the data, in bytes from the start of the file
} fx_record;

typedef struct {
    const unsigned char *data;
    size_t size;
    fx_record *recs;
    int n, cap;
    char err[384];
} fixture;

typedef struct {
    fl_arch_kind arch;
    int maxT, V, L, NH, NKV, C, I, B, T, steps, tie; // GPT-2: NKV = NH, I = 4C, tie 1
    float norm_eps, rope_theta;                      // LLaMA (0 for GPT-2: the defaults)
    float lr, beta1, beta2, eps, weight_decay, max_grad_norm;
} fx_config;

// The parameter names of the fixture's model in table order, with their
// shapes as stored in the fixture and whether AdamW decays them.
typedef struct {
    char name[FL_PARAM_NAME_MAX];
    int ndim;
    uint64_t shape[2];
    int decay;
    int vocab_rows; // shape[0] is V: the engine's row has Vp rows
} fx_param;

#define FX_MAX_PARAMS (2 + 12 * 16 + 2)

// Logit tolerances against the float64 reference: the engine computes in
// float32 (observed on GPT-2 5.4e-7, PyTorch float32 5.1e-7; on the LLaMA
// fixtures see test_llama_ref.c).
#define LOGITS_ATOL 5e-6
#define LOGITS_RTOL 1e-5

// ----------------------------------------------------------------------------
// the reader

// Indexes the records of data[0, size); returns 0 with fx->err set on damage.
int fx_parse(fixture *fx, const unsigned char *data, size_t size);
// Checks every record the tests use and fills *c; 0 with fx->err set if not.
int fx_validate(fixture *fx, fx_config *c);
const fx_record *fx_find(const fixture *fx, const char *name);
// The record `name` with this dtype and shape, or NULL with fx->err set.
const fx_record *fx_expect(fixture *fx, const char *name, uint32_t dtype, int ndim,
                           const uint64_t *shape);
void *fx_copy(const fixture *fx, const fx_record *r); // malloc'd copy of the data
float *fx_floats(fixture *fx, const char *name);      // a validated float32 record
int *fx_ints(fixture *fx, const char *name);          // a validated int32 record
// The parameter names, fixture shapes and decay flags in table order.
int fx_expected_params(const fx_config *c, fx_param *out);
fl_model_config fx_make_config(const fx_config *c);
// Reads and validates the fixture at path (*data: the file, malloc'd,
// which fx points into); 0 after a failed t_check.
int fx_load(const char *path, fixture *fx, fx_config *c, unsigned char **data);

// ----------------------------------------------------------------------------
// checks of the engine against a fixture (each records t_check/t_close results)

// Damaged copies of the fixture (truncated anywhere, corrupt header fields)
// must be refused with a message.
void fx_test_damaged(const unsigned char *data, size_t size, const fixture *good);
// An fp32 model of the fixture's shape, activations for B x T under `policy`.
void fx_model_init(fl_model *m, const fx_config *c, fl_recompute policy);
// Loads `prefix`<name> records into the parameter buffer; the padded
// vocabulary rows V..Vp-1 become zero.
void fx_load_params(fl_model *m, fixture *fx, const char *prefix);
// Compares a buffer (params or grads) view by view against `prefix`<name>.
// The padded vocabulary rows must be exactly zero. With k_bias_atol > 0 the
// key third of each GPT-2 attn.c_attn.bias is compared on its own with that
// tolerance (see test_gpt2_ref.c).
void fx_compare_views(const fl_model *m, fixture *fx, const float *buf, const char *prefix,
                      double atol, double rtol, double k_bias_atol);
// The engine's table against the fixture's parameters: names in order,
// shapes (vocabulary rows padded to Vp), decay flags; 0 if they differ
// (the other checks load weights by name and need a matching table).
int fx_check_table(const fl_model *m, const fx_config *c);
// Loads param/, runs the forward and checks the loss (returned, m->loss,
// the mean of m->losses), the target count and the logits (LOGITS_ATOL,
// LOGITS_RTOL; the padded vocabulary columns must be zero).
void fx_check_forward(fl_model *m, fixture *fx, const fx_config *c, double loss_atol);
// Elements of got outside atol + rtol*|want| (a check that must fail).
size_t fx_count_outside(const float *got, const float *want, size_t n, double atol, double rtol);
// The logits of the last forward without the padded columns, (B,T,V) malloc'd.
float *fx_logits(const fl_model *m);
// Prints the engine's step losses and grad norms beside the reference's and
// compares them.
void fx_check_steps(fixture *fx, const fx_config *c, const float *losses, const float *norms,
                    double loss_atol, double norm_rtol);
// The mean loss of the last forward over its targets, summed in double from
// the per-position losses (less rounding noise than the float mean).
double fx_mean_loss(const fl_model *m);
// Activation checkpointing changes nothing: with the fixture's weights, the
// loss and every gradient under FL_RECOMPUTE_SELECTIVE and FL_RECOMPUTE_BLOCK
// are bitwise those of FL_RECOMPUTE_NONE (fp32).
void fx_check_recompute(fixture *fx, const fx_config *c);

#endif
