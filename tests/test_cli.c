// test_cli.c: the fitlm command as a user meets it: --help, config files,
// flags overriding them, and clear errors with a non-zero exit on bad input.
// Runs the built binary (FITLM_BINARY, set by CTest) in a scratch directory.
#include <dirent.h>
#include <math.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "fitlm/safetensors.h"
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
                              "[scheduler.params.warmup_num_steps]",
                              "--profile"};
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
    fails_with("train --optimizer sgd --betas 0.9,0.9", "betas applies to adamw, not sgd");
    fails_with("train --n-embd 30 --n-head 4", "divisible");
    fails_with("train --seq-len 4096", "exceeds model.max_seq_len");
    fails_with("train --batch 4 --train-batch-size 10", "not a multiple");
    fails_with("train --batch 4 --grad-accum 3 --train-batch-size 8", "train_batch_size 8");
    fails_with("sample --tokens -3", "--tokens");
    fails_with("train --precision bf16 --hysteresis 3", "fp16.hysteresis applies to fp16");
    fails_with("train --precision fp8", "must be one of fp32|bf16|fp16");
    fails_with("train --mem-limit lots", "expected a size such as 8G");
    fails_with("sample --checkpoint nowhere", "nowhere");
    // architectures and presets
    fails_with("train --arch mamba", "model.arch must be gpt2 or llama, got 'mamba'");
    fails_with("train --model gpt2 --arch llama", "model.arch llama contradicts model.preset gpt2");
    fails_with("train --model llama-tiny --n-kv-head 3",
               "must be positive and divide model.n_head");
    fails_with("train --n-kv-head 2", "GPT-2 has no grouped-query attention");
    fails_with("train --rope-theta 500000", "GPT-2 has no rotary embeddings");
    write_text("untied.json", "{\"model\": {\"tie_word_embeddings\": false}}");
    fails_with("train --config untied.json", "GPT-2's LM head is always tied");
    fails_with("train --arch llama --n-embd 96 --n-head 32", "head size");
    fails_with("train --activation-checkpointing all", "must be one of none|selective|block");
    fails_with("train --optimizer lomo --eps2 0.01", "eps2 applies to adalomo, not lomo");
    fails_with("train --optimizer adalomo --clip-grad-value 1", "applies to lomo, not adalomo");
    fails_with("train --optimizer adamw --clip-threshold 2", "applies to adalomo, not adamw");
    fails_with("train --optimizer lomo --stochastic-rounding", "applies to bf16 and fp16 weights");
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
    // DeepSpeed's activation_checkpointing keys: honoured or refused, never ignored
    const struct {
        const char *json, *says;
    } ac[] = {
        {"{\"activation_checkpointing\": {\"partition_activations\": true}}",
         "partition_activations partitions checkpoints across tensor-parallel ranks"},
        {"{\"activation_checkpointing\": {\"cpu_checkpointing\": true}}",
         "cpu_checkpointing offloads partitioned checkpoints"},
        {"{\"activation_checkpointing\": {\"contiguous_memory_optimization\": true}}",
         "contiguous_memory_optimization and number_checkpoints apply to partitioned"},
        {"{\"activation_checkpointing\": {\"number_checkpoints\": 4}}",
         "contiguous_memory_optimization and number_checkpoints apply to partitioned"},
        {"{\"activation_checkpointing\": {\"synchronize_checkpoint_boundary\": true}}",
         "synchronize_checkpoint_boundary synchronises a GPU stream"},
        {"{\"activation_checkpointing\": {\"profile\": true}}", "use --profile"},
        {"{\"activation_checkpointing\": {\"policy\": \"layers\"}}",
         "must be one of none|selective|block"},
    };
    for (size_t i = 0; i < sizeof ac / sizeof ac[0]; i++) {
        write_text("ac.json", ac[i].json);
        fails_with("train --config ac.json", ac[i].says);
    }
    // the DeepSpeed keys at their defaults are accepted with a policy
    write_text("ac.json", "{\"activation_checkpointing\": {\"policy\": \"block\", "
                          "\"partition_activations\": false, \"cpu_checkpointing\": false, "
                          "\"contiguous_memory_optimization\": false, "
                          "\"synchronize_checkpoint_boundary\": false, \"profile\": false}}");
    int rc = fitlm("plan --config ac.json --model tiny --tokenizer byte --batch 2 --seq-len 16");
    t_check(rc == 0 && strstr(output, "activation checkpointing block"),
            "DeepSpeed's activation_checkpointing block with a policy: %.300s", output);
}

