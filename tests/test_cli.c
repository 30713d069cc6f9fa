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
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cjson/cJSON.h>

#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/safetensors.h"
#include "fitlm/train.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_cli_XXXXXX";
static const fl_tokenizer_files byte_tok = {.name = "byte"}; // no files
static char output[65536];

// Runs `fitlm ARGS` in dir with stdout and stderr captured; the exit status.
// A training run is given its peak (a later --peak-tflops overrides it):
// measuring the host's, 0.05 s a run over some 80 runs here, is
// test_metrics' subject.
static int fitlm(const char *args) {
    static char with_peak[8400];
    if (!strncmp(args, "train ", 6) && !strpbrk(args, "|;<>&") && !strstr(args, "--help")) {
        snprintf(with_peak, sizeof with_peak, "%s --peak-tflops 1", args);
        args = with_peak;
    }
    return t_fitlm(dir, args, 1, output, sizeof output);
}

// `fitlm` with printf-style arguments.
static char fitlmf_cmd[8192];
#define fitlmf(...) (snprintf(fitlmf_cmd, sizeof fitlmf_cmd, __VA_ARGS__), fitlm(fitlmf_cmd))

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
    t_fitlm_fails(dir, args, what, output, sizeof output);
}

// A config file's text and what refusing it says.
typedef struct {
    const char *json, *says;
} refused_config;

// Each of n configs written to refused.json and refused by `train --config
// refused.json FLAGS`, saying what it says.
static void refuses_configs(const refused_config *c, size_t n, const char *flags) {
    char args[256];
    snprintf(args, sizeof args, "train --config refused.json %s", flags);
    for (size_t i = 0; i < n; i++) {
        write_text("refused.json", c[i].json);
        fails_with(args, c[i].says);
    }
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
    fails_with("train --optimizer adan", "must be one of adamw|adam|sgd");
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
    // DeepSpeed's schedules: their own parameters, never another's
    fails_with("train --scheduler OneCycle",
               "must be one of constant|cosine|linear|WarmupLR|WarmupDecayLR|WarmupCosineLR");
    fails_with("train --scheduler warmuplr --min-lr-ratio 0.2",
               "scheduler.params.min_lr_ratio applies to scheduler.type constant cosine linear, "
               "not WarmupLR");
    fails_with(
        "train --cos-min-ratio 0.1",
        "scheduler.params.cos_min_ratio applies to scheduler.type WarmupCosineLR, not cosine");
    fails_with(
        "train --scheduler WarmupLR --total-num-steps 10",
        "total_num_steps applies to scheduler.type WarmupDecayLR WarmupCosineLR, not WarmupLR");
    fails_with(
        "train --scheduler WarmupCosineLR --warmup-max-lr 0.01",
        "warmup_max_lr applies to scheduler.type WarmupLR WarmupDecayLR, not WarmupCosineLR");
    fails_with("train --scheduler WarmupLR --warmup 0", "take a positive number of warmup steps");
    fails_with("train --scheduler WarmupLR --lr 1e-4 --warmup-max-lr 1e-3",
               "optimizer.params.lr 0.0001 and the scheduler WarmupLR's warmup_max_lr 0.001: "
               "DeepSpeed would train at the scheduler's");
    fails_with("train --scheduler WarmupDecayLR --lr 1e-4",
               "warmup_max_lr 0.001 (its default): DeepSpeed would train at the scheduler's");
}

