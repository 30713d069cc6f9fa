// test_pipeline_split: pipeline parallelism's stage split (pipeline.h,
// src/parallel/pipeline_split.c; the config's side in parallel_config.c).
// Each method's blocks per virtual stage for several (L, n), GPT-2 124M's
// real sizes among them; "parameters" against every contiguous split of
// small models (its largest stage is the least any reaches); every method
// covers each block exactly once for all L <= 48, n <= 16 with L >= n; and
// each refusal, naming the numbers and the option.
#include <stdio.h>
#include <string.h>

#include "fitlm/dist.h"
#include "fitlm/pipeline.h"
#include "testlib.h"

static int same(const int *a, const int *b, int n) {
    return !memcmp(a, b, (size_t)n * sizeof *a);
}

static void text_of(const int *c, int n, char *out, size_t size) {
    size_t at = 0;
    for (int s = 0; s < n && at < size; s++)
        at += (size_t)snprintf(out + at, size - at, "%s%d", s ? "," : "", c[s]);
}

static void expect_split(int method, int L, int n, const int *list, size_t block, size_t embed,
                         size_t head, const int *want, const char *what) {
    int got[FL_PP_MAX_VIRTUAL];
    fl_pp_split(method, L, n, list, block, embed, head, got);
    char g[256], w[256];
    text_of(got, n, g, sizeof g);
    text_of(want, n, w, sizeof w);
    t_check(same(got, want, n), "%s: L %d over %d stages: %s (want %s)", what, L, n, g, w);
}