static void test_bad_data(void) {
    fails_with("train --data none", "no train token shards at none");
    fails_with("tokenize missing.txt -o x --tokenizer byte", "cannot open data file missing.txt");
    fails_with("tokenize --tokenizer byte", "no input files");
    write_text("empty.txt", "");
    fails_with("tokenize empty.txt -o x --tokenizer byte", "data file empty.txt is empty");
    write_file("latin1.txt", "caf\xe9 au lait", 12);
    fails_with("tokenize latin1.txt -o x --tokenizer byte",
               "latin1.txt is not valid UTF-8: bad byte 0xe9 at offset 3");
    write_text("short.txt", "hi\n\nthere\n");
    t_check(fitlm("tokenize short.txt -o short --tokenizer byte --val-fraction 0") == 0,
            "a short text tokenizes: %.300s", output);
    fails_with("train --data short --tokenizer byte --seq-len 16 --steps 1 --out ''",
               "too few for 1 rank");
    fails_with("train --data short --seq-len 2 --steps 1 --out ''",
               "was tokenized with 'byte', but the tokenizer is 'gpt2'");
    write_text("notashard.bin",
               "this is not a token shard, though it is long enough to have a header of 64 bytes");
    fails_with("train --data notashard.bin --tokenizer byte",
               "notashard.bin is not a fitlm token shard");
}

static void test_config_then_flags(void) {
    char text[8192];
    size_t n = 0;
    for (int i = 0; i < 120; i++) // documents of three lines, blank lines between
        n += (size_t)snprintf(text + n, sizeof text - n, "%sline %d of a small text.\n",
                              i % 3 == 0 && i ? "\n" : "", i);
    write_text("small.txt", text);
    int rc = fitlm("tokenize small.txt -o small --tokenizer byte --val-fraction 0.2");
    t_check(rc == 0 && strstr(output, "train: 32 documents") && strstr(output, "val: 8 documents"),
            "tokenize splits 40 documents 32/8: %.400s", output);
    write_text("run.json", "{\"train_micro_batch_size_per_gpu\": 2, \"seq_len\": 16,"
                           " \"train_steps\": 2, \"optimizer\": {\"type\": \"AdamW\","
                           " \"params\": {\"lr\": 0.5, \"betas\": [0.8, 0.9]}},"
                           " \"model\": {\"preset\": \"tiny\"}, \"data\": \"small\","
                           " \"tokenizer\": \"byte\", \"out_dir\": \"\","
                           " \"sample_tokens\": 5, \"eval_iters\": 2}");
    rc = fitlm("train --lr 0.25 --config run.json --threads 1");
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
    rc = fitlm("train --config run.json --steps 3 --profile");
    const char *rows[] = {"per-op profile: 2 steps",
                          "| matmul lm head ",
                          "| attention ",
                          "| layernorm ",
                          "| optimizer ",
                          "| data loader ",
                          "| other ",
                          "| total "};
    int all = rc == 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) all &= strstr(output, rows[i]) != 0;
    t_check(all, "--profile prints the per-op table of the steps after the first: %.600s", output);
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

