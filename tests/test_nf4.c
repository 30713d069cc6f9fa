// test_nf4.c: the NF4 kernels (src/kernels/nf4.c) against bitsandbytes'
// definition: the tables, the rounding rules at every midpoint, the packing,
// a fixture written by scripts/make_nf4_reference.py (bitwise), every
// dequantisation path against the reference (bitwise, any thread count), and
// the quantisation error against bounds derived from the codebook.
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/kernels.h"
#include "testlib.h"
#include "testref.h"

// bitsandbytes' csrc/kernels.cu dQuantizeNF4 thresholds, copied here again
// so the test does not read the kernel's own table
static const float BNB_THRESHOLDS[15] = {
    -0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,   -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,   0.2035212516784668f,   0.2920137718319893f,    0.3893125355243683f,
    0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f};

// the codebook as docs/anchors list it (7 decimals)
static const double ANCHOR_NF4[16] = {
    -1,        -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0,
    0.0795803, 0.1609302,  0.2461123,  0.3379152,  0.4407098,  0.5626170,  0.7229568,  1};

static const char *ISA_NAME[3] = {"portable", "avx2", "avx512"};
static const fl_dtype DTYPES[3] = {FL_F32, FL_BF16, FL_F16};

static int isa_available(int isa) {
    return isa == NF4_ISA_PORTABLE || (isa == NF4_ISA_AVX2 && fl_cpu()->avx2) ||
           (isa == NF4_ISA_AVX512 && fl_cpu()->avx512f);
}

static size_t nblocks(size_t n, int block) {
    return (n + (size_t)block - 1) / (size_t)block;
}

static int code_at(const uint8_t *codes, size_t i) {
    return (codes[i / 2] >> (i % 2 ? 0 : 4)) & 15;
}

// the largest gap between consecutive values of a sorted table
static double max_gap(const float *t, int n) {
    double g = 0;
    for (int i = 0; i + 1 < n; i++) g = fmax(g, (double)t[i + 1] - t[i]);
    return g;
}

static void fill_normal(float *w, size_t n, uint64_t seed, float std) {
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) w[i] = std * fl_rng_normal(&rng);
}

// ----------------------------------------------------------------------------
// 1. the tables

static void test_tables(void) {
    int ok = 1;
    for (int i = 0; i < 16; i++) ok &= fabs(nf4_codebook[i] - ANCHOR_NF4[i]) <= 5e-8;
    for (int i = 0; i < 15; i++) ok &= nf4_codebook[i] < nf4_codebook[i + 1];
    t_check(ok && nf4_codebook[0] == -1.0f && nf4_codebook[7] == 0.0f && nf4_codebook[15] == 1.0f,
            "nf4_codebook: 16 sorted values, -1, 0 at code 7, 1, equal to the anchors' to 5e-8");
    // each bitsandbytes threshold is the codebook midpoint to one ulp
    ok = 1;
    for (int i = 0; i < 15; i++) {
        float m = (nf4_codebook[i] + nf4_codebook[i + 1]) * 0.5f;
        ok &= m == BNB_THRESHOLDS[i] || nextafterf(m, -2.0f) == BNB_THRESHOLDS[i] ||
              nextafterf(m, 2.0f) == BNB_THRESHOLDS[i];
    }
    t_check(ok, "bitsandbytes' NF4 thresholds are the codebook midpoints to one ulp");

    // dq8_map: create_dynamic_map(signed=True, max_exponent_bits=7,
    // total_bits=8) in double: for exponent i = 0..6, 2^i means of the
    // intervals of linspace(0.1, 1, 2^i + 1), times +-10^(i-6), plus 0 and 1.
    // The fp32 table may differ from it by float32 rounding only.
    double want[256];
    int k = 0;
    for (int i = 0; i < 7; i++) {
        int m = 1 << i;
        for (int j = 0; j < m; j++) {
            double lo = 0.1 + 0.9 * j / m, hi = 0.1 + 0.9 * (j + 1) / m;
            double v = pow(10.0, i - 6) * (lo + hi) / 2;
            want[k++] = v;
            want[k++] = -v;
        }
    }
    want[k++] = 0;
    want[k++] = 1;
    for (int i = 0; i < 256; i++) // insertion sort of 256 values
        for (int j = i; j > 0 && want[j - 1] > want[j]; j--) {
            double t = want[j];
            want[j] = want[j - 1];
            want[j - 1] = t;
        }
    int sorted = 1, close = 1, sym = 1, n_neg = 0, n_pos = 0;
    for (int i = 0; i < 256; i++) {
        if (i) sorted &= dq8_map[i - 1] < dq8_map[i];
        close &= fabs(dq8_map[i] - want[i]) <= 3e-7 * fabs(want[i]);
        n_neg += dq8_map[i] < 0;
        n_pos += dq8_map[i] > 0;
    }
    for (int i = 0; i < 127; i++) sym &= dq8_map[i] == -dq8_map[254 - i];
    t_check(k == 256 && sorted && close && sym,
            "dq8_map: 256 strictly increasing values, create_dynamic_map's to float32 rounding, "
            "symmetric but for the last");
    t_check(n_neg == 127 && n_pos == 128 && dq8_map[127] == 0.0f && dq8_map[255] == 1.0f &&
                dq8_map[0] > -1.0f && dq8_map[0] == -0.992968738f,
            "dq8_map holds 0 (index 127) and 1 (index 255) but not -1: it starts at %.9g",
            dq8_map[0]);
}

