// test_finetune.c: instruction data end to end. `fitlm tokenize --format
// jsonl` writes masked shards (or names FILE:LINE of a bad record, or skips
// and counts with --skip-bad-lines) and never touches a good shard set on
// failure; flags of the other format are refused; training refuses shards
// laid out for another seq_len; and a training step's loss over a masked
// batch of two micro-batches is the mean over the answer tokens alone,
// computed here independently from the model's per-token losses. Then a
// LLaMA run with a Hugging Face tokenizer.json from tokenize to eval.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/data.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_finetune_XXXXXX";
static char output[65536];

// Runs `fitlm ARGS` in dir with stdout and stderr captured; the exit status.
static int fitlm(const char *args) {
    return t_fitlm(dir, args, 1, output, sizeof output);
}

static void fails_with(const char *args, const char *what) {
    t_fitlm_fails(dir, args, what, output, sizeof output);
}

static void write_in_dir(const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    t_write_text(path, text);
}

// Forty examples in the three layouts, of various lengths.
static void write_examples(const char *name, const char *bad_line) {
    char *text = malloc(1 << 16);
    size_t n = 0;
    for (int i = 0; i < 40; i++) {
        if (i == 2 && bad_line) n += (size_t)sprintf(text + n, "%s\n", bad_line);
        if (i % 3 == 0)
            n += (size_t)sprintf(text + n,
                                 "{\"prompt\": \"What is %d times %d?\", \"response\": \"%d\"}\n",
                                 i, i + 1, i * (i + 1));
        else if (i % 3 == 1)
            n += (size_t)sprintf(text + n,
                                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Say %d\"}, "
                                 "{\"role\": \"assistant\", \"content\": \"%d %d %d\"}]}\n",
                                 i, i, i, i);
        else
            n += (size_t)sprintf(text + n,
                                 "{\"instruction\": \"Spell\", \"input\": \"%d\", \"output\": "
                                 "\"digits of %d\"}\n\n",
                                 i, i);
    }
    write_in_dir(name, text);
    free(text);
}

