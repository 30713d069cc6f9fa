// test_placement.c: the device seam's placement and copies, end to end on
// the test device (device.h: the cpu's kernels on memory the host cannot
// touch, so any host access to a model or optimizer buffer that skips the
// table's copies faults). Runs the built binary (FITLM_BINARY) in a scratch
// directory: training on --device test gives the cpu's losses bitwise
// (GPT-2 and LLaMA, fp32, bf16, fp16); a checkpoint saved there resumes
// there bitwise; an export from it evaluates on the cpu to the same loss;
// sampling gives the same tokens; LOMO, AdaLomo and optimizer_in_backward
// (the fused step) train as on the cpu bitwise and an AdaLomo checkpoint
// resumes bitwise; `fitlm plan --device test` predicts the
// device bytes per tag that the run allocates, exactly; and what a device
// does not run yet is refused with a clear error; --mem-limit on a device
// is its budget, refused by the plan and held by the allocator. LoRA and
// QLoRA (NF4, double quantisation) train as on the cpu bitwise, and their
// PEFT exports, --adapter loading and merged exports are the cpu's bytes
// and losses.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/device.h"
#include "fitlm/plan.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_placement_XXXXXX";
static char output[1 << 17];

static char cmd[4096];
#define fitlm(...)                                                                                 \
    (snprintf(cmd, sizeof cmd, __VA_ARGS__), t_fitlm(dir, cmd, 1, output, sizeof output))
// stdout alone (no progress lines)
#define fitlm_out(...)                                                                             \
    (snprintf(cmd, sizeof cmd, __VA_ARGS__), t_fitlm(dir, cmd, 0, output, sizeof output))
#define fails_with(what, ...)                                                                      \
    (snprintf(cmd, sizeof cmd, __VA_ARGS__), t_fitlm_fails(dir, cmd, what, output, sizeof output))

// A small run on the byte-level data: few steps, no evaluation before the end
// (--peak-tflops: measuring the host's peak, 0.05 s a run, is test_metrics' subject)
#define RUN                                                                                        \
    "--data data --tokenizer byte --batch 2 --seq-len 32 --eval-iters 1 --threads 2 "              \
    "--peak-tflops 1"

// A run's losses and gradient norms from OUT/metrics.jsonl, as written
// (floats that read back exactly): "step:loss:norm " per step.
static void step_figures(const char *out, char *figures, size_t size) {
    char path[256], line[2048];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, out);
    FILE *f = fopen(path, "r");
    size_t n = 0;
    figures[0] = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f) && n < size) {
        const char *step = strstr(line, "\"step\":"), *loss = strstr(line, "\"loss\":"),
                   *norm = strstr(line, "\"grad_norm\":");
        if (!step || !loss || !norm) continue;
        n += (size_t)snprintf(figures + n, size - n, "%.*s:%.*s:%.*s ", (int)strcspn(step + 7, ","),
                              step + 7, (int)strcspn(loss + 7, ","), loss + 7,
                              (int)strcspn(norm + 12, ","), norm + 12);
    }
    fclose(f);
}