// ----------------------------------------------------------------------------
// 2. rounding and packing

// A single block of absmax 1 (so w * (1/absmax) == w): w[0] = 1, then values.
static void quantize_unit(const float *vals, int m, int *codes_out) {
    float w[64] = {1.0f}, absmax[1];
    uint8_t codes[32];
    memcpy(w + 1, vals, (size_t)m * sizeof(float));
    nf4_quantize(codes, absmax, w, (size_t)m + 1, 64);
    for (int i = 0; i < m; i++) codes_out[i] = code_at(codes, (size_t)i + 1);
}

static void test_rounding(void) {
    float v[45];
    int c[45], ok = 1;
    for (int j = 0; j < 15; j++) {
        v[3 * j] = BNB_THRESHOLDS[j];
        v[3 * j + 1] = nextafterf(BNB_THRESHOLDS[j], 2.0f);
        v[3 * j + 2] = nextafterf(BNB_THRESHOLDS[j], -2.0f);
    }
    quantize_unit(v, 45, c);
    for (int j = 0; j < 15; j++) ok &= c[3 * j] == j && c[3 * j + 1] == j + 1 && c[3 * j + 2] == j;
    t_check(ok, "every threshold takes the lower code, the next float up the upper one");
    quantize_unit(nf4_codebook, 16, c);
    ok = 1;
    for (int i = 0; i < 16; i++) ok &= c[i] == i;
    t_check(ok, "every codebook value quantises to its own code");
    float big[2] = {-1.0f, 0.999f};
    quantize_unit(big, 2, c);
    t_check(c[0] == 0 && c[1] == 15, "-1 -> code 0, 0.999 -> code 15");

    // packing: first element in the high nibble; odd tail padded with 7
    float w3[3] = {1.0f, nf4_codebook[2], nf4_codebook[9]}, a3;
    uint8_t p3[2];
    nf4_quantize(p3, &a3, w3, 3, 64);
    t_check(a3 == 1.0f && p3[0] == 0xf2 && p3[1] == 0x97,
            "packing: codes 15, 2, 9 -> bytes f2 97 (got %02x %02x)", p3[0], p3[1]);

    // an all-zero block: absmax 0, codes 7, dequantised to +0 on every path
    float z[2 * 32] = {0}, az[2];
    for (int i = 32; i < 64; i++) z[i] = (float)(i - 40) * 1e-3f;
    uint8_t cz[32];
    nf4_quantize(cz, az, z, 64, 32);
    ok = az[0] == 0.0f && az[1] > 0.0f;
    for (int j = 0; j < 16; j++) ok &= cz[j] == 0x77;
    t_check(ok, "a zero block: absmax 0, every byte 0x77");
    for (int isa = 0; isa < 3; isa++) {
        if (!isa_available(isa)) continue;
        for (int d = 0; d < 3; d++) {
            uint16_t out[64] = {0};
            float outf[64] = {0};
            void *o = DTYPES[d] == FL_F32 ? (void *)outf : (void *)out;
            nf4_dequantize_isa(isa, DTYPES[d], o, cz, az, 64, 32);
            int zero = 1;
            for (int i = 0; i < 32; i++)
                zero &= DTYPES[d] == FL_F32 ? outf[i] == 0.0f && !signbit(outf[i]) : out[i] == 0;
            t_check(zero, "%s %s: a zero block dequantises to +0, no NaN", ISA_NAME[isa],
                    fl_dtype_name(DTYPES[d]));
        }
    }

    // blocks of every size, n not a multiple of the block, odd n, odd block:
    // absmax and codes against a direct per-element evaluation
    const int blocks[] = {32, 64, 128, 4096, 33};
    for (int bi = 0; bi < 5; bi++) {
        int block = blocks[bi];
        size_t n = (size_t)block * 5 + 17;
        float *w = malloc(n * sizeof(float)), *absmax = malloc(nblocks(n, block) * sizeof(float));
        uint8_t *codes = malloc((n + 1) / 2);
        fill_normal(w, n, 7 + (uint64_t)block, 0.02f);
        nf4_quantize(codes, absmax, w, n, block);
        int good = 1;
        for (size_t b = 0; b < nblocks(n, block); b++) {
            float a = 0;
            for (size_t i = b * block; i < n && i < (b + 1) * block; i++) a = fmaxf(a, fabsf(w[i]));
            good &= a == absmax[b];
        }
        for (size_t i = 0; i < n; i++) {
            float s = w[i] * (1.0f / absmax[i / block]);
            int want = 0;
            for (int j = 0; j < 15; j++) want += s > BNB_THRESHOLDS[j];
            good &= code_at(codes, i) == want;
        }
        good &= (n % 2 == 0) || (codes[n / 2] & 15) == 7;
        t_check(good, "block %d, n %zu: absmax and every code as defined%s", block, n,
                n % 2 ? ", the odd tail padded with 7" : "");
        free(w), free(absmax), free(codes);
    }
}

