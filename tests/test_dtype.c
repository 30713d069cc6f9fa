// test_dtype.c: bf16 and fp16 conversions: round to nearest even, specials,
// fp16 subnormals, and the vectorised paths against the scalar ones.
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

// The vector paths (AVX-512) must agree bit for bit with the scalar ones.
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

int main(void) {
    test_bf16();
    test_f16();
    test_bulk_matches_scalar();
    return t_report();
}
