// testref.h: the PyTorch reference fixture tests/fixtures/gpt2_tiny.bin,
// written by scripts/make_reference.py, and its reader (shared by the tests
// that compare the engine with it).
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
// Records: "config" int32 [maxT, V, L, NH, C, B, T, steps]; "adamw" float32
// [lr, beta1, beta2, eps, weight_decay, max_grad_norm]; "tokens", "targets"
// int32 (B,T); "param/<name>" initial weights (wte.weight is (V,C), the
// engine's is (Vp,C)); "logits" (B,T,V); "loss" (1); "grad/<name>";
// "step_losses", "step_grad_norms" (steps); "final/<name>" weights after
// `steps` AdamW steps (zero_grad, forward, backward, clip, step) on the same
// batch. The last record of the file is final/ln_f.bias, so a file cut at a
// record boundary is caught by the missing records.
//
// Records: "config" int32 [maxT, V, L, NH, C, B, T, steps]; "adamw" float32
// [lr, beta1, beta2, eps, weight_decay, max_grad_norm]; "tokens", "targets"
// int32 (B,T); "param/<name>" initial weights (wte.weight is (V,C), the
// engine's is (Vp,C)); "logits" (B,T,V); "loss" (1); "grad/<name>";
// "step_losses", "step_grad_norms" (steps); "final/<name>" weights after
// `steps` AdamW steps.
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
    int maxT, V, L, NH, C, B, T, steps;
    float lr, beta1, beta2, eps, weight_decay, max_grad_norm;
} fx_config;

// The parameter names of an L-layer GPT-2 in table order, with their shapes
// as stored in the fixture (wte with V rows) and whether AdamW decays them.
typedef struct {
    char name[FL_PARAM_NAME_MAX];
    int ndim;
    uint64_t shape[2];
    int decay;
} fx_param;

#define FX_MAX_PARAMS (2 + 12 * 16 + 2)

// Logit tolerances against the float64 reference: the engine computes in
// float32 (observed 5.4e-7 on this fixture; PyTorch float32: 5.1e-7).
#define LOGITS_ATOL 5e-6
#define LOGITS_RTOL 1e-5

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
// The parameter names, fixture shapes and decay flags in table order.
int fx_expected_params(const fx_config *c, fx_param *out);
fl_model_config fx_make_config(const fx_config *c);
// Reads and validates the fixture at path (*data: the file, malloc'd,
// which fx points into); 0 after a failed t_check.
int fx_load(const char *path, fixture *fx, fx_config *c, unsigned char **data);

#endif