static void test_losses_equal_cpu(void) {
    const char *models[] = {"tiny", "llama-tiny"}, *precisions[] = {"fp32", "bf16", "fp16"};
    for (int m = 0; m < 2; m++)
        for (int p = 0; p < 3; p++) {
            char want[1024] = "", got[1024] = "";
            const char *devices[] = {"cpu", "test"};
            for (int d = 0; d < 2; d++) {
                int rc =
                    fitlm("train " RUN " --model %s --precision %s --steps 3 --sample-tokens 0 "
                          "--out run_%s --overwrite --device %s%s",
                          models[m], precisions[p], devices[d], devices[d],
                          d ? " --peak-tflops 0" : ""); // the device's peak: unknown
                t_check(rc == 0, "%s %s on --device %s runs: %.600s", models[m], precisions[p],
                        devices[d], output);
                step_figures(d ? "run_test" : "run_cpu", d ? got : want, sizeof want);
            }
            t_check(*want && !strcmp(want, got),
                    "%s %s: --device test's losses and norms are the cpu's bitwise\n  cpu  %s\n  "
                    "test %s",
                    models[m], precisions[p], want, got);
        }
    t_check(strstr(output, "device: test") != NULL, "the start-up names the device: %.300s",
            output);
    // each step waits on the device once, after its last update (its
    // verdict's read), recorded per step; the cpu counts no waits
    char path_w[256];
    int waits[2] = {0, 0}, other = 0;
    for (int d = 0; d < 2; d++) {
        snprintf(path_w, sizeof path_w, "%s/%s/metrics.jsonl", dir, d ? "run_test" : "run_cpu");
        size_t len;
        char *text = (char *)t_read_file(path_w, &len);
        for (const char *p = text; p && (p = strstr(p, "\"host_waits\":")); p++)
            if (p[13] == '1' && (p[14] == ',' || p[14] == '}'))
                waits[d]++;
            else
                other++;
        free(text);
    }
    t_check(waits[1] == 3 && !waits[0] && !other && strstr(output, "queued work 1.00 times a step"),
            "--device test: each of 3 steps waits on the device once (host_waits 1: %d; on the "
            "cpu: %d; other values: %d)",
            waits[1], waits[0], other);
    // the host's multiply-add peak is not the device's: no MFU unless given
    char path[256], line[512] = "";
    snprintf(path, sizeof path, "%s/run_test/metrics.jsonl", dir);
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(line, sizeof line, f)) line[0] = 0;
        fclose(f);
    }
    t_check(strstr(line, "\"peak_flops\":null") &&
                strstr(line, "unknown on the test device: give --peak-tflops"),
            "a device run records no host peak for its MFU: %s", line);
}

// m trained 4 steps on the cpu, and 2 on the test device whose checkpoint
// is resumed to 4 on the test device and on the cpu: both the
// uninterrupted run's steps, bitwise.
static void resumed_bitwise(const char *m) {
    int rc = fitlm("train " RUN " %s --sample-tokens 0 --steps 4 --out whole --overwrite "
                   "--device cpu",
                   m);
    t_check(rc == 0, "the uninterrupted run %s: %.400s", m, output);
    char want[1024], got[1024];
    step_figures("whole", want, sizeof want);
    const char *devices[] = {"test", "cpu"};
    for (int d = 0; d < 2; d++) {
        rc = fitlm("train " RUN " %s --sample-tokens 0 --steps 2 --out half_%s --overwrite "
                   "--device test",
                   m, devices[d]);
        t_check(rc == 0, "the first half of %s on --device test: %.400s", m, output);
        rc = fitlm("train " RUN " --resume half_%s --steps 4 --device %s", devices[d], devices[d]);
        t_check(rc == 0, "%s resumed on --device %s: %.400s", m, devices[d], output);
        char path[64];
        snprintf(path, sizeof path, "half_%s", devices[d]);
        step_figures(path, got, sizeof got);
        t_check(*want && !strcmp(want, got),
                "%s: a test-device checkpoint resumed on --device %s is the uninterrupted run "
                "bitwise\n  want %s\n  got  %s",
                m, devices[d], want, got);
    }
}

static void test_resume_bitwise(void) {
    resumed_bitwise("--model llama-tiny --precision bf16");
}

// ZeRO's stages on one process partition nothing: on a device the plain
// path runs, the cpu's one-rank ZeRO run bitwise (losses, norms), said at
// start; a device's ZeRO-2 checkpoint resumes on the cpu's ZeRO-2 and there
// bitwise.
static void test_zero_one_process(void) {
    for (int stage = 1; stage <= 3; stage++) {
        char want[1024] = "", got[1024] = "";
        const char *devices[] = {"cpu", "test"};
        for (int d = 0; d < 2; d++) {
            int rc = fitlm("train " RUN " --model llama-tiny --precision bf16 --grad-accum 2 "
                           "--steps 3 --sample-tokens 0 --zero-stage %d --out zero_%s --overwrite "
                           "--device %s",
                           stage, devices[d], devices[d]);
            t_check(rc == 0, "ZeRO-%d on --device %s runs: %.600s", stage, devices[d], output);
            step_figures(d ? "zero_test" : "zero_cpu", d ? got : want, sizeof want);
        }
        t_check(*want && !strcmp(want, got),
                "ZeRO-%d on one process: --device test's losses and norms are the cpu's bitwise\n"
                "  cpu  %s\n  test %s",
                stage, want, got);
        char said[96];
        snprintf(said, sizeof said, "ZeRO-%d on one process: nothing to partition%s", stage,
                 stage == 3 ? " (the whole model stays on the device)" : "");
        t_check(strstr(output, said) != NULL, "the start-up says '%s': %.400s", said, output);
    }
    resumed_bitwise("--model llama-tiny --precision bf16 --grad-accum 2 --zero-stage 2");
}