static void test_bad_config_files(void) {
    write_text("unknown.json", "{\"optimizer\": {\"params\": {\"lr\": 0.1, \"foo\": 1}}}");
    fails_with("train --config unknown.json", "unknown.json: unknown key 'optimizer.params.foo'");
    write_text("zerokey.json", "{\"zero_optimization\": {\"stage\": 2, \"frobnicate\": 1}}");
    fails_with("train --config zerokey.json", "unknown key 'zero_optimization.frobnicate' (see");
    // at the top level DeepSpeed passes over what it does not know (LLaMA-
    // Factory's configs carry "comms_config"): the message says it may go;
    // a "_comment" string is a comment (JSON has none)
    write_text("topkey.json", "{\"_comment\": \"a note\", \"comms_config\": {\"verbose\": "
                              "false}}");
    fails_with(
        "train --config topkey.json",
        "unknown key 'comms_config'; DeepSpeed passes over a top-level key it does not know");
    write_text("comment.json", "{\"_comment\": \"a note\", \"zero_optimization\": {\"stage\": 1, "
                               "\"_comment\": \"not here\"}}");
    fails_with("train --config comment.json", "unknown key 'zero_optimization._comment' (see");
    write_text("both.json", "{\"bf16\": {\"enabled\": true}, \"fp16\": {\"enabled\": true}}");
    fails_with("train --config both.json", "cannot both be true");
    write_text("contra.json", "{\"precision\": \"fp32\", \"fp16\": {\"enabled\": true}}");
    fails_with("train --config contra.json", "precision 'fp32' contradicts fp16.enabled");
    write_text("fp16key.json", "{\"fp16\": {\"loss_scale_window\": 10}}");
    fails_with("train --config fp16key.json", "fp16.loss_scale_window applies to fp16 training");
    // DeepSpeed's engine settings: accepted at fitlm's way, refused otherwise
    write_text(
        "engine.json",
        "{\"zero_force_ds_cpu_optimizer\": false, \"dump_state\": false, "
        "\"prescale_gradients\": false, \"gradient_predivide_factor\": 1.0, "
        "\"sparse_gradients\": false, \"data_types\": {\"grad_accum_dtype\": \"fp32\"}, "
        "\"communication_data_type\": \"fp32\", \"fp16\": {\"auto_cast\": true}, "
        "\"bf16\": {\"immediate_grad_update\": true}, "
        "\"compile\": {\"disable\": false, \"backend\": \"inductor\", \"deepcompile\": false}, "
        "\"zero_optimization\": {\"stage\": 3, \"gather_16bit_weights_on_model_save\": "
        "true}}");
    int ok = fitlm("plan --config engine.json --model tiny --tokenizer byte --seq-len 16") == 0;
    t_check(ok, "DeepSpeed's engine settings at fitlm's way: %.300s", output);
    const refused_config engine[] = {
        {"{\"dump_state\": true}", "dump_state true: DeepSpeed's engine state"},
        {"{\"gradient_predivide_factor\": 2}",
         "gradient_predivide_factor 2: fitlm divides no gradient before its reduction"},
        {"{\"sparse_gradients\": true}", "sparse_gradients true: fitlm's embedding gradients"},
        {"{\"data_types\": {\"grad_accum_dtype\": \"bf16\"}}",
         "data_types.grad_accum_dtype bf16: fitlm sums the micro-batches' gradients in fp32"},
        {"{\"bf16\": {\"immediate_grad_update\": false}}",
         "bf16.immediate_grad_update false: fitlm adds each micro-batch's gradient"},
        {"{\"communication_data_type\": \"fp16\"}",
         "communication_data_type fp16: fitlm reduces gradients over ranks in fp32"},
        {"{\"compile\": {\"deepcompile\": true}}",
         "compile.deepcompile true: DeepCompile schedules ZeRO-3's fetches"},
        {"{\"zero_optimization\": {\"stage\": 3, \"gather_16bit_weights_on_model_save\": "
         "false, \"stage3_gather_16bit_weights_on_model_save\": true}}",
         "zero_optimization.stage3_gather_16bit_weights_on_model_save 1 contradicts "
         "zero_optimization.gather_16bit_weights_on_model_save 0 (two names of one setting"}};
    refuses_configs(engine, sizeof engine / sizeof engine[0], "");
    write_text("wallclock.json", "{\"wall_clock_breakdown\": false}");
    fails_with("train --config wallclock.json --profile",
               "profile true contradicts wall_clock_breakdown false");
    // DeepSpeed's feature blocks fitlm does not run: accepted switched off only
    write_text("tb.json", "{\"tensorboard\": {\"enabled\": true, \"output_path\": \"tb\"}}");
    fails_with("train --config tb.json",
               "tb.json: tensorboard enabled: DeepSpeed's TensorBoard monitor, which fitlm does "
               "not run (fitlm writes OUT/metrics.jsonl and OUT/log.txt");
    write_text("flops.json", "{\"flops_profiler\": {\"profile_step\": 2}}");
    fails_with("train --config flops.json",
               "flops_profiler without \"enabled\": false: DeepSpeed's FLOPs profiler");
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
    // what cJSON alone would let through: a second value, repeated keys, NULs
    write_text("trailing.json", "{\"seq_len\": 8} x");
    fails_with("train --config trailing.json",
               "trailing.json: unexpected text after the top-level JSON value at line 1 (byte 15)");
    write_text("dup.json", "{\"seq_len\": 8, \"seq_len\": 9}");
    fails_with("train --config dup.json", "dup.json: duplicate key 'seq_len'");
    write_text("dup2.json", "{\"optimizer\": {\"params\": {\"lr\": 1, \"lr\": 2}}}");
    fails_with("train --config dup2.json", "dup2.json: duplicate key 'optimizer.params.lr'");
    static const char nul[] = "{\"tokenizer\": \"by\0te\"}";
    write_file("nul.json", nul, sizeof nul - 1);
    fails_with("train --config nul.json", "nul.json: a NUL byte at line 1 (byte 17)");
    write_text("nul2.json", "{\"tokenizer\": \"by\\u0000te\"}");
    fails_with("train --config nul2.json", "nul2.json: \\u0000 (a NUL character) at line 1");
    // a directory or a FIFO is refused at once (a FIFO's open must not block)
    char p[600];
    snprintf(p, sizeof p, "%s/confdir", dir);
    mkdir(p, 0755);
    fails_with("train --config confdir", "config file confdir is a directory");
    snprintf(p, sizeof p, "%s/conffifo", dir);
    t_check(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    fails_with("train --config conffifo", "config file conffifo is not a regular file");
    // DeepSpeed's activation_checkpointing keys: honoured or refused, never ignored
    const refused_config ac[] = {
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
    refuses_configs(ac, sizeof ac / sizeof ac[0], "");
    // the LM head in chunks: not where the head keeps its whole logits
    fails_with("plan --model tiny --tokenizer byte --tensor-parallel 2 --ranks 2 --logits-chunk 8",
               "logits_chunk 8: not with tensor or pipeline parallelism");
    fails_with(
        "plan --model tiny --tokenizer byte --pipeline-parallel 2 --ranks 2 --logits-chunk 8",
        "logits_chunk 8: not with tensor or pipeline parallelism");
    // and advised where the logits are what does not fit (a 128K vocabulary)
    fitlm("plan --model llama-tiny --n-layer 4 --n-embd 256 --n-head 4 --n-kv-head 4 "
          "--max-seq-len 256 --vocab-size 128256 --tokenizer byte --batch 4 --seq-len 256 "
          "--precision bf16 --mem-limit 1200M");
    t_check(strstr(output, "does NOT fit") && strstr(output, "  --logits-chunk 256: 1.09 GiB"),
            "plan over its limit advises the LM head in chunks: %.900s", output);
    // the DeepSpeed keys at their defaults are accepted with a policy (null:
    // DeepSpeed's None, a key's or a block's default)
    write_text("ac.json",
               "{\"activation_checkpointing\": {\"policy\": \"block\", "
               "\"partition_activations\": false, \"cpu_checkpointing\": false, "
               "\"contiguous_memory_optimization\": false, \"number_checkpoints\": null, "
               "\"synchronize_checkpoint_boundary\": false, \"profile\": false}, "
               "\"zero_optimization\": {\"offload_param\": null}}");
    int rc = fitlm("plan --config ac.json --model tiny --tokenizer byte --batch 2 --seq-len 16");
    t_check(rc == 0 && strstr(output, "activation checkpointing block"),
            "DeepSpeed's activation_checkpointing block with a policy and nulls: %.300s", output);
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

// tokenize's inputs must be files: a directory or a FIFO fails at once,
// before the output directory is made
static void test_tokenize_input_is_a_file(void) {
    char p[600];
    snprintf(p, sizeof p, "%s/textdir", dir);
    mkdir(p, 0755);
    fails_with("tokenize textdir -o tokdir --tokenizer byte", "data file textdir is a directory");
    snprintf(p, sizeof p, "%s/textfifo", dir);
    t_check(mkfifo(p, 0644) == 0, "mkfifo %s", p);
    fails_with("tokenize textfifo -o tokdir --tokenizer byte",
               "data file textfifo is not a regular file");
    snprintf(p, sizeof p, "%s/tokdir", dir);
    t_check(access(p, F_OK) != 0, "no output directory was made for a bad input");
}

// Every input the user names is read only when it is a regular file (links
// followed): a FIFO in its place fails at once naming it (its open must not
// block: each run is ended after 30 s, which fails the check), and so do a
// device (a link to /dev/null) and a directory.
static char in_path[700];
static const char *in_dir(const char *name) {
    snprintf(in_path, sizeof in_path, "%s/%s", dir, name);
    return in_path;
}
static void copy_in(const char *from, const char *to) {
    size_t n;
    unsigned char *b = t_read_file(from, &n);
    t_check(b != NULL, "read %s", from);
    t_write_file(in_dir(to), b, n);
    free(b);
}
// the good inputs, made again before each case
static void good_inputs(void) {
    char q[700];
    static const char *const dirs[] = {"in_hf", "in_idx",  "in_tok", "in_gpt2",
                                       "in_ad", "in_data", "in_ck",  "in_run"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) mkdir(in_dir(dirs[i]), 0755);
    snprintf(q, sizeof q, "%s/in_base/config.json", dir);
    copy_in(q, "in_hf/config.json");
    copy_in(q, "in_idx/config.json");
    snprintf(q, sizeof q, "%s/in_base/model.safetensors", dir);
    copy_in(q, "in_hf/model.safetensors");
    copy_in(q, "in_idx/model-00001-of-00001.safetensors");
    static char index[4096];
    if (!*index) { // every tensor of the one shard
        fl_safetensors st;
        snprintf(q, sizeof q, "%s/in_base/model.safetensors", dir);
        fl_safetensors_open(&st, q);
        size_t n = (size_t)snprintf(index, sizeof index, "{\"weight_map\": {");
        for (int i = 0; i < st.count; i++)
            n += (size_t)snprintf(index + n, sizeof index - n, "%s\"%s\": \"%s\"", i ? ", " : "",
                                  st.tensors[i].name, "model-00001-of-00001.safetensors");
        snprintf(index + n, sizeof index - n, "}}");
        fl_safetensors_free(&st);
    }
    write_text("in_idx/model.safetensors.index.json", index);
    copy_in(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"),
            "in_tok/tokenizer.json");
    unlink(in_dir("in_tok/tokenizer_config.json"));
    copy_in(t_source_path("data/gpt2/encoder.json"), "in_gpt2/encoder.json");
    copy_in(t_source_path("data/gpt2/vocab.bpe"), "in_gpt2/vocab.bpe");
    write_text("in_ad/adapter_config.json",
               "{\"peft_type\": \"LORA\", \"task_type\": \"CAUSAL_LM\", \"r\": 4, "
               "\"lora_alpha\": 8, \"target_modules\": [\"c_attn\"]}");
    snprintf(q, sizeof q, "%s/in_run0/ckpt_00000001.fitlm", dir);
    copy_in(q, "in_ck/ckpt_00000001.fitlm");
    write_text("in_ck/latest", "ckpt_00000001.fitlm\n");
    write_text("in.txt", "a short text to evaluate on\n");
}

static void test_inputs_are_regular_files(void) {
    char text[4096] = "";
    for (int i = 0; i < 60; i++) strcat(text, "some lines of text, for shards.\n\n");
    write_text("in_small.txt", text);
    int rc = fitlm("tokenize in_small.txt -o in_small --tokenizer byte --val-fraction 0.2");
    rc |= fitlm("train --model tiny --data in_small --tokenizer byte --steps 1 --batch 2 "
                "--seq-len 16 --out in_run0 --sample-tokens 0");
    rc |= fitlm("export in_run0 -o in_base");
    t_check(rc == 0, "a small run to take inputs from: %.300s", output);
    // the file replaced by a FIFO (kind 0), a link to /dev/null (1), a directory (2)
    static const char *const kinds[] = {"is not a regular file (it is a FIFO)",
                                        "is not a regular file (it is a character device)",
                                        "is a directory"};
    static const struct {
        const char *file, *args; // the file replaced; fitlm ARGS
        int n_kinds;             // 2: a directory there means something else
        const char *says;        // NULL: "<the file's name> <kinds[k]>"
    } cases[] = {
        {"in_hf/model.safetensors", "eval --init-from in_hf --text in.txt --tokenizer byte", 3,
         NULL},
        {"in_hf/model.safetensors", "sample --checkpoint in_hf --tokenizer byte --tokens 2", 3,
         NULL},
        {"in_hf/model.safetensors",
         "train --init-from in_hf --data in_small --tokenizer byte --steps 1 --seq-len 16 --out ''",
         3, NULL},
        {"in_hf/model.safetensors", "eval --init-from in_hf/model.safetensors --text in.txt", 2,
         NULL},
        {"in_hf/config.json", "eval --init-from in_hf --text in.txt --tokenizer byte", 3, NULL},
        {"in_idx/model.safetensors.index.json",
         "eval --init-from in_idx --text in.txt --tokenizer byte", 3, NULL},
        {"in_idx/model-00001-of-00001.safetensors",
         "eval --init-from in_idx --text in.txt --tokenizer byte", 3, NULL},
        {"in_tok/tokenizer.json",
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok", 3, NULL},
        {"in_tok/tokenizer_config.json",
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok", 3, NULL},
        {"in_gpt2/encoder.json",
         "tokenize in.txt -o tok_out --tokenizer gpt2 --tokenizer-path in_gpt2", 3, NULL},
        {"in_gpt2/vocab.bpe",
         "tokenize in.txt -o tok_out --tokenizer gpt2 --tokenizer-path in_gpt2", 3, NULL},
        {"in_ad/adapter_config.json",
         "eval --init-from in_hf --adapter in_ad --text in.txt --tokenizer byte", 3, NULL},
        {"in_ad/adapter_model.safetensors",
         "eval --init-from in_hf --adapter in_ad --text in.txt --tokenizer byte", 3, NULL},
        {"in_ad/adapter_model.safetensors",
         "train --init-from in_hf --adapter in_ad --data in_small --tokenizer byte "
         "--steps 1 --seq-len 16 --out ''",
         3, NULL},
        {"in_data/val_000000.bin", "eval --init-from in_hf --data in_data --tokenizer byte", 3,
         NULL},
        {"in_data.bin", "train --data in_data.bin --tokenizer byte --steps 1 --seq-len 16 --out ''",
         2, NULL},
        {"in_gpt2.bin", "eval --init-from in_gpt2.bin --text in.txt --tokenizer byte", 2, NULL},
        {"in.fitlm", "eval --checkpoint in.fitlm --text in.txt", 3,
         "in.fitlm is not a fitlm checkpoint"},
        {"in.fitlm", "export in.fitlm -o exp_out", 3, "in.fitlm is not a fitlm checkpoint"},
        {"in_ck/latest", "sample --checkpoint in_ck --tokens 2", 3, NULL},
        {"in_ck/ckpt_00000001.fitlm", "export in_ck -o exp_out", 3, NULL},
        {"in_ck/ckpt_00000001.fitlm", "eval --checkpoint in_ck --text in.txt", 3, NULL},
        {"in_ck/ckpt_00000001.fitlm", "train --init-from in_ck --data in_small --steps 1 --out ''",
         3, NULL},
        {"in.json", "train --config in.json", 3, NULL},
        {"in.txt", "eval --init-from in_hf --text in.txt --tokenizer byte", 3, NULL},
        {"in.txt", "tokenize in.txt -o tok_out --tokenizer byte", 3, NULL},
        {"in.jsonl", "tokenize in.jsonl -o tok_out --tokenizer byte --format jsonl", 3, NULL},
        {"in_run/metrics.jsonl", "plot in_run -o plot_out", 3, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        // a device or a directory: once per file; a FIFO: by every command
        for (int k = 0; k < (i && !strcmp(cases[i - 1].file, cases[i].file) ? 1 : cases[i].n_kinds);
             k++) {
            good_inputs();
            const char *p = in_dir(cases[i].file);
            unlink(p);
            rmdir(p);
            t_check(k == 0   ? mkfifo(p, 0644) == 0
                    : k == 1 ? symlink("/dev/null", p) == 0
                             : mkdir(p, 0755) == 0,
                    "make %s", p);
            const char *name = strrchr(cases[i].file, '/');
            char says[300];
            snprintf(says, sizeof says, "%s %s", name ? name + 1 : cases[i].file, kinds[k]);
            if (k == 1 && !strcmp(cases[i].file, "in_ck/latest")) // fitlm's own: no link followed
                snprintf(says, sizeof says, "latest is a symbolic link");
            t_fitlm_fails_within(dir, cases[i].args, 30, cases[i].says ? cases[i].says : says,
                                 output, sizeof output);
            unlink(in_dir(cases[i].file));
            rmdir(in_path);
        }
}

// The text of a file with its trailing white space cut and `tail` (n
// bytes) put after its first line's JSON value (line: 1) or the whole text's.
static void json_with_tail(const char *from, const char *to, int line, const char *tail, size_t n) {
    size_t len;
    unsigned char *b = t_read_file(from, &len);
    t_check(b != NULL, "read %s", from);
    size_t end = len;
    if (line) end = (size_t)((unsigned char *)strchr((char *)b, '\n') - b);
    size_t cut = end;
    while (cut && strchr(" \t\r\n", b[cut - 1])) cut--;
    unsigned char *out = malloc(len + n + 1);
    memcpy(out, b, cut);
    memcpy(out + cut, tail, n);
    memcpy(out + cut + n, b + end, len - end);
    t_write_file(in_dir(to), out, cut + n + len - end);
    free(out);
    free(b);
}

// Every JSON file fitlm reads is one value and white space: text after the
// value (a second value, a stray character, bytes after a NUL) is refused
// naming the file and the byte; white space after it is fine. In the
// sanitizer build, each error exit is also checked to report no leak.
static void test_json_inputs_are_whole(void) {
    char q[700];
    int rc = fitlm("train --init-from in_base --lora --lora-target-modules c_attn --data in_small "
                   "--tokenizer byte --steps 1 --seq-len 16 --batch 2 --out in_lora "
                   "--sample-tokens 0");
    t_check(rc == 0, "a LoRA run for its adapter: %.300s", output);
    write_text("in_good.json", "{\"seq_len\": 16}\n");
    write_text("in_cfg.json", "{}\n");
    static const struct {
        const char *from, *file; // the good file (in dir, or in the source tree), the one edited
        int line;                // 1: the tail goes after the first line's value
        const char *args, *says; // fitlm ARGS; its error says "<says><why>"
        const char *ok_args;     // a run that succeeds with white space after the value
    } files[] = {
        {"tests/fixtures/hf_tokenizer_97/tokenizer.json", "in_tok/tokenizer.json", 0,
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
         "in_tok/tokenizer.json is not valid JSON: ",
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok --val-fraction 0"},
        {"@in_cfg.json", "in_tok/tokenizer_config.json", 0,
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
         "in_tok/tokenizer_config.json is not valid JSON: ",
         "tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok --val-fraction 0"},
        {"data/gpt2/encoder.json", "in_gpt2/encoder.json", 0,
         "tokenize in.txt -o tok_out --tokenizer gpt2 --tokenizer-path in_gpt2",
         "in_gpt2/encoder.json is not valid JSON: ",
         "tokenize in.txt -o tok_out --tokenizer gpt2 --tokenizer-path in_gpt2 --val-fraction 0"},
        {"@in_base/config.json", "in_hf/config.json", 0,
         "eval --init-from in_hf --text in.txt --tokenizer byte",
         "in_hf/config.json: not valid JSON: ",
         "eval --init-from in_hf --text in.txt --tokenizer byte"},
        {"@in_idx/model.safetensors.index.json", "in_idx/model.safetensors.index.json", 0,
         "eval --init-from in_idx --text in.txt --tokenizer byte",
         "in_idx/model.safetensors.index.json: not valid JSON: ",
         "eval --init-from in_idx --text in.txt --tokenizer byte"},
        {"@in_lora/adapter/adapter_config.json", "in_ad/adapter_config.json", 0,
         "eval --init-from in_base --adapter in_ad --text in.txt --tokenizer byte",
         "in_ad/adapter_config.json: not valid JSON: ",
         "eval --init-from in_base --adapter in_ad --text in.txt --tokenizer byte"},
        {"@in_run0/metrics.jsonl", "in_run/metrics.jsonl", 1, "plot in_run -o plot_out",
         "in_run/metrics.jsonl:1: not a JSON object (", "plot in_run -o plot_out"},
        {"@in_good.json", "in.json", 0, "train --config in.json",
         "in.json: ", "plan --config in.json --model tiny --tokenizer byte --batch 2"},
    };
    static const struct {
        const char *tail;
        size_t n;
        const char *why;
    } tails[] = {
        {"x", 1, "unexpected text after the top-level JSON value"},
        {" {}", 3, "unexpected text after the top-level JSON value"},
        {"]", 1, "unexpected text after the top-level JSON value"},
        {"\0junk", 5, "a NUL byte"},
    };
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        const char *from = files[f].from;
        if (*from == '@')
            snprintf(q, sizeof q, "%s/%s", dir, from + 1);
        else
            snprintf(q, sizeof q, "%s", t_source_path(from));
        char src[700], adapter[700];
        snprintf(src, sizeof src, "%s", q);
        snprintf(adapter, sizeof adapter, "%s/in_lora/adapter/adapter_model.safetensors", dir);
        for (size_t t = 0; t <= sizeof tails / sizeof tails[0]; t++) {
            good_inputs();
            copy_in(adapter, "in_ad/adapter_model.safetensors");
            if (t == sizeof tails / sizeof tails[0]) { // white space after the value: fine
                // (a line of metrics.jsonl ends at its '\n')
                json_with_tail(src, files[f].file, files[f].line, " \t\r\n \n",
                               files[f].line ? 3 : 6);
                rc = fitlm(files[f].ok_args);
                t_check(rc == 0, "%s with white space after its JSON: fitlm %s: status %d: %.300s",
                        files[f].file, files[f].ok_args, rc, output);
                break;
            }
            if (files[f].line && memchr(tails[t].tail, '\n', tails[t].n)) continue;
            json_with_tail(src, files[f].file, files[f].line, tails[t].tail, tails[t].n);
            char says[400];
            snprintf(says, sizeof says, "%s%s", files[f].says, tails[t].why);
            t_fitlm_fails_within(dir, files[f].args, 60, says, output, sizeof output);
        }
    }
}

// Error exits report no leak (the sanitizer build; t_fitlm_fails checks):
// what a reader held when it failed goes with the process.
static void test_error_exits_do_not_leak(void) {
    good_inputs();
    write_text("in_tok/tokenizer.json", "");
    fails_with("tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
               "tokenizer.json is empty");
    write_text("in_tok/tokenizer.json", " \n");
    fails_with("tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
               "tokenizer.json is not valid JSON: no JSON value");
    good_inputs();
    write_text("in_tok/tokenizer_config.json", "");
    fails_with("tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
               "tokenizer_config.json is empty");
    write_text("in_tok/tokenizer_config.json", "{\"eos_token\": 3}");
    fails_with("tokenize in.txt -o tok_out --tokenizer hf --tokenizer-path in_tok",
               "eos_token must be a string");
    write_text("in_gpt2/encoder.json", "");
    fails_with("tokenize in.txt -o tok_out --tokenizer gpt2 --tokenizer-path in_gpt2",
               "encoder.json is empty");
    fails_with("plot", "fitlm plot needs at least one run directory");
    fails_with("plot in_nowhere", "in_nowhere");
    write_text("in_run/metrics.jsonl", "{\"step\": 1, \"loss\": 2, \"memory\": 5}\n");
    fails_with("plot in_run -o plot_out", "\"memory\" is not an object");
    write_text("in_run/metrics.jsonl", "{\"step\": 1, \"loss\": 2, \"lr\": \"high\"}\n");
    fails_with("plot in_run -o plot_out", "in_run/metrics.jsonl:1");
    write_text("in_file", "a file\n");
    fails_with("plot in_run0 -o in_file", "in_file");
    write_text("in_hf/config.json", "{\"model_type\": \"gpt2\"}");
    fails_with("eval --init-from in_hf --text in.txt --tokenizer byte", "config.json implies");
    write_text("in_ad/adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": -1}");
    fails_with("eval --init-from in_base --adapter in_ad --text in.txt --tokenizer byte",
               "in_ad/adapter_config.json");
    write_text("in.json", "{\"seq_len\": \"long\"}");
    fails_with("train --config in.json", "in.json");
}

// Windows line ends split documents and examples as Unix ones do: the same
// text with LF, CRLF, mixed ends or blank lines of white space is the same
// 40 documents (and, tokenized as examples, the same 40 lines).
static void test_crlf_documents(void) {
    static const char *const ends[][2] = {
        {"\n", "\n"}, {"\r\n", "\r\n"}, {"\n", "\r\n"}, {"\r\n", " \r\n"}, {"\r\n", "\t\n"}};
    for (size_t e = 0; e < sizeof ends / sizeof ends[0]; e++) {
        char text[16384], jsonl[16384];
        size_t n = 0, m = 0;
        for (int i = 0; i < 120; i++) { // documents of three lines, blank lines between
            if (i % 3 == 0 && i) n += (size_t)snprintf(text + n, sizeof text - n, "%s", ends[e][1]);
            n += (size_t)snprintf(text + n, sizeof text - n, "line %d of a small text.%s", i,
                                  ends[e][0]);
            if (i % 3 == 0)
                m += (size_t)snprintf(jsonl + m, sizeof jsonl - m,
                                      "{\"prompt\": \"%d\", \"response\": \"ok\"}%s%s", i,
                                      ends[e][0], i % 2 ? ends[e][1] : "");
        }
        write_text("ends.txt", text);
        int rc = fitlm("tokenize ends.txt -o ends --tokenizer byte --val-fraction 0.2");
        t_check(rc == 0 && strstr(output, "train: 32 documents") &&
                    strstr(output, "val: 8 documents"),
                "line ends %zu: 40 documents, 32/8: %.300s", e, output);
        write_text("ends.jsonl", jsonl);
        rc = fitlm("tokenize ends.jsonl -o ends_ex --format jsonl --tokenizer byte "
                   "--val-fraction 0.2");
        t_check(rc == 0 && strstr(output, "train: 32 examples") &&
                    strstr(output, "val: 8 examples") && strstr(output, "40 lines"),
                "line ends %zu: 40 examples, 32/8: %.300s", e, output);
    }
}

// Lines of `mib` MiB each: an example whose answer fills the line.
static void write_long_lines(const char *name, int lines, double mib) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    size_t n = (size_t)(mib * 1048576.0) - 40;
    char *answer = malloc(n);
    for (size_t i = 0; i < n; i++) answer[i] = "ab cd "[i % 6];
    for (int l = 0; l < lines; l++) {
        fputs("{\"prompt\": \"q\", \"response\": \"", f);
        fwrite(answer, 1, n, f);
        fputs("\"}\n", f);
    }
    fclose(f);
    free(answer);
}

// A JSON Lines record longer than the documented maximum is a bad line
// naming its file and line; memory that runs out while lines are read
// ends the run with an error naming the line being read, status 1, no
// crash (a child limited to 1 GiB of address space; 6 lines of 15 MiB
// take ~14x that as they are tokenized).
static void test_long_lines(void) {
    write_long_lines("long.jsonl", 1, 16.5);
    fails_with("tokenize long.jsonl -o long --format jsonl --tokenizer byte",
               "long.jsonl:1: the line is 16.5 MiB, longer than the 16 MiB an example may be");
#ifdef __SANITIZE_ADDRESS__
    printf("  (the address-space limit is left out: AddressSanitizer reserves terabytes)\n");
#else
    write_long_lines("many.jsonl", 6, 15);
    const char *bin = getenv("FITLM_BINARY");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && ulimit -v 1048576 && timeout 60 %s tokenize many.jsonl -o many --format "
             "jsonl --tokenizer byte --threads 1 --val-fraction 0 2>&1",
             dir, bin ? bin : "fitlm");
    FILE *p = popen(cmd, "r");
    size_t got = p ? fread(output, 1, sizeof output - 1, p) : 0;
    output[got] = 0;
    int status = p ? pclose(p) : -1;
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    t_check(rc == 1 && strstr(output, "fitlm: error: out of memory") &&
                strstr(output, "while reading many.jsonl:"),
            "out of memory under a 1 GiB limit names the line (status %d): %.300s", rc, output);
#endif
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
    write_text("breakdown.json", "{\"wall_clock_breakdown\": true, \"memory_breakdown\": true}");
    rc = fitlm("train --config run.json --config breakdown.json --steps 2");
    t_check(rc == 0 && strstr(output, "per-op profile: 1 step,") && strstr(output, "peak RSS"),
            "DeepSpeed's wall_clock_breakdown and memory_breakdown: the profile and the memory "
            "report (status %d): %.600s",
            rc, output);
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
    // on a device the slots are timed on its clock (a GPU's events; the test
    // device's mark the host's time when recorded)
    rc = fitlm("train --config run.json --steps 3 --profile --device test");
    const char *att = strstr(output, "| attention ");
    all = rc == 0 && att && strstr(output, "per-op profile: 2 steps");
    for (int col = 0; all && col < 4; col++) att = strchr(att + 1, '|');
    t_check(all && att && atof(att + 1) > 0.0,
            "--profile on a device: the table, attention's time measured (%.600s)", output);
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

// Runs `args`, keeping its steps' losses (losses_of) in out; its status.
static int run_losses(const char *args, char *out, size_t size) {
    int rc = fitlm(args);
    losses_of(output, out, size);
    return rc;
}

// DeepSpeed's zero_optimization keys: each honoured or refused naming the
// key, the value and why; none ignored. One representative per class.
static void test_zero_optimization_keys(void) {
    const refused_config refused[] = {
        {"{\"zero_optimization\": {\"stage\": 2, \"contiguous_gradients\": false}}",
         "zero_optimization.contiguous_gradients false: fitlm always keeps a rank's gradient "
         "shard in one contiguous buffer"},
        {"{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"nvme\"}}}",
         "offload_optimizer.device nvme needs offload_optimizer.nvme_path"},
        {"{\"optimizer\": {\"type\": \"lomo\"}, \"zero_optimization\": {\"stage\": 1, "
         "\"offload_optimizer\": "
         "{\"device\": \"nvme\", \"nvme_path\": \"/tmp\"}}}",
         "offload_optimizer.device nvme with optimizer lomo: LOMO keeps no optimizer state"},
        {"{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", "
         "\"nvme_path\": \"/tmp\", \"ratio\": 0.5}}}",
         "offload_optimizer.ratio 0.5: a partial offload is DeepSpeed's CPU-offload feature"},
        {"{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"cpu\", "
         "\"pipeline_read\": true}}}",
         "offload_optimizer.pipeline_read applies to NVMe offload (device nvme); "
         "offload_optimizer.device is cpu"},
        {"{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\"}}}",
         "zero_optimization.offload_param.device nvme needs offload_optimizer.device nvme"},
        {"{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", "
         "\"nvme_path\": \"/tmp\"}, \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
         "\"/var/tmp\"}}}",
         "offload_param.nvme_path /var/tmp differs from offload_optimizer.nvme_path /tmp"},
        {"{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", "
         "\"nvme_path\": \"/tmp\"}, \"offload_param\": {\"device\": \"nvme\", \"buffer_size\": "
         "1e9}}}",
         "offload_param.buffer_size 1e+09: the weights gathered from the file live in stage 3's "
         "buffers"},
        {"{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"nvme\", "
         "\"nvme_path\": \"/tmp\"}}, \"aio\": {\"intra_op_parallelism\": 2}}",
         "aio.intra_op_parallelism 2"},
        {"{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"nvme\", "
         "\"nvme_path\": \"/tmp\"}}, \"aio\": {\"use_gds\": true}}",
         "aio.use_gds true: GPUDirect Storage"},
        {"{\"optimizer_in_backward\": true, \"gradient_accumulation_steps\": 2}",
         "optimizer_in_backward: each block is updated as soon as its gradient is ready, so a "
         "step has one micro-batch; gradient_accumulation_steps is 2"},
        {"{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"cpu\", "
         "\"buffer_size\": 1e8}}}",
         "zero_optimization.offload_param.buffer_size applies to NVMe offload (device nvme)"},
        {"{\"zero_optimization\": {\"stage\": 2, \"max_live_parameters\": 0}}",
         "zero_optimization.max_live_parameters applies to ZeRO stage 3; zero_optimization.stage "
         "is 2"},
        {"{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"gpu\"}}}",
         "offload_optimizer.device must be one of none|cpu|nvme, got 'gpu'"},
        {"{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"cpu\", "
         "\"ratio\": 0.5}}}",
         "offload_optimizer.ratio 0.5: a partial offload needs ZeRO stage 3"},
        {"{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\"}}}",
         "offload_optimizer applies to ZeRO stages 1-3; zero_optimization.stage is 0"},
        {"{\"zero_optimization\": {\"stage\": 2, \"offload_param\": {\"device\": \"cpu\"}}}",
         "offload_param applies to ZeRO stage 3; zero_optimization.stage is 2"},
        {"{\"zero_optimization\": {\"stage\": 2, \"cpu_offload\": true, \"offload_optimizer\": "
         "{\"device\": \"cpu\"}}}",
         "cpu_offload is the deprecated form of zero_optimization.offload_optimizer.device"},
        {"{\"zero_optimization\": {\"stage\": 2, \"stage3_prefetch_bucket_size\": 1e7}}",
         "stage3_prefetch_bucket_size applies to ZeRO stage 3; zero_optimization.stage is 2"},
        {"{\"zero_optimization\": {\"stage\": 1, \"allgather_partitions\": false}}",
         "allgather_partitions false: DeepSpeed then broadcasts"},
        {"{\"zero_optimization\": {\"stage\": 1, \"load_from_fp32_weights\": false}}",
         "load_from_fp32_weights false: a resume restores the fp32 master weights"},
        {"{\"zero_optimization\": {\"stage\": 1, \"elastic_checkpoint\": true}}",
         "elastic_checkpoint true: loading a checkpoint saved by another number of ranks"},
        {"{\"zero_optimization\": {\"stage\": 3, \"zero_quantized_weights\": true}}",
         "zero_quantized_weights true: ZeRO++ quantised communication is not supported"},
        {"{\"zero_optimization\": {\"stage\": 3, \"zero_hpz_partition_size\": 8}}",
         "zero_hpz_partition_size 8: ZeRO++ hierarchical partitioning"},
        {"{\"zero_optimization\": {\"stage\": 3, \"zeropp_loco_param\": {\"err_beta\": 0.8}}}",
         "zeropp_loco_param: LoCo-ZeRO++"},
        {"{\"zero_optimization\": {\"stage\": 3, \"mics_shard_size\": 2}}",
         "mics_shard_size 2: MiCS (sharding within groups of ranks) is not supported"},
        {"{\"zero_optimization\": {\"stage\": 3, \"memory_efficient_linear\": false}}",
         "memory_efficient_linear false: fitlm's stage 3 gathers a block's weights again"},
        {"{\"zero_optimization\": {\"stage\": 1, \"legacy_stage1\": true}}", "legacy_stage1 true"},
        {"{\"aio\": {\"queue_depth\": 32}}",
         "aio.queue_depth 32 tunes NVMe offload's I/O; zero_optimization.offload_optimizer.device "
         "is none, not nvme"},
    };
    refuses_configs(refused, sizeof refused / sizeof refused[0], "--out ''");
    // what the data-parallel engine cannot run, named before anything loads
    // (LoRA and QLoRA over several ranks: test_failures; on one: test_lora_under_zero)
    // DeepSpeed-only keys have no flags
    fails_with("train --allgather-partitions", "unknown option '--allgather-partitions'");

    // every key at a value fitlm honours: the run gets past the config to
    // its data (none here)
    write_text(
        "zero_ok.json",
        "{\"zero_optimization\": {\"stage\": 3, \"allgather_partitions\": true, "
        "\"allgather_bucket_size\": 5e8, \"overlap_comm\": true, \"reduce_scatter\": true, "
        "\"reduce_bucket_size\": 5e8, \"contiguous_gradients\": true, "
        "\"use_multi_rank_bucket_allreduce\": true, \"grad_hooks\": true, "
        "\"load_from_fp32_weights\": true, \"elastic_checkpoint\": false, "
        "\"sub_group_size\": 1e12, "
        "\"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true, \"ratio\": 0.3}, "
        "\"offload_param\": {\"device\": \"cpu\", \"pin_memory\": true}, "
        "\"stage3_max_live_parameters\": 1e9, \"stage3_max_reuse_distance\": 1e9, "
        "\"stage3_prefetch_bucket_size\": 5e7, "
        "\"stage3_param_persistence_threshold\": 1e5, "
        "\"stage3_model_persistence_threshold\": 1e12, "
        "\"stage3_module_granularity_threshold\": 100, "
        "\"stage3_use_all_reduce_for_fetch_params\": false, "
        "\"stage3_gather_16bit_weights_on_model_save\": true, "
        "\"stage3_gather_fp16_weights_on_model_save\": true, "
        "\"ignore_unused_parameters\": false, \"legacy_stage1\": false, "
        "\"round_robin_gradients\": true, \"zero_hpz_partition_size\": 1, "
        "\"zero_quantized_weights\": false, \"zero_quantized_nontrainable_weights\": false, "
        "\"zero_quantized_gradients\": false, \"mics_shard_size\": -1, "
        "\"mics_hierarchical_params_gather\": false, \"memory_efficient_linear\": true, "
        "\"pipeline_loading_checkpoint\": false, \"override_module_apply\": true}, "
        "\"zero_allow_untested_optimizer\": true, "
        "\"aio\": {\"block_size\": 1048576, \"queue_depth\": 8, \"thread_count\": 1, "
        "\"single_submit\": false, \"overlap_events\": true, \"use_gds\": false}}");
    fails_with("train --config zero_ok.json --out '' --data none", "no train token shards at none");
    // DeepSpeed's field names of the stage3_ keys (axolotl's ZeRO-3 configs,
    // with max_live_parameters 0: nothing prefetched, as DeepSpeed), and
    // pin_memory beside device none (Qwen's), taken as DeepSpeed takes them
    write_text("zero_names.json",
               "{\"zero_optimization\": {\"stage\": 3, \"max_live_parameters\": 0, "
               "\"max_reuse_distance\": 0, \"prefetch_bucket_size\": 5e7, "
               "\"param_persistence_threshold\": 0, \"model_persistence_threshold\": 1e12, "
               "\"module_granularity_threshold\": 0, \"use_all_reduce_for_fetch_params\": false, "
               "\"offload_optimizer\": {\"device\": \"none\", \"pin_memory\": true}, "
               "\"offload_param\": {\"device\": \"none\", \"pin_memory\": true}, "
               "\"stage3_gather_16bit_weights_on_model_save\": false}}");
    char names[4096], stage3[4096], cmd[512];
    const char *tiny = "train --model tiny --data small --tokenizer byte --seq-len 16 --batch 2 "
                       "--steps 3 --eval-every 0 --sample-tokens 0 --threads 1 --out '' "
                       "--zero-stage 3";
    snprintf(cmd, sizeof cmd, "%s --config zero_names.json", tiny);
    int rc_names = run_losses(cmd, names, sizeof names);
    snprintf(cmd, sizeof cmd, "%s --param-persistence-threshold 0", tiny);
    int rc_stage3 = run_losses(cmd, stage3, sizeof stage3);
    t_check(rc_names == 0 && rc_stage3 == 0 && *names && !strcmp(names, stage3),
            "DeepSpeed's field names and max_live_parameters 0: the stage-3 run without "
            "prefetch, the same losses as with it (status %d %d)\n%s\nvs\n%s",
            rc_names, rc_stage3, names, stage3);
    write_text("zero_twice.json", "{\"zero_optimization\": {\"stage\": 3, "
                                  "\"stage3_max_live_parameters\": 1e9, "
                                  "\"max_live_parameters\": 0}}");
    fails_with("train --config zero_twice.json",
               "zero_optimization.max_live_parameters 0 contradicts "
               "zero_optimization.stage3_max_live_parameters 1e+09 (two names of one setting");
    write_text("zero_old.json", "{\"zero_optimization\": {\"stage\": 2, \"cpu_offload\": true, "
                                "\"cpu_offload_use_pin_memory\": true}}");
    fails_with("train --config zero_old.json --out '' --data none",
               "no train token shards at none");

    // what the accepted keys set (in-process: fl_config_check, one rank)
    const struct {
        const char *json;
        int micro, accum, total, overlap;
        const char *offload;
    } set[] = {
        // DeepSpeed's batch rule: any two set the third; the total alone, no accumulation
        {"{\"train_batch_size\": 32}", 32, 1, 32, 1, "none"},
        {"{\"train_batch_size\": 32, \"train_micro_batch_size_per_gpu\": 4}", 4, 8, 32, 1, "none"},
        {"{\"train_batch_size\": 32, \"gradient_accumulation_steps\": 4}", 8, 4, 32, 1, "none"},
        {"{\"train_micro_batch_size_per_gpu\": 4, \"gradient_accumulation_steps\": 2}", 4, 2, 8, 1,
         "none"},
        {"{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 4, "
         "\"gradient_accumulation_steps\": 2}",
         4, 2, 8, 1, "none"},
        {"{\"train_micro_batch_size_per_gpu\": 4}", 4, 1, 4, 1, "none"},
        // overlap_comm: DeepSpeed's default is false under stages 1 and 2; true under
        // stage 3, and under DDP (stage 0, above), as PyTorch's DDP
        {"{\"zero_optimization\": {\"stage\": 3}}", 16, 1, 16, 1, "none"},
        {"{\"zero_optimization\": {\"stage\": 2}}", 16, 1, 16, 0, "none"},
        {"{\"zero_optimization\": {\"stage\": 1, \"overlap_comm\": true}}", 16, 1, 16, 1, "none"},
        {"{\"zero_optimization\": {\"stage\": 3, \"overlap_comm\": false}}", 16, 1, 16, 0, "none"},
        // the deprecated cpu_offload is offload_optimizer.device cpu
        {"{\"zero_optimization\": {\"stage\": 1, \"cpu_offload\": true}}", 16, 1, 16, 0, "cpu"},
    };
    for (size_t i = 0; i < sizeof set / sizeof set[0]; i++) {
        fl_train_config cfg;
        fl_config_defaults(&cfg);
        fl_config_load_json_text(&cfg, set[i].json, strlen(set[i].json), "test");
        cfg.threads = 1;
        fl_config_check(&cfg);
        t_check(cfg.micro_batch == set[i].micro && cfg.grad_accum == set[i].accum &&
                    cfg.train_batch_size == set[i].total &&
                    cfg.zero.overlap_comm == set[i].overlap &&
                    !strcmp(cfg.zero_extra.offload_optimizer, set[i].offload),
                "%s: micro %d accum %d total %d overlap %d offload %s", set[i].json,
                cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size, cfg.zero.overlap_comm,
                cfg.zero_extra.offload_optimizer);
    }
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    const char *cap = "{\"zero_optimization\": {\"stage\": 3, "
                      "\"stage3_model_persistence_threshold\": 4096}}";
    fl_config_load_json_text(&cfg, cap, strlen(cap), "test");
    fl_config_check(&cfg);
    t_check(cfg.zero.model_persistence_threshold == 4096.0f,
            "stage3_model_persistence_threshold reaches fl_zero_config (%g)",
            cfg.zero.model_persistence_threshold);
    fails_with("train --train-batch-size 12 --grad-accum 5",
               "train_batch_size 12 is not a multiple of gradient_accumulation_steps 5 x 1 rank");
}

// The tensor-parallel flags reach both commands, and their layout check
// runs before anything loads: one rank cannot be split two ways; a plan of
// 4 ranks at t 2 splits the batch over d = 2 replicas.
static void test_tensor_parallel_flags(void) {
    fails_with("train --tensor-parallel 2 --data none",
               "tensor_parallel.size 2 does not divide the world of 1 rank (1 % 2 = 1)");
    fails_with("train --sequence-parallel --data none",
               "sequence_parallel splits the tokens over the tensor-parallel ranks");
    fails_with("plan --model tiny --tokenizer byte --data small --seq-len 32 --ranks 6 "
               "--tensor-parallel 4",
               "tensor_parallel.size 4 does not divide the world of 6 ranks (6 % 4 = 2)");
    write_text("tp.json",
               "{\"tensor_parallel\": {\"size\": 2}, \"tensor_model_parallel_size\": 4}");
    fails_with("plan --config tp.json --ranks 4",
               "tensor_model_parallel_size 4 contradicts tensor_parallel.size 2");
    int rc = fitlm("plan --model llama-tiny --tokenizer byte --data small --seq-len 32 --ranks 4 "
                   "--tensor-parallel 2 --sequence-parallel --train-batch-size 32 --batch 4");
    t_check(rc == 0 && strstr(output, "grad accum 4 | 4 ranks"),
            "plan --ranks 4 --tensor-parallel 2: train_batch_size 32 = 4 x 4 x 2 replicas: %.600s",
            output);
}

// DeepSpeed's ZeRO tutorial's ZeRO-3 config (docs/_tutorials/zero.md,
// "Offloading to CPU and NVMe with ZeRO-Infinity"), as published, runs on
// one rank with a small model given by flags.
static void test_deepspeed_zero3_example(void) {
    char args[1024];
    snprintf(args, sizeof args,
             "train --config %s --model tiny --tokenizer byte --data small --batch 2 "
             "--seq-len 16 --steps 2 --out '' --sample-tokens 0 --eval-iters 1 --threads 1",
             t_source_path("tests/fixtures/deepspeed_zero3.json"));
    int rc = fitlm(args);
    t_check(rc == 0 && strstr(output, "1 rank, ZeRO-3") && strstr(output, "step     2/2"),
            "DeepSpeed's ZeRO-3 example config runs on one rank (status %d): %.600s", rc, output);
}

// DeepSpeed's optimizer.type Adam is AdamW (adam_w_mode true, its default;
// torch_adam names an implementation of the same rule): the same losses,
// bit for bit; Adam with L2 weight decay is refused.
static void test_deepspeed_adam(void) {
    const char *run = "train --config run.json --steps 3 --eval-every 0 --sample-tokens 0 "
                      "--threads 1 --out ''";
    static char adamw[8192], adam[8192];
    write_text("adam.json", "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.5, "
                            "\"betas\": [0.8, 0.9], \"torch_adam\": true}}}");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s --config adam.json", run);
    int rc1 = run_losses(run, adamw, sizeof adamw), rc2 = run_losses(cmd, adam, sizeof adam);
    t_check(rc1 == 0 && rc2 == 0 && strstr(output, "adamw lr 0.5") && strlen(adamw) > 40 &&
                !strcmp(adamw, adam),
            "optimizer.type Adam trains as AdamW, bit for bit:\n%s---\n%s", adamw, adam);
    write_text("adaml2.json", "{\"optimizer\": {\"type\": \"Adam\", \"params\": "
                              "{\"adam_w_mode\": false, \"weight_decay\": 0.01}}}");
    fails_with("train --config adaml2.json",
               "optimizer.type Adam with adam_w_mode false and weight_decay 0.01 adds the decay to "
               "the gradient (L2 regularisation), which fitlm does not run");
    write_text("adamwl2.json",
               "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"adam_w_mode\": false}}}");
    fails_with("train --config adamwl2.json",
               "optimizer.params.adam_w_mode false contradicts optimizer.type AdamW");
    write_text("sgdtorch.json",
               "{\"optimizer\": {\"type\": \"sgd\", \"params\": {\"torch_adam\": true}}}");
    fails_with("train --config sgdtorch.json",
               "optimizer.params.torch_adam applies to optimizer.type Adam and AdamW, not sgd");
    // DeepSpeedExamples' BERT configs: Adam without bias correction, which
    // changes the steps (the rule itself: test_optim)
    static char plain[8192];
    write_text("adamnobc.json", "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.5, "
                                "\"weight_decay\": 0.0, \"bias_correction\": false}}}");
    write_text("adambc.json", "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": 0.5, "
                              "\"weight_decay\": 0.0, \"bias_correction\": true}}}");
    snprintf(cmd, sizeof cmd, "%s --config adambc.json", run);
    rc1 = run_losses(cmd, plain, sizeof plain);
    snprintf(cmd, sizeof cmd, "%s --config adamnobc.json", run);
    rc2 = run_losses(cmd, adam, sizeof adam);
    t_check(rc1 == 0 && rc2 == 0 && strstr(output, "without bias correction") &&
                strlen(adam) > 40 && strcmp(plain, adam),
            "bias_correction false: the run says so and its steps differ:\n%s---\n%s", plain, adam);
    // what a DeepSpeed optimizer block leaves out takes DeepSpeed's
    // defaults (FusedAdam's betas 0.9,0.999, eps 1e-8, weight_decay 0;
    // torch's SGD's weight_decay 0), a flag its own value, "auto" fitlm's
    write_text("dsdefaults.json", "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": "
                                  "0.01}}}");
    const char *one_step =
        "train --model tiny --data small --tokenizer byte --seq-len 16 --batch 2 "
        "--steps 1 --eval-every 0 --sample-tokens 0 --out '' --threads 1";
    snprintf(cmd, sizeof cmd, "%s --config dsdefaults.json", one_step);
    t_check(fitlm(cmd) == 0 && strstr(output, "betas 0.9,0.999 wd 0 "),
            "a DeepSpeed AdamW block's omitted params are DeepSpeed's: %.400s", output);
    snprintf(cmd, sizeof cmd, "%s --config dsdefaults.json --weight-decay 0.05", one_step);
    t_check(fitlm(cmd) == 0 && strstr(output, "betas 0.9,0.999 wd 0.05 "),
            "a flag gives its own value: %.400s", output);
    write_text("dssgd.json", "{\"optimizer\": {\"type\": \"sgd\", \"params\": {\"lr\": 0.01}}}");
    snprintf(cmd, sizeof cmd, "%s --config dssgd.json", one_step);
    t_check(fitlm(cmd) == 0 && strstr(output, "sgd lr 0.01") && strstr(output, "wd 0 "),
            "a DeepSpeed SGD block without weight_decay: torch's 0: %.400s", output);
    write_text("dsauto.json", "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": "
                              "\"auto\", \"weight_decay\": \"auto\"}}}");
    snprintf(cmd, sizeof cmd, "%s --config dsauto.json", one_step);
    t_check(fitlm(cmd) == 0 && strstr(output, "betas 0.9,0.95 wd 0.1 "),
            "\"auto\" params are fitlm's own: %.400s", output);
    write_text("sgdbc.json",
               "{\"optimizer\": {\"type\": \"sgd\", \"params\": {\"bias_correction\": true}}}");
    fails_with("train --config sgdbc.json",
               "optimizer.params.bias_correction applies to adamw, not sgd");
}

static void test_same_seed_same_losses(void) {
    const char *run = "train --config run.json --steps 4 --eval-every 0 --sample-tokens 0 "
                      "--threads 2 --seed 7";
    static char first[8192], second[8192];
    int rc1 = run_losses(run, first, sizeof first), rc2 = run_losses(run, second, sizeof second);
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

// `common` (a train command) run whole, then with a save at step `at` and
// resumed from it on `threads` threads: the steps after `at` log the same
// losses and the final checkpoints hold the same tensors, bit for bit.
// `name` prefixes the run directories. The resumed run's output stays in
// `output`.
static void resume_matches(const char *name, const char *common, int at, int threads) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --out %swhole", common, name);
    int rc1 = fitlm(cmd);
    snprintf(cmd, sizeof cmd, "%s --out %sparts --save-every %d --keep-checkpoints 0", common, name,
             at);
    int rc2 = fitlm(cmd);
    snprintf(cmd, sizeof cmd, "train --resume %sparts/ckpt_%08d.fitlm --out %sresumed --threads %d",
             name, at, name, threads);
    int rc3 = fitlm(cmd);
    char resumed_from[64];
    snprintf(resumed_from, sizeof resumed_from, "resumed from step %d", at);
    t_check(rc1 == 0 && rc2 == 0 && rc3 == 0 && strstr(output, resumed_from),
            "%s: train, train with saves, resume (status %d %d %d): %.400s", common, rc1, rc2, rc3,
            output);
    static char whole[65536], resumed[65536];
    snprintf(cmd, sizeof cmd, "%swhole/log.txt", name);
    read_file(cmd, whole, sizeof whole);
    snprintf(cmd, sizeof cmd, "%sresumed/log.txt", name);
    read_file(cmd, resumed, sizeof resumed);
    t_check(*log_from(whole, at + 1) && !strcmp(log_from(whole, at + 1), resumed),
            "%s: the steps after a resume log the same losses, bit for bit:\n%s---\n%s", common,
            log_from(whole, at + 1), resumed);
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/%swhole", dir, name);
    snprintf(b, sizeof b, "%s/%sresumed", dir, name);
    // a LoRA checkpoint holds no whole model for fl_ckpts_equal to load
    int lora = strstr(common, "--lora") != NULL;
    t_check(ckpt_tensors_equal(a, b) && (lora || fl_ckpts_equal(a, b)),
            "%s: the final weights and optimizer state are bit for bit the same", common);
}

// Each step's learning rate in DIR/log.txt into lr[] (at most n), and how
// many there were.
static int step_lrs(const char *dirname, double *lr, int n) {
    char name[256];
    static char log[16384];
    snprintf(name, sizeof name, "%s/log.txt", dirname);
    read_file(name, log, sizeof log);
    int k = 0;
    for (const char *p = strstr(log, " lr "); p && k < n; p = strstr(p + 1, " lr "))
        lr[k++] = atof(p + 4);
    return k;
}

// A DeepSpeed single-GPU config as such configs come (HF's ZeRO-2 offload
// example, "auto" values given): an fp16 block switched off with its
// settings, WarmupDecayLR, steps_per_print, wall_clock_breakdown. It runs,
// at DeepSpeed's rates: 0 before its scheduler's first step and at its
// iteration 0 (log 1), then warmup_max_lr, then down a line to 0 at
// total_num_steps.
static void test_deepspeed_zero2_offload_example(void) {
    char args[1024];
    snprintf(args, sizeof args,
             "train --config %s --model tiny --tokenizer byte --data small --seq-len 16 "
             "--steps 6 --out ds_z2 --sample-tokens 0 --eval-iters 1 --threads 1 --device test",
             t_source_path("tests/fixtures/deepspeed_zero2_offload.json"));
    int rc = fitlm(args);
    t_check(rc == 0 && strstr(output, "ZeRO-2 on one process") &&
                strstr(output, "(WarmupDecayLR from 0, warmup 2 log, total_num_steps 6)") &&
                strstr(output, "step     6/6") && !strstr(output, "step     5/6"),
            "the ZeRO-2 offload example config runs, printing its last step only (steps_per_print "
            "2000) (status %d): %.600s",
            rc, output);
    const double want[] = {0, 0, 3e-4, 3e-4, 2.25e-4, 1.5e-4};
    double lr[8];
    int n = step_lrs("ds_z2", lr, 8), same = n == 6;
    for (int i = 0; same && i < n; i++) same = fabs(lr[i] - want[i]) <= 1e-6 * want[i];
    t_check(same, "WarmupDecayLR's rates, step by step (%d steps: %g %g %g %g %g %g)", n, lr[0],
            lr[1], lr[2], lr[3], lr[4], lr[5]);
}

// Hugging Face's ZeRO-3 example config, verbatim: its "auto" values are
// fitlm's own settings (its flags here), as Hugging Face's Trainer fills
// them from its arguments: WarmupLR's log warmup over --warmup 3 from 0 to
// --lr; the fp16 block "auto" is off under bf16; a resume (on the cpu)
// keeps "auto" and goes on bit for bit.
static void test_hf_ds_config_zero3(void) {
    char args[1024];
    snprintf(args, sizeof args,
             "train --config %s --model tiny --tokenizer byte --data small --seq-len 16 --batch 2 "
             "--grad-accum 2 --steps 6 --lr 0.01 --warmup 3 --precision bf16 --sample-tokens 0 "
             "--eval-iters 1 --threads 1 --device test",
             t_source_path("tests/fixtures/hf_ds_config_zero3.json"));
    resume_matches("hf3_", args, 3, 1);
    t_check(strstr(output, "adamw lr 0.01 (WarmupLR from 0, warmup 3 log)") &&
                strstr(output, "1 rank, ZeRO-3") && strstr(output, "step     6/6"),
            "Hugging Face's ZeRO-3 example runs and resumes, its \"auto\" values fitlm's: %.600s",
            output);
    const double want[] = {0, 0, 0.0063092975357145747, 0.01, 0.01, 0.01};
    double lr[8];
    int n = step_lrs("hf3_whole", lr, 8), same = n == 6;
    for (int i = 0; same && i < n; i++) same = fabs(lr[i] - want[i]) <= 1e-6 * want[i];
    t_check(same, "WarmupLR's rates at the \"auto\" values (%d steps: %g %g %g %g %g %g)", n, lr[0],
            lr[1], lr[2], lr[3], lr[4], lr[5]);
    write_text("autotype.json", "{\"optimizer\": {\"type\": \"auto\"}}");
    fails_with("train --config autotype.json", "optimizer.type must be one of");
    // its ZeRO-3 buckets' "auto"s as the Trainer fills them from the hidden
    // size: 10 n_embd = 640 elements persist, no block of llama-tiny, so
    // under its weight offload the device holds a ring of blocks, not the
    // whole weights that DeepSpeed's default threshold (1e5) keeps there
    const char *plan = "plan --model llama-tiny --tokenizer byte --data small --seq-len 16 "
                       "--batch 2 --precision bf16 --device test --config";
    size_t host[2] = {0, 0}, device[2] = {0, 0};
    write_text("hf3_numbers.json",
               "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": "
               "\"cpu\"}, \"offload_param\": {\"device\": \"cpu\"}}}");
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args, "%s %s", plan,
                 k ? "hf3_numbers.json" : t_source_path("tests/fixtures/hf_ds_config_zero3.json"));
        const char *row = fitlm(args) == 0 ? strstr(output, "\n  params ") : NULL;
        if (row) sscanf(row, " params %zu %zu", &host[k], &device[k]);
    }
    t_check(host[0] && device[0] < host[0] && device[1] == host[1],
            "ZeRO-3's \"auto\" buckets from the hidden size: the device holds %zu of the %zu "
            "weight bytes (DeepSpeed's defaults: %zu of %zu)",
            device[0], host[0], device[1], host[1]);
}

// DeepSpeed's scheduler steps after each update an fp16 overflow did not
// skip: WarmupLR (linear, 0.001 to 0.01 over 4) after n updates applied is
// rate[n], whatever the steps skipped before; a resume goes on with it.
static void test_deepspeed_schedule_skips(void) {
    write_text(
        "dsched.json",
        "{\"train_micro_batch_size_per_gpu\": 2, \"seq_len\": 16, \"model\": {\"preset\": "
        "\"tiny\"}, \"data\": \"small\", \"tokenizer\": \"byte\", \"sample_tokens\": 0, "
        "\"eval_iters\": 1, \"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
        "{\"warmup_min_lr\": 0.001, \"warmup_max_lr\": 0.01, \"warmup_num_steps\": 4, "
        "\"warmup_type\": \"linear\"}}, \"fp16\": {\"enabled\": true, \"initial_scale_power\": "
        "20, \"hysteresis\": 1}, \"steps_per_print\": 3}");
    const char *run = "train --config dsched.json --steps 8 --threads 1";
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s --out dsched", run);
    int rc = fitlm(cmd);
    t_check(rc == 0 && strstr(output, "step     3/8") && strstr(output, "step     8/8") &&
                !strstr(output, "step     4/8"),
            "steps_per_print 3: the step lines of steps 3, 6 and the last (status %d): %.600s", rc,
            output);
    static char metrics[65536];
    read_file("dsched/metrics.jsonl", metrics, sizeof metrics);
    const double rate[] = {0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01};
    int steps = 0, applied = 0, skips = 0, ok = 1;
    for (const char *p = strstr(metrics, "\"lr\":"); p; p = strstr(p + 1, "\"lr\":"), steps++) {
        double lr = atof(p + 5), want = rate[applied < 5 ? applied : 5];
        const char *skipped = strstr(p, "\"skipped\":");
        int skip = skipped && atoi(skipped + 10);
        if (fabs(lr - want) > 1e-6 * want) {
            ok = 0;
            printf("  step %d: lr %g after %d updates, want %g\n", steps + 1, lr, applied, want);
        }
        skips += skip;
        applied += !skip;
    }
    t_check(ok && steps == 8 && skips > 0 && applied > 2,
            "each step's rate is WarmupLR's at the updates applied before it (%d steps, %d "
            "skipped by fp16 overflows)",
            steps, skips);
    resume_matches("dsched_", run, 6, 1);
}

// 3 steps, save, resume, 3 more = 6 uninterrupted steps; `extra` selects the
// model and strategies.
static void resume_is_bitwise(const char *name, const char *extra) {
    char common[512];
    snprintf(common, sizeof common,
             "train --config %s --steps 6 --eval-every 0 --sample-tokens 0 --threads 2 "
             "--seed 11 --lr 0.01 %s",
             strstr(extra, "lomo") ? "fused.json" : "run.json", extra);
    resume_matches(name, common, 3, 2);
}

static void test_resume_is_bitwise(void) {
    resume_is_bitwise("", "");
    resume_is_bitwise("llama_",
                      "--model llama-tiny --grad-accum 2 --activation-checkpointing block "
                      "--logits-chunk 5");
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
    fl_pretrained_load(hf, &b, FL_F32, NULL);
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
    fl_pretrained_load(hf, &b, FL_BF16, NULL);
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

// The demo's shape trained from scratch takes its own recipe for the keys a
// run does not give; another shape and pretrained weights keep the defaults.
static void test_demo_recipe(void) {
    const char *run = "train --data small --tokenizer byte --batch 1 --seq-len 16 --threads 1 "
                      "--eval-every 0 --eval-iters 1 --sample-tokens 0";
    // the whole recipe's 320 steps (and its resume below) in the release
    // build: the sanitizer build's quick list runs the short variants
    int rc = 0;
    if (!t_quick()) {
        rc = fitlmf("%s --out ''", run);
        t_check(rc == 0 &&
                    strstr(output, "320 steps | adamw lr 0.006 (cosine, warmup 160, floor 0.1) "
                                   "betas 0.9,0.99 ") &&
                    strstr(output, "step   320/320"),
                "the demo's recipe: %.600s", output);
    }
    rc = fitlmf("%s --out '' --steps 6 --lr 0.002", run);
    t_check(rc == 0 && strstr(output, "6 steps | adamw lr 0.002 (cosine, warmup 3, floor 0.1) "
                                      "betas 0.9,0.99 "),
            "given keys win; the warm-up stays half the steps: %.600s", output);
    rc = fitlmf("%s --out '' --steps 2 --warmup 1 --betas 0.8,0.9", run);
    t_check(rc == 0 && strstr(output, "2 steps | adamw lr 0.006 (cosine, warmup 1, floor 0.1) "
                                      "betas 0.8,0.9 "),
            "given warm-up and betas win: %.600s", output);
    const char *defaults = "lr 0.003 (cosine, warmup 100, floor 0.1) betas 0.9,0.95 ";
    rc = fitlmf("%s --out '' --steps 2 --n-layer 2", run);
    t_check(rc == 0 && strstr(output, defaults), "another shape keeps the defaults: %.600s",
            output);
    rc = fitlmf("%s --steps 2 --out demo_run", run);
    t_check(rc == 0 && fitlm("export demo_run -o demo_hf") == 0, "a demo model exported: %.300s",
            output);
    rc = fitlmf("%s --out '' --steps 2 --init-from demo_hf", run);
    t_check(rc == 0 && strstr(output, "n_layer 4, n_head 4 (kv 4), n_embd 128") &&
                strstr(output, defaults),
            "the demo's shape from pretrained weights keeps the defaults: %.600s", output);
    rc = fitlmf("%s --out '' --steps 2 --optimizer sgd", run);
    t_check(rc == 0 && strstr(output, "2 steps | sgd lr 0.003 (cosine, warmup 100,"),
            "another optimizer keeps the defaults: %.600s", output);
    // a resumed run takes the same recipe (checkpoints keep the given keys only)
    if (t_quick()) return;
    resume_matches("demo_", run, 160, 1);
    t_check(strstr(output, "320 steps | adamw lr 0.006 (cosine, warmup 160, floor 0.1) "
                           "betas 0.9,0.99 ") != NULL,
            "resuming the demo keeps its recipe: %.600s", output);
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
// This CPU as tests/fixtures/recorded_logs/cpu.txt names CPUs: the model name
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

// Recorded GPT-2 runs (tests/fixtures/recorded_logs/README.md): every logged
// loss, lr, gradient norm and validation loss must come out the same. Bitwise in the release
// build on the CPU class they were recorded on; elsewhere to a tolerance.
static void test_matches_recorded_logs(void) {
    char here[512], recorded[512] = "";
    cpu_class(here, sizeof here);
    size_t n;
    char *cpu = (char *)t_read_file(t_source_path("tests/fixtures/recorded_logs/cpu.txt"), &n);
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
        snprintf(want_path, sizeof want_path, "tests/fixtures/recorded_logs/gpt2_tiny_%s.log",
                 precisions[p]);
        snprintf(got_path, sizeof got_path, "%s/pre_%s/log.txt", dir, precisions[p]);
        size_t nw, ng;
        char *want = (char *)t_read_file(t_source_path(want_path), &nw);
        char *got = rc == 0 ? (char *)t_read_file(got_path, &ng) : NULL;
        if (same_cpu) {
            t_check(got && ng == nw && !memcmp(got, want, nw),
                    "%s: the log is bitwise the recorded one (%s)", precisions[p], here);
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

// Polls every 0.1 ms, up to `seconds`, until ready(path, pid); 0 when the
// time runs out or process pid has exited first (it is left to be reaped).
static int poll_until(int (*ready)(const char *path, pid_t pid), const char *path, pid_t pid,
                      double seconds) {
    struct timespec poll = {0, 100000};
    for (double waited = 0; waited < seconds; waited += 1e-4) {
        if (ready(path, pid)) return 1;
        siginfo_t info = {0};
        if (waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid)
            return 0;
        nanosleep(&poll, NULL);
    }
    return 0;
}

// A temporary file of process pid in directory path (NAME.tmp.<pid>: a
// write under way)?
static int has_tmp_of(const char *path, pid_t pid) {
    char suffix[32];
    int len = snprintf(suffix, sizeof suffix, ".tmp.%ld", (long)pid);
    DIR *d = opendir(path);
    int found = 0;
    for (struct dirent *e; d && !found && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        found = n >= (size_t)len && !strcmp(e->d_name + n - len, suffix);
    }
    if (d) closedir(d);
    return found;
}

static int path_exists(const char *path, pid_t pid) {
    (void)pid;
    return access(path, F_OK) == 0;
}

static void test_kill_while_saving(void) {
    const char *bin = getenv("FITLM_BINARY");
    char out[600];
    snprintf(out, sizeof out, "%s/killed", dir);
    srand(12345);
    // (the sanitizer build's quick list: 14, its start-ups slower; the
    // release build's 30 look for the rare moments)
    int loads = 0, tmp_seen = 0, kills = t_quick() ? 14 : 30, last_step = 0, monotonic = 1;
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
                execl(bin, bin, "train", "--resume", "killed", "--threads", "1", "--peak-tflops",
                      "1", (char *)NULL);
            else
                execl(bin, bin, "train", "--config", "run.json", "--steps", "1000000",
                      "--save-every", "1", "--out", "killed", "--eval-every", "0",
                      "--sample-tokens", "0", "--threads", "1", "--lr", "0.001", "--overwrite",
                      "--peak-tflops", "1", (char *)NULL);
            _exit(3);
        }
        // The first run is killed once its first checkpoint is complete: on
        // a loaded machine its start-up alone can outlast a random delay
        // (an earlier version counted such kills as failures). After that,
        // most kills land at a random moment; every third as soon as the
        // run is seen writing a file, so that some certainly land in a
        // write whatever the build's speed (a sanitizer build's steps are
        // slower, its writes no slower, and 30 random kills once caught
        // none).
        struct timespec ts = {0, (long)(50 + rand() % 400) * 1000000L};
        if (i == 0)
            t_check(poll_until(path_exists, latest, pid, 120.0),
                    "the first run saves a checkpoint");
        else if (i % 3 != 2 || !poll_until(has_tmp_of, out, pid, 20.0))
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
    t_check(loads == kills && last_step > 10,
            "the newest complete checkpoint loads after every kill (%d of %d)", loads, kills);
    t_check(monotonic, "resumed runs continue from the newest checkpoint, never going back");
    t_check(tmp_seen > 0, "some kills landed while a checkpoint was being written (%d)", tmp_seen);
}

// ----------------------------------------------------------------------------
// Whole-set replacement and non-finite weights (issue 15): an export or a
// shard set written over an earlier one is swapped in whole, so a kill at
// any moment leaves the old set or the new one, never a mix; sample and
// export refuse NaN and Inf, naming the tensor.

// A GPT-2 "demo" shape (byte vocabulary) from seed, saved as checkpoint
// dir/name; poison >= 0: element 3 of that row set to `value` first.
static void save_demo_ckpt(const char *name, uint64_t seed, int poison, float value) {
    fl_model_config cfg;
    fl_model_preset(&cfg, "demo");
    cfg.vocab_size = 257;
    fl_model_config_finish(&cfg);
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, seed);
    if (poison >= 0) ((float *)m.params)[m.table.views[poison].offset + 3] = value;
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    fl_train_ckpt_save(path, 1, &m, NULL, NULL, NULL, &byte_tok, NULL, 0);
    fl_model_free(&m);
}

// Names, sizes and CRC-32s of a directory's files, sorted: equal digests are
// equal file sets.
static void dir_digest(const char *name, char *out, size_t size) {
    char path[700], names[256][256];
    int n = 0;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d)) && n < 256;)
        if (e->d_name[0] != '.') snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    if (d) closedir(d);
    qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    size_t at = (size_t)snprintf(out, size, "%s", d ? "" : "(missing)");
    for (int i = 0; i < n && at < size; i++) {
        snprintf(path, sizeof path, "%s/%s/%s", dir, name, names[i]);
        size_t len;
        unsigned char *b = t_read_file(path, &len);
        at += (size_t)snprintf(out + at, size - at, "%s:%zu:%08x ", names[i], len,
                               (unsigned)fl_crc32(0, b, len));
        free(b);
    }
}

// Siblings dir/name.tmp.* and dir/name.old.* (a writer's leftovers).
static int leftovers(const char *name) {
    char prefix[200];
    int n = 0, len = snprintf(prefix, sizeof prefix, "%s.", name);
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));)
        n += !strncmp(e->d_name, prefix, (size_t)len) &&
             (!strncmp(e->d_name + len, "tmp.", 4) || !strncmp(e->d_name + len, "old.", 4));
    if (d) closedir(d);
    return n;
}

