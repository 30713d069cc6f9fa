// bench_tokenizer.c: GPT-2 tokenizer encoding speed.
// usage: bench_tokenizer [TEXT [GPT2_DIR]] (default data/brown.txt,
// data/gpt2). Encodes the whole text RUNS times with one thread, then RUNS
// times with two, the text split into two chunks at a newline, one per thread
// (each call has its own cache, so every run starts cold). Prints MB/s,
// median (min-max), the tokens and the bytes per token.
#include "fitlm/core.h"
#include "fitlm/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RUNS = 5, MAX_THREADS = 2 };

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Encodes text split into `threads` chunks that end at newlines; returns
// the seconds taken and the token count in *tokens.
static double encode(const fl_tokenizer *tok, const uint8_t *text, size_t n, int threads,
                     size_t *tokens) {
    size_t start[MAX_THREADS + 1] = {0};
    for (int k = 1; k < threads; k++) {
        size_t at = n * k / threads;
        while (at < n && at > 0 && text[at - 1] != '\n') at++;
        start[k] = at;
    }
    start[threads] = n;
    fl_tokens out[MAX_THREADS] = {{0}};
    double t0 = fl_now();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int k = 0; k < threads; k++)
        fl_tokenizer_encode(tok, text + start[k], start[k + 1] - start[k], &out[k]);
    double secs = fl_now() - t0;
    *tokens = 0;
    for (int k = 0; k < threads; k++) {
        *tokens += out[k].n;
        fl_tokens_free(&out[k]);
    }
    return secs;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "data/brown.txt";
    const char *dir = argc > 2 ? argv[2] : "data/gpt2";
    FILE *f = fopen(path, "rb");
    if (!f) fl_die("cannot open %s (scripts/setup.sh makes the Brown texts)", path);
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f);
    if (n == 0) fl_die("%s is empty", path);
    fseek(f, 0, SEEK_SET);
    uint8_t *text = fl_alloc(FL_MEM_OTHER, n);
    if (fread(text, 1, n, f) != n) fl_die("cannot read %s", path);
    fclose(f);

    double t0 = fl_now();
    fl_tokenizer *tok = fl_tokenizer_load("gpt2", dir);
    printf("gpt2 tokenizer loaded in %.0f ms; encoding %s (%zu bytes), median of %d runs\n",
           1e3 * (fl_now() - t0), path, n, RUNS);
    printf("%-8s %-26s %10s %12s\n", "threads", "MB/s median (min-max)", "tokens", "bytes/token");
    for (int threads = 1; threads <= MAX_THREADS; threads++) {
        double mbs[RUNS];
        size_t tokens = 0;
        for (int r = 0; r < RUNS; r++) mbs[r] = n / 1e6 / encode(tok, text, n, threads, &tokens);
        qsort(mbs, RUNS, sizeof *mbs, cmp_double);
        char cell[64];
        snprintf(cell, sizeof cell, "%.1f (%.1f-%.1f)", mbs[RUNS / 2], mbs[0], mbs[RUNS - 1]);
        printf("%-8d %-26s %10zu %12.2f\n", threads, cell, tokens, (double)n / tokens);
    }
    fl_tokenizer_free(tok);
    fl_free(text);
    return 0;
}