// The figure after `key` in a JSON text ("" when missing).
static void json_field(const char *text, const char *key, char *out, size_t size) {
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *at = strstr(text, k);
    snprintf(out, size, "%.*s", at ? (int)strcspn(at + strlen(k), ",}") : 0,
             at ? at + strlen(k) : "");
}

static void test_export_eval_sample(void) {
    int rc = fitlm("train " RUN " --model tiny --steps 3 --sample-tokens 0 --out ex --overwrite "
                   "--device test");
    t_check(rc == 0, "the test-device run to export: %.400s", output);
    rc = fitlm("export ex -o hf --device test");
    t_check(rc == 0, "export on --device test: %.400s", output);
    char ckpt_loss[64], hf_loss[64];
    rc = fitlm_out("eval --checkpoint ex --data data --seq-len 32 --json --device test");
    json_field(output, "loss", ckpt_loss, sizeof ckpt_loss);
    t_check(rc == 0 && *ckpt_loss, "eval of the checkpoint on --device test: %.400s", output);
    rc = fitlm_out("eval --init-from hf --data data --seq-len 32 --json --device cpu");
    json_field(output, "loss", hf_loss, sizeof hf_loss);
    t_check(rc == 0 && !strcmp(ckpt_loss, hf_loss),
            "the export evaluates on the cpu to the test device's loss (%s, %s): %.300s", ckpt_loss,
            hf_loss, output);

    // the export as pretrained weights (--init-from a Hugging Face
    // directory: each row converted on the host and uploaded)
    char want_steps[1024] = "", got_steps[1024] = "";
    const char *devices[] = {"cpu", "test"};
    for (int d = 0; d < 2; d++) {
        rc = fitlm("train " RUN " --init-from hf --steps 2 --sample-tokens 0 --out init_%s "
                   "--overwrite --device %s",
                   devices[d], devices[d]);
        t_check(rc == 0, "--init-from the export on --device %s: %.400s", devices[d], output);
        char out[64];
        snprintf(out, sizeof out, "init_%s", devices[d]);
        step_figures(out, d ? got_steps : want_steps, sizeof want_steps);
    }
    t_check(*want_steps && !strcmp(want_steps, got_steps),
            "--init-from on --device test trains as on the cpu bitwise\n  cpu  %s\n  test %s",
            want_steps, got_steps);

    // the bytes in hex: a byte-level model's sample may hold a NUL
    static char want[sizeof output];
    rc = fitlm_out(
        "sample --checkpoint ex --tokens 24 --prompt The --device cpu 2>/dev/null | od -An -tx1");
    memcpy(want, output, sizeof output);
    t_check(rc == 0 && *want, "sample on the cpu: %.300s", output);
    rc = fitlm_out(
        "sample --checkpoint ex --tokens 24 --prompt The --device test 2>/dev/null | od -An -tx1");
    t_check(rc == 0 && !strcmp(want, output),
            "sample on --device test gives the cpu's tokens\n  cpu  %.200s\n  test %.200s", want,
            output);
}

// One table's device bytes per tag: `fitlm plan`'s rows (host, device,
// bytes, MiB) or the memory report's device rows (current, peak MiB, peak
// bytes), after the line starting with `header`.
static int device_bytes(const char *text, const char *header, int plan, size_t *bytes) {
    const char *at = strstr(text, header);
    if (!at) return 0;
    at = strchr(at, '\n');
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        char name[32];
        size_t host, device, sum;
        double cur, peak;
        int ok = plan ? sscanf(at + 1, " %31s %zu %zu %zu", name, &host, &device, &sum) == 4
                      : sscanf(at + 1, " %31s %lf %lf %zu", name, &cur, &peak, &device) == 4;
        if (!ok || strcmp(name, fl_mem_tag_name(t))) return 0;
        bytes[t] = device;
        at = strchr(at + 1, '\n');
        if (!at) return 0;
    }
    return 1;
}

