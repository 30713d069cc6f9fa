// test_core.c: the tagged allocator's accounting and the RNG.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "testlib.h"

static void test_allocator_counts_exactly(void) {
    size_t base_total = fl_mem_total_current();
    size_t base_acts = fl_mem_current(FL_MEM_ACTS);
    char *a = fl_alloc(FL_MEM_ACTS, 1000);
    float *b = fl_alloc(FL_MEM_GRADS, 4096 * sizeof(float));
    t_check(((uintptr_t)a & 63) == 0 && ((uintptr_t)b & 63) == 0, "blocks are 64-byte aligned");
    int zero = 1;
    for (int i = 0; i < 1000; i++) zero &= a[i] == 0;
    t_check(zero, "blocks are zero-filled");
    t_check(fl_mem_current(FL_MEM_ACTS) == base_acts + 1000, "acts counts 1000 bytes");
    t_check(fl_mem_total_current() == base_total + 1000 + 4096 * sizeof(float),
            "total is the sum of the tags");
    size_t peak = fl_mem_total_peak();
    fl_free(a);
    t_check(fl_mem_current(FL_MEM_ACTS) == base_acts, "free uncounts the block");
    t_check(fl_mem_peak(FL_MEM_ACTS) >= base_acts + 1000, "peak remembers the block");
    t_check(fl_mem_total_peak() == peak, "total peak does not drop on free");
    fl_free(b);
    fl_free(NULL);
    size_t sum = 0;
    for (int t = 0; t < FL_MEM_NTAGS; t++) sum += fl_mem_current(t);
    t_check(sum == fl_mem_total_current(), "per-tag counters add up to the total");
    t_check(strcmp(fl_mem_tag_name(FL_MEM_OPTIM), "optim") == 0, "tag names");
    t_check(fl_mem_peak_rss() > 0, "peak RSS is readable");
}

// Blocks of 2 MiB or more start on a 2 MiB boundary (header included), so
// that transparent huge pages can back them; FITLM_THP=0 keeps them on 64
// bytes and any other value is refused.
static void alloc_with_thp(void *value) {
    setenv("FITLM_THP", value, 1);
    fl_free(fl_alloc(FL_MEM_OTHER, (size_t)3 << 20));
}

static void test_huge_blocks(void) {
    size_t huge = (size_t)2 << 20, base = fl_mem_current(FL_MEM_ACTS);
    unsetenv("FITLM_THP");
    char *small = fl_alloc(FL_MEM_ACTS, huge - 1), *big = fl_alloc(FL_MEM_ACTS, huge);
    t_check(((uintptr_t)big - 64) % huge == 0, "a 2 MiB block's allocation starts on 2 MiB");
    int zero = 1;
    for (size_t i = 0; i < huge; i += 4096) zero &= big[i] == 0;
    zero &= big[huge - 1] == 0;
    t_check(zero, "a huge block is zero-filled");
    t_check(fl_mem_current(FL_MEM_ACTS) == base + 2 * huge - 1, "counted at their own sizes");
    fl_free(small);
    fl_free(big);
    t_check(fl_mem_current(FL_MEM_ACTS) == base, "and uncounted");
    t_dies("FITLM_THP=2", alloc_with_thp, "2", "FITLM_THP must be 0 or 1, got '2'");
    setenv("FITLM_THP", "0", 1);
    big = fl_alloc(FL_MEM_ACTS, huge);
    t_check(((uintptr_t)big & 63) == 0 && big[huge - 1] == 0 &&
                fl_mem_current(FL_MEM_ACTS) == base + huge,
            "FITLM_THP=0: an aligned, zeroed, counted block");
    fl_free(big);
    unsetenv("FITLM_THP");
}

static void test_rng(void) {
    fl_rng a, b;
    fl_rng_seed(&a, 42);
    fl_rng_seed(&b, 42);
    int same = 1;
    for (int i = 0; i < 1000; i++) same &= fl_rng_u64(&a) == fl_rng_u64(&b);
    t_check(same, "same seed, same stream");
    fl_rng_seed(&b, 43);
    t_check(fl_rng_u64(&a) != fl_rng_u64(&b), "another seed, another stream");
    double sum = 0, sq = 0;
    int n = 200000, in_range = 1, counts[10] = {0};
    for (int i = 0; i < n; i++) {
        float u = fl_rng_uniform(&a);
        in_range &= u >= 0.0f && u < 1.0f;
        float z = fl_rng_normal(&a);
        sum += z;
        sq += (double)z * z;
        counts[fl_rng_below(&a, 10)]++;
    }
    t_check(in_range, "uniform in [0,1)");
    // mean of n normals has sd 1/sqrt(n) = 0.0022; 5 sd bounds
    t_check(fabs(sum / n) < 0.012, "normal mean ~0 (%g)", sum / n);
    t_check(fabs(sq / n - 1.0) < 0.02, "normal variance ~1 (%g)", sq / n);
    int flat = 1;
    for (int k = 0; k < 10; k++) flat &= fabs(counts[k] - n / 10.0) < 5 * sqrt(n * 0.09);
    t_check(flat, "below(10) is uniform");
}