// ----------------------------------------------------------------------------
// 3. the reference fixture (bitwise)

static void *record(fixture *fx, const char *name, uint32_t dtype, uint64_t numel) {
    const fx_record *r = fx_expect(fx, name, dtype, 1, &numel);
    t_check(r != NULL, "fixture record %s: %s", name, r ? "ok" : fx->err);
    return r ? fx_copy(fx, r) : NULL;
}

static int same_codes(const uint8_t *got, const int *want, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i]) return 0;
    return 1;
}

static void test_fixture(void) {
    size_t size;
    unsigned char *data = t_read_file(t_source_path("tests/fixtures/nf4_ref.bin"), &size);
    fixture fx = {0};
    if (!t_check(data && fx_parse(&fx, data, size), "nf4 fixture parses: %s",
                 data ? fx.err : "cannot read tests/fixtures/nf4_ref.bin")) {
        free(data);
        return;
    }
    int *cfg = record(&fx, "config", FX_I32, 3);
    if (!cfg) {
        free(fx.recs);
        free(data);
        return;
    }
    size_t n = (size_t)cfg[0];
    int block = cfg[1], dq_block = cfg[2];
    size_t nb = nblocks(n, block), nn = nblocks(nb, dq_block);
    float *cb = record(&fx, "nf4_codebook", FX_F32, 16),
          *th = record(&fx, "nf4_thresholds", FX_F32, 15);
    float *map = record(&fx, "dq8_map", FX_F32, 256), *w = record(&fx, "w", FX_F32, n);
    int *want_codes = record(&fx, "codes", FX_I32, (n + 1) / 2);
    float *want_absmax = record(&fx, "absmax", FX_F32, nb),
          *want_deq = record(&fx, "dequant", FX_F32, n);
    int *want_dq = record(&fx, "dq_codes", FX_I32, nb);
    float *want_nested = record(&fx, "nested_absmax", FX_F32, nn);
    float *want_off = record(&fx, "offset", FX_F32, 1),
          *want_adq = record(&fx, "absmax_dq", FX_F32, nb);
    float *want_deq_dq = record(&fx, "dequant_dq", FX_F32, n);
    t_check(cb && !memcmp(cb, nf4_codebook, sizeof nf4_codebook), "fixture: nf4_codebook bitwise");
    t_check(th && !memcmp(th, BNB_THRESHOLDS, sizeof BNB_THRESHOLDS),
            "fixture: the thresholds as the C compiler reads bitsandbytes' literals");
    t_check(map && !memcmp(map, dq8_map, sizeof dq8_map), "fixture: dq8_map bitwise");
    if (w && want_codes && want_absmax && want_deq && want_dq && want_nested && want_off &&
        want_adq && want_deq_dq) {
        uint8_t *codes = malloc((n + 1) / 2), *dq = malloc(nb);
        float *absmax = malloc(nb * sizeof(float)), *deq = malloc(n * sizeof(float));
        float *nested = malloc(nn * sizeof(float)), *adq = malloc(nb * sizeof(float)), off;
        nf4_quantize(codes, absmax, w, n, block);
        t_check(same_codes(codes, want_codes, (n + 1) / 2), "fixture: %zu NF4 codes bitwise", n);
        t_check(!memcmp(absmax, want_absmax, nb * sizeof(float)), "fixture: absmax bitwise");
        nf4_dequantize_ref(deq, codes, absmax, n, block);
        t_check(!memcmp(deq, want_deq, n * sizeof(float)), "fixture: dequantised values bitwise");
        dq8_quantize(dq, nested, &off, absmax, nb, dq_block);
        t_check(same_codes(dq, want_dq, nb) && !memcmp(nested, want_nested, nn * sizeof(float)) &&
                    !memcmp(&off, want_off, 4),
                "fixture: double quantisation (codes, nested absmax, offset %.9g) bitwise", off);
        dq8_dequantize(adq, dq, nested, off, nb, dq_block);
        t_check(!memcmp(adq, want_adq, nb * sizeof(float)), "fixture: dequantised absmax bitwise");
        nf4_dequantize(FL_F32, deq, codes, adq, n, block);
        t_check(!memcmp(deq, want_deq_dq, n * sizeof(float)),
                "fixture: values dequantised through the double-quantised absmax bitwise");
        free(codes), free(dq), free(absmax), free(deq), free(nested), free(adq);
    }
    // double quantisation alone, 3 nested blocks (the last partial)
    const fx_record *r = fx_find(&fx, "dq2/in");
    size_t m = r ? r->numel : 0, mn = nblocks(m, dq_block);
    float *in = record(&fx, "dq2/in", FX_F32, m),
          *nest2 = record(&fx, "dq2/nested_absmax", FX_F32, mn);
    float *off2 = record(&fx, "dq2/offset", FX_F32, 1), *out2 = record(&fx, "dq2/out", FX_F32, m);
    int *q2 = record(&fx, "dq2/codes", FX_I32, m);
    if (in && nest2 && off2 && out2 && q2) {
        uint8_t *q = malloc(m);
        float *nested = malloc(mn * sizeof(float)), *out = malloc(m * sizeof(float)), off;
        dq8_quantize(q, nested, &off, in, m, dq_block);
        dq8_dequantize(out, q, nested, off, m, dq_block);
        t_check(same_codes(q, q2, m) && !memcmp(nested, nest2, mn * sizeof(float)) &&
                    !memcmp(&off, off2, 4) && !memcmp(out, out2, m * sizeof(float)),
                "fixture: double quantisation of %zu values in %zu blocks bitwise", m, mn);
        free(q), free(nested), free(out);
    }
    free(cfg), free(cb), free(th), free(map), free(w), free(want_codes), free(want_absmax);
    free(want_deq), free(want_dq), free(want_nested), free(want_off), free(want_adq);
    free(want_deq_dq), free(in), free(nest2), free(off2), free(out2), free(q2);
    free(fx.recs);
    free(data);
}

