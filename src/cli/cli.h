// cli.h: the fitlm subcommands.
#ifndef FITLM_CLI_H
#define FITLM_CLI_H

int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_plan(int argc, char **argv);

// True when argv holds -h or --help.
int wants_help(int argc, char **argv);
// Writes a token of the byte tokenizer to stdout as it is generated.
void print_byte_token(int token, void *ctx);

#endif
