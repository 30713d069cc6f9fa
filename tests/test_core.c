// test_core.c: the tagged allocator's accounting and the RNG; the option
// table's names of one setting, and the tensor-parallel layout and batch
// checks it feeds (cfg->ranks stands for the world: no MPI).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/params.h"
#include "fitlm/train.h"
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

// fl_rng_jump(n) = n draws, for short and long jumps and after other draws
static void test_rng_jump(void) {
    const uint64_t jumps[] = {0, 1, 63, 64, 65, 1000, (1u << 20) + 3};
    int same = 1;
    for (size_t k = 0; k < sizeof jumps / sizeof jumps[0]; k++) {
        fl_rng a, b;
        fl_rng_seed(&a, 7 + k);
        for (int i = 0; i < 5; i++) fl_rng_u64(&a);
        b = a;
        for (uint64_t i = 0; i < jumps[k]; i++) fl_rng_u64(&a);
        fl_rng_jump(&b, jumps[k]);
        for (int i = 0; i < 4; i++) same &= fl_rng_u64(&a) == fl_rng_u64(&b);
    }
    t_check(same, "fl_rng_jump(n) lands where n draws do (n up to 2^20 + 3)");
}

// A table of over 1 M values drawn by 2 threads, each piece from its jump,
// equals the one stream drawn in order: every rule, a row with live rows,
// rows of one value, rows across pieces.
static void test_params_init_parallel(void) {
    fl_param_table t = {0};
    const struct {
        const char *name;
        size_t rows, cols, live;
        fl_init_rule init;
    } rows[] = {{"a", 1000, 700, 990, FL_INIT_NORMAL}, {"b", 1, 3, 0, FL_INIT_ONES},
                {"c", 300, 1000, 0, FL_INIT_UNIFORM},  {"d", 7, 5, 0, FL_INIT_ZEROS},
                {"e", 1, 1, 0, FL_INIT_NORMAL},        {"f", 257, 333, 0, FL_INIT_NORMAL}};
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        size_t shape[2] = {rows[r].rows, rows[r].cols};
        int i = fl_params_add(&t, rows[r].name, 0, 2, shape);
        t.views[i].init = rows[r].init;
        t.views[i].std = 0.02f + 0.01f * (float)r;
        t.views[i].live_rows = rows[r].live;
    }
    float *got = malloc(t.numel * sizeof(float)), *want = malloc(t.numel * sizeof(float));
    int threads = fl_threads();
    fl_set_threads(2);
    t_check(fl_params_init_bytes(t.numel, 2) > 0, "a table of %zu values is drawn in parallel",
            t.numel);
    fl_params_init(&t, FL_F32, got, 99);
    fl_set_threads(threads);
    fl_rng rng;
    fl_rng_seed(&rng, 99);
    size_t at = 0;
    for (int i = 0; i < t.count; i++) {
        const fl_param_view *v = &t.views[i];
        size_t drawn = v->live_rows ? v->live_rows * v->shape[1] : v->numel;
        for (size_t j = 0; j < v->numel; j++)
            want[at++] = v->init == FL_INIT_ONES     ? 1.0f
                         : j >= drawn                ? 0.0f
                         : v->init == FL_INIT_NORMAL ? v->std * fl_rng_normal(&rng)
                         : v->init == FL_INIT_UNIFORM
                             ? v->std * (2.0f * fl_rng_uniform(&rng) - 1.0f)
                             : 0.0f;
    }
    t_check(!memcmp(got, want, t.numel * sizeof(float)),
            "the parallel draw is the one stream's, bitwise (%zu values)", t.numel);
    free(got);
    free(want);
    fl_params_free(&t);
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

// ---------------------------------------------------------------------------
// tensor parallelism's keys, flags and layout checks