// Entries of dir/name, or -1 when it does not exist.
static int count_entries(const char *name) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    DIR *d = opendir(path);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

// Starts `fitlm args...` in the scratch directory, silent, and SIGKILLs it
// once its temporary directory out.tmp.<pid> holds `files` entries, or has
// gone again (swapped in): a kill point by progress, not by time, so a slow
// or loaded machine moves it nowhere. files < 0: waits for the writer.
static void run_and_kill(const char **args, const char *out, int files) {
    const char *bin = getenv("FITLM_BINARY");
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir) != 0) _exit(2);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execv(bin, (char *const *)args);
        _exit(3);
    }
    char tmp[200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", out, (long)pid);
    int status, seen = 0;
    while (files >= 0 && waitpid(pid, &status, WNOHANG) == 0) {
        int n = count_entries(tmp);
        seen |= n >= 0;
        if (seen && (n < 0 || n >= files)) {
            kill(pid, SIGKILL);
            break;
        }
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    waitpid(pid, &status, 0);
}

// Runs two writers of one directory, `a` and `b` (whose complete sets have
// na and nb files), alternately, `kills` times, each killed at a point of
// its progress: after a random 0..n files of the new set, or after the swap;
// after every kill, `check` must find one complete set. Returns how many
// kills left a writer's temporaries behind (it was in the middle).
static int kill_writers(const char *out, const char **a, int na, const char **b, int nb, int kills,
                        void (*check)(int kill)) {
    int mid = 0;
    srand(4242);
    for (int k = 0; k < kills; k++) {
        int n = k % 2 ? nb : na;
        // 2 in 7 after the swap (odd: both writers), else within the writing;
        // the second half by two renames, as where the kernel cannot exchange
        if (k == kills / 2) setenv("FITLM_TEST_NO_EXCHANGE", "1", 1);
        run_and_kill(k % 2 ? b : a, out, k % 7 >= 5 ? n + 1 : rand() % (n + 1));
        mid += leftovers(out) > 0;
        check(k);
    }
    unsetenv("FITLM_TEST_NO_EXCHANGE");
    return mid;
}

static fl_model at_old_model, at_new_model;
static char at_old[16384], at_new[16384];
static int at_saw_old, at_saw_new, at_restored;

// The export directory is exactly one of the two reference exports and
// loads as that model (a DIR missing beside DIR.old.<pid>, a kill between
// the two renames where the kernel cannot exchange, is restored first).
static void check_export(int kill) {
    char path[600], got[16384];
    snprintf(path, sizeof path, "%s/at_hf", dir);
    if (access(path, F_OK) != 0 && leftovers("at_hf")) {
        fl_dir_recover(path);
        at_restored++;
    }
    dir_digest("at_hf", got, sizeof got);
    int is_old = !strcmp(got, at_old), is_new = !strcmp(got, at_new);
    at_saw_old += is_old;
    at_saw_new += is_new;
    if (!t_check(is_old || is_new, "after kill %d the export is the old or the new one: %s", kill,
                 got))
        return;
    fl_model m;
    fl_hf_load(path, &m, FL_F32);
    const fl_model *want = is_old ? &at_old_model : &at_new_model;
    t_check(m.table.numel == want->table.numel &&
                !memcmp(m.params, want->params, m.table.numel * sizeof(float)),
            "after kill %d the export loads as the %s weights", kill, is_old ? "old" : "new");
    fl_model_free(&m);
}

static void test_kill_while_exporting(void) {
    save_demo_ckpt("at_a", 1, -1, 0);
    save_demo_ckpt("at_b", 2, -1, 0);
    // old: one file; new: seven shards and an index, another layout to mix
    int rc = fitlm("export at_a -o at_ref_a") |
             fitlm("export at_b -o at_ref_b --max-shard-size 600K") | fitlm("export at_a -o at_hf");
    t_check(rc == 0, "reference exports: %.300s", output);
    dir_digest("at_ref_a", at_old, sizeof at_old);
    dir_digest("at_ref_b", at_new, sizeof at_new);
    t_check(strstr(at_new, "model-00002-of-") && strstr(at_old, "model.safetensors:"),
            "the two exports differ in layout: %s | %s", at_old, at_new);
    char path[600];
    snprintf(path, sizeof path, "%s/at_ref_a", dir);
    fl_hf_load(path, &at_old_model, FL_F32);
    snprintf(path, sizeof path, "%s/at_ref_b", dir);
    fl_hf_load(path, &at_new_model, FL_F32);
    // a file of the user's beside the export stays through every swap
    write_text("at_hf/README.md", "mine\n");
    const char *a[] = {"fitlm", "export", "at_a", "-o", "at_hf", NULL};
    const char *b[] = {"fitlm", "export", "at_b", "-o", "at_hf", "--max-shard-size", "600K", NULL};
    // the references hold no README.md: compare with it added
    write_text("at_ref_a/README.md", "mine\n");
    write_text("at_ref_b/README.md", "mine\n");
    dir_digest("at_ref_a", at_old, sizeof at_old);
    dir_digest("at_ref_b", at_new, sizeof at_new);
    int kills = 28, mid = kill_writers("at_hf", a, count_entries("at_ref_a"), b,
                                       count_entries("at_ref_b"), kills, check_export);
    printf("  %d kills while exporting: the old export %d times, the new %d, %d killed in the "
           "middle (temporaries left), %d restored\n",
           kills, at_saw_old, at_saw_new, mid, at_restored);
    t_check(mid > 0 && at_saw_old > 0 && at_saw_new > 0,
            "kills landed mid-export (%d) and both outcomes occurred (%d old, %d new)", mid,
            at_saw_old, at_saw_new);
    // the next clean run removes the killed ones' temporaries
    rc = fitlm("export at_b -o at_hf --max-shard-size 600K");
    char got[16384];
    dir_digest("at_hf", got, sizeof got);
    t_check(rc == 0 && !strcmp(got, at_new) && leftovers("at_hf") == 0,
            "a clean export after the kills: the new set, no temporaries left (%d): %s",
            leftovers("at_hf"), got);
    // a kill between the two renames (no exchange): DIR missing, DIR.old.<pid>
    // the complete old export, DIR.tmp.<pid> the new one; the next run
    // restores the old one before it writes
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    char from[700], to[700];
    snprintf(from, sizeof from, "%s/at_hf", dir);
    snprintf(to, sizeof to, "%s/at_hf.old.%ld", dir, (long)dead);
    t_check(rename(from, to) == 0, "rename %s aside", from);
    t_mark_temporary(to, dead); // as the writer marked both
    snprintf(to, sizeof to, "%s/at_hf.tmp.%ld", dir, (long)dead);
    t_mark_temporary(to, dead);
    strcat(to, "/config.json");
    t_write_text(to, "{\"partial\": true}");
    rc = fitlm("export at_a -o at_hf");
    dir_digest("at_hf", got, sizeof got);
    t_check(rc == 0 && strstr(output, "restored at_hf from ./at_hf.old.") && !strcmp(got, at_old) &&
                leftovers("at_hf") == 0,
            "a half-swapped export is restored, then replaced; no leftovers: %.300s | %s", output,
            got);
    fl_model_free(&at_old_model);
    fl_model_free(&at_new_model);
}

static char tok_old[16384], tok_new[16384];
static uint64_t tok_old_n, tok_new_n;
static int tok_saw_old, tok_saw_new;

static uint64_t train_tokens(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    fl_loader l;
    fl_loader_open(&l, path, "train", 16, 1, 0, 0, 1); // dies on a damaged shard
    uint64_t n = l.n_tokens;
    fl_loader_close(&l);
    return n;
}

// The shard directory is exactly the old or the new set, and the loader
// opens it with that set's token count.
static void check_shards(int kill) {
    char got[16384];
    dir_digest("at_tok", got, sizeof got);
    int is_old = !strcmp(got, tok_old), is_new = !strcmp(got, tok_new);
    tok_saw_old += is_old;
    tok_saw_new += is_new;
    if (!t_check(is_old || is_new, "after kill %d the shards are the old or the new set: %s", kill,
                 got))
        return;
    uint64_t n = train_tokens("at_tok");
    t_check(n == (is_old ? tok_old_n : tok_new_n), "after kill %d the loader reads %llu tokens",
            kill, (unsigned long long)n);
}

static void test_kill_while_tokenizing(void) {
    // two texts of other words and lengths: 23 and 45 shards of 1024 tokens
    static char text[60000];
    const char *words[2][4] = {{"alpha", "beta", "gamma", "delta"},
                               {"red", "green", "blue", "violet"}};
    for (int t = 0; t < 2; t++) {
        size_t n = 0;
        unsigned r = 7u + (unsigned)t;
        for (int doc = 0; doc < 40; doc++) {
            for (int w = 0; w < (t ? 180 : 90); w++) {
                r = r * 1103515245u + 12345u;
                n += (size_t)snprintf(text + n, sizeof text - n, "%s ", words[t][(r >> 16) % 4]);
            }
            n += (size_t)snprintf(text + n, sizeof text - n, "\n\n");
        }
        write_text(t ? "at_new.txt" : "at_old.txt", text);
    }
    int rc = fitlm("tokenize at_old.txt -o at_tok_old --tokenizer byte --shard-tokens 1024") |
             fitlm("tokenize at_new.txt -o at_tok_new --tokenizer byte --shard-tokens 1024") |
             fitlm("tokenize at_old.txt -o at_tok --tokenizer byte --shard-tokens 1024");
    t_check(rc == 0, "reference shard sets: %.300s", output);
    dir_digest("at_tok_old", tok_old, sizeof tok_old);
    dir_digest("at_tok_new", tok_new, sizeof tok_new);
    tok_old_n = train_tokens("at_tok_old");
    tok_new_n = train_tokens("at_tok_new");
    t_check(tok_old_n != tok_new_n && strcmp(tok_old, tok_new), "the two sets differ (%llu, %llu)",
            (unsigned long long)tok_old_n, (unsigned long long)tok_new_n);
    const char *a[] = {"fitlm",  "tokenize",    "at_old.txt", "-o",
                       "at_tok", "--tokenizer", "byte",       "--shard-tokens",
                       "1024",   "--threads",   "1",          NULL};
    const char *b[] = {"fitlm",  "tokenize",    "at_new.txt", "-o",
                       "at_tok", "--tokenizer", "byte",       "--shard-tokens",
                       "1024",   "--threads",   "1",          NULL};
    int kills = 28, mid = kill_writers("at_tok", a, count_entries("at_tok_old"), b,
                                       count_entries("at_tok_new"), kills, check_shards);
    printf("  %d kills while tokenizing: the old set %d times, the new %d, %d killed in the "
           "middle\n",
           kills, tok_saw_old, tok_saw_new, mid);
    t_check(mid > 0 && tok_saw_old > 0 && tok_saw_new > 0,
            "kills landed mid-write (%d) and both outcomes occurred (%d old, %d new)", mid,
            tok_saw_old, tok_saw_new);
    // fewer shards over more: the set is replaced, no stale shard survives
    rc = fitlm("tokenize at_old.txt -o at_tok --tokenizer byte --shard-tokens 1024");
    char got[16384];
    dir_digest("at_tok", got, sizeof got);
    t_check(rc == 0 && !strcmp(got, tok_old) && leftovers("at_tok") == 0,
            "a clean tokenize after the kills: the old set alone, no temporaries: %s", got);
    // in place (a directory with a subdirectory): stale shards go whatever
    // their numbering
    char p[600];
    snprintf(p, sizeof p, "%s/at_tok/sub", dir);
    mkdir(p, 0755);
    write_text("at_tok/train_000999.bin", "stale");
    rc = fitlm("tokenize at_old.txt -o at_tok --tokenizer byte --shard-tokens 1024");
    snprintf(p, sizeof p, "%s/at_tok/train_000999.bin", dir);
    t_check(rc == 0 && access(p, F_OK) != 0 && train_tokens("at_tok") == tok_old_n,
            "written in place, a stale shard numbered past a gap is removed: %.200s", output);
}

static void test_refuses_nonfinite_weights(void) {
    fl_model_config cfg;
    fl_model_preset(&cfg, "demo");
    cfg.vocab_size = 257;
    fl_model_config_finish(&cfg);
    fl_param_table t;
    fl_model_table(&t, &cfg);
    char row[FL_PARAM_NAME_MAX], msg[200];
    snprintf(row, sizeof row, "%s", t.views[5].name);
    fl_params_free(&t);
    save_demo_ckpt("at_nan", 3, 5, NAN);
    snprintf(msg, sizeof msg, "tensor '%s' holds NaN at element 3", row);
    fails_with("sample --checkpoint at_nan --tokens 4", msg);
    fails_with("export at_nan -o at_nan_hf", msg);
    char p[600];
    snprintf(p, sizeof p, "%s/at_nan_hf", dir);
    t_check(access(p, F_OK) != 0 && leftovers("at_nan_hf") == 0, "a refused export writes nothing");
    // a Hugging Face directory with an Inf; an adapter with a NaN
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 4);
    snprintf(p, sizeof p, "%s/at_good_hf", dir);
    fl_hf_export(p, &m, m.params, FL_F32, 0);
    fl_lora_config lc;
    fl_lora_config_defaults(&lc);
    lc.r = 4;
    fl_model_add_lora(&m, &lc, 5);
    ((float *)m.lora.params)[m.lora.table.views[1].offset + 2] = NAN;
    snprintf(p, sizeof p, "%s/at_nan_adapter", dir);
    fl_peft_save(p, &m, NULL);
    snprintf(msg, sizeof msg, "at_nan_adapter: LoRA adapter tensor '%s' holds NaN at element 2",
             m.lora.table.views[1].name);
    fl_model_free(&m);
    fails_with("sample --checkpoint at_good_hf --adapter at_nan_adapter --tokenizer byte", msg);
    fails_with("export at_good_hf --merge --adapter at_nan_adapter -o at_nan_merged", msg);
    fl_model_init(&m, &cfg, FL_F32, 4);
    ((float *)m.params)[m.table.views[0].offset] = -INFINITY;
    snprintf(p, sizeof p, "%s/at_inf_hf", dir);
    fl_hf_export(p, &m, m.params, FL_F32, 0);
    snprintf(msg, sizeof msg, "tensor '%s' holds Inf at element 0", m.table.views[0].name);
    fl_model_free(&m);
    fails_with("sample --checkpoint at_inf_hf --tokenizer byte", msg);
    t_check(fitlm("sample --checkpoint at_good_hf --tokenizer byte --tokens 4") == 0,
            "finite weights still sample: %.200s", output);
}

