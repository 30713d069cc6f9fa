// helpers.h: what every fitlm command shares (src/cli/helpers.c).
#ifndef FITLM_CLI_HELPERS_H
#define FITLM_CLI_HELPERS_H

#include "fitlm/lora.h"

// The value of a numeric option, checked against [min, max]; dies naming flag.
double cli_number(const char *flag, const char *text, double min, double max);
// The same, for a whole number.
int cli_whole(const char *flag, const char *text, int min, int max);
// True when argv holds -h or --help.
int wants_help(int argc, char **argv);
// The NF4 options of a base loaded for sampling or merging, the way the
// adapter was trained on it: --quantize nf4, --double-quant (no value),
// --nf4-blocksize N. Returns the argv entries consumed (0: not one of them).
int cli_quant_option(int argc, char **argv, int i, fl_quant_config *q);
// Writes a generated token's bytes to stdout (ctx: the fl_tokenizer).
void print_token(int token, void *tokenizer);
// `--device NAME` (eval, sample, export): makes the named device the one
// models are made on (LoRA adapters and NF4 weights included); dies as
// fl_device_get does.
void cli_use_device(const char *name);

#endif
