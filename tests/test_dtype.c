// test_dtype.c: bf16 and fp16 conversions: round to nearest even, specials,
// fp16 subnormals, and the vectorised paths against the scalar ones.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/dtype.h"
#include "testlib.h"

static float f(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static void test_bf16(void) {
    t_check(fl_f32_to_bf16(1.0f) == 0x3f80, "1.0");
    t_check(fl_f32_to_bf16(f(0x3f808000u)) == 0x3f80, "tie rounds to even (down)");
    t_check(fl_f32_to_bf16(f(0x3f818000u)) == 0x3f82, "tie rounds to even (up)");
    t_check(fl_f32_to_bf16(f(0x3f808001u)) == 0x3f81, "above the tie rounds up");
    t_check(fl_f32_to_bf16(INFINITY) == 0x7f80 && fl_f32_to_bf16(-INFINITY) == 0xff80, "inf");
    t_check(fl_f32_to_bf16(f(0x7f7fffffu)) == 0x7f80, "FLT_MAX rounds to inf");
    uint16_t nan = fl_f32_to_bf16(f(0x7f800001u)); // a NaN whose payload would round away
    t_check((nan & 0x7f80) == 0x7f80 && (nan & 0x7f), "NaN stays NaN (0x%04x)", nan);
    t_check(fl_bf16_to_f32(0xc0a0) == -5.0f, "bf16 -> f32");
}

static void test_f16(void) {
    t_check(fl_f32_to_f16(1.0f) == 0x3c00 && fl_f16_to_f32(0x3c00) == 1.0f, "1.0");
    t_check(fl_f32_to_f16(65504.0f) == 0x7bff, "max fp16");
    t_check(fl_f32_to_f16(65519.0f) == 0x7bff && fl_f32_to_f16(65520.0f) == 0x7c00,
            "65520 rounds to inf, 65519 does not");
    t_check(fl_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00, "tie rounds to even (down)");
    t_check(fl_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02, "tie rounds to even (up)");
    t_check(fl_f32_to_f16(ldexpf(1.0f, -24)) == 0x0001, "smallest subnormal");
    t_check(fl_f32_to_f16(ldexpf(1.0f, -25)) == 0x0000, "half the smallest subnormal ties to 0");
    t_check(fl_f32_to_f16(ldexpf(1.5f, -25)) == 0x0001, "above the tie rounds up");
    t_check(fl_f16_to_f32(0x0001) == ldexpf(1.0f, -24), "subnormal -> f32");
    t_check(fl_f32_to_f16(ldexpf(1023.5f, -24)) == 0x0400, "rounds up into the normals");
    t_check(fl_f32_to_f16(-0.0f) == 0x8000, "-0");
    t_check(isnan(fl_f16_to_f32(fl_f32_to_f16(NAN))), "NaN");
    // NaN as F16C: quieted, the top 10 payload bits kept
    t_check(fl_f32_to_f16(f(0x7fe00000u)) == 0x7f00 && fl_f32_to_f16(f(0xff800001u)) == 0xfe00,
            "f32 NaN -> quiet fp16 NaN with its payload");
    float q = fl_f16_to_f32(0xfc01);
    t_check(memcmp(&q, &(uint32_t){0xffc02000u}, 4) == 0, "fp16 sNaN -> quiet f32 NaN");
    t_check(fl_f16_to_f32(0xfc00) == -INFINITY, "-inf");
    // every fp16 value round-trips exactly
    int all = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        float x = fl_f16_to_f32((uint16_t)h);
        if (isnan(x)) continue;
        all &= fl_f32_to_f16(x) == h;
    }
    t_check(all, "all 63k finite fp16 values round-trip");
}

// The dispatched vector path must agree bit for bit with the scalar ones.
static float fp32_of(fl_dtype dt, uint16_t h) {
    return dt == FL_BF16 ? fl_bf16_to_f32(h) : fl_f16_to_f32(h);
}