static void test_cpu_probe(void) {
    const fl_cpu_features *f = fl_cpu();
    t_check(!f->avx512f || f->avx2, "AVX-512 implies AVX2 (probe is consistent)");
    t_check(!f->avx512_bf16 || f->avx512f, "AVX512_BF16 implies AVX-512F");
    // uncapped, the widest ISA the CPU has, as the compiler's own probe sees it
    const char *cap = getenv("FITLM_ISA");
    if (!getenv("FITLM_NO_SIMD") && (!cap || !strcmp(cap, "avx512"))) {
        int avx2 = t_cpu_avx2();
        int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                     __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        fl_isa want = avx512 ? FL_ISA_AVX512 : avx2 ? FL_ISA_AVX2 : FL_ISA_PORTABLE;
        t_check(fl_cpu_isa() == want, "the probe finds %s, the CPU has %s",
                fl_isa_name(fl_cpu_isa()), fl_isa_name(want));
    }
    t_check_expected_isa();
}

// fl_cpu() reads the environment once per process: each case runs in a
// child (t_dies forks) of a parent that has not called it yet.
static void probe_with_isa(void *isa) {
    setenv("FITLM_ISA", isa, 1);
    unsetenv("FITLM_NO_SIMD");
    const fl_cpu_features *f = fl_cpu();
    fl_isa got = fl_cpu_isa();
    // a cap is a ceiling: exit 1 (what t_dies expects) with the outcome
    fl_die("FITLM_ISA=%s gives %s%s", (const char *)isa, fl_isa_name(got),
           f->avx512_bf16 || f->amx_bf16 ? " with bf16" : "");
}

// FITLM_ISA below AVX-512 has OpenBLAS run its AVX2 kernels, but only where
// the CPU has AVX2 (the emulated Nehalem of CMakeLists.txt has not)
static void coretype_with_isa(void *isa) {
    setenv("FITLM_ISA", isa, 1);
    unsetenv("OPENBLAS_CORETYPE");
    const char *core = fl_openblas_coretype();
    fl_die("OpenBLAS core %s", core ? core : "unchanged");
}

static void test_openblas_coretype(void) {
    const char *want = t_cpu_avx2() ? "OpenBLAS core Haswell\n" : "OpenBLAS core unchanged\n";
    t_dies("FITLM_ISA=portable: OpenBLAS's kernels", coretype_with_isa, "portable", want);
    t_dies("FITLM_ISA=avx2: OpenBLAS's kernels", coretype_with_isa, "avx2", want);
}

static void test_isa_cap(void) {
    t_dies("FITLM_ISA=sse", probe_with_isa, "sse", "FITLM_ISA must be portable, avx2 or avx512");
    t_dies("FITLM_ISA=portable", probe_with_isa, "portable", "gives portable\n");
    // avx2 where the CPU has it (asked of the compiler's own probe), else
    // portable; never AVX-512 or its bf16
    t_dies("FITLM_ISA=avx2", probe_with_isa, "avx2",
           t_cpu_avx2() ? "FITLM_ISA=avx2 gives avx2\n" : "FITLM_ISA=avx2 gives portable\n");
}

// Sizes in messages: bytes below 1 KiB, then three significant digits; two
// sizes a message compares never read the same unless they are.
static void test_size_text(void) {
    const struct {
        size_t bytes;
        const char *text;
    } cases[] = {{0, "0 bytes"},
                 {1023, "1023 bytes"},
                 {1024, "1.00 KiB"},
                 {120832, "118 KiB"},
                 {1536u << 10, "1.50 MiB"},
                 {(size_t)(12.3 * 1073741824.0), "12.3 GiB"},
                 {(size_t)1 << 62, "4.00 EiB"},
                 {SIZE_MAX, "16.0 EiB"}};
    char a[FL_SIZE_TEXT], b[FL_SIZE_TEXT];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        t_check(!strcmp(fl_size_text(cases[i].bytes, a), cases[i].text), "%zu bytes: %s (want %s)",
                cases[i].bytes, a, cases[i].text);
    const struct {
        size_t need, have;
        const char *need_text, *have_text;
    } pairs[] = {{10 << 20, (10 << 20) - 4096, "10485760 bytes", "10481664 bytes"},
                 {8192, 8191, "8192 bytes", "8191 bytes"},
                 {(size_t)5 << 30, ((size_t)5 << 30) + 1, "5368709120 bytes", "5368709121 bytes"},
                 {1 << 20, 2 << 20, "1.00 MiB", "2.00 MiB"},
                 {1000, 999, "1000 bytes", "999 bytes"},
                 {4096, 4096, "4.00 KiB", "4.00 KiB"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        fl_size_text_pair(pairs[i].need, pairs[i].have, a, b);
        t_check(!strcmp(a, pairs[i].need_text) && !strcmp(b, pairs[i].have_text),
                "needs %zu, has %zu: \"%s\", \"%s\"", pairs[i].need, pairs[i].have, a, b);
    }
}

int main(void) {
    test_isa_cap(); // first: before anything calls fl_cpu()
    test_openblas_coretype();
    test_allocator_counts_exactly();
    test_huge_blocks();
    test_rng();
    test_size_text();
    test_cpu_probe();
    return t_report();
}
