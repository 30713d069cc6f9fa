// bench_tokenizer.c: encoding speed of the gpt2 tokenizer and of the hf
// tokenizers of LLaMA-1/2 (SentencePiece-style BPE) and LLaMA-3 (byte-level
// BPE). usage: bench_tokenizer [TEXT [DATA_DIR]] (default data/brown.txt,
// data: its gpt2/, llama/ and llama3/). Encodes the whole text RUNS times
// with one thread, then RUNS times with two, the text split into two chunks
// at a newline, one per thread (each call has its own cache, so every run
// starts cold). Prints the CPU, then per tokenizer and thread count MB/s,
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

static void cpu_model(char *out, size_t cap) {
    char line[512];
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && colon) {
            snprintf(out, cap, "%s", colon + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    }
    fclose(f);
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "data/brown.txt";
    const char *data = argc > 2 ? argv[2] : "data";
    FILE *f = fopen(path, "rb");
    if (!f) fl_die("cannot open %s (scripts/setup.sh makes the Brown texts)", path);
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f);
    if (n == 0) fl_die("%s is empty", path);
    fseek(f, 0, SEEK_SET);
    uint8_t *text = fl_alloc(FL_MEM_OTHER, n);
    if (fread(text, 1, n, f) != n) fl_die("cannot read %s", path);
    fclose(f);

    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    printf("CPU: %s; encoding %s (%zu bytes), median of %d runs\n\n", cpu, path, n, RUNS);
    printf("| tokenizer | threads | MB/s median (min-max) | tokens | bytes/token | load ms |\n");
    printf("|---|---|---|---|---|---|\n");
    static const char *const tokenizers[][3] = {
        {"gpt2", "gpt2", "gpt2"}, {"llama (hf)", "hf", "llama"}, {"llama3 (hf)", "hf", "llama3"}};
    for (int k = 0; k < 3; k++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", data, tokenizers[k][2]);
        double t0 = fl_now();
        fl_tokenizer *tok = fl_tokenizer_load(tokenizers[k][1], dir);
        double load_ms = 1e3 * (fl_now() - t0);
        for (int threads = 1; threads <= MAX_THREADS; threads++) {
            double mbs[RUNS];
            size_t tokens = 0;
            for (int r = 0; r < RUNS; r++)
                mbs[r] = n / 1e6 / encode(tok, text, n, threads, &tokens);
            qsort(mbs, RUNS, sizeof *mbs, cmp_double);
            printf("| %s | %d | %.1f (%.1f-%.1f) | %zu | %.2f | %.0f |\n", tokenizers[k][0],
                   threads, mbs[RUNS / 2], mbs[0], mbs[RUNS - 1], tokens, (double)n / tokens,
                   load_ms);
        }
        fl_tokenizer_free(tok);
    }
    fl_free(text);
    return 0;
}