static void test_plan_equals_measured(void) {
    const char *cases[] = {
        "--model tiny --precision fp32 --sample-tokens 8",
        "--model llama-tiny --precision bf16 --activation-checkpointing selective --grad-accum 2 "
        "--sample-tokens 0",
        "--model tiny --precision fp16 --activation-checkpointing block --sample-tokens 0",
        // the fused step: no master, AdaLomo's factored state, a two-pass
        // clip, and AdamW's master and moments updated from the backward
        "--model tiny --precision bf16 --optimizer lomo --grad-clip 1 --sample-tokens 0",
        "--model llama-tiny --precision fp32 --optimizer adalomo --sample-tokens 0",
        "--model tiny --precision fp16 --optimizer lomo --activation-checkpointing block "
        "--sample-tokens 0",
        "--model llama-tiny --precision bf16 --optimizer adamw --optimizer-in-backward "
        "--sample-tokens 0",
        // ZeRO on one process: the plain path's bytes
        "--model llama-tiny --precision bf16 --zero-stage 3 --grad-accum 2 --sample-tokens 0",
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t planned[FL_MEM_NTAGS], measured[FL_MEM_NTAGS];
        int rc = fitlm("plan " RUN " %s --steps 2 --device test", cases[c]);
        int ok = rc == 0 && device_bytes(output, "tag (per rank)", 1, planned);
        t_check(ok, "plan --device test %s prints host and device bytes: %.600s", cases[c], output);
        rc = fitlm("train " RUN
                   " %s --steps 2 --out plan_run --overwrite --mem-report --device test",
                   cases[c]);
        ok &= rc == 0 && device_bytes(output, "device memory by tag", 0, measured);
        t_check(ok, "train --device test %s reports device memory: %.600s", cases[c], output);
        for (int t = 0; t < FL_MEM_NTAGS && ok; t++)
            t_check(planned[t] == measured[t], "%s: planned device bytes of %s %zu = measured %zu",
                    cases[c], fl_mem_tag_name(t), planned[t], measured[t]);
    }
}

// Whether step_figures' "step:loss:norm " list has a skipped step (norm 0)
// followed by an updated one.
static int skip_then_update(const char *figures) {
    int skipped = 0, step;
    double loss, norm;
    for (const char *p = figures; sscanf(p, "%d:%lf:%lf", &step, &loss, &norm) == 3;) {
        if (norm == 0.0)
            skipped = 1;
        else if (skipped)
            return 1;
        p = strchr(p, ' ');
        if (!p) break;
        p++;
    }
    return 0;
}

// The fused step (step.c: each unit updated from the backward pass) on the
// test device: LOMO and AdaLomo on fp32 and 16-bit weights (stochastic
// rounding, keyed on the seed, step and element, as on the cpu), the
// two-pass global-norm clip, LOMO's clip by value, fp16's loss scale with
// overflowing steps skipped (the first ones overflow at power[m]), activation
// checkpointing, and AdamW and SGD with --optimizer-in-backward: the cpu's
// losses and norms bitwise, GPT-2 and LLaMA.
static void test_fused_equal_cpu(void) {
    const char *cases[] = {
        "--optimizer lomo --precision fp32",
        "--optimizer lomo --precision bf16 --grad-clip 1 --clip-grad-value 0.5",
        "--optimizer lomo --precision bf16 --activation-checkpointing block",
        "--optimizer lomo --precision fp16 --loss-scale 0 --initial-scale-power", // + power[m]
        "--optimizer lomo --precision fp16 --grad-clip 1 --activation-checkpointing selective",
        "--optimizer adalomo --precision fp32 --grad-clip 1",
        "--optimizer adalomo --precision bf16",
        "--optimizer adalomo --precision bf16 --grad-clip 1 --activation-checkpointing block",
        "--optimizer adamw --optimizer-in-backward --precision bf16",
        "--optimizer adamw --optimizer-in-backward --precision fp32 --grad-clip 1",
        "--optimizer sgd --optimizer-in-backward --precision bf16 --grad-clip 1",
    };
    const char *models[] = {"tiny", "llama-tiny"}, *power[] = {" 17", " 20"};
    for (int m = 0; m < 2; m++)
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            char want[1024] = "", got[1024] = "";
            const char *devices[] = {"cpu", "test"};
            int scaled = strstr(cases[c], "scale-power") != NULL;
            for (int d = 0; d < 2; d++) {
                int rc = fitlm("train " RUN " --model %s %s%s --steps 4 --sample-tokens 0 "
                               "--out fused_%s --overwrite --device %s",
                               models[m], cases[c], scaled ? power[m] : "", devices[d], devices[d]);
                t_check(rc == 0, "%s %s on --device %s runs: %.600s", models[m], cases[c],
                        devices[d], output);
                step_figures(d ? "fused_test" : "fused_cpu", d ? got : want, sizeof want);
            }
            t_check(*want && !strcmp(want, got),
                    "%s %s: --device test's losses and norms are the cpu's bitwise\n  cpu  %s\n"
                    "  test %s",
                    models[m], cases[c], want, got);
            // (which steps overflow depends on the data, the README: a
            // skipped step and an update after it, whichever they are)
            if (scaled)
                t_check(skip_then_update(want),
                        "the fp16 run skips an overflowing step and then updates: %s", want);
        }
}