static void test_tokenize_jsonl(void) {
    write_examples("ex.jsonl", NULL);
    int rc = fitlm("tokenize ex.jsonl -o ft --format jsonl --tokenizer byte --seq-len 64 "
                   "--val-fraction 0.1");
    t_check(rc == 0 && strstr(output, "train: 36 examples") && strstr(output, "val: 4 examples") &&
                strstr(output, "windows of 65 tokens") && strstr(output, "% targets"),
            "tokenize --format jsonl writes windows and prints a summary: %.600s", output);
    char path[512];
    snprintf(path, sizeof path, "%s/ft/train_000000.bin", dir);
    fl_shard s;
    fl_shard_open(&s, path);
    t_check(s.version == 2 && s.layout.seq_len == 64 && s.layout.policy == FL_SEQ_TRUNCATE &&
                s.layout.packed == 1 && s.layout.n_examples == 36 && s.n_targets > 0 &&
                s.n_targets < s.n_tokens / 2,
            "the shard records its layout, examples and targets (%llu of %llu)",
            (unsigned long long)s.n_targets, (unsigned long long)s.n_tokens);
    fl_shard_close(&s);

    // a bad line: FILE:LINE and nothing written over the good set
    size_t before_n, after_n;
    unsigned char *before = t_read_file(path, &before_n);
    write_examples("bad.jsonl", "{\"prompt\": \"a\", \"response\": 7}");
    fails_with("tokenize bad.jsonl -o ft --format jsonl --tokenizer byte --seq-len 64",
               "bad.jsonl:3: field \"response\" is not a string");
    unsigned char *after = t_read_file(path, &after_n);
    t_check(before_n == after_n && !memcmp(before, after, before_n),
            "a failed tokenize leaves the earlier shard set as it was");
    free(before);
    free(after);
    rc = fitlm("tokenize bad.jsonl -o ft_skip --format jsonl --tokenizer byte --seq-len 64 "
               "--skip-bad-lines");
    t_check(rc == 0 && strstr(output, "skipping bad.jsonl:3: field \"response\"") &&
                strstr(output, "1 bad line(s) skipped"),
            "--skip-bad-lines skips, names and counts: %.600s", output);
    write_in_dir("none.jsonl", "{\"prompt\": \"a\", \"response\": \"\"}\n");
    fails_with("tokenize none.jsonl -o x --format jsonl --tokenizer byte --skip-bad-lines",
               "none of the 1 lines is a valid example");

    // long examples: truncated (dropped when no answer is left) or split
    rc = fitlm("tokenize ex.jsonl -o ft_split --format jsonl --tokenizer byte --seq-len 16 "
               "--overflow split --template chatml --val-fraction 0");
    t_check(rc == 0 && strstr(output, "split, 0 dropped"), "--overflow split: %.600s", output);
    fails_with("tokenize ex.jsonl -o x --format jsonl --tokenizer byte --seq-len 8",
               "no training example keeps a target within 9 tokens");

    // flags of the other format, unknown values
    fails_with("tokenize ex.jsonl -o x --template chatml --tokenizer byte",
               "--template is an option of --format jsonl");
    fails_with("tokenize ex.jsonl -o x --skip-bad-lines --tokenizer byte",
               "--skip-bad-lines is an option of --format jsonl");
    fails_with("tokenize ex.jsonl -o x --format jsonl --doc-separator x --tokenizer byte",
               "--doc-separator is an option of --format text");
    fails_with("tokenize ex.jsonl -o x --format jsonl --template vicuna --tokenizer byte",
               "--template vicuna: expected default, chatml, llama3 or llama2");
    fails_with("tokenize ex.jsonl -o x --format jsonl --overflow wrap --tokenizer byte",
               "--overflow wrap: expected truncate or split");
    fails_with("tokenize ex.jsonl -o x --format csv", "--format csv: expected text or jsonl");
    t_check(fitlm("tokenize --help") == 0 && strstr(output, "--skip-bad-lines") &&
                strstr(output, "--overflow POLICY") && strstr(output, "--no-packing") &&
                strstr(output, "--prompt-field"),
            "tokenize --help lists the jsonl options");

    // training: the shards' seq_len must be the run's
    fails_with("train --data ft --tokenizer byte --model tiny --seq-len 16 --steps 1 --out ''",
               "was laid out for sequence length 64 (fitlm tokenize --seq-len), but this run's "
               "is 16");
    rc = fitlm("train --data ft --tokenizer byte --model tiny --seq-len 64 --batch 2 --steps 2 "
               "--eval-every 0 --eval-iters 1 --sample-tokens 0 --out ''");
    t_check(rc == 0 && strstr(output, "step     2/2"), "train runs on masked shards: %.600s",
            output);
}

// The loss of a step over two micro-batches of masked windows is the mean of
// the per-token losses at the mask's targets, the mask read from the shard.
static void test_masked_loss(void) {
    enum { B = 2, T = 64, MICRO = 2 };
    char data[512];
    snprintf(data, sizeof data, "%s/ft", dir);
    fl_loader l;
    fl_loader_open(&l, data, "train", T, 1, 0, 0, 1); // in order: windows 0..3
    t_check(l.n_windows >= MICRO * B, "enough windows for the batch (%llu)",
            (unsigned long long)l.n_windows);
    int inputs[MICRO * B * T], targets[MICRO * B * T], full[MICRO * B * T];
    fl_loader_next(&l, inputs, targets, MICRO * B);
    const fl_shard *s = &l.shards[0];
    long expect_targets = 0;
    for (size_t i = 0; i < (size_t)MICRO * B * T; i++) {
        size_t w = i / T, t = i % T, k = w * (T + 1) + t + 1; // the target's index in the shard
        full[i] = (int)fl_shard_token(s, k);
        expect_targets += fl_shard_is_target(s, k);
    }
    fl_model_config cfg = {
        .max_seq_len = T, .vocab_size = 257, .n_layer = 2, .n_head = 4, .n_embd = 32};
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 3);
    fl_model_alloc_acts(&m, B, T, FL_RECOMPUTE_NONE, 0);
    // independently: every position's loss, averaged over the mask's targets
    double sum = 0.0;
    for (int k = 0; k < MICRO; k++) {
        fl_model_forward(&m, inputs + k * B * T, full + k * B * T, B, T);
        for (size_t i = 0; i < (size_t)B * T; i++) {
            size_t g = (size_t)k * B * T + i, w = g / T, t = g % T;
            if (fl_shard_is_target(s, w * (T + 1) + t + 1)) sum += m.losses[i];
        }
    }
    fl_optimizer_config oc = {.kind = FL_OPT_SGD, .grad_accum = MICRO};
    fl_optimizer o;
    fl_optimizer_init(&o, &oc, &m.table, FL_F32, m.params, m.grads);
    fl_train_result r = fl_train_step(&m, &o, inputs, targets, MICRO, B, T, 0.0f);
    double mean = sum / (double)expect_targets;
    t_check(r.n_targets == expect_targets && expect_targets > 0 &&
                expect_targets < MICRO * B * T / 2,
            "the step counts the mask's targets only (%ld of %d)", r.n_targets, MICRO * B * T);
    t_check(fabs(r.loss - mean) <= 1e-5 * mean,
            "the step's loss is the mean over answer tokens of the whole batch (%.7f vs %.7f)",
            r.loss, mean);
    fl_optimizer_free(&o);
    fl_model_free(&m);
    fl_loader_close(&l);
}