// Every tensor of the two directories' newest checkpoints, bit for bit.
static int fl_ckpts_equal(const char *a, const char *b) {
    fl_model ma, mb;
    char tok[32];
    fl_ckpt_load_model(a, &ma, FL_F32, tok, sizeof tok);
    fl_ckpt_load_model(b, &mb, FL_F32, tok, sizeof tok);
    size_t n = ma.table.numel;
    int same = n == mb.table.numel && !memcmp(ma.params, mb.params, n * sizeof(float));
    fl_ckpt *x = fl_ckpt_open(a), *y = fl_ckpt_open(b);
    // every optimizer's state tensors, row by row, where the checkpoints hold them
    const char *state[] = {"m", "v", "momentum", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"};
    for (int i = 0; i < 6 && same; i++) {
        for (int r = 0; r < ma.table.count && same; r++) {
            char name[128];
            snprintf(name, sizeof name, "optim/%s/%s", state[i], ma.table.views[r].name);
            size_t k = fl_ckpt_numel(x, name);
            same &= k == fl_ckpt_numel(y, name);
            if (!k || !same) continue;
            float *bx = malloc(k * sizeof(float)), *by = malloc(k * sizeof(float));
            fl_ckpt_read(x, name, FL_F32, bx, k);
            fl_ckpt_read(y, name, FL_F32, by, k);
            same &= !memcmp(bx, by, k * sizeof(float));
            free(bx);
            free(by);
        }
    }
    same &= fl_ckpt_step(x) == fl_ckpt_step(y);
    fl_ckpt_close(x);
    fl_ckpt_close(y);
    fl_model_free(&ma);
    fl_model_free(&mb);
    return same;
}

static void read_file(const char *name, char *out, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(out, 1, size - 1, f) : 0;
    out[n] = 0;
    if (f) fclose(f);
}

// The newest checkpoints of two run directories hold the same tensors, bit
// for bit: their tensor tables (names, dtypes, sizes, offsets, CRC-32s) and
// data, the header from "tensors" to the end of the file. Whatever the sets
// (the model, LoRA adapters, a LoRA + LOMO base, every optimizer's state).
static int ckpt_tensors_equal(const char *a, const char *b) {
    unsigned char *file[2];
    const char *from[2];
    size_t n[2];
    const char *dirs[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        fl_ckpt *ck = fl_ckpt_open(dirs[i]); // dies (failing the test) if damaged
        file[i] = t_read_file(fl_ckpt_path(ck), &n[i]);
        fl_ckpt_close(ck);
        from[i] = file[i] ? strstr((const char *)file[i] + 28, "\"tensors\":[") : NULL;
    }
    int same =
        from[0] && from[1] &&
        n[0] - (size_t)(from[0] - (char *)file[0]) == n[1] - (size_t)(from[1] - (char *)file[1]) &&
        !memcmp(from[0], from[1], n[0] - (size_t)(from[0] - (char *)file[0]));
    free(file[0]);
    free(file[1]);
    return same;
}

// Lines of a step log from step `from` on.
static const char *log_from(const char *log, int from) {
    char key[32];
    snprintf(key, sizeof key, "step %d ", from);
    const char *p = strstr(log, key);
    return p ? p : "";
}

// N steps, save, resume, M more steps == N+M uninterrupted steps, bit for bit:
// the logged losses and every tensor of the final checkpoint.
// N steps, save, resume, M steps = N+M steps, bit for bit; `name` prefixes
// the run directories, `extra` selects the model and strategies.
static void resume_is_bitwise(const char *name, const char *extra) {
    char common[512], cmd[1024];
    snprintf(common, sizeof common,
             "train --config %s --steps 6 --eval-every 0 --sample-tokens 0 --threads 2 "
             "--seed 11 --lr 0.01 %s",
             strstr(extra, "lomo") ? "fused.json" : "run.json", extra);
    snprintf(cmd, sizeof cmd, "%s --out %swhole", common, name);
    int rc1 = fitlm(cmd);
    snprintf(cmd, sizeof cmd, "%s --out %sparts --save-every 3 --keep-checkpoints 0", common, name);
    int rc2 = fitlm(cmd);
    snprintf(cmd, sizeof cmd,
             "train --resume %sparts/ckpt_00000003.fitlm --out %sresumed --threads 2", name, name);
    int rc3 = fitlm(cmd);
    t_check(rc1 == 0 && rc2 == 0 && rc3 == 0 && strstr(output, "resumed from step 3"),
            "%s: train, train with saves, resume (status %d %d %d): %.400s", extra, rc1, rc2, rc3,
            output);
    static char whole[8192], resumed[8192];
    snprintf(cmd, sizeof cmd, "%swhole/log.txt", name);
    read_file(cmd, whole, sizeof whole);
    snprintf(cmd, sizeof cmd, "%sresumed/log.txt", name);
    read_file(cmd, resumed, sizeof resumed);
    t_check(*log_from(whole, 4) && !strcmp(log_from(whole, 4), resumed),
            "%s: steps 4-6 after a resume log the same losses, bit for bit:\n%s---\n%s", extra,
            log_from(whole, 4), resumed);
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/%swhole", dir, name);
    snprintf(b, sizeof b, "%s/%sresumed", dir, name);
    // a LoRA checkpoint holds no whole model for fl_ckpts_equal to load
    int lora = strstr(extra, "--lora") != NULL;
    t_check(ckpt_tensors_equal(a, b) && (lora || fl_ckpts_equal(a, b)),
            "%s: the final weights and optimizer state are bit for bit the same", extra);
}

static void test_resume_is_bitwise(void) {
    resume_is_bitwise("", "");
    resume_is_bitwise("llama_",
                      "--model llama-tiny --grad-accum 2 --activation-checkpointing block");
    // fused optimizers on 16-bit weights: stochastic rounding seeded per step
    write_text("fused.json", "{\"train_micro_batch_size_per_gpu\": 2, \"seq_len\": 16,"
                             " \"model\": {\"preset\": \"tiny\"}, \"data\": \"small\","
                             " \"tokenizer\": \"byte\", \"eval_iters\": 2}");
    resume_is_bitwise("lomo_", "--model llama-tiny --optimizer lomo --precision bf16");
    resume_is_bitwise("adalomo_", "--optimizer adalomo --precision bf16 --activation-checkpointing "
                                  "selective");
    fails_with("train --resume parts/ckpt_00000003.fitlm --out r2 --n-layer 3",
               "model.n_layer 3 contradicts parts/ckpt_00000003.fitlm");
    fails_with("train --resume parts/ckpt_00000003.fitlm --out r2 --precision bf16",
               "was trained in fp32; this run is bf16");
    fails_with("train --resume llama_parts/ckpt_00000003.fitlm --out r2 --arch gpt2",
               "model.arch gpt2 contradicts llama_parts/ckpt_00000003.fitlm, a llama model");
    fails_with("train --resume nothing-here", "cannot open checkpoint nothing-here");
    write_text("resume.json", "{\"resume\": \"parts\"}");
    fails_with("train --config resume.json", "resume is a command-line option");
}

static void test_export_and_pretrained(void) {
    int rc = fitlm("export whole -o hf");
    t_check(rc == 0 && strstr(output, "exported"), "export to safetensors: %.300s", output);
    char ck[600], hf[600];
    snprintf(ck, sizeof ck, "%s/whole", dir);
    snprintf(hf, sizeof hf, "%s/hf", dir);
    fl_model a, b;
    char tok[32];
    fl_ckpt_load_model(ck, &a, FL_F32, tok, sizeof tok);
    fl_pretrained_load(hf, &b, FL_F32);
    t_check(a.table.numel == b.table.numel &&
                !memcmp(a.params, b.params, a.table.numel * sizeof(float)),
            "checkpoint -> safetensors -> model is bit-exact");
    fl_model_free(&a);
    fl_model_free(&b);
    rc = fitlm("sample --checkpoint hf --tokenizer byte --tokens 8 --prompt 'line '");
    t_check(rc == 0 && strstr(output, "line "), "sample from the exported directory: %.200s",
            output);
    rc = fitlm("sample --checkpoint whole --tokens 8");
    t_check(rc == 0, "sample from a checkpoint (its own tokenizer): %.200s", output);
    rc =
        fitlm("train --init-from hf --data small --tokenizer byte --steps 2 --batch 2 --seq-len 16 "
              "--out '' --sample-tokens 0");
    t_check(rc == 0 && strstr(output, "n_layer 2, n_head 4 (kv 4), n_embd 64, mlp 256, vocab 257"),
            "train --init-from a Hugging Face directory takes its shape: %.400s", output);
    fails_with("train --init-from hf --data small --tokenizer byte --n-embd 32",
               "model.n_embd 32 contradicts hf, whose model has 64");
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "sample --checkpoint hf --tokens 3 --tokenizer-path %s",
             t_source_path("data/gpt2"));
    fails_with(cmd, "tokenizer's vocabulary (50257) is not the model's (257)");
    // LLaMA, from the resume test's run: export, load, sample, continue from it
    rc = fitlm("export llama_whole -o llama_hf --dtype bf16");
    t_check(rc == 0 && strstr(output, "exported"), "export a LLaMA checkpoint: %.300s", output);
    snprintf(ck, sizeof ck, "%s/llama_whole", dir);
    snprintf(hf, sizeof hf, "%s/llama_hf", dir);
    fl_ckpt_load_model(ck, &a, FL_BF16, tok, sizeof tok);
    fl_pretrained_load(hf, &b, FL_BF16);
    t_check(a.config.arch == FL_ARCH_LLAMA && b.config.arch == FL_ARCH_LLAMA &&
                a.table.numel == b.table.numel &&
                !memcmp(a.params, b.params, a.table.numel * sizeof(uint16_t)),
            "LLaMA checkpoint -> bf16 safetensors -> model: the rounded weights");
    fl_model_free(&a);
    fl_model_free(&b);
    rc = fitlm("sample --checkpoint llama_hf --tokenizer byte --tokens 8 --prompt 'the '");
    t_check(rc == 0 && strstr(output, "the "), "sample from the LLaMA directory: %.200s", output);
    rc = fitlm("train --init-from llama_hf --data small --tokenizer byte --steps 2 --batch 2 "
               "--seq-len 16 --out '' --sample-tokens 0 --precision bf16");
    t_check(rc == 0 && strstr(output, "(llama): n_layer 2, n_head 4 (kv 2), n_embd 64, mlp 176"),
            "train --init-from a LLaMA directory takes its shape: %.400s", output);
    fails_with("export whole --format onnx", "--format onnx is not supported");
    fails_with("export nowhere", "nowhere is not a fitlm checkpoint");
}

