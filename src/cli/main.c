// main.c: the fitlm command: dispatches to the subcommands.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fitlm/core.h"

static void usage(FILE *out) {
    fprintf(out, "usage: fitlm <command> [options]\n\n"
                 "commands:\n"
                 "  train    train a GPT-2 model; with no options, the demo: a small model on the\n"
                 "           Brown corpus, then a checkpoint in out/ and a text sample\n"
                 "  sample   generate text from a checkpoint\n"
                 "  plan     the memory per tag a training run needs, printed before allocating\n\n"
                 "'fitlm <command> --help' lists the command's options and their defaults.\n");
}

int wants_help(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return 1;
    return 0;
}

void print_byte_token(int token, void *ctx) {
    (void)ctx;
    putchar(token);
    fflush(stdout);
}

int main(int argc, char **argv) {
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
    fprintf(stderr, "fitlm: error: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 1;
}