// ----------------------------------------------------------------------------
// 4. every path and dtype against the reference, any thread count

static void test_paths(void) {
    const int blocks[] = {64, 33, 4096};
    for (int bi = 0; bi < 3; bi++) {
        int block = blocks[bi];
        size_t n = 3 * 4096 + 37; // chunks, blocks and bytes all end mid-way
        float *w = malloc(n * sizeof(float)), *absmax = malloc(nblocks(n, block) * sizeof(float));
        float *ref = malloc(n * sizeof(float));
        uint8_t *codes = malloc((n + 1) / 2), *want = malloc(n * 4), *got = malloc(n * 4);
        fill_normal(w, n, 99 + (uint64_t)block, 0.02f);
        w[100] = 0.5f; // an outlier
        nf4_quantize(codes, absmax, w, n, block);
        nf4_dequantize_ref(ref, codes, absmax, n, block);
        for (int d = 0; d < 3; d++) {
            fl_dtype dt = DTYPES[d];
            size_t bytes = n * fl_dtype_size(dt);
            fl_store_f32(dt, want, ref, n);
            for (int isa = 0; isa < 3; isa++) {
                if (!isa_available(isa)) {
                    printf("  skip: %s path (the CPU lacks it)\n", ISA_NAME[isa]);
                    continue;
                }
                memset(got, 0xcd, bytes);
                nf4_dequantize_isa(isa, dt, got, codes, absmax, n, block);
                t_check(!memcmp(got, want, bytes), "block %d, %s, %s path == reference bitwise",
                        block, fl_dtype_name(dt), ISA_NAME[isa]);
            }
            memset(got, 0xcd, bytes);
            nf4_dequantize(dt, got, codes, absmax, n, block);
            t_check(!memcmp(got, want, bytes), "block %d, %s, nf4_dequantize == reference bitwise",
                    block, fl_dtype_name(dt));
        }
        free(w), free(absmax), free(ref), free(codes), free(want), free(got);
    }

    // 1 thread vs 2: quantisation, double quantisation and dequantisation
    size_t n = 1 << 16, nb = n / 64;
    float *w = malloc(n * sizeof(float)), *a1 = malloc(nb * 4), *a2 = malloc(nb * 4);
    float *o1 = malloc(n * 4), *o2 = malloc(n * 4), nest1[4], nest2[4], off1, off2;
    uint8_t *c1 = malloc(n / 2), *c2 = malloc(n / 2), *q1 = malloc(nb), *q2 = malloc(nb);
    fill_normal(w, n, 5, 0.02f);
    int threads = fl_threads();
    omp_set_num_threads(1);
    nf4_quantize(c1, a1, w, n, 64);
    dq8_quantize(q1, nest1, &off1, a1, nb, 256);
    nf4_dequantize(FL_BF16, o1, c1, a1, n, 64);
    omp_set_num_threads(2);
    nf4_quantize(c2, a2, w, n, 64);
    dq8_quantize(q2, nest2, &off2, a2, nb, 256);
    nf4_dequantize(FL_BF16, o2, c2, a2, n, 64);
    omp_set_num_threads(threads);
    t_check(!memcmp(c1, c2, n / 2) && !memcmp(a1, a2, nb * 4) && !memcmp(q1, q2, nb) &&
                !memcmp(nest1, nest2, sizeof nest1) && off1 == off2 && !memcmp(o1, o2, n * 2),
            "1 and 2 threads give the same bits (quantise, double-quantise, dequantise)");
    free(w), free(a1), free(a2), free(o1), free(o2), free(c1), free(c2), free(q1), free(q2);
}

