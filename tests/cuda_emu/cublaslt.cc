// cublaslt.cc: the CUDA emulator's cuBLASLt (cublasLt.h): column-major
// D = alpha op(A) op(B) + beta C, plus the bias epilogue's vector (one value
// per row of D, added to every column) and the GELU epilogues (GELU_AUX,
// GELU_AUX_BIAS: the value stored to the aux matrix, then GELU's tanh form
// in fp32 to D; DGELU: the value times the tanh form's derivative at the
// aux matrix's value), the sums in fp32 in k order and each
// result rounded once to D's type (to nearest even). As cuBLASLt: C is not
// read when beta is 0; the algorithm carries the operand alignment it was
// chosen for, and a call with less aligned pointers fails.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cublasLt.h"
#include "emu.hpp"

struct fl_emu_lt_handle {
    int unused;
};

struct fl_emu_lt_desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    cublasOperation_t ta, tb;
    cublasLtEpilogue_t epilogue;
    const void *bias;
    int bias_type; // -1: D's
    void *aux;     // the GELU's input, D's type, aux_ld apart
    int64_t aux_ld;
};

struct fl_emu_lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
};

struct fl_emu_lt_pref {
    uint64_t max_workspace;
    uint32_t align[4]; // A, B, C, D
};

namespace {

// an epilogue that writes (GELU_AUX) or reads (DGELU) the aux matrix
bool gelu(cublasLtEpilogue_t e) {
    return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
           e == CUBLASLT_EPILOGUE_DGELU;
}

// d/dx of GELU's tanh form, 0.5 x (1 + tanh(s (x + k x^3)))
float dgelu(float x) {
    const float s = 0.7978845608f, k = 0.044715f;
    float t = tanhf(s * (x + k * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * s * (1.0f + 3.0f * k * x * x);
}

size_t type_bytes(int t) {
    return t == CUDA_R_32F ? 4 : 2;
}

int known_type(int t) {
    return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF;
}

float load(int t, const void *p, size_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    uint32_t u;
    if (t == CUDA_R_16BF) {
        u = (uint32_t)h << 16;
    } else { // binary16
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0) {
            float f = ldexpf((float)m, -24);
            return sign ? -f : f;
        }
        u = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void store(int t, void *p, size_t i, float x) {
    if (t == CUDA_R_32F) {
        ((float *)p)[i] = x;
        return;
    }
    uint32_t u;
    memcpy(&u, &x, 4);
    uint16_t h;
    if (t == CUDA_R_16BF) {
        h = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                            : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    } else {
        uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
        if (a > 0x7f800000u)
            h = (uint16_t)(sign | 0x7e00u);
        else if (a >= 0x477ff000u)
            h = (uint16_t)(sign | 0x7c00u);
        else if (a < 0x38800000u) {
            float f;
            memcpy(&f, &a, 4);
            h = (uint16_t)(sign | (uint32_t)rintf(ldexpf(f, 24)));
        } else
            h = (uint16_t)(sign | ((a + 0xc8000fffu + ((a >> 13) & 1)) >> 13));
    }
    ((uint16_t *)p)[i] = h;
}

// TF32: 10 mantissa bits, to nearest (ties away, as the tensor cores' conversion)
float tf32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu;
    memcpy(&x, &u, 4);
    return x;
}

// op(X)'s shape from X's stored layout
void op_shape(const fl_emu_lt_layout *x, cublasOperation_t op, uint64_t *rows, uint64_t *cols) {
    *rows = op == CUBLAS_OP_N ? x->rows : x->cols;
    *cols = op == CUBLAS_OP_N ? x->cols : x->rows;
}

// The checks cuBLASLt makes of a problem: shapes that agree, leading
// dimensions at least the rows, the types it supports with fp32 compute.
cublasStatus_t check(const fl_emu_lt_desc *d, const fl_emu_lt_layout *a, const fl_emu_lt_layout *b,
                     const fl_emu_lt_layout *c, const fl_emu_lt_layout *dl) {
    uint64_t am, ak, bk, bn;
    op_shape(a, d->ta, &am, &ak);
    op_shape(b, d->tb, &bk, &bn);
    if (ak != bk || am != dl->rows || bn != dl->cols || c->rows != dl->rows || c->cols != dl->cols)
        return CUBLAS_STATUS_INVALID_VALUE;
    const fl_emu_lt_layout *all[] = {a, b, c, dl};
    for (const fl_emu_lt_layout *x : all)
        if (x->ld < (int64_t)(x->rows ? x->rows : 1) || !known_type(x->type))
            return CUBLAS_STATUS_INVALID_VALUE;
    if (a->type != b->type || c->type != dl->type ||
        (dl->type != a->type && dl->type != CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->scale != CUDA_R_32F ||
        (d->compute != CUBLAS_COMPUTE_32F && d->compute != CUBLAS_COMPUTE_32F_FAST_TF32))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a->type != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && d->epilogue != CUBLASLT_EPILOGUE_BIAS &&
        !gelu(d->epilogue))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    // the aux's leading dimension: a multiple of 8, at least D's rows (cublasLt.h)
    if (gelu(d->epilogue) && (d->aux_ld % 8 || d->aux_ld < (int64_t)dl->rows))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (d->bias_type >= 0 && (!known_type(d->bias_type) ||
                              (d->bias_type != (int)dl->type && d->bias_type != CUDA_R_32F)))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}

void matmul(fl_emu_lt_desc d, float alpha, const void *A, fl_emu_lt_layout a, const void *B,
            fl_emu_lt_layout b, float beta, const void *C, fl_emu_lt_layout c, void *D,
            fl_emu_lt_layout dl) {
    uint64_t m = dl.rows, n = dl.cols, k, unused;
    op_shape(&a, d.ta, &unused, &k);
    int tf = d.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    // op(A) by rows, each k contiguous values; op(B) by blocks of LANES
    // columns, their values at each p side by side (columns past n zero)
    enum { LANES = 8 };
    uint64_t blocks = (n + LANES - 1) / LANES;
    std::vector<float> ar(m * k), bc(blocks * k * LANES, 0.0f);
    for (uint64_t i = 0; i < m; i++)
        for (uint64_t p = 0; p < k; p++) {
            size_t at = d.ta == CUBLAS_OP_N ? i + p * (uint64_t)a.ld : p + i * (uint64_t)a.ld;
            float v = load(a.type, A, at);
            ar[i * k + p] = tf ? tf32(v) : v;
        }
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t p = 0; p < k; p++) {
            size_t at = d.tb == CUBLAS_OP_N ? p + j * (uint64_t)b.ld : j + p * (uint64_t)b.ld;
            float v = load(b.type, B, at);
            bc[(j / LANES * k + p) * LANES + j % LANES] = tf ? tf32(v) : v;
        }
    int bias_type = d.bias_type >= 0 ? d.bias_type : (int)dl.type;
    // each value's sum in k order from 0, as one chain would add it; LANES
    // columns' chains at once only so that they overlap in the pipeline
    for (uint64_t jb = 0; jb < blocks; jb++)
        for (uint64_t i = 0; i < m; i++) {
            const float *x = &ar[i * k], *y = &bc[jb * k * LANES];
            float s[LANES] = {0.0f};
            for (uint64_t p = 0; p < k; p++)
                for (int q = 0; q < LANES; q++) s[q] += x[p] * y[p * LANES + q];
            for (uint64_t j = jb * LANES; j < n && j < (jb + 1) * LANES; j++) {
                float v = alpha * s[j % LANES];
                if (beta != 0.0f) v += beta * load(c.type, C, i + j * (uint64_t)c.ld);
                if (d.epilogue == CUBLASLT_EPILOGUE_BIAS ||
                    d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
                    v += load(bias_type, d.bias, i);
                size_t aux_at = i + j * (uint64_t)d.aux_ld;
                if (d.epilogue == CUBLASLT_EPILOGUE_DGELU) { // the gradient through GELU
                    v *= dgelu(load(dl.type, d.aux, aux_at));
                } else if (gelu(d.epilogue)) { // the input stored, GELU's tanh form applied
                    store(dl.type, d.aux, aux_at, v);
                    v = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
                }
                store(dl.type, D, i + j * (uint64_t)dl.ld, v);
            }
        }
}

// the bytes of a column-major matrix's storage
size_t extent(const fl_emu_lt_layout *x) {
    if (!x->rows || !x->cols) return 0;
    return ((x->cols - 1) * (uint64_t)x->ld + x->rows) * type_bytes(x->type);
}

} // namespace

extern "C" {

// each status's name and cuBLAS's text for it
static const struct {
    cublasStatus_t st;
    const char *name, *text;
} statuses[] = {
    {CUBLAS_STATUS_SUCCESS, "CUBLAS_STATUS_SUCCESS", "the operation completed successfully"},
    {CUBLAS_STATUS_NOT_INITIALIZED, "CUBLAS_STATUS_NOT_INITIALIZED",
     "the library was not initialized"},
    {CUBLAS_STATUS_INVALID_VALUE, "CUBLAS_STATUS_INVALID_VALUE",
     "an invalid value was used as an argument"},
    {CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_STATUS_NOT_SUPPORTED",
     "the functionality requested is not supported"},
};

const char *cublasLtGetStatusString(cublasStatus_t st) {
    for (const auto &s : statuses)
        if (s.st == st) return s.text;
    return "unknown status";
}

const char *cublasLtGetStatusName(cublasStatus_t st) {
    for (const auto &s : statuses)
        if (s.st == st) return s.name;
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    *h = new fl_emu_lt_handle{0};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    *d = new fl_emu_lt_desc{
        compute, scale, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, NULL, -1, NULL, 0};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t size) {
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        if (size != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
        cublasOperation_t op;
        memcpy(&op, buf, size);
        if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = op;
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (size != sizeof(cublasLtEpilogue_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->epilogue, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->bias, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->aux, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
        if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&d->aux_ld, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
        if (size != sizeof(cudaDataType_t)) return CUBLAS_STATUS_INVALID_VALUE;
        cudaDataType_t t;
        memcpy(&t, buf, size);
        d->bias_type = (int)t;
        return CUBLAS_STATUS_SUCCESS;
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
    if (!known_type(type)) return CUBLAS_STATUS_INVALID_VALUE;
    *l = new fl_emu_lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    *p = new fl_emu_lt_pref{0, {256, 256, 256, 256}}; // cuBLASLt's defaults
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t size) {
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->max_workspace, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    }
    int i = attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
    if (i < 0 || i > 3 || size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(&p->align[i], buf, size);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t *results,
                                              int *found) {
    if (!h || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    *found = 0;
    cublasStatus_t st = check(d, a, b, c, dl);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    // FITLM_CUDA_EMU_NO_EPILOGUES=1: a library without kernels for the bias
    // and GELU epilogues (the caller's fallback tested)
    const char *none = getenv("FITLM_CUDA_EMU_NO_EPILOGUES");
    if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && none && !strcmp(none, "1"))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    // an algorithm for operands aligned to at least the element size
    for (int i = 0; i < 4; i++) {
        const fl_emu_lt_layout *x = i == 0 ? a : i == 1 ? b : i == 2 ? c : dl;
        if (p->align[i] < type_bytes(x->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    // two algorithms (the same arithmetic; the second's data marks it), so
    // that a caller's loop over several runs
    for (int r = 0; r < requested && r < 2; r++) {
        results[r] = cublasLtMatmulHeuristicResult_t{};
        for (int i = 0; i < 4; i++) results[r].algo.data[i] = p->align[i];
        results[r].algo.data[4] = (uint64_t)r;
        results[r].state = CUBLAS_STATUS_SUCCESS;
        results[r].wavesCount = 1.0f;
        *found = r + 1;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t a, const void *B,
                              cublasLtMatrixLayout_t b, const void *beta, const void *C,
                              cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(fl_emu::lock);
    if (!h || !algo) return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t st = check(d, a, b, c, dl);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    const void *ptrs[] = {A, B, C, D};
    for (int i = 0; i < 4; i++)
        if ((uintptr_t)ptrs[i] % algo->data[i]) return CUBLAS_STATUS_INVALID_VALUE;
    if (C != D && (c->ld != dl->ld || c->type != dl->type))
        return CUBLAS_STATUS_NOT_SUPPORTED; // in place, or C laid out as D
    const fl_emu_lt_layout *ls[] = {a, b, c, dl};
    float be;
    memcpy(&be, beta, sizeof be);
    for (int i = 0; i < 4; i++) {
        if (i == 2 && be == 0.0f) continue; // C is not read
        if (extent(ls[i]) && !fl_emu::is_device(ptrs[i], extent(ls[i])))
            fl_emu::die("cublasLtMatmul: operand %c (%zu bytes) is not in device memory", "ABCD"[i],
                        extent(ls[i]));
    }
    if (gelu(d->epilogue) &&
        !fl_emu::is_device(d->aux, ((dl->cols - 1) * (uint64_t)d->aux_ld + dl->rows) *
                                       type_bytes(dl->type)))
        fl_emu::die("cublasLtMatmul: the GELU epilogue's aux matrix is not in device memory");
    if ((d->epilogue == CUBLASLT_EPILOGUE_BIAS || d->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) &&
        !fl_emu::is_device(d->bias,
                           dl->rows * type_bytes(d->bias_type >= 0 ? d->bias_type : (int)dl->type)))
        fl_emu::die("cublasLtMatmul: the bias is not %llu values in device memory",
                    (unsigned long long)dl->rows);
    if (workspace_bytes && !fl_emu::is_device(workspace, workspace_bytes))
        fl_emu::die("cublasLtMatmul: the workspace (%zu bytes) is not in device memory",
                    workspace_bytes);
    float al;
    memcpy(&al, alpha, sizeof al);
    // the descriptor's and layouts' values now (host pointer mode), the arithmetic when the stream
    // runs
    fl_emu_lt_desc dv = *d;
    fl_emu_lt_layout av = *a, bv = *b, cv = *c, dv_l = *dl;
    fl_emu::enqueue(s, [=]() { matmul(dv, al, A, av, B, bv, be, C, cv, D, dv_l); });
    return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
