// main.c: the fitlm command: dispatches to the subcommands.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitlm/core.h"
#include "fitlm/tokenizer.h"

static void usage(FILE *out) {
    fprintf(
        out,
        "usage: fitlm <command> [options]\n\n"
        "commands:\n"
        "  train    train a GPT-2 or LLaMA model; with no options, the demo: a small model on the\n"
        "           Brown corpus, then a checkpoint in out/ and a text sample\n"
        "  sample   generate text from a checkpoint or pretrained weights\n"
        "  plan     the memory per tag a training run needs, printed before allocating\n"
        "  tokenize text or JSON Lines instruction data to token shards for training\n"
        "  export   a checkpoint to Hugging Face safetensors + config.json (+ tokenizer.json)\n"
        "  eval     a model's loss, perplexity and bits per byte over whole data\n"
        "  plot     PNG and SVG figures of runs' metrics (loss, lr, memory), overlaid\n\n"
        "'fitlm <command> --help' lists the command's options and their defaults.\n");
}

double cli_number(const char *flag, const char *text, double min, double max) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || errno || !(v >= min && v <= max))
        fl_die("option %s expects a number in [%g, %g], got '%s'", flag, min, max, text);
    return v;
}

int cli_whole(const char *flag, const char *text, int min, int max) {
    double v = cli_number(flag, text, min, max);
    if (v != floor(v)) fl_die("option %s expects a whole number, got '%s'", flag, text);
    return (int)v;
}

int wants_help(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return 1;
    return 0;
}

void print_token(int token, void *tokenizer) {
    const fl_tokenizer *tok = tokenizer;
    size_t len;
    const uint8_t *bytes = fl_tokenizer_token_bytes(tok, token, &len);
    int eot = token == fl_tokenizer_eot(tok); // a document ends: its name on a line of its own
    if (eot) putchar('\n');
    fwrite(bytes, 1, len, stdout);
    if (eot) putchar('\n');
    fflush(stdout);
}

int main(int argc, char **argv) {
    fl_runtime_env(argv);
    if (argc < 2) {
        usage(stderr);
        return 1;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "train")) return cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "export")) return cmd_export(argc - 2, argv + 2);
    if (!strcmp(cmd, "plot")) return cmd_plot(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    fprintf(stderr, "fitlm: error: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 1;
}

int cli_quant_option(int argc, char **argv, int i, fl_quant_config *q) {
    const char *a = argv[i];
    if (!strcmp(a, "--double-quant")) {
        q->double_quant = 1;
        return 1;
    }
    if (strcmp(a, "--quantize") && strcmp(a, "--nf4-blocksize")) return 0;
    if (i + 1 >= argc) fl_die("option %s needs a value", a);
    const char *v = argv[i + 1];
    if (!strcmp(a, "--nf4-blocksize")) {
        q->blocksize = cli_whole(a, v, 32, 4096);
    } else if (!strcmp(v, "nf4")) {
        q->enabled = 1;
    } else {
        fl_die("--quantize %s is not supported: nf4 is the one 4-bit format", v);
    }
    return 2;
}