// dq8 ties: x exactly on the midpoint of two map values takes the even index.
// Symmetric inputs have mean 0 and nested absmax 1, so x * (1 / nested) == x.
static void test_dq8_ties(void) {
    int j = -1;
    for (int k = 129; k < 254 && j < 0; k += 2) { // odd k: the tie must move up
        double m = ((double)dq8_map[k] + dq8_map[k + 1]) / 2;
        if ((double)(float)m == m) j = k;
    }
    if (!t_check(j > 0, "a dq8 midpoint exact in fp32 exists")) return;
    float t = (float)(((double)dq8_map[j] + dq8_map[j + 1]) / 2);
    float below = nextafterf(t, 0.0f), above = nextafterf(t, 2.0f);
    float a[8] = {1.0f, -1.0f, t, -t, below, above, -below, -above};
    uint8_t q[8];
    float nested, off;
    dq8_quantize(q, &nested, &off, a, 8, 256);
    // -x sits on the midpoint of 253 - j (even) and 254 - j
    t_check(off == 0.0f && nested == 1.0f && q[0] == 255 && q[2] == j + 1 && q[3] == 253 - j,
            "dq8: x on the midpoint of indices %d, %d takes %d (got %d), -x takes %d (got %d)", j,
            j + 1, j + 1, q[2], 253 - j, q[3]);
    t_check(q[4] == j && q[5] == j + 1 && q[6] == 254 - j && q[7] == 253 - j,
            "dq8: one float below the midpoint takes %d, one above %d (got %d, %d)", j, j + 1, q[4],
            q[5]);
}

