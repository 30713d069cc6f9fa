// pipeline_split.c: L blocks over n = p x v virtual stages (pipeline.h):
// uniform (DeepSpeed's partition_uniform), balanced by parameters, or an
// explicit list, each checked to cover every block exactly once before a
// stage is built (Megatron#1304 built 28 of 30 layers without a word).
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/pipeline.h"

#define OPTION "pipeline_parallel.split (--pipeline-split)"

int fl_pp_split_parse(const char *text, const char *what, int *counts, int *n_counts) {
    *n_counts = 0;
    if (!strcmp(text, "uniform")) return FL_PP_SPLIT_UNIFORM;
    if (!strcmp(text, "parameters")) return FL_PP_SPLIT_PARAMETERS;
    const char *p = text;
    for (;;) {
        if (!isdigit((unsigned char)*p))
            fl_die("%s: expected uniform, parameters or blocks per (virtual) stage as a list "
                   "such as 4,6,6,4; got '%s'",
                   what, text);
        if (*n_counts == FL_PP_MAX_VIRTUAL)
            fl_die("%s: more than %d entries in '%.40s...'", what, FL_PP_MAX_VIRTUAL, text);
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || v > 1 << 20)
            fl_die("%s: entry %d of '%s' is too large (at most %d blocks a stage)", what,
                   *n_counts + 1, text, 1 << 20);
        counts[(*n_counts)++] = (int)v;
        if (!*end) return FL_PP_SPLIT_EXPLICIT;
        if (*end != ',' || !end[1])
            fl_die("%s: expected uniform, parameters or blocks per (virtual) stage as a list "
                   "such as 4,6,6,4; got '%s'",
                   what, text);
        p = end + 1;
    }
}

// DeepSpeed's partition_uniform (runtime/utils.py): L / n each, the first
// L % n one more.
static void split_uniform(int L, int n, int *count) {
    for (int s = 0; s < n; s++) count[s] = L / n + (s < L % n);
}

// Minimises the largest stage's parameters: every stage starts with one
// block, and each further block goes to the stage that is lightest with it
// (the earliest among equals). The blocks being alike, each step keeps the
// sorted stage weights the least possible, so the largest is the least any
// contiguous split reaches (the tests check it against every split of small
// models); ties give the earlier stages more blocks. DeepSpeed's
// partition_method "parameters" balances layer counts the same way, with the
// embedding and head its own layers; here they ride on the first and the last
// virtual stage, whose extra weight the blocks' balance absorbs.
static void split_parameters(int L, int n, size_t block, size_t embed, size_t head, int *count) {
    FL_ASSERT(block > 0 || n == 1); // blocks without parameters would all go to one stage
    for (int s = 0; s < n; s++) count[s] = 1;
    for (int b = n; b < L; b++) {
        int best = 0;
        size_t best_weight = 0;
        for (int s = 0; s < n; s++) {
            size_t w =
                (size_t)(count[s] + 1) * block + (s == 0 ? embed : 0) + (s == n - 1 ? head : 0);
            if (s == 0 || w < best_weight) best = s, best_weight = w;
        }
        count[best]++;
    }
}

// An explicit list against the model, naming the option and the numbers.
static void check_explicit(int L, int n, const int *list) {
    long long sum = 0;
    for (int s = 0; s < n; s++) {
        if (list[s] < 1)
            fl_die(OPTION ": virtual stage %d of %d has %d blocks; every stage needs at least one",
                   s, n, list[s]);
        sum += list[s];
    }
    if (sum != L)
        fl_die(OPTION ": the %d entries sum to %lld blocks, the model has %d (n_layer); every "
                      "block belongs to exactly one stage",
               n, sum, L);
}

void fl_pp_split(int method, int L, int n, const int *explicit_counts, size_t block_params,
                 size_t embed_params, size_t head_params, int *count) {
    if (n < 1 || n > FL_PP_MAX_VIRTUAL)
        fl_die(OPTION ": %d virtual stages (pipeline_parallel.size x virtual_stages); 1 to %d "
                      "are possible",
               n, FL_PP_MAX_VIRTUAL);
    if (L < n)
        fl_die(OPTION
               ": %d blocks (n_layer) cannot fill %d virtual stages "
               "(pipeline_parallel.size x virtual_stages): every stage needs at least one block",
               L, n);
    switch (method) {
    case FL_PP_SPLIT_UNIFORM:
        split_uniform(L, n, count);
        break;
    case FL_PP_SPLIT_PARAMETERS:
        split_parameters(L, n, block_params, embed_params, head_params, count);
        break;
    default:
        FL_ASSERT(method == FL_PP_SPLIT_EXPLICIT);
        check_explicit(L, n, explicit_counts);
        memcpy(count, explicit_counts, (size_t)n * sizeof *count);
    }
    fl_pp_split_check(L, n, count);
}

void fl_pp_split_check(int L, int n, const int *count) {
    int first = 0; // the first block of stage s
    for (int s = 0; s < n; s++) {
        if (count[s] < 1)
            fl_die("stage split: virtual stage %d of %d holds %d blocks (from block %d); every "
                   "stage needs at least one",
                   s, n, count[s], first);
        if (count[s] > L - first)
            fl_die("stage split: virtual stage %d of %d holds %d blocks from block %d, past the "
                   "model's last block %d: %d blocks too many",
                   s, n, count[s], first, L - 1, count[s] - (L - first));
        first += count[s];
    }
    if (first < L)
        fl_die("stage split: blocks %d to %d are in no stage: the %d stages hold %d of the %d "
               "blocks",
               first, L - 1, n, first, L);
}
