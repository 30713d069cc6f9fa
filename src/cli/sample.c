// sample.c: `fitlm sample`: load a checkpoint and generate text.
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitlm/io.h"
#include "fitlm/model.h"

typedef struct {
    const char *checkpoint, *prompt;
    int tokens, top_k, threads;
    float temperature;
    unsigned long long seed;
} sample_options;

static void help(void) {
    printf("usage: fitlm sample [options]\n\n"
           "  --checkpoint DIR     directory holding model.ckpt (default: out)\n"
           "  --prompt TEXT        text to continue (default: \"The \")\n"
           "  --tokens N           tokens to generate (default: 400)\n"
           "  --temperature X      softmax temperature, 0 = greedy (default: 0.8)\n"
           "  --top-k K            sample among the K most likely tokens, 0 = all (default: 40)\n"
           "  --seed N             random seed (default: 1337)\n"
           "  --threads N          threads, 0 = all cores (default: 0)\n");
}

static double number(const char *flag, const char *text, double min, double max) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || errno || !(v >= min && v <= max))
        fl_die("option %s expects a number in [%g, %g], got '%s'", flag, min, max, text);
    return v;
}

static int whole(const char *flag, const char *text, double min, double max) {
    double v = number(flag, text, min, max);
    if (v != floor(v)) fl_die("option %s expects a whole number, got '%s'", flag, text);
    return (int)v;
}

int cmd_sample(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        help();
        return 0;
    }
    sample_options o = {"out", "The ", 400, 40, 0, 0.8f, 1337};
    for (int i = 0; i < argc; i++) {
        const char *flag = argv[i];
        if (strncmp(flag, "--", 2) != 0) fl_die("unexpected argument '%s' (see --help)", flag);
        if (i + 1 >= argc) fl_die("option %s needs a value", flag);
        const char *v = argv[++i];
        if (!strcmp(flag, "--checkpoint"))
            o.checkpoint = v;
        else if (!strcmp(flag, "--prompt"))
            o.prompt = v;
        else if (!strcmp(flag, "--tokens"))
            o.tokens = whole(flag, v, 0, 1 << 20);
        else if (!strcmp(flag, "--temperature"))
            o.temperature = (float)number(flag, v, 0, 100);
        else if (!strcmp(flag, "--top-k"))
            o.top_k = whole(flag, v, 0, 1 << 30);
        else if (!strcmp(flag, "--seed"))
            o.seed = (unsigned long long)number(flag, v, 0, 1.8e19);
        else if (!strcmp(flag, "--threads"))
            o.threads = whole(flag, v, 0, 4096);
        else
            fl_die("unknown option '%s' (see --help)", flag);
    }
    if (o.threads) fl_set_threads(o.threads);
    if (!*o.prompt) fl_die("--prompt must not be empty");

    fl_gpt2 model;
    char tokenizer[32];
    int step;
    fl_ckpt_load(o.checkpoint, &model, FL_F32, tokenizer, sizeof tokenizer, &step);
    if (strcmp(tokenizer, "byte") != 0)
        fl_die("checkpoint %s uses tokenizer '%s', which this version cannot decode", o.checkpoint,
               tokenizer);
    fl_gpt2_alloc_acts(&model, 1, model.config.max_seq_len);

    int n_prompt = (int)strlen(o.prompt);
    int *tokens = fl_alloc(FL_MEM_OTHER, (size_t)(n_prompt + o.tokens) * sizeof(int));
    for (int i = 0; i < n_prompt; i++) tokens[i] = (unsigned char)o.prompt[i];
    fl_rng rng;
    fl_rng_seed(&rng, o.seed);
    fputs(o.prompt, stdout);
    fl_gpt2_generate(&model, tokens, n_prompt, o.tokens, o.temperature, o.top_k, &rng,
                     print_byte_token, NULL);
    putchar('\n');
    fl_free(tokens);
    fl_gpt2_free(&model);
    return 0;
}