// ----------------------------------------------------------------------------
// 5, 6. quantisation error, double quantisation, storage

static void test_error(void) {
    const size_t n = 1 << 20;
    const int block = 64;
    size_t nb = nblocks(n, block), nn = nblocks(nb, FL_DQ_BLOCK);
    float *w = malloc(n * sizeof(float)), *deq = malloc(n * sizeof(float));
    float *absmax = malloc(nb * 4), *adq = malloc(nb * 4), *nested = malloc(nn * 4), off;
    uint8_t *codes = malloc(n / 2), *q = malloc(nb);
    fill_normal(w, n, 2024, 0.02f);
    double sum = 0, sum2 = 0;
    for (size_t i = 0; i < n; i++) sum += w[i], sum2 += (double)w[i] * w[i];
    double std = sqrt(sum2 / n - (sum / n) * (sum / n));
    nf4_quantize(codes, absmax, w, n, block);
    nf4_dequantize(FL_F32, deq, codes, absmax, n, block);

    // |w - deq| <= half the largest codebook gap times the block's absmax,
    // plus the fp32 roundings of w * (1/absmax) and of c * absmax (2^-23 each)
    double half = max_gap(nf4_codebook, 16) / 2, err_sum = 0, err_max = 0;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)deq[i] - w[i]), a = absmax[i / block];
        if (e > half * a + 4.0 * a / (1 << 23)) bad++;
        err_sum += e;
        err_max = fmax(err_max, e);
    }
    t_check(bad == 0, "NF4: every |error| <= %.4f x its block's absmax (%zu over)", half, bad);
    printf("  NF4 block %d on N(0, 0.02), n = 2^20: mean |err| = %.4f std, max = %.4f std "
           "(%.3g)\n",
           block, err_sum / n / std, err_max / std, err_max);

    // double quantisation: |absmax_dq - absmax| <= half the largest dq8 gap
    // times the nested absmax, plus fp32 roundings
    dq8_quantize(q, nested, &off, absmax, nb, FL_DQ_BLOCK);
    dq8_dequantize(adq, q, nested, off, nb, FL_DQ_BLOCK);
    double dhalf = max_gap(dq8_map, 256) / 2, rel_max = 0;
    bad = 0;
    for (size_t b = 0; b < nb; b++) {
        double e = fabs((double)adq[b] - absmax[b]), s = nested[b / FL_DQ_BLOCK];
        if (e > dhalf * s + 4.0 * (s + fabs(off) + absmax[b]) / (1 << 23)) bad++;
        rel_max = fmax(rel_max, e / absmax[b]);
    }
    t_check(bad == 0, "DQ: every |absmax error| <= %.5f x its nested absmax (%zu over)", dhalf,
            bad);
    size_t flips = 0;
    for (size_t i = 0; i < n; i++) {
        float s = w[i] * (1.0f / adq[i / block]);
        int c = 0;
        for (int j = 0; j < 15; j++) c += s > BNB_THRESHOLDS[j];
        flips += c != code_at(codes, i);
    }
    nf4_dequantize(FL_F32, deq, codes, adq, n, block);
    err_sum = err_max = 0;
    bad = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)deq[i] - w[i]), a = absmax[i / block];
        double da = fabs((double)adq[i / block] - a);
        if (e > half * a + da + 4.0 * (a + da) / (1 << 23)) bad++;
        err_sum += e;
        err_max = fmax(err_max, e);
    }
    t_check(bad == 0, "NF4 + DQ: every |error| <= %.4f x absmax + |absmax error| (%zu over)", half,
            bad);
    printf("  NF4 + DQ: mean |err| = %.4f std, max = %.4f std (%.3g); absmax moved by at most "
           "%.2f%%; requantising with it would change %.2f%% of the codes\n",
           err_sum / n / std, err_max / std, err_max, 100 * rel_max, 100.0 * flips / n);

    // storage per parameter, from the buffer sizes
    double bpp = ((n + 1) / 2 + nb * sizeof(float)) / (double)n;
    double bpp_dq = ((n + 1) / 2 + nb * 1 + nn * sizeof(float) + sizeof(float)) / (double)n;
    t_check(bpp == 0.5 + 4.0 / 64 && fabs(bpp_dq - (0.5 + (1 + 4.0 / 256) / 64)) <= 4.0 / n,
            "bytes/param: %.6f = 0.5 + 4/64 without DQ, %.6f = 0.5 + (1 + 4/256)/64 (+ the "
            "offset) with DQ (%.4f and %.4f bits)",
            bpp, bpp_dq, 8 * bpp, 8 * bpp_dq);
    free(w), free(deq), free(absmax), free(adq), free(nested), free(codes), free(q);
}