// A config from the defaults, JSON text (NULL: none) and flags (space-separated).
static void config_of(fl_train_config *cfg, const char *json, const char *flags) {
    fl_config_defaults(cfg);
    if (json) fl_config_load_json_text(cfg, json, strlen(json), "test.json");
    char copy[512], *argv[32];
    snprintf(copy, sizeof copy, "%s", flags ? flags : "");
    int argc = 0;
    for (char *tok = strtok(copy, " "); tok && argc < 32; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    fl_config_parse_args(cfg, argc, argv);
}

static void config_from_json(void *json) {
    fl_train_config cfg;
    config_of(&cfg, json, NULL);
}

static void test_tp_keys_and_flags(void) {
    const struct {
        const char *json, *flags;
        int t, sp;
    } set[] = {
        {NULL, NULL, 1, 0},
        {"{\"tensor_parallel\": {\"size\": 2}}", NULL, 2, 0},
        {"{\"tensor_model_parallel_size\": 4}", NULL, 4, 0},
        {"{\"tensor_parallel\": {\"autotp_size\": 8}}", NULL, 8, 0},
        {"{\"sequence_parallel\": true}", NULL, 1, 1},
        {NULL, "--tensor-parallel 2 --sequence-parallel", 2, 1},
        {NULL, "--tensor-parallel=4", 4, 0},
        // two names at one value agree
        {"{\"tensor_parallel\": {\"size\": 2, \"autotp_size\": 2}, "
         "\"tensor_model_parallel_size\": 2}",
         NULL, 2, 0},
        // a flag overrides the file, whichever name the file gave
        {"{\"tensor_model_parallel_size\": 2, \"sequence_parallel\": true}",
         "--tensor-parallel 4 --sequence-parallel=false", 4, 0},
    };
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++) {
        fl_train_config cfg;
        config_of(&cfg, set[i].json, set[i].flags);
        t_check(cfg.tensor_parallel == set[i].t && cfg.sequence_parallel == set[i].sp,
                "%s %s: tensor_parallel %d (want %d), sequence_parallel %d (want %d)",
                set[i].json ? set[i].json : "", set[i].flags ? set[i].flags : "",
                cfg.tensor_parallel, set[i].t, cfg.sequence_parallel, set[i].sp);
    }
    // two names of one setting at different values, in one file: refused naming both
    t_dies("tensor_parallel.size and Megatron's name disagree", config_from_json,
           "{\"tensor_parallel\": {\"size\": 2}, \"tensor_model_parallel_size\": 4}",
           "test.json: tensor_model_parallel_size 4 contradicts tensor_parallel.size 2");
    t_dies("Megatron's and DeepSpeed's names disagree", config_from_json,
           "{\"tensor_model_parallel_size\": 2, \"tensor_parallel\": {\"autotp_size\": 4}}",
           "test.json: tensor_parallel.autotp_size 4 contradicts tensor_model_parallel_size 2");
    t_dies("tensor_parallel.size 0", config_from_json, "{\"tensor_parallel\": {\"size\": 0}}",
           "tensor_parallel.size = 0 is out of range");
    t_dies("DeepSpeed's other tensor_parallel keys", config_from_json,
           "{\"tensor_parallel\": {\"autotp_size\": 2, \"preset_model\": \"llama\"}}",
           "unknown key 'tensor_parallel.preset_model'");

    // A resume: the checkpoint's config (one source), then this run's flags
    // over it, at another layout; the run's config then records the new one.
    fl_train_config cfg;
    config_of(&cfg, "{\"tensor_model_parallel_size\": 2, \"sequence_parallel\": true}",
              "--tensor-parallel 4 --sequence-parallel=false");
    char *json = fl_config_to_json(&cfg);
    t_check(strstr(json, "\"tensor_parallel\":{\"size\":4}") &&
                !strstr(json, "tensor_model_parallel_size") &&
                strstr(json, "\"sequence_parallel\":false"),
            "a flag replaces the checkpoint's name of the setting: %s", json);
    fl_train_config again;
    config_of(&again, json, NULL);
    t_check(again.tensor_parallel == 4 && !again.sequence_parallel,
            "and the saved config reads back (%d, %d)", again.tensor_parallel,
            again.sequence_parallel);
    fl_free(json);
    // a later file replaces an earlier file's name (a --config over a checkpoint's config)
    config_of(&cfg, "{\"tensor_parallel\": {\"autotp_size\": 2}}", NULL);
    const char *later = "{\"tensor_model_parallel_size\": 4}";
    fl_config_load_json_text(&cfg, later, strlen(later), "later.json");
    t_check(cfg.tensor_parallel == 4 && !fl_config_given(&cfg, "tensor_parallel.autotp_size") &&
                fl_config_given(&cfg, "tensor_model_parallel_size"),
            "a later source's name replaces an earlier one's (%d)", cfg.tensor_parallel);
    // the ranks agree on the layout: it is in the canonical text
    config_of(&cfg, NULL, "--tensor-parallel 2 --sequence-parallel");
    char *canon = fl_config_canonical(&cfg);
    t_check(strstr(canon, "\ntensor_parallel.size=2\n") &&
                strstr(canon, "\nsequence_parallel=true\n"),
            "the canonical text holds tensor_parallel.size and sequence_parallel");
    free(canon);
}

