// cli.h: the fitlm subcommands.
#ifndef FITLM_CLI_H
#define FITLM_CLI_H

int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_plot(int argc, char **argv);
int cmd_eval(int argc, char **argv);

#endif