static void test_bulk_matches_scalar(void) {
    enum { N = 1000 };
    float x[N], back[N];
    uint16_t h[N];
    t_fill(x, N, 3, 100.0f);
    x[0] = INFINITY, x[1] = -0.0f, x[2] = 1e-6f, x[3] = 7e4f, x[4] = f(0x3f808000u);
    fl_dtype types[2] = {FL_BF16, FL_F16};
    for (int k = 0; k < 2; k++) {
        fl_dtype dt = types[k];
        fl_convert(dt, h, FL_F32, x, N);
        int same = 1;
        for (int i = 0; i < N; i++)
            same &= h[i] == (dt == FL_BF16 ? fl_f32_to_bf16(x[i]) : fl_f32_to_f16(x[i]));
        t_check(same, "%s: bulk f32 -> 16 bit equals scalar", fl_dtype_name(dt));
        fl_convert(FL_F32, back, dt, h, N);
        same = 1;
        for (int i = 0; i < N; i++) {
            float s = dt == FL_BF16 ? fl_bf16_to_f32(h[i]) : fl_f16_to_f32(h[i]);
            same &= memcmp(&s, &back[i], 4) == 0;
        }
        t_check(same, "%s: bulk 16 bit -> f32 equals scalar", fl_dtype_name(dt));
        float scratch[N];
        const float *row = fl_load_f32(dt, h, N, scratch);
        t_check(row == scratch && memcmp(row, back, sizeof back) == 0, "fl_load_f32 converts");
        float acc[N];
        fl_convert(FL_F32, acc, dt, h, N);
        fl_accumulate_f32(dt, h, x, N);
        same = 1;
        for (int i = 0; i < N; i++) {
            float want_f = acc[i] + x[i];
            uint16_t want = dt == FL_BF16 ? fl_f32_to_bf16(want_f) : fl_f32_to_f16(want_f);
            same &= h[i] == want;
        }
        t_check(same, "%s: accumulate adds in fp32 and rounds once", fl_dtype_name(dt));
    }
    t_check(fl_load_f32(FL_F32, x, N, back) == x, "fp32 rows are not copied");
    t_check(fl_has_inf_or_nan(FL_F32, x, N), "inf found in fp32");
    t_check(!fl_has_inf_or_nan(FL_F32, x + 1, N - 1), "no inf in the rest");
    fl_convert(FL_F16, h, FL_F32, x + 1, N - 1);
    t_check(fl_has_inf_or_nan(FL_F16, h, N - 1), "7e4 overflows fp16");
}

// ----------------------------------------------------------------------------
// every vector path against the scalar conversions, bit for bit

static float decode(fl_dtype dt, uint16_t h) {
    return dt == FL_BF16 ? fl_bf16_to_f32(h) : fl_f16_to_f32(h);
}

static uint16_t to_16(fl_dtype dt, float x) {
    return dt == FL_BF16 ? fl_f32_to_bf16(x) : fl_f32_to_f16(x);
}

static int cpu_has(int isa) {
    return isa == FL_ISA_PORTABLE || (isa == FL_ISA_AVX2 && fl_cpu()->avx2) ||
           (isa == FL_ISA_AVX512 && fl_cpu()->avx512f);
}

// All 65536 bf16 and fp16 values (NaNs, subnormals, +-inf, +-0) to fp32.
static void test_isa_from_16(int isa, fl_dtype dt) {
    enum { N = 65536 };
    static uint16_t h[N];
    static float got[N];
    for (uint32_t i = 0; i < N; i++) h[i] = (uint16_t)i;
    fl_convert_isa(isa, FL_F32, got, dt, h, N);
    int same = 1;
    for (uint32_t i = 0; i < N; i++) {
        float want = decode(dt, h[i]);
        same &= memcmp(&want, &got[i], 4) == 0;
    }
    t_check(same, "%s: all 65536 %s -> fp32 equal scalar", fl_isa_name((fl_isa)isa),
            fl_dtype_name(dt));
}