typedef struct {
    int world, t, sp, micro, seq;
    fl_model_config model;
} layout;

static void tp_check_layout(void *arg) {
    const layout *l = arg;
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    cfg.ranks = l->world;
    cfg.tensor_parallel = l->t;
    cfg.sequence_parallel = l->sp;
    cfg.micro_batch = l->micro;
    cfg.seq_len = l->seq;
    fl_tp_check(&cfg, &l->model);
}

static void test_tp_layouts(void) {
    // n_head, n_kv_head, intermediate_size: a finished shape's
    const fl_model_config gpt2 = {
        .n_head = 12, .n_kv_head = 12, .n_embd = 768, .intermediate_size = 3072};
    const fl_model_config gqa2 = {.n_head = 8, .n_kv_head = 2, .intermediate_size = 256};
    const fl_model_config gqa4 = {.n_head = 8, .n_kv_head = 4, .intermediate_size = 256};
    const fl_model_config mlp100 = {.n_head = 8, .n_kv_head = 8, .intermediate_size = 100};
    const struct {
        layout l;
        const char *says; // NULL: accepted
    } cases[] = {
        {{4, 2, 0, 4, 128, gpt2}, NULL},
        {{4, 4, 1, 4, 128, gpt2}, NULL},
        {{1, 1, 0, 3, 7, gqa2}, NULL},
        {{4, 2, 0, 1, 1, gqa4}, NULL}, // n_kv_head 4, t 2: two KV heads a rank
        {{2, 2, 0, 1, 1, gqa2}, NULL}, // n_kv_head 2, t 2: one a rank
        {{6, 4, 0, 4, 128, gqa4},
         "tensor_parallel.size 4 does not divide the world of 6 ranks (6 % 4 = 2): the ranks "
         "form d = world / t data-parallel replicas of 4 ranks each"},
        {{1, 2, 0, 4, 128, gqa4}, "does not divide the world of 1 rank (1 % 2 = 1)"},
        {{8, 8, 0, 4, 128, gpt2},
         "tensor_parallel.size 8 does not divide model.n_head 12 (12 % 8 = 4)"},
        {{4, 4, 0, 4, 128, gqa2},
         "tensor_parallel.size 4 is a multiple of model.n_kv_head 2, more ranks than key/value "
         "heads: Megatron's scheme"},
        {{8, 8, 0, 4, 128, mlp100},
         "tensor_parallel.size 8 does not divide model.intermediate_size 100 (100 % 8 = 4)"},
        {{1, 1, 1, 4, 128, gpt2},
         "sequence_parallel splits the tokens over the tensor-parallel ranks: it needs "
         "tensor_parallel.size above 1"},
        {{4, 4, 1, 3, 5, gpt2},
         "sequence_parallel: train_micro_batch_size_per_gpu 3 x seq_len 5 = 15 tokens do not "
         "split over tensor_parallel.size 4 (15 % 4 = 3)"},
        {{4, 4, 0, 3, 5, gpt2}, NULL}, // the same without sequence parallelism
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        layout l = cases[i].l;
        char name[96];
        snprintf(name, sizeof name, "world %d, t %d%s, n_head %d, n_kv_head %d, mlp %d", l.world,
                 l.t, l.sp ? " with SP" : "", l.model.n_head, l.model.n_kv_head,
                 l.model.intermediate_size);
        if (cases[i].says) {
            t_dies(name, tp_check_layout, &l, cases[i].says);
        } else {
            tp_check_layout(&l);
            t_check(1, "%s: accepted", name);
        }
    }
}

