// test_matmul_dnnl.c: the oneDNN bf16 GEMM backend (src/kernels/matmul_dnnl.c)
// against the fp32 matmul_forward_ref / matmul_backward_ref on the same
// bf16-rounded inputs: forward with and without bias, backward accumulating
// into prefilled gradients with every combination of NULL gradients, and
// bitwise determinism. Skipped (with a legitimate check) on CPUs without
// native bf16.
#include "fitlm/core.h"
#include "fitlm/dtype.h"
#include "fitlm/kernels.h"
#include "testlib.h"

#include "../src/kernels/matmul_dnnl.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Tolerance. Inputs are bf16 values, so every product is exact in fp32 and
// the two sides differ by (a) oneDNN's single rounding of its fp32 result to
// bf16, at most half an ulp: 2^-8 of the value's magnitude (rtol), and (b)
// the fp32 summation error of both sides, a sum of K terms in different
// orders. Its rigorous bound (K-1)*2^-24*sum|a*b| is ~K times larger than
// what random data produce; the typical size is ~sqrt(K) roundings of a
// partial sum of size ~sqrt(K)*max|a*b|, i.e. K*2^-24*max|a*b|. atol is 8
// times that (it matters only for results near zero; elsewhere rtol
// dominates by orders of magnitude).
#define RTOL 0x1p-8

static double atol_for(int K, double max_product) {
    return 8.0 * K * 0x1p-24 * max_product;
}

// worst |got-want| / (atol + rtol*|want|) over all elements, for the report
static double worst_ratio = 0.0;

static void compare(const char *name, const uint16_t *got_bf16, const float *want, size_t n,
                    double atol) {
    float *got = malloc(n * sizeof *got);
    for (size_t i = 0; i < n; i++) {
        got[i] = fl_bf16_to_f32(got_bf16[i]);
        double r = fabs((double)got[i] - want[i]) / (atol + RTOL * fabs(want[i]));
        if (r > worst_ratio || r != r) worst_ratio = r;
    }
    t_close(name, got, want, n, atol, RTOL);
    free(got);
}

// n bf16 values uniform in [-scale, scale), and their fp32 twins
static void fill_bf16(uint16_t *h, float *f, size_t n, unsigned seed, float scale) {
    t_fill(f, n, seed, scale);
    for (size_t i = 0; i < n; i++) {
        h[i] = fl_f32_to_bf16(f[i]);
        f[i] = fl_bf16_to_f32(h[i]);
    }
}

typedef struct {
    int N, C, OC;
} shape;