// AdaLomo's state and the stochastically rounded bf16 weights in a
// test-device checkpoint: resumed on the test device and on the cpu, the
// uninterrupted cpu run's steps bitwise.
static void test_fused_resume_bitwise(void) {
    resumed_bitwise("--model tiny --precision bf16 --optimizer adalomo --grad-clip 1");
}

static void test_refusals(void) {
    fails_with("this build has no CUDA backend", "train " RUN " --model tiny --device cuda");
    fails_with("this build has no CUDA backend", "plan " RUN " --model tiny --device cuda");
    fails_with("this build has no CUDA backend", "eval --checkpoint ex --data data --device cuda");
    fails_with("must be one of cpu|cuda|test", "train " RUN " --model tiny --device tpu");
    fails_with("2 ranks", "plan " RUN " --model tiny --device test --ranks 2");
    fails_with("offload_param.max_in_cpu 1e+06: fitlm keeps no weights in host memory",
               "train " RUN " --model tiny --steps 1 --device test --config offload.json");
    // a run that does not fit the device's free memory, refused before
    // allocating, with what would fit (the test device holds 64 GiB)
    fails_with("What would fit", "train " RUN " --model tiny --batch 1000000 --device test "
                                 "--steps 1");
    t_check(strstr(output, "device memory") && strstr(output, "--batch"),
            "the refusal names the device memory and a micro-batch that fits: %.600s", output);
}

// --mem-limit on a device: the device's budget. A run planned one byte over
// it is refused before allocating, naming the budget; at exactly its planned
// bytes it trains; `fitlm plan` prints the budget and the fit.
static void test_mem_limit_device(void) {
    const char *run = "train " RUN " --model tiny --precision bf16 --steps 2 --device test";
    size_t planned[FL_MEM_NTAGS], need = 0;
    int ok = fitlm("plan " RUN " --model tiny --precision bf16 --steps 2 --device test") == 0 &&
             device_bytes(output, "tag (per rank)", 1, planned);
    t_check(ok, "plan --device test prints the device bytes: %.600s", output);
    if (!ok) return;
    for (int t = 0; t < FL_MEM_NTAGS; t++) need += planned[t];
    fails_with("device budget", "%s --out capped --overwrite --mem-limit %zu", run, need - 1);
    t_check(strstr(output, "--mem-limit") && strstr(output, "What would fit"),
            "the refusal names --mem-limit and what would fit: %.600s", output);
    t_check(fitlm("%s --out capped --overwrite --mem-limit %zu", run, need) == 0,
            "a run at its planned device bytes trains under the cap: %.600s", output);
    // the host is not held to the device's budget: the run's host bytes
    // (its data, the host's transient buffers) are more than 1 KiB
    t_check(fitlm("plan " RUN " --model tiny --precision bf16 --device test --mem-limit %zu",
                  need) == 0 &&
                strstr(output, "device budget") && strstr(output, "needed, fits") &&
                strstr(output, "(available memory)"),
            "plan at the budget: fits, the host against its available memory: %.600s", output);
    t_check(fitlm("plan " RUN " --model tiny --precision bf16 --device test --mem-limit %zu",
                  need - 1) == 0 &&
                strstr(output, "device budget") && strstr(output, "does NOT fit") &&
                strstr(output, "what would fit on the device"),
            "plan over the budget: does NOT fit, with the alternatives: %.600s", output);
    fails_with("device budget", "train " RUN " --model tiny --steps 1 --device test "
                                "--mem-limit 1KiB");
}

