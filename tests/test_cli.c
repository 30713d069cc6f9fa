// test_cli.c: the fitlm command as a user meets it: --help, config files,
// flags overriding them, and clear errors with a non-zero exit on bad input.
// Runs the built binary (FITLM_BINARY, set by CTest) in a scratch directory.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_cli_XXXXXX";
static char output[65536];

// Runs `fitlm ARGS` with stdout and stderr captured; returns the exit status.
static int fitlm(const char *args) {
    const char *bin = getenv("FITLM_BINARY");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cd %s && %s %s 2>&1", dir, bin ? bin : "fitlm", args);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(output, 1, sizeof output - 1, p);
    output[n] = 0;
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void write_file(const char *name, const char *text, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    fwrite(text, 1, n, f);
    fclose(f);
}

static void write_text(const char *name, const char *text) {
    write_file(name, text, strlen(text));
}

// Expects `fitlm args` to fail with status 1 and say `what`.
static void fails_with(const char *args, const char *what) {
    int rc = fitlm(args);
    t_check(rc == 1 && strstr(output, "fitlm: error:") && strstr(output, what),
            "'fitlm %s' should fail saying \"%s\"; got status %d and: %.400s", args, what, rc,
            output);
}

static void test_help_lists_every_option_with_default(void) {
    t_check(fitlm("--help") == 0 && strstr(output, "train") && strstr(output, "sample"),
            "fitlm --help lists the commands");
    int rc = fitlm("train --help");
    t_check(rc == 0, "train --help exits 0");
    const char *expected[] = {"--config FILE",
                              "--batch",
                              "[train_micro_batch_size_per_gpu]",
                              "--grad-accum",
                              "[gradient_accumulation_steps]",
                              "--lr",
                              "default: 0.003",
                              "--seq-len",
                              "--steps",
                              "--eval-every",
                              "--seed",
                              "--threads",
                              "[optimizer.params.betas]",
                              "[gradient_clipping]",
                              "[scheduler.params.warmup_num_steps]"};
    for (size_t i = 0; i < sizeof expected / sizeof expected[0]; i++)
        t_check(strstr(output, expected[i]) != NULL, "train --help mentions %s", expected[i]);
    t_check(fitlm("sample --help") == 0 && strstr(output, "--temperature") &&
                strstr(output, "--top-k") && strstr(output, "(default: 0.8)"),
            "sample --help lists its options with defaults");
}

static void test_bad_flags(void) {
    fails_with("frobnicate", "unknown command 'frobnicate'");
    fails_with("train --frobnicate 3", "unknown option '--frobnicate'");
    fails_with("train --lr abc", "expects a number");
    fails_with("train --batch 0", "out of range");
    fails_with("train --batch 2.5", "whole number");
    fails_with("train --steps", "needs a value");
    fails_with("train --optimizer adam", "must be one of adamw|sgd");
    fails_with("train --momentum 0.9", "momentum applies to sgd");
    fails_with("train --optimizer sgd --betas 0.9,0.9", "apply to adamw");
    fails_with("train --n-embd 30 --n-head 4", "divisible");
    fails_with("train --seq-len 4096", "exceeds model.max_seq_len");
    fails_with("train --batch 4 --train-batch-size 10", "not a multiple");
    fails_with("train --batch 4 --grad-accum 3 --train-batch-size 8", "train_batch_size 8");
    fails_with("sample --tokens -3", "--tokens");
    fails_with("train --precision bf16 --hysteresis 3", "fp16.hysteresis applies to fp16");
    fails_with("train --precision fp8", "must be one of fp32|bf16|fp16");
    fails_with("train --mem-limit lots", "expected a size such as 8G");
    fails_with("sample --checkpoint nowhere", "cannot open checkpoint nowhere/model.ckpt");
}

static void test_bad_config_files(void) {
    write_text("unknown.json", "{\"optimizer\": {\"params\": {\"lr\": 0.1, \"foo\": 1}}}");
    fails_with("train --config unknown.json", "unknown.json: unknown key 'optimizer.params.foo'");
    write_text("toplevel.json", "{\"zero_optimization\": {\"stage\": 2}}");
    fails_with("train --config toplevel.json", "unknown key 'zero_optimization'");
    write_text("both.json", "{\"bf16\": {\"enabled\": true}, \"fp16\": {\"enabled\": true}}");
    fails_with("train --config both.json", "cannot both be true");
    write_text("contra.json", "{\"precision\": \"fp32\", \"fp16\": {\"enabled\": true}}");
    fails_with("train --config contra.json", "precision 'fp32' contradicts fp16.enabled");
    write_text("fp16key.json", "{\"fp16\": {\"enabled\": false, \"loss_scale_window\": 10}}");
    fails_with("train --config fp16key.json", "fp16.loss_scale_window applies to fp16 training");
    write_text("type.json", "{\"train_micro_batch_size_per_gpu\": \"eight\"}");
    fails_with("train --config type.json", "train_micro_batch_size_per_gpu must be a number");
    write_text("range.json", "{\"gradient_accumulation_steps\": 0}");
    fails_with("train --config range.json", "out of range");
    write_text("syntax.json", "{\n  \"seed\": 1,\n  \"train_steps\": ,\n}");
    fails_with("train --config syntax.json", "syntax.json: invalid JSON at line 3");
    write_text("betas.json", "{\"optimizer\": {\"params\": {\"betas\": [0.9]}}}");
    fails_with("train --config betas.json", "array of two numbers");
    write_text("notobj.json", "[1, 2]");
    fails_with("train --config notobj.json", "top level must be a JSON object");
    write_text("nested.json", "{\"optimizer\": 3}");
    fails_with("train --config nested.json", "optimizer must be an object");
    fails_with("train --config missing.json", "cannot open config file missing.json");
}

static void test_bad_data(void) {
    fails_with("train --data none.txt", "cannot open data file none.txt");
    write_text("empty.txt", "");
    fails_with("train --data empty.txt --val-data ''", "data file empty.txt is empty");
    write_file("latin1.txt", "caf\xe9 au lait", 12);
    fails_with("train --data latin1.txt --val-data ''",
               "latin1.txt is not valid UTF-8: bad byte 0xe9 at offset 3");
    write_text("short.txt", "hi");
    fails_with("train --data short.txt --val-data '' --seq-len 16 --steps 1 --out ''",
               "shorter than one sequence");
}

static void test_config_then_flags(void) {
    char text[4096];
    size_t n = 0;
    for (int i = 0; i < 60; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, "line %d of a small text.\n", i);
    write_text("small.txt", text);
    write_text("run.json", "{\"train_micro_batch_size_per_gpu\": 2, \"seq_len\": 16,"
                           " \"train_steps\": 2, \"optimizer\": {\"type\": \"AdamW\","
                           " \"params\": {\"lr\": 0.5, \"betas\": [0.8, 0.9]}},"
                           " \"model\": {\"preset\": \"tiny\"}, \"data\": \"small.txt\","
                           " \"val_data\": \"small.txt\", \"out_dir\": \"\","
                           " \"sample_tokens\": 5, \"eval_iters\": 2}");
    int rc = fitlm("train --lr 0.25 --config run.json --threads 1");
    t_check(rc == 0, "a run from a config file succeeds (status %d): %.300s", rc, output);
    t_check(strstr(output, "adamw lr 0.25") != NULL, "the flag overrides the file's lr: %.300s",
            output);
    t_check(strstr(output, "batch 2 x 16 tokens") != NULL, "the file sets the batch");
    t_check(strstr(output, "step     2/2") != NULL, "two steps are logged, one line each");
    t_check(strstr(output, "final val loss") != NULL, "a validation loss is reported");

    rc = fitlm("train --config run.json --mem-limit 2.1M");
    t_check(rc == 1 && strstr(output, "more than the limit of 2.10 MiB") &&
                strstr(output, "Largest: optim") && strstr(output, "--batch 1"),
            "a plan over --mem-limit stops before allocating, with advice: %.600s", output);
    rc = fitlm("train --config run.json --fp16 --steps 3 --mem-report");
    t_check(rc == 0 && strstr(output, "| scale 65536") && strstr(output, "| skipped 0") &&
                strstr(output, "master") && strstr(output, "peak RSS"),
            "fp16 runs log the loss scale and skipped steps; --mem-report reports: %.600s", output);
    // The tagged allocations are all the engine's memory; what RSS adds on top
    // is code, libraries and the BLAS/oneDNN runtimes: ~30 MiB measured here.
    const char *over = strstr(output, "untracked overhead ");
    double mib = over ? atof(over + strlen("untracked overhead ")) : -1.0;
    printf("  peak RSS - tagged peak = %.2f MiB\n", mib);
    t_check(mib >= 0.0 && mib < 64.0, "untracked memory is small (%.2f MiB < 64)", mib);
}

// Keeps only what must repeat: each step's loss, lr and norm (not the timing).
static void losses_of(const char *text, char *out, size_t size) {
    size_t n = 0;
    for (const char *p = strstr(text, "| loss "); p; p = strstr(p + 1, "| loss ")) {
        const char *end = strstr(p, " ms");
        while (end && end > p && *end != '|') end--; // drop the timing field
        int len = end ? (int)(end - p) : 0;
        n += (size_t)snprintf(out + n, size - n, "%.*s\n", len, p);
        if (n >= size) break;
    }
}

static void test_same_seed_same_losses(void) {
    const char *run = "train --config run.json --steps 4 --eval-every 0 --sample-tokens 0 "
                      "--threads 2 --seed 7";
    static char first[8192], second[8192];
    int rc1 = fitlm(run);
    losses_of(output, first, sizeof first);
    int rc2 = fitlm(run);
    losses_of(output, second, sizeof second);
    t_check(rc1 == 0 && rc2 == 0 && strlen(first) > 40, "two seeded runs succeed: %s", first);
    t_check(strcmp(first, second) == 0, "same seed and threads, identical step logs:\n%s---\n%s",
            first, second);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_help_lists_every_option_with_default();
    test_bad_flags();
    test_bad_config_files();
    test_bad_data();
    test_config_then_flags();
    test_same_seed_same_losses();
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) return 1;
    return t_report();
}
