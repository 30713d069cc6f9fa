// helpers.c: what every fitlm command shares: numeric option values, the
// help flag, the NF4 options of a base loaded for sampling or merging, and
// printing a generated token.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/tokenizer.h"
#include "helpers.h"
#include "fitlm/device.h"

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

void cli_use_device(const char *name) {
    fl_device_use(fl_device_get(name));
}