// ----------------------------------------------------------------------------
// LoRA, QLoRA and LoRA + LOMO (the data and configs of the tests above)

// A LLaMA base as a Hugging Face directory, for QLoRA (NF4 rows are
// quantised as they load from safetensors) and --init-from.
static void make_lora_base(void) {
    int rc = fitlm("train --model llama-tiny --data small --tokenizer byte --batch 2 --seq-len 16 "
                   "--steps 1 --eval-every 0 --sample-tokens 0 --threads 2 --out lora_base");
    int rc2 = fitlm("export lora_base -o lora_base_hf");
    t_check(rc == 0 && rc2 == 0, "a LLaMA base for the LoRA tests (status %d %d): %.300s", rc, rc2,
            output);
}

static void test_lora_resume_is_bitwise(void) {
    // a frozen base from the seed: the checkpoint holds the adapters and AdamW's state
    resume_is_bitwise("lora_", "--model llama-tiny --lora --lora-dropout 0.1 --precision bf16");
    // the base trained by LOMO in the same backward: saved too, with its own optimizer
    resume_is_bitwise("loralomo_", "--model llama-tiny --lora --lora-base-optimizer lomo "
                                   "--lora-base-lr 0.001 --precision bf16");
    // NF4 base from init_from, quantised again on resume: the same codes
    resume_is_bitwise("qlora_", "--init-from lora_base_hf --lora --lora-target-modules all-linear "
                                "--quantize nf4 --double-quant --precision bf16");
    // the resumed QLoRA run reports its quantisation error (blocks of 64):
    // mean |w - dequant(w)| > 0 and, for 4 bits, well below the weights' RMS
    const char *nf4 = strstr(output, "NF4 base (block 64");
    const char *err = nf4 ? strstr(nf4, "error mean ") : NULL;
    double mean = -1, most = -1, pct = -1;
    int got = err ? sscanf(err, "error mean %lf, max %lf (%lf%%", &mean, &most, &pct) : 0;
    t_check(got == 3 && mean > 0 && most >= mean && pct > 0 && pct < 10,
            "QLoRA prints its NF4 error: mean %g > 0, %g%% of the RMS (< 10%%): %.300s", mean, pct,
            nf4 ? nf4 : output);
    fails_with("train --resume lora_parts/ckpt_00000003.fitlm --out r2 --lora-r 16",
               "holds adapters of rank 8; this run's lora.r is 16");
    fails_with("train --resume parts/ckpt_00000003.fitlm --out r2 --lora",
               "has no LoRA adapters; this run trains adapters");
}

