// main.c: the fitlm command: dispatches to the subcommands.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fitlm/core.h"

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