// The allocator's cap: what the plan misjudges still cannot pass it.
static void over_cap(void *arg) {
    (void)arg;
    const fl_device *dev = fl_device_get("test");
    fl_mem_device_set_cap((size_t)1 << 20);
    void *p = dev->alloc(dev, FL_MEM_PARAMS, (size_t)512 << 10);
    dev->free(dev, p);
    dev->alloc(dev, FL_MEM_ACTS, (size_t)3 << 19); // 1.5 MiB: over
}

static void test_allocator_cap(void) {
    t_dies("a device allocation over the cap", over_cap, NULL,
           "device memory cap of 1.00 MiB (--mem-limit) exceeded allocating 1.50 MiB for acts");
}

// What a device holds itself (cuda: its context) counts against the cap,
// which stands for a card's total memory: in the allocator's cap, and in
// the plan's device budget (a test table that says it holds 600 KiB).
static void over_cap_held(void *arg) {
    (void)arg;
    const fl_device *dev = fl_device_get("test");
    fl_mem_device_set_cap((size_t)1 << 20);
    fl_mem_device_set_reserved((size_t)600 << 10);
    dev->alloc(dev, FL_MEM_PARAMS, (size_t)512 << 10); // 1.09 MiB with what it holds
}

static size_t holds_600k(const fl_device *d) {
    (void)d;
    return (size_t)600 << 10;
}

static void test_cap_counts_held(void) {
    t_dies("a device allocation over the cap with what the device holds", over_cap_held, NULL,
           "allocated there, and 600 KiB the device holds itself (its context))");
    fl_device held = *fl_device_get("test");
    held.reserved = holds_600k;
    fl_plan_request r;
    fl_plan_request_init(&r);
    r.dev = &held;
    r.device_cap = (size_t)1 << 20;
    t_check(fl_plan_device_limit(&r) == ((size_t)424 << 10),
            "the plan's device budget is --mem-limit less what the device holds (%zu)",
            fl_plan_device_limit(&r));
    r.device_cap = (size_t)500 << 10;
    t_check(fl_plan_device_limit(&r) == 1, "a limit below it leaves no budget (%zu)",
            fl_plan_device_limit(&r));
}

// ----------------------------------------------------------------------------
// LoRA and QLoRA on the test device (issue 46): the adapters, their
// optimizer and the NF4 base weights live on the device; what reaches the
// host (checkpoints, the PEFT export, merging) goes through copies.

// the binary files a and b (under dir) hold the same bytes
static int same_bytes(const char *a, const char *b) {
    snprintf(cmd, sizeof cmd, "cmp -s %s/%s %s/%s", dir, a, dir, b);
    return system(cmd) == 0;
}

// Trains `flags` on the cpu and on --device test into OUT_cpu and
// OUT_test; their losses, norms and PEFT adapters must be the same.
static void lora_runs_equal(const char *out, const char *flags) {
    char want[1024] = "", got[1024] = "", run[64], a[128], b[128];
    const char *devices[] = {"cpu", "test"};
    for (int d = 0; d < 2; d++) {
        snprintf(run, sizeof run, "%s_%s", out, devices[d]);
        int rc = fitlm("train " RUN " %s --steps 3 --sample-tokens 0 --out %s --overwrite "
                       "--device %s",
                       flags, run, devices[d]);
        t_check(rc == 0, "%s on --device %s runs: %.600s", flags, devices[d], output);
        step_figures(run, d ? got : want, sizeof want);
    }
    t_check(*want && !strcmp(want, got),
            "%s: --device test's losses and norms are the cpu's bitwise\n  cpu  %s\n  test %s",
            flags, want, got);
    const char *files[] = {"adapter_model.safetensors", "adapter_config.json"};
    for (int f = 0; f < 2; f++) {
        snprintf(a, sizeof a, "%s_cpu/adapter/%s", out, files[f]);
        snprintf(b, sizeof b, "%s_test/adapter/%s", out, files[f]);
        t_check(same_bytes(a, b), "%s: the test device's PEFT %s is the cpu's bytes", flags,
                files[f]);
    }
}