// out/adapter is PEFT's pair of files, and --adapter continues from it: its
// first validation loss is the writer's last, bit for bit (same base, data,
// batch and eval_iters; fp32, so the saved adapters are the trained values).
static void test_lora_adapter(void) {
    const char *run = "train --init-from lora_base_hf --data small --tokenizer byte --batch 2 "
                      "--seq-len 16 --eval-iters 2 --sample-tokens 0 --threads 2";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --steps 4 --eval-every 0 --lr 0.01 --lora --lora-r 4 --out ad",
             run);
    int rc = fitlm(cmd);
    t_check(rc == 0 && strstr(output, "LoRA adapter written to ad/adapter (PEFT format)"),
            "a LoRA run writes its adapter (status %d): %.400s", rc, output);
    static char text[8192], log[8192];
    // read back as PEFT's config (the layout of the JSON text is the writer's)
    read_file("ad/adapter/adapter_config.json", text, sizeof text);
    char path[600];
    snprintf(path, sizeof path, "%s/ad/adapter", dir);
    fl_lora_config lc;
    fl_peft_read_config(path, &lc); // dies (failing the test) on a config PEFT would not write
    t_check(lc.r == 4 && lc.alpha == 8 && !strcmp(lc.target_modules, "q_proj,v_proj") &&
                strstr(text, "lora_base_hf"),
            "adapter_config.json: r 4, lora_alpha 8, the default targets, the base: %.600s", text);
    size_t n_weights;
    snprintf(path, sizeof path, "%s/ad/adapter/adapter_model.safetensors", dir);
    unsigned char *weights = t_read_file(path, &n_weights);
    t_check(weights && n_weights > 1792 * 4 &&
                strstr((char *)weights + 8,
                       "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
            "adapter_model.safetensors holds the adapters under PEFT's names (%zu bytes)",
            n_weights);
    read_file("ad/log.txt", log, sizeof log);
    const char *last = strstr(log, "step 4 val ");
    snprintf(cmd, sizeof cmd, "%s --adapter ad/adapter --steps 0 --out ad2", run);
    rc = fitlm(cmd);
    read_file("ad2/log.txt", text, sizeof text);
    t_check(rc == 0 && last && !strcmp(text + strlen("step 0"), last + strlen("step 4")),
            "--adapter starts from the adapter: first val loss %s= the writer's last %s", text,
            last ? last : "(none)");
    // and writes it back unchanged: the same bytes
    size_t n_again;
    snprintf(path, sizeof path, "%s/ad2/adapter/adapter_model.safetensors", dir);
    unsigned char *again = t_read_file(path, &n_again);
    t_check(weights && again && n_again == n_weights && !memcmp(again, weights, n_weights),
            "an adapter loaded and saved again is byte for byte the same");
    free(weights);
    free(again);
    // the adapter changes the model: fresh adapters (B = 0) give the base's loss
    snprintf(cmd, sizeof cmd, "%s --lora --lora-r 4 --steps 0 --out ad3", run);
    rc = fitlm(cmd);
    read_file("ad3/log.txt", log, sizeof log);
    t_check(rc == 0 && strncmp(log, "step 0 val ", 11) == 0 && strcmp(log, text) != 0,
            "without the adapter the loss differs: %s vs %s", log, text);
    // an adapter of rank 8 (PEFT's minimal config) against --lora-r 16
    char r8[600];
    snprintf(r8, sizeof r8, "%s/r8", dir);
    t_check(mkdir(r8, 0755) == 0, "mkdir %s", r8);
    write_text("r8/adapter_config.json",
               "{\"peft_type\": \"LORA\", \"task_type\": \"CAUSAL_LM\", \"r\": 8, "
               "\"lora_alpha\": 16, \"target_modules\": [\"q_proj\", \"v_proj\"]}");
    snprintf(cmd, sizeof cmd, "%s --adapter r8 --lora-r 16 --steps 1 --out ''", run);
    fails_with(cmd, "lora.r contradicts the adapter r8 (its adapter_config.json)");
}