// fp32 -> 16 bits for both signs and every exponent: all 8192 values of the
// 13 bits fp16 drops under 10 patterns of the 10 bits above them (which
// include bf16's ties, its round-to-even bit 16, and carries out of an
// all-ones mantissa: into the next exponent, and into inf from the largest
// values), so both dtypes meet their ties, subnormals, NaNs (payloads
// included) and the round-up-into-inf cases. 42M values per path.
static void test_isa_from_f32(int isa) {
    enum { LO = 8192, NHI = 10, N = LO * NHI };
    static const uint32_t his[NHI] = {0, 1, 4, 5, 8, 0xc, 0x3f7, 0x3fb, 0x3ff, 0x2a5};
    static float x[N];
    static uint16_t got[N];
    int same[2] = {1, 1};
    for (uint32_t se = 0; se < 512; se++) {
        for (int k = 0; k < NHI; k++)
            for (uint32_t lo = 0; lo < LO; lo++) x[k * LO + lo] = f(se << 23 | his[k] << 13 | lo);
        for (int d = 0; d < 2; d++) {
            fl_dtype dt = d ? FL_F16 : FL_BF16;
            fl_convert_isa(isa, dt, got, FL_F32, x, N);
            for (int i = 0; i < N; i++) same[d] &= got[i] == to_16(dt, x[i]);
        }
    }
    for (int d = 0; d < 2; d++)
        t_check(same[d], "%s: fp32 -> %s equals scalar on 42M patterns", fl_isa_name((fl_isa)isa),
                fl_dtype_name(d ? FL_F16 : FL_BF16));
    // the subnormal fp32 inputs vcvtneps2bf16 would flush to zero
    float sub[16];
    for (int i = 0; i < 16; i++) sub[i] = f(i % 2 ? 0x00018000u : 0x007fffffu);
    fl_convert_isa(isa, FL_BF16, got, FL_F32, sub, 16);
    t_check(got[0] == 0x0080 && got[15] == 0x0002, "%s: fp32 subnormals round, not flush to 0",
            fl_isa_name((fl_isa)isa));
}

// Every length 0..40 at offsets 0..3 (vector body plus scalar tail), all
// four directions and bf16 <-> fp16, against fl_convert_isa's portable path.
static void test_isa_tails(int isa) {
    enum { M = 48 };
    float x[M], y[M], want_y[M];
    uint16_t h[M], want_h[M], g[M], want_g[M];
    t_fill(x, M, 7, 70000.0f); // past fp16's range too
    x[5] = NAN, x[17] = -INFINITY, x[30] = 1e-6f;
    int same = 1;
    for (size_t off = 0; off < 4; off++)
        for (size_t n = 0; n + off <= 40; n++)
            for (int d = 0; d < 2; d++) {
                fl_dtype dt = d ? FL_F16 : FL_BF16, other = d ? FL_BF16 : FL_F16;
                memset(h, 0xab, sizeof h), memset(want_h, 0xab, sizeof want_h);
                fl_convert_isa(isa, dt, h + off, FL_F32, x + off, n);
                fl_convert_isa(FL_ISA_PORTABLE, dt, want_h + off, FL_F32, x + off, n);
                same &= !memcmp(h, want_h, sizeof h);
                memset(y, 0xab, sizeof y), memset(want_y, 0xab, sizeof want_y);
                fl_convert_isa(isa, FL_F32, y + off, dt, h + off, n);
                fl_convert_isa(FL_ISA_PORTABLE, FL_F32, want_y + off, dt, h + off, n);
                same &= !memcmp(y, want_y, sizeof y);
                memset(g, 0xab, sizeof g), memset(want_g, 0xab, sizeof want_g);
                fl_convert_isa(isa, other, g + off, dt, h + off, n);
                fl_convert_isa(FL_ISA_PORTABLE, other, want_g + off, dt, h + off, n);
                same &= !memcmp(g, want_g, sizeof g);
            }
    t_check(same, "%s: lengths 0..40 at offsets 0..3 equal scalar, nothing written past n",
            fl_isa_name((fl_isa)isa));
}