// Dequantisation speed of a LLaMA-7B MLP matrix (4096 x 11008) to bf16, per
// path: printed, not checked.
static void bench_dequantize(void) {
    const size_t n = (size_t)4096 * 11008;
    const int block = 64;
    uint8_t *codes = malloc(n / 2);
    float *absmax = malloc(n / block * sizeof(float));
    uint16_t *out = malloc(n * 2);
    fl_rng rng;
    fl_rng_seed(&rng, 1);
    for (size_t i = 0; i < n / 2; i++) codes[i] = (uint8_t)fl_rng_u64(&rng);
    for (size_t b = 0; b < n / block; b++) absmax[b] = 0.05f + 0.01f * fl_rng_uniform(&rng);
    for (int isa = 0; isa < 3; isa++) {
        if (!isa_available(isa)) continue;
        double best = 1e9;
        for (int r = 0; r < 3; r++) {
            double t0 = fl_now();
            nf4_dequantize_isa(isa, FL_BF16, out, codes, absmax, n, block);
            best = fmin(best, fl_now() - t0);
        }
        printf("  dequantise 4096x11008 to bf16, %s: %.1f ms (%d threads)\n", ISA_NAME[isa],
               1e3 * best, fl_threads());
    }
    free(codes), free(absmax), free(out);
}

int main(void) {
    printf("cpu: avx2 %d, avx512f %d, avx512_bf16 %d; threads %d\n", fl_cpu()->avx2,
           fl_cpu()->avx512f, fl_cpu()->avx512_bf16, fl_threads());
    test_tables();
    test_rounding();
    test_fixture();
    test_paths();
    test_dq8_ties();
    test_error();
    if (!t_quick()) bench_dequantize(); // timings, which an emulated CPU's are not
    return t_report();
}