// A LLaMA user's path with a Hugging Face tokenizer.json (LLaMA-2's, from
// scripts/setup.sh): chat data in the llama2 template, a model whose
// vocabulary comes from the tokenizer, and sample and eval that find the
// tokenizer's files through the run's checkpoint.
static void test_hf_tokenizer_run(void) {
    const char *tok = t_source_path("data/llama/tokenizer.json");
    if (!t_check(access(tok, R_OK) == 0, "%s exists (scripts/setup.sh makes it)", tok)) return;
    char *text = malloc(1 << 14);
    size_t n = 0;
    for (int i = 0; i < 20; i++)
        n += (size_t)sprintf(text + n,
                             "{\"messages\": [{\"role\": \"user\", \"content\": \"Count to "
                             "%d.\"}, {\"role\": \"assistant\", \"content\": \"%d, %d.\"}]}\n",
                             i + 2, i + 1, i + 2);
    write_in_dir("chat.jsonl", text);
    free(text);
    char args[4096], tok_dir[2048];
    snprintf(tok_dir, sizeof tok_dir, "%s", tok);
    *strrchr(tok_dir, '/') = 0;
    snprintf(args, sizeof args,
             "tokenize chat.jsonl -o hfdata --format jsonl --tokenizer hf --tokenizer-path %s "
             "--template llama2 --seq-len 32 --val-fraction 0.2",
             tok_dir);
    int rc = fitlm(args);
    t_check(rc == 0 && strstr(output, "train: 16 examples"),
            "tokenize with the hf tokenizer: %.600s", output);
    snprintf(args, sizeof args,
             "train --data hfdata --tokenizer hf --tokenizer-path %s --model tiny --arch llama "
             "--seq-len 32 --batch 2 --steps 2 --eval-every 0 --eval-iters 1 --sample-tokens 4 "
             "--out run --overwrite",
             tok_dir);
    rc = fitlm(args);
    t_check(rc == 0 && strstr(output, "vocab 32000 (padded 32000)") &&
                strstr(output, "step     2/2"),
            "train with the hf tokenizer, vocabulary 32000 taken from it: %.800s", output);
    rc = fitlm("sample --checkpoint run --tokens 4 --prompt 'Count to 3.'");
    t_check(rc == 0, "sample finds the tokenizer's files through the checkpoint: %.600s", output);
    rc = fitlm("eval --checkpoint run --data hfdata --json");
    t_check(rc == 0 && strstr(output, "\"tokenizer\":\"hf\""), "eval of the run: %.600s", output);
    // exported with its tokenizer, the directory is a whole model: training
    // from it needs no tokenizer flags
    rc = fitlm("export run -o hfexport");
    char copied[2048];
    snprintf(copied, sizeof copied, "%s/hfexport/tokenizer_config.json", dir);
    t_check(rc == 0 && access(copied, R_OK) == 0,
            "export copies tokenizer.json and "
            "tokenizer_config.json beside the weights: %.600s",
            output);
    rc = fitlm("train --init-from hfexport --data hfdata --seq-len 32 --batch 2 --steps 1 "
               "--eval-every 0 --eval-iters 1 --sample-tokens 4 --out ''");
    t_check(rc == 0 && strstr(output, "vocab 32000"),
            "train --init-from an exported directory takes its tokenizer.json: %.600s", output);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_tokenize_jsonl();
    test_masked_loss();
    test_hf_tokenizer_run();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