// The run's config checks call fl_tp_check: a shape from the flags refused
// by fl_config_finish, before anything is allocated.
static void finish_flags(void *flags) {
    fl_train_config cfg;
    config_of(&cfg, NULL, flags);
    cfg.ranks = 4;
    fl_config_finish(&cfg, 257);
}

static void test_tp_checked_by_config_finish(void) {
    t_dies("fl_config_finish: n_head 6 over t 4", finish_flags,
           "--model tiny --n-head 6 --n-embd 96 --seq-len 16 --tensor-parallel 4",
           "tensor_parallel.size 4 does not divide model.n_head 6 (6 % 4 = 2)");
    t_dies("fl_config_finish: LLaMA's 2 KV heads over t 4", finish_flags,
           "--model llama-tiny --seq-len 16 --tensor-parallel 4",
           "tensor_parallel.size 4 is a multiple of model.n_kv_head 2");
    fl_train_config cfg;
    config_of(&cfg, NULL,
              "--model llama-tiny --seq-len 16 --tensor-parallel 2 --sequence-parallel --batch 3");
    cfg.ranks = 4;
    fl_config_finish(&cfg, 257);
    t_check(cfg.tensor_parallel == 2 && cfg.train_batch_size == 6,
            "llama-tiny over 4 ranks at t 2 finishes: train_batch_size %d = 3 x 2 replicas",
            cfg.train_batch_size);
}

static void batch_rule(void *json) {
    fl_train_config cfg;
    config_of(&cfg, json, NULL);
    cfg.ranks = 4;
    fl_parallel_check_batch(&cfg);
}

// DeepSpeed's batch rule over the data-parallel size d = world / t
// (Megatron's global_batch = micro x m x d): t = 2 over 4 ranks is d = 2.
static void test_batch_rule_over_replicas(void) {
    const struct {
        const char *json;
        int micro, accum, total;
    } set[] = {
        {"{\"tensor_parallel\": {\"size\": 2}, \"train_micro_batch_size_per_gpu\": 4, "
         "\"gradient_accumulation_steps\": 2}",
         4, 2, 16},
        {"{\"tensor_parallel\": {\"size\": 2}, \"train_batch_size\": 16, "
         "\"train_micro_batch_size_per_gpu\": 4}",
         4, 2, 16},
        {"{\"tensor_parallel\": {\"size\": 2}, \"train_batch_size\": 16, "
         "\"gradient_accumulation_steps\": 4}",
         2, 4, 16},
        {"{\"tensor_parallel\": {\"size\": 4}, \"train_batch_size\": 6}", 6, 1, 6},
        {"{\"train_micro_batch_size_per_gpu\": 4, \"gradient_accumulation_steps\": 2}", 4, 2,
         32}, // t 1: every rank a replica
    };
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++) {
        fl_train_config cfg;
        config_of(&cfg, set[i].json, NULL);
        cfg.ranks = 4;
        fl_parallel_check_batch(&cfg);
        t_check(cfg.micro_batch == set[i].micro && cfg.grad_accum == set[i].accum &&
                    cfg.train_batch_size == set[i].total,
                "%s over 4 ranks: micro %d accum %d total %d (want %d %d %d)", set[i].json,
                cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size, set[i].micro, set[i].accum,
                set[i].total);
    }
    t_dies("train_batch_size over replicas", batch_rule,
           "{\"tensor_parallel\": {\"size\": 2}, \"train_batch_size\": 12, "
           "\"gradient_accumulation_steps\": 5}",
           "train_batch_size 12 is not a multiple of gradient_accumulation_steps 5 x 2 "
           "data-parallel replicas (4 ranks / tensor_parallel.size 2)");
    t_dies("the batch rule over a world t does not divide", batch_rule,
           "{\"tensor_parallel\": {\"size\": 3}}", "(4 % 3 = 1)");
}

// ----------------------------------------------------------------------------
// pipeline parallelism's keys and refusals (fl_pp_check, fl_pp_finish_split)

typedef struct {
    int ranks;
    const char *json, *flags;
} run_config;

static void finish_run(void *arg) {
    const run_config *r = arg;
    fl_train_config cfg;
    config_of(&cfg, r->json, r->flags);
    cfg.ranks = r->ranks;
    fl_config_finish(&cfg, 257);
}