// --seed takes train's 64-bit syntax, exactly: 2^53 and 2^53 + 1 are two
// seeds (through a double they were one).
static void test_sample_seed_is_64_bit(void) {
    const char *run = "sample --checkpoint at_a --tokens 48 --temperature 1 --top-k 0 --seed";
    static char first[sizeof output];
    char cmd[300];
    snprintf(cmd, sizeof cmd, "%s 9007199254740992", run);
    int rc = fitlm(cmd);
    memcpy(first, output, sizeof first);
    snprintf(cmd, sizeof cmd, "%s 9007199254740993", run);
    int rc2 = fitlm(cmd);
    t_check(rc == 0 && rc2 == 0 && strcmp(first, output),
            "seeds 2^53 and 2^53 + 1 give different samples: %.100s | %.100s", first, output);
    snprintf(cmd, sizeof cmd, "%s 18446744073709551615", run);
    t_check(fitlm(cmd) == 0, "--seed 2^64 - 1 is accepted: %.200s", output);
    fails_with("sample --checkpoint at_a --seed 18446744073709551616", "whole number in [0, 2^64)");
    fails_with("sample --checkpoint at_a --seed -1", "whole number in [0, 2^64)");
    fails_with("sample --checkpoint at_a --seed 1e3", "whole number in [0, 2^64)");
}