// Options that would do nothing, or that the engine cannot honour, are
// errors naming the option, before anything trains.
static void test_lora_errors(void) {
    const char *data = "--data small --tokenizer byte --batch 2 --seq-len 16 --steps 1 --out '' "
                       "--sample-tokens 0 --threads 1";
    const struct {
        const char *args, *says;
    } cases[] = {
        {"--quantize nf4", "QLoRA trains LoRA adapters on them (add --lora)"},
        {"--lora-r 4", "lora.r applies to LoRA training; set lora.enabled (--lora)"},
        {"--lora --quantize fp4", "bnb_4bit_quant_type fp4 is not supported: use nf4"},
        {"--lora --lora-bias all", "lora.bias all is not supported: biases stay frozen"},
        {"--model tiny --lora --lora-target-modules q_proj",
         "'q_proj' matches no module of this GPT-2 model (its linear layers: c_attn"},
        {"--model llama-tiny --lora --lora-target-modules input_layernorm",
         "'input_layernorm' matches model.layers.0.input_layernorm, which is not a linear layer"},
        {"--init-from lora_base --lora --quantize nf4",
         "lora_base: NF4 quantisation (--quantize nf4) loads a Hugging Face model directory"},
        {"--model llama-tiny --lora --lora-base-optimizer lomo --grad-accum 2",
         "cannot accumulate gradients (gradient_accumulation_steps is 2)"},
        {"--model llama-tiny --lora --lora-base-optimizer lomo --precision fp16",
         "lora.base_optimizer with fp16 is not supported"},
        {"--init-from lora_base_hf --lora --lora-base-optimizer lomo --quantize nf4",
         "NF4 weights cannot be trained"},
        {"--model llama-tiny --lora --lora-base-lr 0.1",
         "lora.base_lr applies to a trained base; set lora.base_optimizer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "train %s %s", data, cases[i].args);
        fails_with(cmd, cases[i].says);
    }
}

// SIGKILL at random moments of a run that saves every step: the newest
// complete checkpoint always loads, and the run resumes from it.
// This CPU as tests/fixtures/prerefactor/cpu.txt names CPUs: the model name
// and the features whose kernels change float results.
static void cpu_class(char *out, size_t size) {
    char line[8192], model[256] = "", flags[8192] = "";
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f) && !(*model && *flags)) {
        if (!*model && sscanf(line, "model name : %255[^\n]", model) == 1) continue;
        if (!strncmp(line, "flags", 5)) snprintf(flags, sizeof flags, "%s ", strchr(line, ':'));
    }
    if (f) fclose(f);
    size_t n = (size_t)snprintf(out, size, "%s", model);
    const char *features[] = {"avx512f", "avx512_bf16", "amx_bf16"};
    for (int i = 0; i < 3; i++) {
        char word[32];
        snprintf(word, sizeof word, " %s ", features[i]);
        if (strstr(flags, word) && n < size)
            n += (size_t)snprintf(out + n, size - n, " %s", features[i]);
    }
}