static void pp_check_of(void *cfg) {
    fl_pp_check(cfg, &((fl_train_config *)cfg)->model);
}

static void test_pp_keys(void) {
    fl_train_config cfg;
    // DeepSpeed's pipeline.stages: a number is pipeline_parallel.size, "auto" leaves it
    config_of(&cfg, "{\"pipeline\": {\"stages\": 4}}", NULL);
    t_check(cfg.pipeline_parallel == 4, "pipeline.stages 4 sets p (%d)", cfg.pipeline_parallel);
    config_of(&cfg, "{\"pipeline\": {\"stages\": \"auto\"}, \"pipeline_parallel\": {\"size\": 2}}",
              NULL);
    t_check(cfg.pipeline_parallel == 2 && !fl_config_given(&cfg, "pipeline.stages"),
            "pipeline.stages auto keeps pipeline_parallel.size 2 (%d)", cfg.pipeline_parallel);
    config_of(&cfg, "{\"pipeline\": {\"stages\": \"auto\"}}", "--pipeline-parallel 2");
    char *json = fl_config_to_json(&cfg);
    t_check(cfg.pipeline_parallel == 2 && !strstr(json, "stages"),
            "auto under --pipeline-parallel 2: p %d, not saved: %s", cfg.pipeline_parallel, json);
    fl_free(json);
    config_of(&cfg, "{\"pipeline\": {\"stages\": \"auto\"}}", NULL);
    t_check(cfg.pipeline_parallel == 1, "auto alone: p 1 (%d)", cfg.pipeline_parallel);
    t_dies("pipeline.stages and pipeline_parallel.size disagree", config_from_json,
           "{\"pipeline_parallel\": {\"size\": 4}, \"pipeline\": {\"stages\": 2}}",
           "test.json: pipeline.stages 2 contradicts pipeline_parallel.size 4");
    t_dies("pipeline.stages 'two'", config_from_json, "{\"pipeline\": {\"stages\": \"two\"}}",
           "test.json: pipeline.stages must be a number");
    t_dies("pipeline_parallel.schedule zb", config_from_json,
           "{\"pipeline_parallel\": {\"schedule\": \"zb\"}}",
           "test.json: pipeline_parallel.schedule must be one of gpipe|1f1b|interleaved, got 'zb'");
    config_of(&cfg, NULL, "--pipeline-schedule Interleaved --virtual-stages 2");
    t_check(!strcmp(cfg.pipeline_schedule, "interleaved") && cfg.virtual_stages == 2,
            "--pipeline-schedule is a choice: %s", cfg.pipeline_schedule);
    // Megatron's first/last stage blocks: an explicit list at finish time
    // (GPT-2's 12 blocks over 4 stages: 2, then 8 over the middle 2, then 2)
    config_of(&cfg,
              "{\"decoder_first_pipeline_num_layers\": 2, "
              "\"decoder_last_pipeline_num_layers\": 2}",
              "--model gpt2 --pipeline-parallel 4 --seq-len 16");
    cfg.ranks = 4;
    fl_config_finish(&cfg, 257);
    t_check(!strcmp(cfg.pipeline_split, "2,4,4,2"), "first 2, last 2 over p 4: %s",
            cfg.pipeline_split);
    config_of(
        &cfg, NULL,
        "--model gpt2 --pipeline-parallel 4 --seq-len 16 --decoder-last-pipeline-num-layers 3 "
        "--pipeline-split 3,3,3,3");
    cfg.ranks = 4;
    fl_config_finish(&cfg, 257);
    t_check(!strcmp(cfg.pipeline_split, "3,3,3,3"), "last 3 and the same list given: %s",
            cfg.pipeline_split);
    // under v = 2 each stage's blocks split over its chunks: virtual stage c p + r
    config_of(&cfg, NULL,
              "--model gpt2 --pipeline-parallel 4 --seq-len 16 --decoder-first-pipeline-num-layers "
              "2 --decoder-last-pipeline-num-layers 2 --pipeline-schedule interleaved "
              "--virtual-stages 2 --grad-accum 4");
    cfg.ranks = 8;
    fl_config_finish(&cfg, 257);
    t_check(!strcmp(cfg.pipeline_split, "1,2,2,1,1,2,2,1") && cfg.train_batch_size == 16 * 4 * 2,
            "first 2, last 2 over p 4, v 2: %s; train_batch_size %d over 2 replicas",
            cfg.pipeline_split, cfg.train_batch_size);
}