// ----------------------------------------------------------------------------
// runs that never lose work: the output directory is the run's own (a resume
// continues where its checkpoint is; a new run does not start over another;
// one process at a time), an interrupt saves, divergence never overwrites a
// good checkpoint, and a resume says what it changes.

static char run_data[4200];

// A tiny GPT-2 on the byte-tokenized Brown corpus, ~1 ms a step; one thread,
// so that a loaded machine does not slow it down by spinning OpenMP threads.
static const char *small_run(void) {
    if (!*run_data)
        snprintf(run_data, sizeof run_data,
                 "train --model tiny --tokenizer byte --data %s --batch 2 --seq-len 16 "
                 "--eval-every 0 --sample-tokens 0 --threads 1",
                 t_source_path("data/brown_byte"));
    return run_data;
}

// The step of SUB's newest checkpoint, after reading every tensor (CRC-32
// checked: a damaged file fails the test); -1 when SUB has no `latest`.
static int latest_step(const char *sub) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s/latest", dir, sub);
    if (access(path, F_OK) != 0) return -1;
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    fl_ckpt *ck = fl_ckpt_open(path);
    int step = fl_ckpt_step(ck);
    fl_ckpt_close(ck);
    fl_model m;
    char tok[32];
    fl_ckpt_load_model(path, &m, FL_F32, tok, sizeof tok);
    fl_model_free(&m);
    return step;
}

