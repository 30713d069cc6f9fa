// cpu.c: run-time CPU feature probe, threads and the clock. Fast kernels ask
// fl_cpu() which instruction sets they may use; the build itself targets
// baseline x86-64, so one binary runs everywhere.
#include "fitlm/core.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <omp.h>
#include <cblas.h>

#if defined(__x86_64__)
#include <cpuid.h>

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

// CPUID's vendor string is "AuthenticAMD" (ebx, edx, ecx: "Auth" "enti" "cAMD")
static int vendor_amd(void) {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;
}

static void probe(fl_cpu_features *f) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    int osxsave = (c >> 27) & 1;
    if (!osxsave) return;
    uint64_t xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 0x6) == 0x6, zmm_ok = (xcr0 & 0xe6) == 0xe6;
    f->fma = ymm_ok && ((c >> 12) & 1);
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    f->avx2 = ymm_ok && ((b >> 5) & 1);
    f->avx512f = zmm_ok && ((b >> 16) & 1);
    f->avx512bw = zmm_ok && ((b >> 30) & 1);
    f->avx512vl = zmm_ok && ((b >> 31) & 1);
    int amx_bf16 = (d >> 22) & 1;
    unsigned a1, b1, c1, d1;
    if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f->avx512_bf16 = zmm_ok && ((a1 >> 5) & 1);
    f->amx_bf16 = amx_bf16 && ((xcr0 >> 17) & 3) == 3;
    // measured peaks (bench_train): Zen 4 465 GFLOP/s bf16 against 234 fp32;
    // an Emerald Rapids VM 160 against 325
    f->bf16_dot_fast = f->avx512_bf16 && vendor_amd();
}
#else
static void probe(fl_cpu_features *f) {
    (void)f;
}
#endif

// The widest ISA FITLM_ISA allows (FITLM_NO_SIMD=1: portable), so that one
// machine runs every path its CPU has; the CPU's own when unset.
static fl_isa isa_cap(void) {
    const char *off = getenv("FITLM_NO_SIMD"), *cap = getenv("FITLM_ISA");
    if (off && off[0] == '1') return FL_ISA_PORTABLE;
    if (!cap || !*cap) return FL_ISA_AVX512;
    for (int isa = FL_ISA_PORTABLE; isa <= FL_ISA_AVX512; isa++)
        if (!strcmp(cap, fl_isa_name((fl_isa)isa))) return (fl_isa)isa;
    fl_die("FITLM_ISA must be portable, avx2 or avx512, got '%s'", cap);
}

const fl_cpu_features *fl_cpu(void) {
    static fl_cpu_features features;
    static int probed;
    if (!probed) {
        fl_isa cap = isa_cap();
        if (cap > FL_ISA_PORTABLE) probe(&features);
        if (cap < FL_ISA_AVX512) // AVX-512 and what builds on it
            features.avx512f = features.avx512bw = features.avx512vl = features.avx512_bf16 =
                features.amx_bf16 = features.bf16_dot_fast = 0;
        probed = 1;
    }
    return &features;
}

fl_isa fl_cpu_isa(void) {
    const fl_cpu_features *f = fl_cpu();
    if (f->avx512f && f->avx512bw && f->avx512vl) return FL_ISA_AVX512;
    if (f->avx2 && f->fma) return FL_ISA_AVX2;
    return FL_ISA_PORTABLE;
}

const char *fl_isa_name(fl_isa isa) {
    static const char *names[] = {"portable", "avx2", "avx512"};
    return names[isa];
}

void fl_set_threads(int n) {
    if (n < 1) fl_die("threads must be >= 1 (got %d)", n);
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
    // 2 = OpenMP. The pthreads build (Debian's default libopenblas.so.0)
    // would spin its own threads against ours: ~20x slower attention.
    static int warned;
    if (openblas_get_parallel() != 2 && !warned++)
        fl_warn("the loaded OpenBLAS is not its OpenMP build; fitlm will run slowly "
                "(install libopenblas-openmp-dev and rebuild)");
}

// Debian 12's OpenBLAS (0.3.21) picks its kernels by CPU model, and a model
// newer than it knows gets its generic SSE3 ones (Prescott): on an Emerald
// Rapids (model 207) its sgemm ran at 33 GFLOP/s instead of about 200, and
// attention's GEMMs with it. OpenBLAS runs the kernels it is told to
// without a check of its own, so AVX2's are named only where the CPU has
// AVX2, whatever the cap (named on an emulated Nehalem, OpenBLAS's sgemm
// stopped on an illegal instruction).
const char *fl_openblas_coretype(void) {
    if (getenv("OPENBLAS_CORETYPE")) return NULL;
    if (isa_cap() < FL_ISA_AVX512) {
        fl_cpu_features uncapped = {0};
        probe(&uncapped);
        return uncapped.avx2 && uncapped.fma ? "Haswell" : NULL;
    }
    const char *core = openblas_get_corename();
    const char *vector[] = {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"};
    for (size_t i = 0; i < sizeof vector / sizeof vector[0]; i++)
        if (core && !strcmp(core, vector[i])) return NULL;
    fl_isa isa = fl_cpu_isa();
    return isa == FL_ISA_AVX512 ? "SkylakeX" : isa == FL_ISA_AVX2 ? "Haswell" : NULL;
}

void fl_runtime_env(char **argv) {
    int change = 0;
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) {
        setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
        change = 1;
    }
    const char *core = fl_openblas_coretype();
    if (core) {
        setenv("OPENBLAS_CORETYPE", core, 1);
        change = 1;
    }
    if (change) execv("/proc/self/exe", argv);
}

int fl_threads(void) {
    return omp_get_max_threads();
}

double fl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