static void test_isa_paths(void) {
    for (int isa = FL_ISA_PORTABLE; isa <= FL_ISA_AVX512; isa++) {
        if (!cpu_has(isa)) {
            printf("%s: not on this CPU, skipped\n", fl_isa_name((fl_isa)isa));
            continue;
        }
        test_isa_from_16(isa, FL_BF16);
        test_isa_from_16(isa, FL_F16);
        test_isa_from_f32(isa);
        test_isa_tails(isa);
    }
}

// ----------------------------------------------------------------------------
// stochastic rounding

// Many stochastic roundings of x (one per element index): each is one of
// the two 16-bit neighbours of x, and their mean is x within 6 standard
// deviations of the mean of M coin flips (spacing * 0.5 / sqrt(M)).
static void check_sr_value(fl_dtype dt, float x) {
    enum { M = 20000 };
    static float src[M];
    static uint16_t h[M];
    for (int i = 0; i < M; i++) src[i] = x;
    fl_store_f32_stochastic(dt, h, src, M, 0x1234abcdull, 777);
    uint16_t near = dt == FL_BF16 ? fl_f32_to_bf16(x) : fl_f32_to_f16(x);
    // the other neighbour: one step of the magnitude towards x
    uint16_t other = fabsf(decode(dt, near)) > fabsf(x) ? near - 1 : near + 1;
    if (decode(dt, near) == x) other = near;
    float spacing = fabsf(decode(dt, other) - decode(dt, near));
    double sum = 0.0;
    int neighbours = 1;
    for (int i = 0; i < M; i++) {
        neighbours &= h[i] == near || h[i] == other;
        sum += decode(dt, h[i]);
    }
    double mean = sum / M, tol = 6.0 * 0.5 * spacing / sqrt((double)M);
    t_check(neighbours, "%s SR of %.9g: always one of its two neighbours", fl_dtype_name(dt), x);
    t_check(fabs(mean - x) <= tol, "%s SR of %.9g: mean %.9g within %.3g (unbiased)",
            fl_dtype_name(dt), x, mean, tol);
}