static void test_shape(shape s) {
    int N = s.N, C = s.C, OC = s.OC;
    size_t nx = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
    printf("N=%d C=%d OC=%d\n", N, C, OC);
    unsigned seed = (unsigned)(N * 1000003 + C * 1009 + OC);

    // inputs in [-1,1), so |a*b| <= 1 for every GEMM; the prefilled
    // gradients are of the size of what is added to them (~sqrt(K)/3)
    uint16_t *x = malloc(nx * 2), *w = malloc(nw * 2), *b = malloc(OC * 2), *dy = malloc(ny * 2);
    float *xf = malloc(nx * 4), *wf = malloc(nw * 4), *bf = malloc(OC * 4), *dyf = malloc(ny * 4);
    fill_bf16(x, xf, nx, seed + 1, 1.0f);
    fill_bf16(w, wf, nw, seed + 2, 1.0f);
    fill_bf16(b, bf, OC, seed + 3, 1.0f);
    fill_bf16(dy, dyf, ny, seed + 4, 1.0f);
    uint16_t *dx0 = malloc(nx * 2), *dw0 = malloc(nw * 2), *db0 = malloc(OC * 2);
    float *dxf = malloc(nx * 4), *dwf = malloc(nw * 4), *dbf = malloc(OC * 4);
    fill_bf16(dx0, dxf, nx, seed + 5, 0.3f * sqrtf((float)OC) + 1.0f);
    fill_bf16(dw0, dwf, nw, seed + 6, 0.3f * sqrtf((float)N) + 1.0f);
    fill_bf16(db0, dbf, OC, seed + 7, 0.3f * sqrtf((float)N) + 1.0f);

    // fp32 oracle on the same values
    float *yf = malloc(ny * 4), *yf_nobias = malloc(ny * 4);
    matmul_forward_ref(yf, xf, wf, bf, N, C, OC);
    matmul_forward_ref(yf_nobias, xf, wf, NULL, N, C, OC);
    matmul_backward_ref(dxf, dwf, dbf, dyf, xf, wf, N, C, OC);

    size_t ws_bytes = dnnl_matmul_workspace_bytes(FL_BF16, N, C, OC);
    t_check(ws_bytes == dnnl_matmul_workspace_bytes(FL_BF16, N, C, OC),
            "workspace bytes stable for N=%d C=%d OC=%d", N, C, OC);
    printf("  workspace %zu bytes\n", ws_bytes);
    // the workspace, followed by guard bytes oneDNN must leave alone
    enum { GUARD = 4096 };
    unsigned char *ws = fl_alloc(FL_MEM_WORKSPACE, ws_bytes + GUARD);
    memset(ws + ws_bytes, 0xa5, GUARD);

    // forward overwrites: start from NaNs
    uint16_t *y = malloc(ny * 2), *y2 = malloc(ny * 2);
    for (size_t i = 0; i < ny; i++) y[i] = 0x7fc0;
    dnnl_matmul_forward(FL_BF16, y, x, w, b, ws, N, C, OC);
    compare("forward", y, yf, ny, atol_for(C + 1, 1.0));
    for (size_t i = 0; i < ny; i++) y2[i] = 0x7fc0;
    dnnl_matmul_forward(FL_BF16, y2, x, w, NULL, ws, N, C, OC);
    compare("forward, no bias", y2, yf_nobias, ny, atol_for(C, 1.0));
    dnnl_matmul_forward(FL_BF16, y2, x, w, b, ws, N, C, OC);
    t_check(memcmp(y, y2, ny * 2) == 0, "forward deterministic (N=%d C=%d OC=%d)", N, C, OC);

    // backward: every combination of NULL gradients, each from the prefill
    uint16_t *dx = malloc(nx * 2), *dw = malloc(nw * 2), *db = malloc(OC * 2);
    uint16_t *dx_all = malloc(nx * 2), *dw_all = malloc(nw * 2), *db_all = malloc(OC * 2);
    for (int mask = 7; mask >= 0; mask--) {
        memcpy(dx, dx0, nx * 2);
        memcpy(dw, dw0, nw * 2);
        memcpy(db, db0, OC * 2);
        dnnl_matmul_backward(FL_BF16, mask & 1 ? dx : NULL, mask & 2 ? dw : NULL,
                             mask & 4 ? db : NULL, dy, x, w, ws, N, C, OC);
        char name[64];
        if (mask == 7) {
            compare("dinp (+= prefill)", dx, dxf, nx, atol_for(OC + 1, 1.0));
            compare("dweight (+= prefill)", dw, dwf, nw, atol_for(N + 1, 1.0));
            compare("dbias (+= prefill)", db, dbf, OC, atol_for(N + 1, 1.0));
            memcpy(dx_all, dx, nx * 2);
            memcpy(dw_all, dw, nw * 2);
            memcpy(db_all, db, OC * 2);
            continue;
        }
        // the same bits as with all three, and NULL ones left alone
        snprintf(name, sizeof name, "backward mask %d", mask);
        t_check(memcmp(dx, mask & 1 ? dx_all : dx0, nx * 2) == 0, "%s: dinp", name);
        t_check(memcmp(dw, mask & 2 ? dw_all : dw0, nw * 2) == 0, "%s: dweight", name);
        t_check(memcmp(db, mask & 4 ? db_all : db0, OC * 2) == 0, "%s: dbias", name);
    }

    // determinism: a second full run gives the same bits
    memcpy(dx, dx0, nx * 2);
    memcpy(dw, dw0, nw * 2);
    memcpy(db, db0, OC * 2);
    dnnl_matmul_backward(FL_BF16, dx, dw, db, dy, x, w, ws, N, C, OC);
    t_check(memcmp(dx, dx_all, nx * 2) == 0 && memcmp(dw, dw_all, nw * 2) == 0 &&
                memcmp(db, db_all, OC * 2) == 0,
            "backward deterministic (N=%d C=%d OC=%d)", N, C, OC);

    int guard_ok = 1;
    for (size_t i = 0; i < GUARD; i++) guard_ok &= ws[ws_bytes + i] == 0xa5;
    t_check(guard_ok, "nothing written past the workspace (N=%d C=%d OC=%d)", N, C, OC);
    fl_free(ws);
    free(x), free(w), free(b), free(dy), free(xf), free(wf), free(bf), free(dyf);
    free(dx0), free(dw0), free(db0), free(dxf), free(dwf), free(dbf);
    free(yf), free(yf_nobias), free(y), free(y2);
    free(dx), free(dw), free(db), free(dx_all), free(dw_all), free(db_all);
}