static void test_pp_refusals(void) {
    const char *gpt2 = "--model gpt2 --seq-len 16 ";
    char flags[32][320];
    const struct {
        int ranks;
        const char *json, *flags, *says;
    } cases[] = {
        {6, NULL, "--tensor-parallel 2 --pipeline-parallel 2",
         "tensor_parallel.size 2 x pipeline_parallel.size 2 does not divide the world of 6 ranks "
         "(6 % 4 = 2): the ranks form d = world / (t p) data-parallel replicas of 4 ranks each"},
        {3, NULL, "--pipeline-parallel 2",
         "pipeline_parallel.size 2 does not divide the world of 3 ranks (3 % 2 = 1)"},
        {4, NULL, "--pipeline-parallel 2 --virtual-stages 2",
         "pipeline_parallel.virtual_stages 2: several chunks a rank are run by the interleaved "
         "schedule, and pipeline_parallel.schedule is 1f1b"},
        {4, NULL, "--pipeline-parallel 2 --pipeline-schedule interleaved",
         "pipeline_parallel.schedule interleaved runs 2 or more chunks a rank; "
         "pipeline_parallel.virtual_stages is 1"},
        {4, NULL,
         "--pipeline-parallel 4 --pipeline-schedule interleaved --virtual-stages 2 --grad-accum 6",
         "pipeline_parallel.schedule interleaved with pipeline_parallel.size 4, "
         "gradient_accumulation_steps 6 (m, the micro-batches a step) and virtual_stages 2: "
         "--pipeline-schedule interleaved takes the micro-batches in groups of "
         "--pipeline-parallel 4: --grad-accum (gradient_accumulation_steps) 6 must be a "
         "multiple of 4 (Megatron's rule)"},
        {4, NULL,
         "--pipeline-parallel 4 --pipeline-schedule interleaved --virtual-stages 4 --grad-accum 4",
         "pipeline_parallel.split (--pipeline-split): 12 blocks (n_layer) cannot fill 16 "
         "virtual stages"},
        {2, NULL, "--pipeline-parallel 2 --pipeline-split 4,4,4",
         "pipeline_parallel.split (--pipeline-split) 4,4,4 has 3 entries; pipeline_parallel.size "
         "2 x virtual_stages 1 = 2 virtual stages need one each"},
        {2, NULL, "--pipeline-parallel 2 --pipeline-split 5,5",
         "pipeline_parallel.split (--pipeline-split): the 2 entries sum to 10 blocks, the model "
         "has 12 (n_layer)"},
        {4, NULL, "--pipeline-parallel 2 --zero-stage 2",
         "zero_optimization.stage 2 (--zero-stage) with pipeline_parallel.size 2 is refused, as "
         "DeepSpeed refuses pipeline parallelism with ZeRO-2 and ZeRO-3: a stage's gradients "
         "live across all the micro-batches of a step"},
        // parameter offload is stage 3's: refused with it
        {4, "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"cpu\"}}}",
         "--pipeline-parallel 2",
         "zero_optimization.stage 3 (--zero-stage) with "
         "pipeline_parallel.size 2 is refused"},
        {2, NULL, "--pipeline-parallel 2 --lora",
         "pipeline parallelism (--pipeline-parallel 2) with LoRA adapters is not supported"},
        {2, NULL, "--pipeline-parallel 2 --lora --quantize nf4",
         "pipeline parallelism (--pipeline-parallel 2) with NF4 base weights (QLoRA) is not "
         "supported"},
        {2, NULL, "--pipeline-parallel 2 --optimizer lomo --grad-accum 4",
         "optimizer.type lomo updates each block in the backward pass of a step's one "
         "micro-batch: under pipeline parallelism (--pipeline-parallel 2) "
         "gradient_accumulation_steps (--grad-accum) must be 1, not 4"},
        {2, NULL, "--pipeline-parallel 2 --optimizer adalomo --grad-accum 2",
         "optimizer.type adalomo updates each block in the backward pass"},
        {8, "{\"train_batch_size\": 12, \"gradient_accumulation_steps\": 4}",
         "--tensor-parallel 2 --pipeline-parallel 2",
         "train_batch_size 12 is not a multiple of gradient_accumulation_steps 4 x 2 "
         "data-parallel replicas (8 ranks / (tensor_parallel.size 2 x pipeline_parallel.size 2))"},
        // Megatron's first/last stage blocks
        {1, NULL, "--decoder-first-pipeline-num-layers 3",
         "decoder_first_pipeline_num_layers 3: the first and last pipeline stages' blocks need "
         "pipeline_parallel.size 2 or more, which is 1"},
        {4, NULL, "--pipeline-parallel 4 --decoder-first-pipeline-num-layers 2",
         "decoder_first_pipeline_num_layers 2: the 10 blocks left to the 3 middle pipeline "
         "stages (n_layer 12) do not split evenly (10 % 3 = 1), as Megatron requires"},
        {2, NULL,
         "--pipeline-parallel 2 --decoder-first-pipeline-num-layers 5 "
         "--decoder-last-pipeline-num-layers 5",
         "decoder_first_pipeline_num_layers 5 and decoder_last_pipeline_num_layers 5: the first "
         "and last stages are all of pipeline_parallel.size 2's, so they must hold the model's 12 "
         "blocks (n_layer), not 10"},
        {4, NULL,
         "--pipeline-parallel 4 --decoder-first-pipeline-num-layers 6 "
         "--decoder-last-pipeline-num-layers 5",
         "decoder_first_pipeline_num_layers 6 and decoder_last_pipeline_num_layers 5: 1 of the "
         "model's 12 blocks (n_layer) are left to the 2 middle pipeline stages"},
        {4, NULL,
         "--pipeline-parallel 2 --decoder-first-pipeline-num-layers 3 --pipeline-schedule "
         "interleaved --virtual-stages 2 --grad-accum 2",
         "decoder_first_pipeline_num_layers 3: the first stage's 3 blocks do not split over its "
         "pipeline_parallel.virtual_stages 2 chunks (3 % 2 = 1)"},
        {4, NULL,
         "--pipeline-parallel 4 --decoder-last-pipeline-num-layers 3 --pipeline-split uniform",
         "decoder_last_pipeline_num_layers 3: their split 3,3,3,3 contradicts "
         "pipeline_parallel.split (--pipeline-split) uniform"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(flags[i], sizeof flags[i], "%s%s", gpt2, cases[i].flags);
        run_config r = {cases[i].ranks, cases[i].json, flags[i]};
        char name[400];
        snprintf(name, sizeof name, "%d ranks: %s", r.ranks, cases[i].flags);
        t_dies(name, finish_run, &r, cases[i].says);
    }
    // accepted: PP x TP x DP over 8 ranks, 1F1B over GPT-2's 12 blocks
    fl_train_config cfg;
    config_of(&cfg, NULL,
              "--model gpt2 --seq-len 16 --tensor-parallel 2 --pipeline-parallel 2 --batch 2 "
              "--grad-accum 4 --zero-stage 1");
    cfg.ranks = 8;
    fl_config_finish(&cfg, 257);
    t_check(cfg.train_batch_size == 2 * 4 * 2, "t 2 x p 2 x d 2: train_batch_size %d = 2 x 4 x 2",
            cfg.train_batch_size);
    // fl_pp_check itself names a schedule the option table would have refused
    cfg.pipeline_parallel = 2;
    snprintf(cfg.pipeline_schedule, sizeof cfg.pipeline_schedule, "zb");
    t_dies("fl_pp_check: schedule zb", pp_check_of, &cfg,
           "pipeline_parallel.schedule (--pipeline-schedule) must be gpipe, 1f1b or interleaved, "
           "got 'zb'");
}

int main(void) {
    test_isa_cap(); // first: before anything calls fl_cpu()
    test_openblas_coretype();
    test_allocator_counts_exactly();
    test_huge_blocks();
    test_rng();
    test_rng_jump();
    test_params_init_parallel();
    test_size_text();
    test_cpu_probe();
    test_tp_keys_and_flags();
    test_tp_layouts();
    test_tp_checked_by_config_finish();
    test_batch_rule_over_replicas();
    test_pp_keys();
    test_pp_refusals();
    return t_report();
}