// GPT-2 runs recorded before the model driver replaced the GPT-2-only code
// (tests/fixtures/prerefactor/README.md): every logged loss, lr, gradient
// norm and validation loss must come out the same. Bitwise in the release
// build on the CPU class they were recorded on; elsewhere to a tolerance.
static void test_matches_prerefactor_recording(void) {
    char here[512], recorded[512] = "";
    cpu_class(here, sizeof here);
    size_t n;
    char *cpu = (char *)t_read_file(t_source_path("tests/fixtures/prerefactor/cpu.txt"), &n);
    sscanf(cpu, "%511[^\n]", recorded);
    free(cpu);
    // bitwise only for the release build on the CPU class recorded: another
    // CPU runs other kernels, and the sanitizer build is compiled otherwise
#ifdef __SANITIZE_ADDRESS__
    int same_cpu = 0;
    snprintf(here + strlen(here), sizeof here - strlen(here), " (sanitizer build)");
#else
    int same_cpu = !strcmp(here, recorded);
#endif
    const char *precisions[] = {"fp32", "bf16", "fp16"};
    for (int p = 0; p < 3; p++) {
        char args[1024], want_path[256], got_path[512];
        snprintf(args, sizeof args,
                 "train --model tiny --tokenizer byte --data %s --batch 4 --seq-len 32 --steps 8 "
                 "--warmup 2 --threads 2 --eval-every 4 --eval-iters 2 --sample-tokens 0 "
                 "--precision %s --out pre_%s",
                 t_source_path("data/brown_byte"), precisions[p], precisions[p]);
        int rc = fitlm(args);
        snprintf(want_path, sizeof want_path, "tests/fixtures/prerefactor/gpt2_tiny_%s.log",
                 precisions[p]);
        snprintf(got_path, sizeof got_path, "%s/pre_%s/log.txt", dir, precisions[p]);
        size_t nw, ng;
        char *want = (char *)t_read_file(t_source_path(want_path), &nw);
        char *got = rc == 0 ? (char *)t_read_file(got_path, &ng) : NULL;
        if (same_cpu) {
            t_check(got && ng == nw && !memcmp(got, want, nw),
                    "%s: the log is bitwise the pre-refactor recording (%s)", precisions[p], here);
        } else {
            // the same lines, each number within tol relative
            double tol = p == 0 ? 1e-4 : 3e-3, worst = 0;
            int lines = 0, ok = got != NULL;
            for (char *a = want, *b = got; ok && a < want + nw; lines++) {
                char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
                ok = ea && eb && strncmp(a, b, 8) == 0;
                for (char *x = a, *y = b; ok && x < ea;) {
                    char *xe, *ye;
                    double u = strtod(x, &xe), v = strtod(y, &ye);
                    if (xe == x) { // a word: skip it in both
                        x += strcspn(x, " \n") + (x[strcspn(x, " \n")] == ' ');
                        y += strcspn(y, " \n") + (y[strcspn(y, " \n")] == ' ');
                        continue;
                    }
                    double rel = fabs(u - v) / (fabs(u) > 1e-30 ? fabs(u) : 1);
                    if (rel > worst) worst = rel;
                    x = xe + (*xe == ' ');
                    y = ye + (*ye == ' ');
                }
                a = ea + 1;
                b = eb + 1;
            }
            t_check(ok && worst <= tol,
                    "%s: recorded on '%s', this CPU is '%s': not bitwise comparable; %d lines "
                    "within %g relative (worst %.2g)",
                    precisions[p], recorded, here, lines, tol, worst);
        }
        free(want);
        free(got);
    }
}