static void test_lora_qlora_equal_cpu(void) {
    lora_runs_equal("lora32", "--model tiny --precision fp32 --lora --lora-dropout 0.1");
    lora_runs_equal("lora16", "--model llama-tiny --precision bf16 --lora --lora-target-modules "
                              "all-linear");
    // LoRA + LOMO: the base trained in the same backward pass, by LOMO with
    // the two-pass clip and by AdaLomo, its 16-bit weights stochastically rounded
    lora_runs_equal("lora_lomo", "--model llama-tiny --precision bf16 --lora "
                                 "--lora-base-optimizer lomo --grad-clip 1");
    // step 3 a spike by its norm: the base's verdict skips the adapters' step
    // too (on the device without the host looking: the gate's parent)
    lora_runs_equal("lora_lomo_spike", "--model llama-tiny --precision bf16 --lora "
                                       "--lora-base-optimizer lomo --grad-clip 1 "
                                       "--skip-update-gradz 0.001 --skip-update-lossz 0.001 "
                                       "--skip-update-min-steps 2 --skip-update-window 4 --seed 1");
    char path[256];
    size_t len;
    snprintf(path, sizeof path, "%s/lora_lomo_spike_test/metrics.jsonl", dir);
    char *spiked = (char *)t_read_file(path, &len);
    t_check(spiked && strstr(spiked, "\"skipped_steps\":1"),
            "LoRA + LOMO on the test device: a step is a spike (skipped_steps in %s)", path);
    free(spiked);
    lora_runs_equal("lora_adalomo", "--model tiny --precision bf16 --lora "
                                    "--lora-base-optimizer adalomo --grad-clip 0.5");
    // QLoRA on a Hugging Face base (one step of a LLaMA, exported)
    int rc = fitlm("train " RUN " --model llama-tiny --steps 1 --sample-tokens 0 --out qsrc "
                   "--overwrite --device cpu");
    t_check(rc == 0, "the QLoRA base's run: %.400s", output);
    rc = fitlm("export qsrc -o qbase");
    t_check(rc == 0, "the QLoRA base's export: %.400s", output);
    lora_runs_equal("qlora", "--init-from qbase --precision bf16 --lora --quantize nf4 "
                             "--lora-dropout 0.1");
    lora_runs_equal("qlora_dq", "--init-from qbase --precision bf16 --lora --quantize nf4 "
                                "--double-quant");
}

// A LoRA checkpoint (dropout on: its step counts), a QLoRA one (NF4,
// double quantisation) and a LoRA + AdaLomo one saved on the test device resume there and on the
// cpu as the uninterrupted run (after test_lora_qlora_equal_cpu: its base).
static void test_lora_resume_bitwise(void) {
    resumed_bitwise("--model llama-tiny --precision bf16 --lora --lora-dropout 0.1");
    resumed_bitwise("--init-from qbase --precision bf16 --lora --quantize nf4 --double-quant");
    resumed_bitwise("--model tiny --precision bf16 --lora --lora-base-optimizer adalomo "
                    "--grad-clip 0.5");
}

// --adapter on the device: training continues as on the cpu, eval gives
// the cpu's loss, sample the cpu's bytes, and --merge the cpu's merged
// export (after
// test_lora_qlora_equal_cpu: its base and adapters).
static void test_adapter_on_device(void) {
    // training continued from an adapter (--adapter loads it through copies)
    lora_runs_equal("cont", "--init-from qbase --adapter qlora_dq_test/adapter --quantize nf4 "
                            "--double-quant --precision bf16");
    const char *cases[] = {"--adapter qlora_test/adapter --quantize nf4",
                           "--adapter qlora_dq_test/adapter --quantize nf4 --double-quant"};
    for (int c = 0; c < 2; c++) {
        char loss[2][64];
        const char *devices[] = {"cpu", "test"};
        for (int d = 0; d < 2; d++) {
            int rc = fitlm_out("eval --init-from qbase %s --data data --seq-len 32 --json "
                               "--device %s",
                               cases[c], devices[d]);
            json_field(output, "loss", loss[d], sizeof loss[d]);
            t_check(rc == 0 && *loss[d], "eval %s on --device %s: %.400s", cases[c], devices[d],
                    output);
            rc = fitlm("export qbase %s --merge -o merged_%s --device %s", cases[c], devices[d],
                       devices[d]);
            t_check(rc == 0, "export --merge %s on --device %s: %.400s", cases[c], devices[d],
                    output);
        }
        t_check(!strcmp(loss[0], loss[1]), "eval %s: --device test's loss %s = the cpu's %s",
                cases[c], loss[1], loss[0]);
        t_check(same_bytes("merged_cpu/model.safetensors", "merged_test/model.safetensors"),
                "export --merge %s: --device test's merged weights are the cpu's bytes", cases[c]);
    }
    static char want[sizeof output];
    const char *s = "sample --checkpoint qbase --adapter qlora_dq_test/adapter --quantize nf4 "
                    "--double-quant --tokenizer byte --tokens 16 --prompt The --device";
    int rc = fitlm_out("%s cpu 2>/dev/null | od -An -tx1", s);
    memcpy(want, output, sizeof output);
    t_check(rc == 0 && *want, "sample with an adapter on the cpu: %.300s", output);
    rc = fitlm_out("%s test 2>/dev/null | od -An -tx1", s);
    t_check(rc == 0 && !strcmp(want, output),
            "sample with an adapter on --device test gives the cpu's tokens\n  cpu  %.200s\n  "
            "test %.200s",
            want, output);
}