static void die_unsupported(void *arg) {
    (void)arg;
    uint16_t a = 0, c = 0;
    dnnl_matmul_forward(FL_F16, &c, &a, &a, NULL, NULL, 1, 1, 1);
}

// matmul (src/kernels/matmul.c) takes oneDNN for bf16 only where its native
// kernels beat fp32 FMAs: AMX, or AVX512_BF16 on AMD
static void test_dispatch(void) {
    const fl_cpu_features *f = fl_cpu();
    t_check(!f->bf16_dot_fast || f->avx512_bf16, "a fast bf16 dot product is AVX512_BF16");
    int native = (f->amx_bf16 || f->bf16_dot_fast) && dnnl_matmul_supported(FL_BF16);
    t_check(matmul_native_bf16(FL_BF16) == native &&
                (!strcmp(matmul_gemm_name(FL_BF16), native ? "onednn" : "fitlm") ||
                 fl_cpu_isa() == FL_ISA_PORTABLE),
            "bf16 GEMMs: %s (avx512_bf16 %d, fast dot product %d, amx_bf16 %d)",
            matmul_gemm_name(FL_BF16), f->avx512_bf16, f->bf16_dot_fast, f->amx_bf16);
    t_check(!matmul_native_bf16(FL_F32) && !matmul_native_bf16(FL_F16) &&
                strcmp(matmul_gemm_name(FL_F32), "onednn") &&
                strcmp(matmul_gemm_name(FL_F16), "onednn"),
            "fp32 and fp16 never take oneDNN");
}

int main(void) {
    test_dispatch();
    t_check(!dnnl_matmul_supported(FL_F32), "fp32 is never supported");
    t_check(!dnnl_matmul_supported(FL_F16), "fp16 is never supported");
    t_dies("fp16 forward", die_unsupported, NULL, "not supported");
    if (!dnnl_matmul_supported(FL_BF16)) {
        printf("oneDNN bf16 matmul not supported on this CPU (avx512_bf16 %d): tests skipped\n",
               fl_cpu()->avx512_bf16);
        t_check(!dnnl_matmul_supported(FL_BF16), "bf16 consistently unsupported");
        return t_report();
    }
    printf("oneDNN bf16 matmul supported (avx512_bf16 %d, amx_bf16 %d), %d threads\n",
           fl_cpu()->avx512_bf16, fl_cpu()->amx_bf16, fl_threads());

    const shape shapes[] = {
        {256, 768, 2304}, // GPT-2 attention qkv
        {64, 3072, 768},  // GPT-2 MLP projection
        {1, 7, 33},       {5, 64, 50}, {3, 1, 1}, {17, 100, 129}, {130, 33, 7},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) test_shape(shapes[i]);
    // shapes again, from the cache, interleaved with others
    test_shape(shapes[2]);
    printf("worst error / tolerance: %.3f\n", worst_ratio);

    dnnl_matmul_release();
    // a released cache is rebuilt on demand
    test_shape(shapes[3]);
    dnnl_matmul_release();
    return t_report();
}