static void test_stochastic_rounding(void) {
    fl_dtype types[2] = {FL_BF16, FL_F16};
    for (int k = 0; k < 2; k++) {
        fl_dtype dt = types[k];
        // inexact values: normal, negative, near a power of two, fp16 subnormals
        float xs[] = {1.0f + 1.0f / 3000,
                      -2.7182818f,
                      0.1f,
                      1.0f - 1e-4f,
                      123.456f,
                      -3.1e-5f,
                      ldexpf(5.3f, -24),
                      -ldexpf(0.25f, -24),
                      ldexpf(1023.7f, -24)};
        for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++) check_sr_value(dt, xs[i]);

        // values exact in the dtype are stored unchanged; NaN and inf kept
        enum { N = 4096 };
        static float src[N], back[N];
        static uint16_t h[N], h2[N];
        int exact = 1;
        for (uint32_t c = 0; c < 65536; c += 16) {
            float x = decode(dt, (uint16_t)c);
            if (isnan(x)) continue;
            for (int i = 0; i < 16; i++) src[i] = x;
            fl_store_f32_stochastic(dt, h, src, 16, c * 31u, c);
            for (int i = 0; i < 16; i++) exact &= h[i] == (uint16_t)c;
        }
        t_check(exact, "%s SR: every exact value (inf, 0, -0, subnormals included) is kept",
                fl_dtype_name(dt));
        src[0] = NAN, src[1] = -NAN, src[2] = INFINITY, src[3] = -INFINITY;
        fl_store_f32_stochastic(dt, h, src, 4, 99, 0);
        fl_convert(FL_F32, back, dt, h, 4);
        t_check(isnan(back[0]) && isnan(back[1]) && back[2] == INFINITY && back[3] == -INFINITY,
                "%s SR: NaN stays NaN, inf stays inf", fl_dtype_name(dt));

        // deterministic for a seed, independent of how the buffer is split
        t_fill(src, N, 11, 3.0f);
        fl_store_f32_stochastic(dt, h, src, N, 42, 1000);
        fl_store_f32_stochastic(dt, h2, src, 1234, 42, 1000);
        fl_store_f32_stochastic(dt, h2 + 1234, src + 1234, N - 1234, 42, 1000 + 1234);
        t_check(!memcmp(h, h2, sizeof h), "%s SR: the same bits for any split of the buffer",
                fl_dtype_name(dt));
        fl_store_f32_stochastic(dt, h2, src, N, 43, 1000);
        int differ = 0;
        for (int i = 0; i < N; i++) differ += h[i] != h2[i];
        t_check(differ > N / 10, "%s SR: another seed rounds differently (%d of %d)",
                fl_dtype_name(dt), differ, N);
    }
    float one[3] = {1.5f, -2.0f, 1e-30f}, out[3];
    fl_store_f32_stochastic(FL_F32, out, one, 3, 1, 0);
    t_check(!memcmp(one, out, sizeof one), "fp32 SR is a copy");
    // 65504 < x < 65536 in fp16 rounds between the largest finite value and inf
    float big = 65520.0f;
    uint16_t hb[64];
    float bigs[64];
    for (int i = 0; i < 64; i++) bigs[i] = big;
    fl_store_f32_stochastic(FL_F16, hb, bigs, 64, 5, 0);
    int ok = 1, infs = 0;
    for (int i = 0; i < 64; i++) {
        ok &= hb[i] == 0x7bff || hb[i] == 0x7c00;
        infs += hb[i] == 0x7c00;
    }
    t_check(ok && infs > 10 && infs < 54, "fp16 SR of 65520: 65504 or inf (%d of 64 inf)", infs);
}

// fl_convert_rows: each row as fl_convert converts it, nothing between the
// rows written (a head of 20 values in rows 37 apart and back)
static void test_convert_rows(void) {
    enum { ROWS = 9, COLS = 20, LD = 37 };
    float x[ROWS * LD], back[ROWS * LD];
    uint16_t h[ROWS * LD], want[COLS];
    t_fill(x, ROWS * LD, 5, 10.0f);
    fl_dtype types[2] = {FL_BF16, FL_F16};
    for (int k = 0; k < 2; k++) {
        fl_dtype dt = types[k];
        memset(h, 0xab, sizeof h);
        for (int i = 0; i < ROWS * LD; i++) back[i] = -1.0f;
        fl_convert_rows(dt, h, LD, FL_F32, x, LD, ROWS, COLS);
        fl_convert_rows(FL_F32, back, COLS, dt, h, LD, ROWS, COLS);
        int same = 1;
        for (int r = 0; r < ROWS; r++) {
            fl_convert(dt, want, FL_F32, x + r * LD, COLS);
            same &= !memcmp(h + r * LD, want, sizeof want);
            for (int c = COLS; c < LD; c++) same &= h[r * LD + c] == 0xabab;
            for (int c = 0; c < COLS; c++) same &= back[r * COLS + c] == fp32_of(dt, want[c]);
        }
        for (int i = ROWS * COLS; i < ROWS * LD; i++) same &= back[i] == -1.0f;
        t_check(same, "%s: fl_convert_rows converts row by row, in place", fl_dtype_name(dt));
    }
}

int main(void) {
    test_bf16();
    test_f16();
    test_bulk_matches_scalar();
    test_convert_rows();
    test_isa_paths();
    test_stochastic_rounding();
    return t_report();
}