static void test_lora_plan_equals_measured(void) {
    const char *cases[] = {
        "--model tiny --precision fp32 --lora --lora-dropout 0.1 --quantize nf4",
        "--model llama-tiny --precision bf16 --lora --quantize nf4 --double-quant --grad-accum 2",
        "--model llama-tiny --precision bf16 --lora --lora-target-modules all-linear "
        "--activation-checkpointing block",
        "--model llama-tiny --precision bf16 --lora --lora-base-optimizer adalomo --grad-clip 1",
        // the plan takes a pretrained model's shape from its directory, as train does
        "--init-from qbase --precision bf16 --lora --quantize nf4 --double-quant",
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t planned[FL_MEM_NTAGS], measured[FL_MEM_NTAGS];
        int rc = fitlm("plan " RUN " %s --steps 2 --sample-tokens 0 --device test", cases[c]);
        int ok = rc == 0 && device_bytes(output, "tag (per rank)", 1, planned);
        t_check(ok, "plan --device test %s prints host and device bytes: %.600s", cases[c], output);
        rc = fitlm("train " RUN " %s --steps 2 --sample-tokens 0 --out plan_lora --overwrite "
                   "--mem-report --device test",
                   cases[c]);
        ok &= rc == 0 && device_bytes(output, "device memory by tag", 0, measured);
        t_check(ok, "train --device test %s reports device memory: %.600s", cases[c], output);
        for (int t = 0; t < FL_MEM_NTAGS && ok; t++)
            t_check(planned[t] == measured[t], "%s: planned device bytes of %s %zu = measured %zu",
                    cases[c], fl_mem_tag_name(t), planned[t], measured[t]);
    }
}

int main(void) {
    if (!getenv("FITLM_BINARY")) {
        printf("placement: FITLM_BINARY not set (run under ctest)\n");
        return 77;
    }
    t_check(mkdtemp(dir) != NULL, "mkdtemp");
    const char *src = getenv("FITLM_SOURCE_DIR");
    char readme[512];
    snprintf(readme, sizeof readme, "%s/README.md", src ? src : ".");
    t_check(fitlm("tokenize %s -o data --tokenizer byte --val-fraction 0.1", readme) == 0,
            "tokenize the README: %.300s", output);
    char path[256];
    snprintf(path, sizeof path, "%s/offload.json", dir);
    FILE *f = fopen(path, "w");
    if (f) {
        // weight offload to NVMe with weights kept in host memory besides
        // (max_in_cpu), which fitlm does not offer (weight offload to
        // pinned memory or NVMe runs: test_device_offload.c)
        fputs("{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": "
              "\"nvme\", \"nvme_path\": \".\"}, \"offload_param\": {\"device\": \"nvme\", "
              "\"max_in_cpu\": 1e6}}}",
              f);
        fclose(f);
    }
    test_losses_equal_cpu();
    test_resume_bitwise();
    test_zero_one_process();
    test_export_eval_sample();
    test_plan_equals_measured();
    test_fused_equal_cpu();
    test_fused_resume_bitwise();
    test_refusals();
    test_mem_limit_device();
    test_allocator_cap();
    test_cap_counts_held();
    test_lora_qlora_equal_cpu();
    test_lora_resume_bitwise();
    test_adapter_on_device();
    test_lora_plan_equals_measured();
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", dir);
    return t_report();
}