static void test_uniform(void) {
    const struct {
        int L, n, want[16];
    } cases[] = {
        {12, 4, {3, 3, 3, 3}},
        {10, 4, {3, 3, 2, 2}}, // DeepSpeed's partition_uniform: the first L % n one more
        {7, 3, {3, 2, 2}},
        {5, 5, {1, 1, 1, 1, 1}},
        {13, 1, {13}},
        {48, 16, {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3}},
        {47, 16, {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2}},
        {17, 16, {2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_split(FL_PP_SPLIT_UNIFORM, cases[i].L, cases[i].n, NULL, 0, 0, 0, cases[i].want,
                     "uniform");
}

// GPT-2 124M (fitlm's padded vocabulary 50304, 1024 positions, C 768): a
// block is 12C^2 + 13C, the embedding wte + wpe, the last stage the final
// norm and its copy of the tied wte (the table's sizes: test_config_split).
enum { C = 768 };
static const size_t gpt2_block = 12ull * C * C + 13 * C;  // 7,087,872
static const size_t gpt2_embed = 50304ull * C + 1024 * C; // 39,419,904
static const size_t gpt2_head = 2 * C + 50304ull * C;     // 38,635,008

static void test_parameters_gpt2(void) {
    t_check(gpt2_block == 7087872 && gpt2_embed == 39419904 && gpt2_head == 38635008,
            "GPT-2 124M's sizes: block %zu, embedding %zu, head %zu", gpt2_block, gpt2_embed,
            gpt2_head);
    // the embedding and the tied head weigh about 5.5 blocks each: the end
    // stages take fewer blocks; among equal largest stages the earlier
    // stages get more blocks
    const struct {
        int n, want[12];
    } cases[] = {
        {1, {12}},
        {2, {6, 6}},
        {3, {2, 8, 2}},
        {4, {1, 5, 5, 1}},
        {6, {1, 3, 3, 2, 2, 1}},
        {12, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_split(FL_PP_SPLIT_PARAMETERS, 12, cases[i].n, NULL, gpt2_block, gpt2_embed,
                     gpt2_head, cases[i].want, "parameters, GPT-2 124M");
    // no embedding or head to carry: the blocks alone, as uniform
    const int even[4] = {3, 3, 2, 2};
    expect_split(FL_PP_SPLIT_PARAMETERS, 10, 4, NULL, 5, 0, 0, even, "parameters, blocks only");
    // a head heavier than the embedding: the last stage gets fewer
    const int heavy_head[3] = {4, 4, 1};
    expect_split(FL_PP_SPLIT_PARAMETERS, 9, 3, NULL, 10, 0, 25, heavy_head,
                 "parameters, heavy head");
}

static size_t largest_stage(const int *c, int n, size_t block, size_t embed, size_t head) {
    size_t most = 0;
    for (int s = 0; s < n; s++) {
        size_t w = (size_t)c[s] * block + (s == 0 ? embed : 0) + (s == n - 1 ? head : 0);
        if (w > most) most = w;
    }
    return most;
}

// The least largest stage over every contiguous split of L blocks into n
// non-empty runs (compositions, enumerated recursively).
static size_t least_largest(int L, int n, int s, int left, int *c, size_t block, size_t embed,
                            size_t head) {
    if (s == n - 1) {
        c[s] = left;
        return largest_stage(c, n, block, embed, head);
    }
    size_t best = (size_t)-1;
    for (int k = 1; k <= left - (n - s - 1); k++) {
        c[s] = k;
        size_t w = least_largest(L, n, s + 1, left - k, c, block, embed, head);
        if (w < best) best = w;
    }
    return best;
}

static void test_parameters_is_least(void) {
    const size_t extras[][2] = {{0, 0}, {7, 0}, {0, 7}, {13, 4}, {4, 13}, {30, 30}, {2, 55}};
    int failures = 0, cases = 0;
    for (int L = 1; L <= 10; L++)
        for (int n = 1; n <= 5 && n <= L; n++)
            for (size_t e = 0; e < sizeof extras / sizeof extras[0]; e++) {
                int got[16], scratch[16];
                size_t embed = extras[e][0], head = extras[e][1];
                fl_pp_split(FL_PP_SPLIT_PARAMETERS, L, n, NULL, 3, embed, head, got);
                size_t w = largest_stage(got, n, 3, embed, head);
                size_t least = least_largest(L, n, 0, L, scratch, 3, embed, head);
                cases++;
                if (w != least && failures++ < 5)
                    t_check(0,
                            "parameters: L %d, n %d, embed %zu, head %zu: largest %zu, least "
                            "%zu",
                            L, n, embed, head, w, least);
            }
    t_check(!failures, "parameters reaches the least largest stage in all %d small cases", cases);
}

// Every block in exactly one stage, in order: the block -> stage map built
// from the counts, independently of fl_pp_split_check.
static int covers(const int *c, int n, int L) {
    int owner[64], b = 0;
    for (int i = 0; i < L; i++) owner[i] = -1;
    for (int s = 0; s < n; s++) {
        if (c[s] < 1) return 0;
        for (int k = 0; k < c[s]; k++, b++) {
            if (b >= L || owner[b] != -1) return 0;
            owner[b] = s;
        }
    }
    for (int i = 0; i < L; i++)
        if (owner[i] < 0 || (i && owner[i] < owner[i - 1])) return 0;
    return b == L;
}

static void test_coverage(void) {
    int bad = 0, cases = 0;
    for (int L = 1; L <= 48; L++)
        for (int n = 1; n <= 16 && n <= L; n++) {
            int uniform[16], params[16], list[16], given[16];
            fl_pp_split(FL_PP_SPLIT_UNIFORM, L, n, NULL, 0, 0, 0, uniform);
            fl_pp_split(FL_PP_SPLIT_PARAMETERS, L, n, NULL, gpt2_block, gpt2_embed, gpt2_head,
                        params);
            // an explicit list: uniform's, reversed
            for (int s = 0; s < n; s++) list[s] = uniform[n - 1 - s];
            fl_pp_split(FL_PP_SPLIT_EXPLICIT, L, n, list, 0, 0, 0, given);
            cases += 3;
            int ok = covers(uniform, n, L) && covers(params, n, L) && covers(given, n, L) &&
                     same(given, list, n);
            if (!ok && bad++ < 5)
                t_check(0, "L %d over %d stages: a block left out or twice", L, n);
        }
    t_check(!bad, "uniform, parameters and explicit cover every block once: %d splits", cases);
}

static void test_parse(void) {
    int c[FL_PP_MAX_VIRTUAL], n = -1;
    t_check(fl_pp_split_parse("uniform", "opt", c, &n) == FL_PP_SPLIT_UNIFORM && n == 0,
            "parse: uniform");
    t_check(fl_pp_split_parse("parameters", "opt", c, &n) == FL_PP_SPLIT_PARAMETERS && n == 0,
            "parse: parameters");
    const int want[4] = {4, 6, 6, 4};
    t_check(fl_pp_split_parse("4,6,6,4", "opt", c, &n) == FL_PP_SPLIT_EXPLICIT && n == 4 &&
                same(c, want, 4),
            "parse: 4,6,6,4 (%d entries)", n);
    t_check(fl_pp_split_parse("12", "opt", c, &n) == FL_PP_SPLIT_EXPLICIT && n == 1 && c[0] == 12,
            "parse: one entry");
}

static void parse_text(void *text) {
    int c[FL_PP_MAX_VIRTUAL], n;
    fl_pp_split_parse(text, "pipeline_parallel.split", c, &n);
}

typedef struct {
    int method, L, n;
    int list[8];
} split_case;

static void split_of(void *arg) {
    const split_case *s = arg;
    int count[FL_PP_MAX_VIRTUAL];
    fl_pp_split(s->method, s->L, s->n, s->list, 1, 0, 0, count);
}

static void check_of(void *arg) {
    const split_case *s = arg;
    fl_pp_split_check(s->L, s->n, s->list);
}

static void test_refusals(void) {
    const char *bad_text[] = {"", "4,,4", "4,", ",4", "abc", "-1,2", "4;4", " 4", "Uniform"};
    for (size_t i = 0; i < sizeof bad_text / sizeof bad_text[0]; i++) {
        char name[64], says[160];
        snprintf(name, sizeof name, "parse '%s'", bad_text[i]);
        snprintf(says, sizeof says,
                 "pipeline_parallel.split: expected uniform, parameters or blocks per (virtual) "
                 "stage as a list such as 4,6,6,4; got '%s'",
                 bad_text[i]);
        t_dies(name, parse_text, (void *)bad_text[i], says);
    }
    t_dies("parse an entry too large", parse_text, "4,2000000",
           "pipeline_parallel.split: entry 2 of '4,2000000' is too large");
    split_case few = {FL_PP_SPLIT_UNIFORM, 3, 4, {0}};
    t_dies("3 blocks over 4 stages", split_of, &few,
           "pipeline_parallel.split (--pipeline-split): 3 blocks (n_layer) cannot fill 4 virtual "
           "stages");
    split_case few_params = {FL_PP_SPLIT_PARAMETERS, 7, 8, {0}};
    t_dies("parameters: 7 blocks over 8 stages", split_of, &few_params,
           "7 blocks (n_layer) cannot fill 8 virtual stages");
    split_case zero = {FL_PP_SPLIT_EXPLICIT, 8, 3, {4, 0, 4}};
    t_dies("explicit with an empty stage", split_of, &zero,
           "pipeline_parallel.split (--pipeline-split): virtual stage 1 of 3 has 0 blocks");
    split_case short_sum = {FL_PP_SPLIT_EXPLICIT, 30, 4, {7, 7, 7, 7}};
    t_dies("explicit summing to 28 of 30 (Megatron#1304)", split_of, &short_sum,
           "pipeline_parallel.split (--pipeline-split): the 4 entries sum to 28 blocks, the model "
           "has 30 (n_layer)");
    split_case long_sum = {FL_PP_SPLIT_EXPLICIT, 8, 2, {5, 5}};
    t_dies("explicit summing to 10 of 8", split_of, &long_sum, "the 2 entries sum to 10 blocks");
    split_case left_out = {0, 30, 4, {7, 7, 7, 7}};
    t_dies("check: blocks left out", check_of, &left_out,
           "stage split: blocks 28 to 29 are in no stage: the 4 stages hold 28 of the 30 blocks");
    split_case excess = {0, 8, 3, {3, 3, 4}};
    t_dies("check: past the last block", check_of, &excess,
           "stage split: virtual stage 2 of 3 holds 4 blocks from block 6, past the model's last "
           "block 7: 2 blocks too many");
    split_case empty = {0, 8, 3, {4, 4, 0}};
    t_dies("check: an empty stage", check_of, &empty,
           "stage split: virtual stage 2 of 3 holds 0 blocks (from block 8)");
    split_case fine = {0, 8, 3, {3, 3, 2}};
    check_of(&fine);
    t_check(1, "check: 3,3,2 covers 8 blocks");
}

// fl_pp_config_split: the sizes from the model's table (GPT-2 124M's the
// same as above), the option's list against p x v.
static void config_split(fl_train_config *cfg, fl_model_config *m, const char *preset, int p, int v,
                         const char *split) {
    fl_config_defaults(cfg);
    memset(m, 0, sizeof *m);
    fl_model_preset(m, preset);
    if (!m->vocab_size) m->vocab_size = 50257; // GPT-2's tokenizer
    fl_model_config_finish(m);
    cfg->pipeline_parallel = p;
    cfg->virtual_stages = v;
    snprintf(cfg->pipeline_split, sizeof cfg->pipeline_split, "%s", split);
}

static void config_split_dies(void *split) {
    fl_train_config cfg;
    fl_model_config m;
    config_split(&cfg, &m, "gpt2", 2, 2, split);
    int count[FL_PP_MAX_VIRTUAL];
    fl_pp_config_split(&cfg, &m, count);
}

static void test_config_split(void) {
    fl_train_config cfg;
    fl_model_config m;
    int got[FL_PP_MAX_VIRTUAL];
    config_split(&cfg, &m, "gpt2", 3, 1, "parameters");
    fl_pp_config_split(&cfg, &m, got);
    const int three[3] = {2, 8, 2};
    t_check(same(got, three, 3), "GPT-2 124M over 3 stages by its table: %d,%d,%d", got[0], got[1],
            got[2]);
    config_split(&cfg, &m, "gpt2", 2, 3, "parameters"); // 6 virtual stages
    fl_pp_config_split(&cfg, &m, got);
    const int six[6] = {1, 3, 3, 2, 2, 1};
    t_check(same(got, six, 6), "GPT-2 124M over 2 x 3 virtual stages: %d,%d,%d,%d,%d,%d", got[0],
            got[1], got[2], got[3], got[4], got[5]);
    config_split(&cfg, &m, "gpt2", 2, 2, "3,3,3,3");
    fl_pp_config_split(&cfg, &m, got);
    const int list[4] = {3, 3, 3, 3};
    t_check(same(got, list, 4), "an explicit list over 2 x 2 virtual stages");
    // LLaMA untied: the head is the norm and lm_head, the embedding the same size
    config_split(&cfg, &m, "tinyllama-1.1b", 4, 1, "parameters");
    fl_pp_config_split(&cfg, &m, got);
    t_check(got[0] + got[1] + got[2] + got[3] == m.n_layer && got[0] < got[1] && got[3] < got[2],
            "TinyLlama's %d blocks over 4 stages: %d,%d,%d,%d (the end stages fewer)", m.n_layer,
            got[0], got[1], got[2], got[3]);
    t_dies("a list of 3 for 2 x 2 virtual stages", config_split_dies, "4,4,4",
           "pipeline_parallel.split (--pipeline-split) 4,4,4 has 3 entries; "
           "pipeline_parallel.size 2 x virtual_stages 2 = 4 virtual stages need one each");
}

int main(void) {
    test_uniform();
    test_parameters_gpt2();
    test_parameters_is_least();
    test_coverage();
    test_parse();
    test_refusals();
    test_config_split();
    return t_report();
}