static int exists(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

// Files of SUB whose name holds ".tmp".
static int count_tmp(const char *sub) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, sub);
    DIR *d = opendir(path);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strstr(e->d_name, ".tmp") != NULL;
    if (d) closedir(d);
    return n;
}

// Starts `fitlm ARGS` (split at spaces) in the scratch directory, its output
// into the file `out`.
static pid_t spawn_fitlm(const char *out, const char *args) {
    static char copy[8192];
    snprintf(copy, sizeof copy, "%s", args);
    char *argv[128];
    const char *bin = getenv("FITLM_BINARY");
    int argc = 0;
    argv[argc++] = (char *)(bin ? bin : "fitlm");
    for (char *tok = strtok(copy, " "); tok && argc < 127; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    argv[argc] = NULL;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir) != 0) _exit(2);
        int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], argv);
        _exit(3);
    }
    return pid;
}

// Waits until SUB/log.txt has `lines` step lines (the run is mid-training);
// 0 after 20 s or when the child has exited.
static int wait_for_steps(const char *sub, int lines, pid_t pid) {
    char name[256];
    static char log[1 << 16];
    snprintf(name, sizeof name, "%s/log.txt", sub);
    for (int i = 0; i < 4000; i++) {
        read_file(name, log, sizeof log);
        int n = 0;
        for (const char *p = strstr(log, " loss "); p; p = strstr(p + 1, " loss ")) n++;
        if (n >= lines) return 1;
        if (waitpid(pid, NULL, WNOHANG) == pid) return 0;
        struct timespec ts = {0, 5000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

// The child's exit status (128 + signal when killed); kills it after 30 s.
static int exit_status(pid_t pid) {
    int status = 0;
    for (int i = 0; i < 3000 && waitpid(pid, &status, WNOHANG) != pid; i++) {
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
        if (i == 2999) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
        }
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The number after `key` in text, or -1.
static int number_after(const char *text, const char *key) {
    const char *p = strstr(text, key);
    return p ? atoi(p + strlen(key)) : -1;
}

// --learn-vocab: a BPE learnt from the training documents, written beside
// the shards, trained on and sampled from with --tokenizer-path
static void test_learn_vocab(void) {
    fails_with("tokenize short.txt -o lv --tokenizer byte --learn-vocab 300",
               "--learn-vocab learns a GPT-2-style BPE (--tokenizer gpt2), not --tokenizer byte");
    fails_with("tokenize short.txt -o lv --learn-vocab 300 --tokenizer-path x",
               "--learn-vocab writes its tokenizer to -o lv; --tokenizer-path names an existing "
               "one");
    fails_with("tokenize short.txt -o lv --learn-vocab 256", "expects a number in [257, 1e+06]");
    fails_with("tokenize short.txt -o lv --format jsonl --learn-vocab 300",
               "--learn-vocab is an option of --format text");
    int rc = fitlmf("tokenize %s -o lv --learn-vocab 1000 --val-fraction 0.06",
                    t_source_path("data/brown.txt"));
    t_check(rc == 0 &&
                strstr(output, "learnt a byte-level BPE of 1000 tokens from 470 training "
                               "documents") &&
                strstr(output, "tokenizer gpt2 (vocab 1000)") && exists("lv/encoder.json") &&
                exists("lv/vocab.bpe") && exists("lv/train_000000.bin"),
            "tokenize --learn-vocab 1000 writes the tokenizer beside the shards (status %d): "
            "%.400s",
            rc, output);
    rc = fitlm("train --model tiny --data lv --tokenizer-path lv --batch 2 --seq-len 16 --steps 2 "
               "--eval-every 0 --sample-tokens 8 --threads 1 --out ''");
    t_check(rc == 0 && strstr(output, "vocab 1000 (padded 1024)") && strstr(output, "--- sample"),
            "a model trains on the learnt tokens and samples with their tokenizer (status %d): "
            "%.400s",
            rc, output);
    fails_with("train --model tiny --data lv --batch 2 --seq-len 16 --steps 1 --out ''",
               "the training data lv has a vocabulary of 1000, but the gpt2 tokenizer at "
               "data/gpt2 has 50257: the data was tokenized with another one (its directory "
               "holds a learnt one: --tokenizer-path lv)");
}

static void test_resume_continues_in_its_directory(void) {
    int rc = fitlmf("%s --steps 4 --save-every 2 --keep-checkpoints 0 --out orig", small_run());
    t_check(rc == 0 && latest_step("orig") == 4, "a run to copy (status %d): %.300s", rc, output);
    static char before[8192], after[8192];
    read_file("orig/log.txt", before, sizeof before);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp -a %s/orig %s/copy", dir, dir);
    t_check(system(cmd) == 0, "copy the run directory");
    // the copy's checkpoints record out_dir "orig": the resume must not go there
    rc = fitlm("train --resume copy --steps 6");
    read_file("orig/log.txt", after, sizeof after);
    t_check(rc == 0 && strstr(output, "continuing in copy") && latest_step("copy") == 6,
            "resuming a copy continues in the copy (status %d): %.400s", rc, output);
    t_check(latest_step("orig") == 4 && !exists("orig/ckpt_00000006.fitlm") &&
                exists("orig/ckpt_00000002.fitlm") && !strcmp(before, after),
            "the original run is untouched: its latest, its checkpoints, its log");
    // --out given now wins
    rc = fitlm("train --resume orig --steps 6 --out elsewhere");
    t_check(rc == 0 && latest_step("elsewhere") == 6 && latest_step("orig") == 4,
            "--resume DIR --out OTHER continues in OTHER (status %d): %.300s", rc, output);
    // a checkpoint file: its directory; the log keeps the lines up to its step
    rc = fitlm("train --resume copy/ckpt_00000002.fitlm --steps 3");
    static char log[8192];
    read_file("copy/log.txt", log, sizeof log);
    t_check(rc == 0 && strstr(output, "continuing in copy") && latest_step("copy") == 3,
            "--resume FILE continues in the file's directory (status %d): %.300s", rc, output);
    t_check(!strncmp(log, "step 1 loss ", 12) && strstr(log, "\nstep 2 loss ") &&
                strstr(log, "\nstep 3 loss ") && !strstr(log, "step 4 ") &&
                !strncmp(before, log, (size_t)(log_from(before, 3) - before)),
            "the log keeps every line up to the checkpoint's step, nothing after it:\n%s", log);
}

static void test_new_run_refuses_a_used_directory(void) {
    int rc = fitlmf("%s --steps 2 --out orig", small_run());
    t_check(rc == 1 && strstr(output, "orig already holds a run") &&
                strstr(output, "--resume orig") && strstr(output, "--overwrite"),
            "a new run into a run's directory is refused, saying how to resume or start over "
            "(status %d): %.400s",
            rc, output);
    char path[600];
    snprintf(path, sizeof path, "%s/logonly", dir);
    mkdir(path, 0755);
    write_text("logonly/log.txt", "step 1 loss 5\n");
    rc = fitlmf("%s --steps 2 --out logonly", small_run());
    t_check(rc == 1 && strstr(output, "logonly already holds a run"),
            "a directory with only a log is a run too (status %d): %.300s", rc, output);
    // --overwrite: orig holds ckpt 2 and 4 of the old run; this run saves 1, 2
    // (replacing the old 2) and 3, and prunes only its own
    rc = fitlmf("%s --steps 3 --save-every 1 --keep-checkpoints 1 --out orig --overwrite",
                small_run());
    t_check(rc == 0 && latest_step("orig") == 3 && !exists("orig/ckpt_00000001.fitlm") &&
                !exists("orig/ckpt_00000002.fitlm"),
            "--overwrite starts over; keep 1 prunes this run's older checkpoints (status %d): "
            "%.300s",
            rc, output);
    snprintf(path, sizeof path, "%s/orig/ckpt_00000004.fitlm", dir);
    int kept = access(path, F_OK) == 0;
    char old_run[64] = "", new_run[64] = "";
    if (kept) {
        fl_ckpt *ck = fl_ckpt_open(path);
        snprintf(old_run, sizeof old_run, "%s", fl_ckpt_run(ck));
        fl_ckpt_close(ck);
        snprintf(path, sizeof path, "%s/orig", dir);
        ck = fl_ckpt_open(path);
        snprintf(new_run, sizeof new_run, "%s", fl_ckpt_run(ck));
        fl_ckpt_close(ck);
    }
    t_check(kept && *old_run && *new_run && strcmp(old_run, new_run),
            "the old run's checkpoint 4 is never deleted by the new run (runs %s and %s)", old_run,
            new_run);
}

static void test_one_run_per_directory_and_sigterm(void) {
    char args[8192];
    snprintf(args, sizeof args, "%s --steps 1000000 --save-every 50 --out locked", small_run());
    pid_t pid = spawn_fitlm("locked.out", args);
    int running = wait_for_steps("locked", 3, pid);
    int rc = fitlmf("%s --steps 2 --out locked --overwrite", small_run());
    char says[128];
    snprintf(says, sizeof says, "locked is in use by another fitlm run (process %d)", (int)pid);
    t_check(running && rc == 1 && strstr(output, says),
            "a second run into a directory fails at once naming the first's pid (status %d): "
            "%.300s",
            rc, output);
    kill(pid, SIGTERM);
    int status = exit_status(pid);
    static char text[1 << 16];
    read_file("locked.out", text, sizeof text);
    int step = number_after(text, "interrupted by SIGTERM after step ");
    t_check(status == 143 && step > 0 && strstr(text, "checkpoint written to locked"),
            "SIGTERM: the step finishes, a checkpoint is saved, status 143 (status %d): %.200s",
            status, strstr(text, "interrupted") ? strstr(text, "interrupted") : "");
    t_check(latest_step("locked") == step && count_tmp("locked") == 0,
            "the interrupt's checkpoint is latest (step %d) and no temporary file is left", step);
    rc = fitlmf("train --resume locked --steps %d", step + 2);
    char resumed[64];
    snprintf(resumed, sizeof resumed, "resumed from step %d", step);
    t_check(rc == 0 && strstr(output, resumed) && latest_step("locked") == step + 2,
            "the run continues from the interrupt's checkpoint (status %d): %.300s", rc, output);
}

static void test_sigint_saves_and_a_second_exits(void) {
    char args[8192];
    snprintf(args, sizeof args, "%s --steps 1000000 --out intr", small_run());
    pid_t pid = spawn_fitlm("intr.out", args);
    int running = wait_for_steps("intr", 5, pid);
    kill(pid, SIGINT);
    int status = exit_status(pid);
    static char text[1 << 16];
    read_file("intr.out", text, sizeof text);
    int step = number_after(text, "interrupted by SIGINT after step ");
    t_check(running && status == 130 && step >= 5 &&
                strstr(text, "checkpoint written to intr (continue with fitlm train --resume "
                             "intr)"),
            "SIGINT: a checkpoint, a message saying where, status 130 (status %d): %.200s", status,
            strstr(text, "interrupted") ? strstr(text, "interrupted") : "");
    t_check(latest_step("intr") == step && count_tmp("intr") == 0,
            "the checkpoint at step %d is latest; no temporary file survives", step);
    int rc = fitlmf("train --resume intr --steps %d", step + 1);
    t_check(rc == 0 && latest_step("intr") == step + 1, "resume after SIGINT (status %d): %.300s",
            rc, output);
    // a second SIGINT exits at once, mid-step or mid-save: the checkpoint
    // before stays, and the next run cleans a killed write's leftovers
    int all = 1, tmp_left = 0;
    for (int i = 0; i < 3; i++) {
        char sub[32];
        snprintf(sub, sizeof sub, "intr2_%d", i);
        snprintf(args, sizeof args,
                 "%s --steps 1000000 --save-every 1 --keep-checkpoints 2 --out %s", small_run(),
                 sub);
        pid = spawn_fitlm("intr2.out", args);
        running = wait_for_steps(sub, 5 + 5 * i, pid);
        kill(pid, SIGINT);
        struct timespec ts = {0, 200000L * i};
        nanosleep(&ts, NULL);
        kill(pid, SIGINT);
        status = exit_status(pid);
        step = latest_step(sub);
        tmp_left += count_tmp(sub);
        char leftover[700]; // as a write killed by a second signal leaves it
        snprintf(leftover, sizeof leftover, "%s/%s/ckpt_00000099.fitlm.tmp.99999", dir, sub);
        t_mark_temporary(leftover, 99999);
        strcat(leftover, "/ckpt_00000099.fitlm");
        t_write_text(leftover, "partial");
        rc = fitlmf("train --resume %s --steps %d", sub, step + 1);
        all &= running && status == 130 && step >= 1 && rc == 0 && count_tmp(sub) == 0;
    }
    printf("  a second SIGINT left a killed write's temporary file %d times (of 3)\n", tmp_left);
    t_check(all, "a second SIGINT exits with 130, the latest checkpoint loads and resumes, and "
                 "the next run deletes leftovers");
}

static void test_log_write_error_stops_the_run(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/full", dir);
    mkdir(path, 0755);
    // a write error: a file-size limit (SIGXFSZ ignored, so a write past it
    // fails with EFBIG, as on a full disk with ENOSPC), which metrics.jsonl
    // reaches first, at step 4 of 6; a link planted at a log's name (once
    // log.txt -> /dev/full here) is not written through: see test_paths
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 1024;
    void (*was)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    int rc = fitlmf("%s --steps 6 --out full --overwrite", small_run());
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, was);
    t_check(rc == 1 &&
                strstr(output, "writing the metrics log full/metrics.jsonl failed: File too "
                               "large") &&
                !strstr(output, "step     6/6"),
            "a log write error is an error naming the file, and the run stops (status %d): %.300s",
            rc, output);
}

// Count of `what` in text.
static int occurrences(const char *text, const char *what) {
    int n = 0;
    for (const char *p = strstr(text, what); p; p = strstr(p + 1, what)) n++;
    return n;
}

static void test_divergence_stops_without_a_bad_checkpoint(void) {
    // SGD at lr 1000 without clipping: a non-finite loss within a few steps
    const char *sgd = "--optimizer sgd --grad-clip 0 --lr 1000 --weight-decay 0 --warmup 0 "
                      "--steps 60 --save-every 1 --keep-checkpoints 0";
    int rc = fitlmf("%s %s --out div", small_run(), sgd);
    int k = number_after(output, "training diverged at step ");
    char name[64];
    snprintf(name, sizeof name, "div/ckpt_%08d.fitlm", k);
    t_check(rc == 1 && k > 1 && strstr(output, "the step was not applied") &&
                latest_step("div") == k - 1 && !exists(name),
            "divergence at step %d stops the run; the last good checkpoint stays latest (status "
            "%d): %.300s",
            k, rc, strstr(output, "fitlm: error") ? strstr(output, "fitlm: error") : output);
    // --skip-nonfinite 2: two steps skipped without an update, then it stops
    rc = fitlmf("%s %s --skip-nonfinite 2 --out div2", small_run(), sgd);
    int skips = occurrences(output, " skipped: loss ");
    int k2 = number_after(output, "training diverged at step ");
    t_check(rc == 1 && skips == 2 && k2 > 3 && strstr(output, "budget is spent"),
            "--skip-nonfinite 2 skips two steps, then stops (status %d, %d skips): %.300s", rc,
            skips, strstr(output, "fitlm: error") ? strstr(output, "fitlm: error") : output);
    // the checkpoints around the skipped steps hold the same weights
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/div2/ckpt_%08d.fitlm", dir, k2 - 3);
    snprintf(b, sizeof b, "%s/div2/ckpt_%08d.fitlm", dir, k2 - 1);
    int same = 0;
    if (k2 > 3 && access(a, F_OK) == 0 && access(b, F_OK) == 0) {
        fl_model ma, mb;
        char tok[32];
        fl_ckpt_load_model(a, &ma, FL_F32, tok, sizeof tok);
        fl_ckpt_load_model(b, &mb, FL_F32, tok, sizeof tok);
        same = !memcmp(ma.params, mb.params, ma.table.numel * sizeof(float));
        fl_model_free(&ma);
        fl_model_free(&mb);
    }
    t_check(same, "a skipped step applies no update: steps %d and %d have the same weights", k2 - 3,
            k2 - 1);
    // DeepSpeed's bf16.check_grad_overflow true: every such step skipped, no limit
    write_text("bf16over.json", "{\"bf16\": {\"enabled\": true, \"check_grad_overflow\": true}}");
    rc = fitlmf("%s %s --steps 12 --config bf16over.json --out ''", small_run(), sgd);
    skips = occurrences(output, " skipped: loss ");
    t_check(skips > 2 && strstr(output, "of --skip-nonfinite 1073741824)") &&
                !strstr(output, "budget is spent"),
            "bf16.check_grad_overflow true skips every non-finite step (%d skips): %.300s", skips,
            strstr(output, "fitlm: error") ? strstr(output, "fitlm: error") : output);
    write_text("bf16over32.json", "{\"bf16\": {\"check_grad_overflow\": true}}");
    rc = fitlmf("%s --precision fp32 --config bf16over32.json --out ''", small_run());
    t_check(rc == 1 && strstr(output, "bf16.check_grad_overflow applies to bf16 training; "
                                      "precision is fp32"),
            "bf16.check_grad_overflow true under fp32 is refused: %.300s", output);
    // LOMO without clipping updates in the backward: already applied, so it stops
    rc = fitlmf("%s --optimizer lomo --lr 1000 --grad-clip 0 --warmup 0 --steps 60 --out '' "
                "--skip-nonfinite 5",
                small_run());
    t_check(rc == 1 && strstr(output, "the update was already applied"),
            "single-pass LOMO: a non-finite norm after the update stops at once (status %d): "
            "%.300s",
            rc, output);
    // fp16 overflow steps, skipped by the loss scaler, are normal
    rc = fitlmf("%s --fp16 --initial-scale-power 30 --hysteresis 1 --lr 0.001 --steps 20 --out ''",
                small_run());
    t_check(rc == 0 && strstr(output, "OVERFLOW") && !strstr(output, "diverged") &&
                !strstr(output, "SPIKE"),
            "fp16 overflow steps are not divergence, nor spikes (status %d): %.300s", rc, output);
    fails_with("train --eps 0", "optimizer.params.eps 0: adamw divides");
}

// Issue 42, item 14: every number fitlm reports is finite, or it is an error
// naming what and where. Finite weights too large for the logits (load
// accepts them: they are finite) make eval's loss, sample's logits and
// train's validation loss non-finite, in every precision.
// The demo's shape (vocabulary 257), its random weights.
static void demo_model(fl_model *m) {
    fl_model_config cfg;
    fl_model_preset(&cfg, "demo");
    cfg.vocab_size = 257;
    fl_model_config_finish(&cfg);
    fl_model_init(m, &cfg, FL_F32, 3);
}

// A demo-shaped checkpoint whose row `row` holds `value` at its elements
// [first, first + n).
static void save_poisoned_ckpt(const char *name, const char *row, int first, int n, float value) {
    fl_model m;
    demo_model(&m);
    int r = fl_params_find(&m.table, row);
    FL_ASSERT(r >= 0);
    for (int i = 0; i < n; i++) ((float *)m.params)[m.table.views[r].offset + first + i] = value;
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    fl_train_ckpt_save(path, 1, &m, NULL, NULL, NULL, &byte_tok, NULL, 0);
    fl_model_free(&m);
}

static void test_nonfinite_results_are_errors(void) {
    write_text("nf.txt", "The quick brown fox jumps over the lazy dog.\n\nA second document.\n");
    // inf logits (NaN loss); huge finite ones (a finite loss whose perplexity
    // overflows); the start token's embedding (NaN from the first layer norm,
    // at every position); fp16-sized weights that overflow fp16's activations
    const char *rows[] = {"ln_f.weight", "ln_f.bias", "wte.weight", "ln_f.weight"};
    const int firsts[] = {3, 3, 256 * 128, 3}, counts[] = {120, 1, 128, 120};
    const float values[] = {3e38f, 1e30f, 3e38f, 6e4f};
    for (int i = 0; i < 4; i++) {
        char name[32], args[256];
        snprintf(name, sizeof name, "huge_%d", i);
        save_poisoned_ckpt(name, rows[i], firsts[i], counts[i], values[i]);
        const char *precisions[] = {"fp32", "bf16", "fp16"};
        for (int p = i == 3 ? 2 : 0; p < 3; p++) {
            snprintf(args, sizeof args, "eval --checkpoint %s --text nf.txt --json --precision %s",
                     name, precisions[p]);
            int rc = fitlm(args);
            t_check(rc == 1 && !strstr(output, "null") && !strstr(output, "\"loss\"") &&
                        (strstr(output, "not finite") || strstr(output, "holds Inf") ||
                         strstr(output, "overflow")),
                    "%s: eval of a model whose %s holds %g fails naming it (status %d): %.300s",
                    args, rows[i], values[i], rc, output);
        }
        if (i != 2) continue; // the others' logits after the start token are finite
        snprintf(args, sizeof args, "sample --checkpoint %s --tokens 4", name);
        int rc = fitlm(args);
        t_check(rc == 1 && strstr(output, "logits for generated token 1 are not finite"),
                "%s: sampling from non-finite logits fails (status %d): %.300s", args, rc, output);
    }
    // a Hugging Face directory (safetensors) with the same overflow
    {
        fl_model m;
        demo_model(&m);
        const fl_param_view *v = &m.table.views[fl_params_find(&m.table, "ln_f.weight")];
        for (size_t i = 0; i < v->numel; i++) ((float *)m.params)[v->offset + i] = 3e38f;
        char p[600];
        snprintf(p, sizeof p, "%s/huge_hf", dir);
        fl_hf_export(p, &m, m.params, FL_F32, 0);
        fl_model_free(&m);
        int rc = fitlm("eval --init-from huge_hf --tokenizer byte --text nf.txt --json");
        t_check(rc == 1 && strstr(output, "not finite") && !strstr(output, "null"),
                "eval of a safetensors model whose weights overflow fails (status %d): %.300s", rc,
                output);
    }
    // a huge finite value in the residual stream (an MLP's or attention's
    // output bias): the next layer norm's variance overflows; its 1/sqrt(inf)
    // was 0, which reduced every row to the norm's bias and gave a finite,
    // wrong loss (ln V); now NaN, reported
    const char *stream[] = {"h.0.mlp.c_proj.bias", "h.1.attn.c_proj.bias", "h.1.mlp.c_fc.bias"};
    for (int i = 0; i < 3; i++) {
        char name[32];
        snprintf(name, sizeof name, "huge_stream_%d", i);
        save_poisoned_ckpt(name, stream[i], 3, 1, 1e30f);
        int rc = fitlmf("eval --checkpoint %s --text nf.txt --json", name);
        t_check(rc == 1 && strstr(output, "not finite") && !strstr(output, "\"loss\""),
                "eval of a model whose %s holds 1e30 (a norm's variance overflows) fails (status "
                "%d): %.300s",
                stream[i], rc, output);
    }
    // the position named: window and file
    fitlm("eval --checkpoint huge_0 --text nf.txt");
    t_check(strstr(output, "of window 0 of nf.txt") != NULL,
            "eval names the window and file: %.300s", output);
    // training: a validation loss that is not finite stops the run, naming the step
    int rc =
        fitlmf("train --init-from huge_2 --tokenizer byte --data %s --batch 2 --seq-len 16 "
               "--eval-every 1 --eval-iters 2 --steps 2 --sample-tokens 0 --threads 1 --out nf_run",
               t_source_path("data/brown_byte"));
    t_check(rc == 1 &&
                strstr(output, "the validation loss at step 0 is not finite (validation "
                               "batch 0 of 2 gave") &&
                !exists("nf_run/latest"),
            "train: a non-finite validation loss stops the run at its step (status %d): %.300s", rc,
            strstr(output, "fitlm: error") ? strstr(output, "fitlm: error") : output);
    // finite and not overflowing: still fine
    save_poisoned_ckpt("fine", "ln_f.weight", 3, 1, 2.0f);
    t_check(fitlm("eval --checkpoint fine --text nf.txt --json") == 0 &&
                strstr(output, "\"perplexity\":") && !strstr(output, "null,\"nats\""),
            "a finite model evaluates: %.200s", output);
}

// OUT/log.txt, malloc'd (NULL: none).
static char *run_log_text(const char *sub, size_t *n) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s/log.txt", dir, sub);
    return access(path, F_OK) == 0 ? (char *)t_read_file(path, n) : NULL;
}

// The spike guard (issue 42, item 15): a run resumed at a learning rate far
// too high spikes; the guard skips those steps before their update, says so
// and stops after skip_update_max_in_row of them, and no checkpoint is
// written after the first: for every step kind, by the loss or the norm test.
static void test_spike_guard(void) {
    const char *save = "--save-every 1 --keep-checkpoints 0";
    // a normal run with the defaults skips nothing: its log is bitwise that
    // of the guard off
    int rc = fitlmf("%s --steps 24 %s --out sg", small_run(), save);
    int rc2 = fitlmf("%s --steps 24 --skip-update-lossz 0 --skip-update-gradz 0 --out sg_off",
                     small_run());
    size_t n1 = 0, n2 = 0;
    char *on = run_log_text("sg", &n1), *off = run_log_text("sg_off", &n2);
    t_check(
        rc == 0 && rc2 == 0 && on && off && n1 == n2 && !memcmp(on, off, n1) &&
            !strstr(on, "skipped_steps"),
        "a normal run: the guard skips nothing, the log is that of the guard off (status %d %d)",
        rc, rc2);
    free(on);
    free(off);
    const char *kinds[] = {"", "--optimizer lomo --grad-clip 0", "--optimizer lomo --grad-clip 1",
                           "--optimizer adalomo --grad-clip 0"};
    for (int k = 0; k < 4; k++) {
        char sub[32];
        snprintf(sub, sizeof sub, "sg%d", k);
        if (k) // the plain kind resumes sg
            fitlmf("%s %s --lr 0.01 --steps 24 %s --out %s", small_run(), kinds[k], save, sub);
        const char *from = k ? sub : "sg";
        rc = fitlmf("train --resume %s --steps 60 --lr 30 %s", from, save);
        int first = number_after(output, "SPIKE! Skipping step ");
        char ck[64];
        snprintf(ck, sizeof ck, "%s/ckpt_%08d.fitlm", from, first);
        // the window came with the checkpoint: judged from the first resumed
        // step on (a fresh one would wait for 16 normal steps)
        t_check(rc == 1 && first > 24 && first <= 27 &&
                    occurrences(output, "SPIKE! Skipping step ") == 5 &&
                    strstr(output, "5 steps in a row were skipped as spikes") &&
                    latest_step(from) == first - 1 && !exists(ck),
                "%s: the spikes from step %d skipped, 5 in a row stop the run, latest is step %d "
                "(status %d): %.400s",
                *kinds[k] ? kinds[k] : "adamw", first, latest_step(from), rc,
                strstr(output, "SPIKE") ? strstr(output, "SPIKE") : output);
    }
    // the count in the step line and metrics.jsonl; the limit and the norm test alone
    rc = fitlm("train --resume sg --steps 60 --lr 30 --skip-update-lossz 0 --skip-update-gradz 10 "
               "--skip-update-max-in-row 2 --out sg_gn");
    char path[600];
    snprintf(path, sizeof path, "%s/sg_gn/metrics.jsonl", dir);
    size_t n;
    char *metrics = access(path, F_OK) == 0 ? (char *)t_read_file(path, &n) : NULL;
    t_check(rc == 1 && occurrences(output, "SPIKE! Skipping step ") == 2 &&
                strstr(output, "gradient norm") && strstr(output, "--skip-update-gradz 10") &&
                strstr(output, "| SPIKE skipped_steps 2") && metrics &&
                strstr(metrics, "\"skipped\":1,\"skipped_steps\":2,"),
            "the norm's test alone, 2 in a row at most; counted in the step line and "
            "metrics.jsonl (status %d): %.400s",
            rc, strstr(output, "SPIKE") ? strstr(output, "SPIKE") : output);
    free(metrics);
    // off: the same resume is not stopped by the guard
    rc = fitlm("train --resume sg --steps 40 --lr 30 --skip-update-lossz 0 --skip-update-gradz 0 "
               "--out sg_none");
    t_check(!strstr(output, "SPIKE"), "the guard off skips nothing (status %d): %.200s", rc,
            output);
    // thresholds from a config file, checked
    write_text("sg.json", "{\"skip_update_lossz\": 0, \"skip_update_gradz\": 3, "
                          "\"skip_update_max_in_row\": 1}");
    rc = fitlm("train --resume sg --steps 60 --lr 30 --config sg.json --out sg_cfg");
    t_check(rc == 1 && occurrences(output, "SPIKE! Skipping step ") == 1 &&
                strstr(output, "--skip-update-gradz 3)"),
            "skip_update_* from a config file (status %d): %.300s", rc,
            strstr(output, "SPIKE") ? strstr(output, "SPIKE") : output);
    fails_with("train --skip-update-window 8 --skip-update-min-steps 9",
               "skip_update_min_steps (9) is larger than skip_update_window (8)");
    fails_with("train --skip-update-lossz -1", "--skip-update-lossz");
}

static void test_resume_checks(void) {
    int rc = fitlmf("%s --steps 4 --out rc", small_run());
    t_check(rc == 0 && latest_step("rc") == 4, "a run to resume (status %d)", rc);
    fails_with("train --resume rc --steps 3", "train_steps 3 is not above the checkpoint's step 4");
    fails_with("train --resume rc --steps 4", "train_steps 4 is not above the checkpoint's step 4");
    fails_with("train --resume rc --steps 6 --init-from rc", "--init-from and --resume together");
    rc = fitlm("train --resume rc --steps 5 --threads 2 --batch 4 --seed 9");
    t_check(rc == 0 && strstr(output, "threads 2 differs from the checkpoint's 1") &&
                strstr(output, "batch 4 (was 2)") && strstr(output, "seed 9 (was 1337)"),
            "a resume prints what it changes: threads, batch, seed (status %d): %.600s", rc,
            output);
    t_check(strstr(output, "model from rc (gpt2): n_layer 2") != NULL,
            "the header names the checkpoint the shape comes from: %.200s", output);
    rc = fitlm("export rc -o rc_hf");
    int rc2 = fitlmf("%s --init-from rc_hf --steps 1 --out ''", small_run());
    t_check(rc == 0 && rc2 == 0 && strstr(output, "model from rc_hf (gpt2): n_layer 2"),
            "--init-from a Hugging Face directory: the header names it (status %d %d): %.200s", rc,
            rc2, output);
}

// ----------------------------------------------------------------------------
// A checkpoint holds the tokenizer it was trained with (issue 42): export
// writes that copy, parsed and checked against the model, and nothing reads
// the path the checkpoint's config records, which a forged header (plain
// JSON, a CRC anyone recomputes) can point at any file.

static const char TK_SECRET[] = "SECRET-KEY-7f3a9c";

// The bytes of dir/name (malloc'ed, NUL after them), or NULL.
static char *slurp(const char *name, size_t *n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (access(path, R_OK) != 0) return NULL;
    char *data = (char *)t_read_file(path, n);
    char *text = malloc(*n + 1);
    memcpy(text, data, *n);
    text[*n] = 0;
    free(data);
    return text;
}

static int same_bytes(const char *a, const char *b) {
    size_t na, nb;
    char *x = slurp(a, &na), *y = slurp(b, &nb);
    int same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

// LoRA and QLoRA on one rank under a ZeRO config (PEFT's recipe for one
// GPU: ZeRO-3 with the optimizer and the weights offloaded to the cpu):
// the stage partitions nothing and offload device cpu is RAM on the cpu,
// so the run is the plain one bitwise (losses, norms, the adapters); NVMe
// offload is refused, naming why.
static void test_lora_under_zero(void) {
    write_text("z3_offload.json",
               "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": "
               "\"cpu\"}, \"offload_param\": {\"device\": \"cpu\"}}}");
    static const char *const runs[][2] = {
        {"--model llama-tiny --lora --lora-dropout 0.1 --grad-accum 2", "--config z3_offload.json"},
        {"--init-from lora_base_hf --lora --quantize nf4 --precision bf16", "--zero-stage 2"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char cmd[1024], plain[4096], zero[4096], a[64], b[64];
        const char *common = "train --data small --tokenizer byte --batch 2 --seq-len 16 "
                             "--steps 3 --eval-every 0 --sample-tokens 0 --threads 2";
        snprintf(cmd, sizeof cmd, "%s %s --out lz_plain --overwrite", common, runs[i][0]);
        int rc1 = run_losses(cmd, plain, sizeof plain);
        snprintf(cmd, sizeof cmd, "%s %s %s --out lz_zero --overwrite", common, runs[i][0],
                 runs[i][1]);
        int rc2 = run_losses(cmd, zero, sizeof zero);
        t_check(rc1 == 0 && rc2 == 0 && strstr(output, "on one process: nothing to partition"),
                "%s %s runs on one rank, saying the stage partitions nothing (status %d %d): "
                "%.600s",
                runs[i][0], runs[i][1], rc1, rc2, output);
        snprintf(a, sizeof a, "lz_plain/adapter/adapter_model.safetensors");
        snprintf(b, sizeof b, "lz_zero/adapter/adapter_model.safetensors");
        t_check(*plain && !strcmp(plain, zero) && same_bytes(a, b),
                "%s with %s: the plain run's losses and adapters bitwise\n%s\nvs\n%s", runs[i][0],
                runs[i][1], plain, zero);
    }
    write_text("nvme_lora.json",
               "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": "
               "\"nvme\", \"nvme_path\": \".\"}}}");
    fails_with("train --lora --config nvme_lora.json",
               "offload_optimizer.device nvme with LoRA adapters is not supported");
}

// Whether any file in dir/sub or its siblings sub.tmp.*, sub.old.* holds
// needle (what an export wrote, or left behind).
static int export_holds(const char *sub, const char *needle) {
    char top[600];
    snprintf(top, sizeof top, "%s", dir);
    DIR *d = opendir(top);
    int found = 0;
    for (struct dirent *e; d && (e = readdir(d)) && !found;) {
        if (strncmp(e->d_name, sub, strlen(sub))) continue;
        char path[1200];
        snprintf(path, sizeof path, "%s/%s", top, e->d_name);
        DIR *in = opendir(path);
        for (struct dirent *f; in && (f = readdir(in)) && !found;) {
            char name[600];
            size_t n;
            snprintf(name, sizeof name, "%.250s/%.250s", e->d_name, f->d_name);
            struct stat st;
            char full[1400];
            snprintf(full, sizeof full, "%s/%s", top, name);
            if (stat(full, &st) != 0 || !S_ISREG(st.st_mode)) continue;
            char *text = slurp(name, &n);
            for (size_t i = 0; text && !found && i + strlen(needle) <= n; i++)
                found = !memcmp(text + i, needle, strlen(needle));
            free(text);
        }
        if (in) closedir(in);
    }
    if (d) closedir(d);
    return found;
}

// Rewrites checkpoint file dir/name's header as anyone can: its config's
// tokenizer_path set to `path`, the prefix's lengths and CRC-32 recomputed
// as ckpt.c computes them. drop_files also cuts the stored files off the
// end and writes version 2: the layout of a checkpoint saved before
// checkpoints held their tokenizer.
static void forge_tokenizer_path(const char *name, const char *path, int drop_files) {
    size_t n;
    char *file = slurp(name, &n);
    uint8_t *b = (uint8_t *)file;
    uint32_t hlen = fl_get_u32(b + 12);
    uint64_t dlen = fl_get_u64(b + 16);
    cJSON *root = cJSON_ParseWithLength(file + 28, hlen);
    cJSON *cfg = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "meta"), "config");
    cJSON_ReplaceItemInObject(cfg, "tokenizer_path", cJSON_CreateString(path));
    const cJSON *files = cJSON_GetObjectItem(root, "files");
    if (drop_files && files) {
        for (const cJSON *f = files->child; f; f = f->next)
            dlen -= (uint64_t)cJSON_GetObjectItem(f, "bytes")->valuedouble;
        cJSON_DeleteItemFromObject(root, "files");
    }
    char *header = cJSON_PrintUnformatted(root);
    size_t h = strlen(header);
    uint8_t *out = malloc(28 + h + dlen);
    memcpy(out, b, 28);
    if (drop_files) fl_put_u32(out + 8, 2);
    fl_put_u32(out + 12, (uint32_t)h);
    fl_put_u64(out + 16, dlen);
    memcpy(out + 28, header, h);
    memcpy(out + 28 + h, b + 28 + hlen, dlen);
    fl_put_u32(out + 24, fl_crc32(fl_crc32(0, out, 24), header, h));
    char full[1024];
    snprintf(full, sizeof full, "%s/%s", dir, name);
    t_write_file(full, out, 28 + h + dlen);
    free(out);
    cJSON_free(header);
    cJSON_Delete(root);
    free(file);
}

static void test_checkpoint_holds_its_tokenizer(void) {
    char cmd[4096], path[1024];
    snprintf(path, sizeof path, "%s/tk_tok", dir);
    mkdir(path, 0755);
    size_t n;
    unsigned char *tok =
        t_read_file(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"), &n);
    write_file("tk_tok/tokenizer.json", (const char *)tok, n);
    write_file("tk_trained.json", (const char *)tok, n); // the reference
    free(tok);
    const char *tok_cfg = "{\"eos_token\": \"</s>\", \"chat_template\": \"{{ messages }}\"}";
    write_text("tk_tok/tokenizer_config.json", tok_cfg);
    write_text("tk_trained_config.json", tok_cfg);
    char *text = malloc(1 << 14);
    size_t len = 0;
    for (int i = 0; i < 60; i++)
        len += (size_t)sprintf(text + len, "the cat %d sat on the mat and ate.\n\n", i);
    write_text("tk.txt", text);
    free(text);
    int rc = fitlm("tokenize tk.txt -o tk_data --tokenizer hf --tokenizer-path tk_tok "
                   "--val-fraction 0");
    rc |= fitlm("train --data tk_data --tokenizer hf --tokenizer-path tk_tok --model tiny "
                "--batch 2 --seq-len 16 --steps 2 --eval-every 0 --sample-tokens 4 --threads 2 "
                "--out tk_run");
    if (!t_check(rc == 0, "a run with a Hugging Face tokenizer: %.400s", output)) return;

    // the round trip: the files trained with, loadable by our loader
    rc = fitlm("export tk_run -o tk_hf");
    snprintf(path, sizeof path, "%s/tk_hf", dir);
    fl_tokenizer *loaded = rc == 0 ? fl_tokenizer_load("hf", path) : NULL;
    t_check(rc == 0 && same_bytes("tk_hf/tokenizer.json", "tk_trained.json") &&
                same_bytes("tk_hf/tokenizer_config.json", "tk_trained_config.json") && loaded &&
                fl_tokenizer_vocab_size(loaded) == 97,
            "export writes the tokenizer trained with, byte for byte, and it loads: %.300s",
            output);
    fl_tokenizer_free(loaded);

    // the files changed or gone after training: the checkpoint's copy is
    // what goes out; the changed file, named now, is checked and refused
    // another vocabulary: the trained one with a 98th token
    tok = t_read_file(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"), &n);
    char *other = malloc(n + 32), *at = strstr((char *)tok, "\"vocab\": {");
    if (!t_check(at != NULL, "the fixture has a vocab")) return;
    size_t head = (size_t)(at - (char *)tok) + 10;
    memcpy(other, tok, head);
    n = head + (size_t)sprintf(other + head, "\"zq\": 97, ");
    memcpy(other + n, tok + head, strlen((char *)tok + head));
    n += strlen((char *)tok + head);
    free(tok);
    const struct {
        const char *what, *bytes, *refusal;
        size_t n;
    } changed[] = {
        {"another vocabulary", other, "has a vocabulary of 98, but the model of tk_run has 97", n},
        {"unparsable", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0", "is not valid JSON",
         0},
        {"JSON of no tokenizer", "{\"name\": \"a config\", \"vocab_size\": 97}",
         "model must be an object", 0},
        {"empty", "", "is empty", 0},
    };
    for (size_t k = 0; k < sizeof changed / sizeof changed[0]; k++) {
        write_file("tk_tok/tokenizer.json", changed[k].bytes,
                   changed[k].n ? changed[k].n : strlen(changed[k].bytes));
        rc = fitlm("export tk_run -o tk_hf");
        t_check(rc == 0 && same_bytes("tk_hf/tokenizer.json", "tk_trained.json"),
                "tokenizer file %s after training: export writes the trained one: %.300s",
                changed[k].what, output);
        rc = fitlm("sample --checkpoint tk_run --tokens 4 --prompt 'the cat'");
        int rc2 = fitlm("eval --checkpoint tk_run --text tk.txt --json");
        t_check(rc == 0 && rc2 == 0, "%s: sample and eval use the checkpoint's copy: %.300s",
                changed[k].what, output);
        fails_with("export tk_run -o tk_named --tokenizer-path tk_tok", changed[k].refusal);
        snprintf(path, sizeof path, "%s/tk_named", dir);
        t_check(access(path, F_OK) != 0 && leftovers("tk_named") == 0,
                "%s, named on export's command line: refused, nothing written", changed[k].what);
    }
    free(other);
    // tokenizer_config.json too: the stored one goes out; a changed one named now is parsed
    tok = t_read_file(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"), &n);
    write_file("tk_tok/tokenizer.json", (const char *)tok, n);
    free(tok);
    write_text("tk_tok/tokenizer_config.json", "eos_token: </s>");
    rc = fitlm("export tk_run -o tk_hf");
    t_check(rc == 0 && same_bytes("tk_hf/tokenizer_config.json", "tk_trained_config.json"),
            "tokenizer_config.json changed after training: the trained one goes out: %.300s",
            output);
    fails_with("export tk_run -o tk_named --tokenizer-path tk_tok",
               "tokenizer_config.json is not valid JSON");
    snprintf(path, sizeof path, "%s/tk_tok", dir);
    t_remove_dir(path); // gone
    rc = fitlm("export tk_run -o tk_hf");
    t_check(rc == 0 && same_bytes("tk_hf/tokenizer.json", "tk_trained.json"),
            "the tokenizer's files deleted: the export still has them: %.300s", output);
    rc = fitlm("train --resume tk_run --steps 3 --sample-tokens 4");
    t_check(rc == 0 && strstr(output, "step     3/3"),
            "a resume uses the checkpoint's copy (the recorded path is gone): %.400s", output);

    // a forged header naming a secret as the tokenizer: a file, or a
    // directory whose tokenizer.json parses and whose tokenizer_config.json
    // holds the secret
    write_text("tk_secret", TK_SECRET);
    snprintf(path, sizeof path, "%s/tk_secretdir", dir);
    mkdir(path, 0755);
    tok = t_read_file(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"), &n);
    write_file("tk_secretdir/tokenizer.json", (const char *)tok, n);
    free(tok);
    snprintf(cmd, sizeof cmd, "{\"eos_token\": \"</s>\", \"api_key\": \"%s\"}", TK_SECRET);
    write_text("tk_secretdir/tokenizer_config.json", cmd);
    snprintf(path, sizeof path, "%s/tk_forged", dir);
    mkdir(path, 0755);
    char *latest = slurp("tk_run/latest", &n), ck_name[600];
    if (!t_check(latest && n > 1, "tk_run has a checkpoint")) return;
    latest[strcspn(latest, "\n")] = 0;
    char forged[600];
    snprintf(ck_name, sizeof ck_name, "tk_run/%.300s", latest);
    snprintf(forged, sizeof forged, "tk_forged/%.300s", latest);
    snprintf(cmd, sizeof cmd, "%.300s\n", latest);
    write_text("tk_forged/latest", cmd);
    free(latest);
    const char *targets[] = {"tk_secret", "tk_secretdir", "tk_secretdir/tokenizer.json"};
    for (int t = 0; t < 3; t++)
        for (int drop = 0; drop < 2; drop++) {
            char target[1024], *ck;
            snprintf(target, sizeof target, "%s/%s", dir, targets[t]);
            ck = slurp(ck_name, &n);
            write_file(forged, ck, n);
            free(ck);
            forge_tokenizer_path(forged, target, drop);
            const char *held = "holds no copy of its hf tokenizer";
            rc = fitlm("export tk_forged -o tk_out");
            t_check(drop ? rc != 0 && strstr(output, held)
                         : rc == 0 && same_bytes("tk_out/tokenizer.json", "tk_trained.json"),
                    "forged tokenizer_path %s (%s): export %s: %.300s", targets[t],
                    drop ? "no stored copy" : "a stored copy",
                    drop ? "refuses" : "writes the stored copy", output);
            t_check(!export_holds("tk_out", TK_SECRET) && !strstr(output, TK_SECRET),
                    "forged tokenizer_path %s: the secret is in no exported file", targets[t]);
            rc = fitlm("sample --checkpoint tk_forged --tokens 4");
            int rc2 = fitlm("eval --checkpoint tk_forged --text tk.txt");
            t_check(drop ? rc != 0 && rc2 != 0 && strstr(output, held) : rc == 0 && rc2 == 0,
                    "forged tokenizer_path %s: sample and eval %s: %.300s", targets[t],
                    drop ? "ask for --tokenizer-path" : "use the stored copy", output);
            rc = fitlm("train --init-from tk_forged --data tk_data --batch 2 --seq-len 16 "
                       "--steps 1 --eval-every 0 --sample-tokens 4 --out ''");
            t_check(drop ? rc != 0 && strstr(output, held) : rc == 0,
                    "forged tokenizer_path %s: --init-from it %s: %.300s", targets[t],
                    drop ? "asks for --tokenizer-path" : "uses the stored copy", output);
            rc = fitlm("train --resume tk_forged --out tk_resumed --overwrite --steps 4 "
                       "--sample-tokens 4");
            t_check(drop ? rc != 0 && strstr(output, held) : rc == 0,
                    "forged tokenizer_path %s: a resume %s: %.300s", targets[t],
                    drop ? "asks for --tokenizer-path" : "uses the stored copy", output);
        }
    // named on the command line, an old checkpoint's tokenizer is the user's to give
    snprintf(cmd, sizeof cmd, "export tk_forged -o tk_out --tokenizer-path %s/tk_secretdir", dir);
    rc = fitlm(cmd);
    t_check(rc == 0 && same_bytes("tk_out/tokenizer.json", "tk_trained.json"),
            "--tokenizer-path gives an old checkpoint its tokenizer: %.300s", output);
    // a byte-level model exported over it: no tokenizer file stays beside it
    rc = fitlm("export whole -o tk_out");
    snprintf(path, sizeof path, "%s/tk_out/tokenizer.json", dir);
    char cfg_path[1024];
    snprintf(cfg_path, sizeof cfg_path, "%s/tk_out/tokenizer_config.json", dir);
    t_check(rc == 0 && access(path, F_OK) != 0 && access(cfg_path, F_OK) != 0,
            "a byte-level checkpoint exports without a tokenizer, none left from before: %.300s",
            output);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_help_lists_every_option_with_default();
    test_bad_flags();
    test_bad_config_files();
    test_bad_data();
    test_tokenize_input_is_a_file();
    test_config_then_flags();
    test_crlf_documents();
    test_long_lines();
    test_zero_optimization_keys();
    test_tensor_parallel_flags();
    test_deepspeed_zero3_example();
    test_deepspeed_zero2_offload_example();
    test_deepspeed_schedule_skips();
    test_hf_ds_config_zero3();
    test_same_seed_same_losses();
    test_deepspeed_adam();
    test_resume_is_bitwise();
    test_export_and_pretrained();
    test_checkpoint_holds_its_tokenizer();
    test_demo_recipe();
    make_lora_base();
    test_lora_resume_is_bitwise();
    test_lora_under_zero();
    test_lora_adapter();
    test_lora_errors();
    test_inputs_are_regular_files();
    test_json_inputs_are_whole();
    test_error_exits_do_not_leak();
    test_matches_recorded_logs();
    test_kill_while_saving();
    test_learn_vocab();
    test_resume_continues_in_its_directory();
    test_new_run_refuses_a_used_directory();
    test_one_run_per_directory_and_sigterm();
    test_sigint_saves_and_a_second_exits();
    test_log_write_error_stops_the_run();
    test_divergence_stops_without_a_bad_checkpoint();
    test_spike_guard();
    test_nonfinite_results_are_errors();
    test_resume_checks();
    test_kill_while_exporting();
    test_kill_while_tokenizing();
    test_refuses_nonfinite_weights();
    test_sample_seed_is_64_bit();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