static void test_kill_while_saving(void) {
    const char *bin = getenv("FITLM_BINARY");
    char out[600];
    snprintf(out, sizeof out, "%s/killed", dir);
    srand(12345);
    int loads = 0, tmp_seen = 0, kills = 30, last_step = 0, monotonic = 1;
    for (int i = 0; i < kills; i++) {
        char latest[700];
        snprintf(latest, sizeof latest, "%s/latest", out);
        int resume = access(latest, F_OK) == 0;
        pid_t pid = fork();
        if (pid == 0) {
            if (chdir(dir) != 0) _exit(2);
            int null = open("/dev/null", O_WRONLY);
            dup2(null, 1);
            dup2(null, 2);
            if (resume)
                execl(bin, bin, "train", "--resume", "killed", "--threads", "1", (char *)NULL);
            else
                execl(bin, bin, "train", "--config", "run.json", "--steps", "1000000",
                      "--save-every", "1", "--out", "killed", "--eval-every", "0",
                      "--sample-tokens", "0", "--threads", "1", "--lr", "0.001", (char *)NULL);
            _exit(3);
        }
        struct timespec ts = {0, (long)(50 + rand() % 400) * 1000000L};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        DIR *d = opendir(out);
        for (struct dirent *e; d && (e = readdir(d));)
            tmp_seen += strstr(e->d_name, ".tmp") != NULL;
        if (d) closedir(d);
        if (access(latest, F_OK) != 0) continue;
        fl_ckpt *ck = fl_ckpt_open(out); // dies (failing the test) if damaged
        int step = fl_ckpt_step(ck);
        fl_ckpt_close(ck);
        char tok[32];
        fl_model m;
        fl_ckpt_load_model(out, &m, FL_F32, tok, sizeof tok); // reads and checks every CRC
        fl_model_free(&m);
        monotonic &= step >= last_step;
        last_step = step;
        loads++;
    }
    printf("  %d kills: the latest checkpoint loaded %d times (last at step %d); a killed "
           "writer's temporary file was found %d times\n",
           kills, loads, last_step, tmp_seen);
    t_check(loads >= kills - 3 && last_step > 10,
            "the newest complete checkpoint loads after every kill (%d of %d)", loads, kills);
    t_check(monotonic, "resumed runs continue from the newest checkpoint, never going back");
    t_check(tmp_seen > 0, "some kills landed while a checkpoint was being written (%d)", tmp_seen);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_help_lists_every_option_with_default();
    test_bad_flags();
    test_bad_config_files();
    test_bad_data();
    test_config_then_flags();
    test_same_seed_same_losses();
    test_resume_is_bitwise();
    test_export_and_pretrained();
    make_lora_base();
    test_lora_resume_is_bitwise();
    test_lora_adapter();
    test_lora_errors();
    test_matches_prerefactor_recording();
    test_kill_while_saving();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
