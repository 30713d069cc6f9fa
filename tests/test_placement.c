// test_placement.c: the device seam's placement and copies, end to end on
// the test device (device.h: the cpu's kernels on memory the host cannot
// touch, so any host access to a model or optimizer buffer that skips the
// table's copies faults). Runs the built binary (FITLM_BINARY) in a scratch
// directory: training on --device test gives the cpu's losses bitwise
// (GPT-2 and LLaMA, fp32, bf16, fp16); a checkpoint saved there resumes
// there bitwise; an export from it evaluates on the cpu to the same loss;
// sampling gives the same tokens; `fitlm plan --device test` predicts the
// device bytes per tag that the run allocates, exactly; and what a device
// does not run yet is refused with a clear error.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

// A small run on the byte-level data: few steps, no evaluation before the end.
#define RUN "--data data --tokenizer byte --batch 2 --seq-len 32 --eval-iters 1 --threads 2"

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
                          "--out run_%s --overwrite --device %s",
                          models[m], precisions[p], devices[d], devices[d]);
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
}

// Resume on the test device, and of the test device's checkpoint on the
// cpu: both the uninterrupted run's steps.
static void test_resume_bitwise(void) {
    const char *m = "--model llama-tiny --precision bf16 --sample-tokens 0";
    int rc = fitlm("train " RUN " %s --steps 4 --out whole --overwrite --device cpu", m);
    t_check(rc == 0, "the uninterrupted run: %.400s", output);
    char want[1024], got[1024];
    step_figures("whole", want, sizeof want);
    const char *devices[] = {"test", "cpu"};
    for (int d = 0; d < 2; d++) {
        rc = fitlm("train " RUN " %s --steps 2 --out half_%s --overwrite --device test", m,
                   devices[d]);
        t_check(rc == 0, "the first half on --device test: %.400s", output);
        rc = fitlm("train " RUN " --resume half_%s --steps 4 --device %s", devices[d], devices[d]);
        t_check(rc == 0, "resumed on --device %s: %.400s", devices[d], output);
        char path[64];
        snprintf(path, sizeof path, "half_%s", devices[d]);
        step_figures(path, got, sizeof got);
        t_check(*want && !strcmp(want, got),
                "a test-device checkpoint resumed on --device %s is the uninterrupted run "
                "bitwise\n  want %s\n  got  %s",
                devices[d], want, got);
    }
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

static void test_refusals(void) {
    fails_with("this build has no CUDA backend", "train " RUN " --model tiny --device cuda");
    fails_with("this build has no CUDA backend", "plan " RUN " --model tiny --device cuda");
    fails_with("this build has no CUDA backend", "eval --checkpoint ex --data data --device cuda");
    fails_with("must be one of cpu|cuda|test", "train " RUN " --model tiny --device tpu");
    const struct {
        const char *flags, *what;
    } refused[] = {
        {"--lora", "LoRA adapters"},
        {"--optimizer lomo", "the lomo optimizer"},
        {"--optimizer adalomo", "the adalomo optimizer"},
        {"--optimizer-in-backward", "optimizer_in_backward"},
        {"--zero-stage 1", "ZeRO stage 1 without offload_optimizer"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        fails_with(refused[i].what, "train " RUN " --model tiny --steps 1 --device test %s",
                   refused[i].flags);
    fails_with("2 ranks", "plan " RUN " --model tiny --device test --ranks 2");
    fails_with("weight offload",
               "train " RUN " --model tiny --steps 1 --device test --config offload.json");
    fails_with("a LoRA adapter", "sample --checkpoint ex --adapter nowhere --device test");
    // a run that does not fit the device's free memory, refused before
    // allocating, with what would fit (the test device holds 64 GiB)
    fails_with("What would fit", "train " RUN " --model tiny --batch 1000000 --device test "
                                 "--steps 1");
    t_check(strstr(output, "device memory") && strstr(output, "--batch"),
            "the refusal names the device memory and a micro-batch that fits: %.600s", output);
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
        fputs("{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": "
              "\"cpu\"}, \"offload_param\": {\"device\": \"cpu\"}}}",
              f);
        fclose(f);
    }
    test_losses_equal_cpu();
    test_resume_bitwise();
    test_export_eval_sample();
    test_plan_equals_measured();
    test_refusals();
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", dir);
    return t_report();
}
