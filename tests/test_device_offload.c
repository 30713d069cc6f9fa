// test_device_offload.c: ZeRO-Offload on one device (offload_optimizer
// device cpu with --device test): the master weights, optimizer state and
// gradient sum in pinned host memory, updated by the cpu's rules while the
// model stays on the device. Runs the built binary (FITLM_BINARY) in a
// scratch directory: an offloaded run gives the losses, norms and final
// weights of the same run without offload on the test device and on the
// cpu, bitwise (ZeRO-1 and 2, fp32/bf16/fp16, AdamW and SGD, with and
// without clipping and accumulation), and so with NVMe under it; a resume
// is bitwise; `fitlm plan` predicts the host, pinned and device bytes per
// tag the run allocates. Weight offload (ZeRO-3 with offload_param cpu)
// gives the stage-1 offloaded run's and the cpu's figures and weights
// bitwise, resumes bitwise, and holds less than the whole weights on the
// device. The device holds no whole gradient, only a ring of two units'
// (accumulation summed on the host, bitwise the cpu's), its peak the plan's
// and under the whole gradient's. Weight offload to NVMe (offload_param and offload_optimizer
// device nvme: the weights in the optimizer's file, read through pinned
// staging buffers) gives the cpu's and the pinned weight offload's figures
// and weights bitwise and resumes bitwise. Under weight offload the device
// never holds the whole weights (they are built in pinned host memory): its
// peak of weights is the plan's and under the model's. Pinned memory the
// host lacks, offload_param keys fitlm does not honour and ZeRO-3 without
// offload_param on a device are refused. The share of the step the device
// waits on the host is reported per step and measured. The gradients' sum
// made on the device (accumulate_on_device; fp32 gradients bound to it in
// place) gives the cpu's figures and weights bitwise. The delayed update (delayed_update) gives a
// cpu reference's (the plain step computing with the weights one update
// old) bitwise, runs in slices over the next step, resumes bitwise, and is
// refused where it cannot run. LoRA and QLoRA offload their adapters'
// optimizer (and LoRA a dense frozen base under offload_param): the cpu's
// run bitwise, resumed bitwise, planned exactly, advised, or refused.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/run.h"
#include "fitlm/train.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_devoffload_XXXXXX";
static char output[1 << 17];

static char cmd[4096];
#define fitlm(...)                                                                                 \
    (snprintf(cmd, sizeof cmd, __VA_ARGS__), t_fitlm(dir, cmd, 1, output, sizeof output))
#define fails_with(what, ...)                                                                      \
    (snprintf(cmd, sizeof cmd, __VA_ARGS__), t_fitlm_fails(dir, cmd, what, output, sizeof output))

// (--peak-tflops: measuring the host's peak, 0.05 s a run, is test_metrics' subject)
#define RUN                                                                                        \
    "--data data --tokenizer byte --batch 2 --seq-len 32 --eval-iters 1 --threads 2 "              \
    "--sample-tokens 0 --overwrite --peak-tflops 1"

// "loss:norm " per step from OUT/metrics.jsonl, as written (floats that read
// back exactly).
static void step_figures(const char *out, char *figures, size_t size) {
    char path[256], line[2048];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, out);
    FILE *f = fopen(path, "r");
    size_t n = 0;
    figures[0] = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f) && n < size) {
        const char *loss = strstr(line, "\"loss\":"), *norm = strstr(line, "\"grad_norm\":");
        if (!loss || !norm) continue;
        n += (size_t)snprintf(figures + n, size - n, "%.*s:%.*s ", (int)strcspn(loss + 7, ","),
                              loss + 7, (int)strcspn(norm + 12, ","), norm + 12);
    }
    fclose(f);
}

// Whether two files hold the same bytes (and exist).
static int same_file(const char *a, const char *b) {
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
    int same = fa && fb;
    while (same) {
        int x = fgetc(fa), y = fgetc(fb);
        if (x != y) same = 0;
        if (x == EOF || y == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

static void write_config(const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    t_check(f != NULL, "write %s", path);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

// The final weights of run `out` (trained with `flags`) into `path`: its
// export's, or under LoRA its adapters in PEFT's format.
static void final_weights(const char *flags, const char *out, char *path, size_t size) {
    if (strstr(flags, "--lora")) {
        snprintf(path, size, "%s/adapter/adapter_model.safetensors", out);
        return;
    }
    int rc = fitlm("export %s -o ex_%s", out, out);
    t_check(rc == 0, "export of %s: %.400s", out, output);
    snprintf(path, size, "ex_%s/model.safetensors", out);
}

// One configuration on the cpu and the test device without offload, and on
// the test device with it: the same figures and final weights.
static void check_case(const char *flags, const char *stage) {
    const char *runs[3][2] = {{"cpu", ""}, {"test", ""}, {"test", stage}};
    char figures[3][1024], weights[3][128], out[8];
    for (int i = 0; i < 3; i++) {
        int rc = fitlm("train " RUN " %s --out r%d --device %s%s%s", flags, i, runs[i][0],
                       *runs[i][1] ? " --config " : "", runs[i][1]);
        t_check(rc == 0, "%s on --device %s %s runs: %.600s", flags, runs[i][0], runs[i][1],
                output);
        snprintf(out, sizeof out, "r%d", i);
        step_figures(out, figures[i], sizeof figures[i]);
        final_weights(flags, out, weights[i], sizeof weights[i]);
    }
    for (int i = 1; i < 3; i++) {
        t_check(*figures[0] && !strcmp(figures[0], figures[i]),
                "%s: --device test%s%s's losses and norms are the cpu's bitwise\n  cpu  %s\n  "
                "test %s",
                flags, i == 2 ? " with " : "", i == 2 ? stage : "", figures[0], figures[i]);
        t_check(same_file(weights[0], weights[i]),
                "%s: the final weights of --device test%s%s are the cpu's bitwise", flags,
                i == 2 ? " with " : "", i == 2 ? stage : "");
    }
}

static void test_equals_plain(void) {
    check_case("--model tiny --precision fp32 --grad-accum 2 --steps 3", "off1.json");
    check_case("--model llama-tiny --precision bf16 --grad-accum 2 --steps 3", "off2.json");
    check_case("--model tiny --precision fp16 --steps 3", "off1.json");
    check_case("--model llama-tiny --precision bf16 --optimizer sgd --momentum 0.9 --grad-clip 0 "
               "--steps 3",
               "off1.json");
    check_case("--model tiny --precision fp16 --optimizer sgd --grad-accum 2 --steps 3",
               "off2.json");
    check_case("--model llama-tiny --precision fp32 --optimizer sgd --momentum 0.9 --steps 3",
               "off2.json");
    // ZeRO-3 with the optimizer offloaded and not the weights: on one
    // process its partition is the whole model, which stays on the device
    check_case("--model llama-tiny --precision bf16 --grad-accum 2 --steps 3", "off3.json");
    // the fp32 sum on the device (accumulate_on_device), the update after
    // the backward pass and during it
    check_case("--model llama-tiny --precision bf16 --grad-accum 3 --steps 3", "ad.json");
    check_case("--model tiny --precision fp16 --optimizer sgd --grad-accum 2 --steps 3", "ad.json");
    check_case("--model llama-tiny --precision bf16 --grad-clip 0 --grad-accum 2 --steps 3",
               "ad.json");
    check_case("--model llama-tiny --precision bf16 --grad-accum 3 --steps 3", "w3ad.json");
    // fp32: the units' gradients are the device's sum, added to in place
    // (the tied embedding's bound at the LM head)
    check_case("--model tiny --precision fp32 --grad-accum 3 --steps 3", "ad.json");
    check_case("--model llama-tiny --precision fp32 --optimizer sgd --momentum 0.9 --grad-clip 0 "
               "--grad-accum 2 --steps 3",
               "ad.json");
    check_case("--model llama-tiny --precision fp32 --grad-accum 2 --steps 3", "w3ad.json");
    // NVMe under it: the master and state paged from a file through host buffers
    check_case("--model llama-tiny --precision bf16 --grad-accum 2 --steps 3", "nvme.json");
    check_case("--model tiny --precision fp16 --optimizer sgd --momentum 0.9 --steps 3",
               "nvme.json");
}

// `flags` trained 4 steps on the cpu, and on the test device under
// `config` interrupted after 2 steps (into `half`) and resumed to 4: the
// same losses, norms and final weights, bitwise.
static void resumed_equals_cpu(const char *flags, const char *config, const char *half) {
    int rc = fitlm("train " RUN " %s --steps 4 --out rwhole --device cpu", flags);
    t_check(rc == 0, "the uninterrupted run: %.400s", output);
    rc =
        fitlm("train " RUN " %s --steps 2 --out %s --device test --config %s", flags, half, config);
    t_check(rc == 0, "the first half under %s: %.400s", config, output);
    rc = fitlm("train --data data --tokenizer byte --threads 2 --sample-tokens 0 --resume %s "
               "--steps 4 --device test --config %s",
               half, config);
    t_check(rc == 0, "resumed under %s: %.400s", config, output);
    char want[1024], got[1024], a[128], b[128];
    step_figures("rwhole", want, sizeof want);
    step_figures(half, got, sizeof got);
    t_check(*want && !strcmp(want, got),
            "%s under %s resumed is the uninterrupted cpu run bitwise\n  want %s\n  got  %s", flags,
            config, want, got);
    final_weights(flags, "rwhole", a, sizeof a);
    final_weights(flags, half, b, sizeof b);
    t_check(same_file(a, b),
            "%s under %s: the resumed run's final weights are the uninterrupted run's bitwise",
            flags, config);
}

// No clipping, fp16 or spike guard: the cpu updates each unit during the
// last micro-batch's backward pass (the run says so), and the losses, norms
// and weights stay the cpu's bitwise; with clipping it says why it waits.
static void test_overlap(void) {
    static const char *const cases[] = {
        "--model tiny --precision fp32 --grad-clip 0 --grad-accum 2 --steps 3",
        "--model llama-tiny --precision bf16 --grad-clip 0 --grad-accum 2 --steps 3",
        "--model llama-tiny --precision bf16 --grad-clip 0 --activation-checkpointing block "
        "--steps 3",
        "--model tiny --precision bf16 --grad-clip 0 --optimizer sgd --steps 3",
        // a spike guard tight enough to skip steps: judged on the loss before
        // the backward pass, a spike's step goes the plain way, skipped
        "--model tiny --precision fp32 --grad-clip 0 --skip-update-lossz 0.2 "
        "--skip-update-max-in-row 50 "
        "--skip-update-min-steps 2 --steps 10",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_case(cases[i], i % 2 ? "off2.json" : "off1.json");
        int rc = fitlm("train " RUN " %s --out ov --device test --config off1.json", cases[i]);
        t_check(rc == 0 && strstr(output, "the cpu updates each unit during the last backward"),
                "%s: the offloaded update overlaps the backward pass: %.600s", cases[i], output);
    }
    // under weight offload too: a unit's new weights stay in the pinned copy
    // the ring uploads from, the units still to run being untouched
    check_case("--model llama-tiny --precision bf16 --grad-clip 0 --grad-accum 2 --steps 3",
               "w3.json");
    check_case("--model tiny --precision fp32 --grad-clip 0 --activation-checkpointing block "
               "--steps 3",
               "w3.json");
    int rc = fitlm("train " RUN " --model tiny --precision bf16 --steps 1 --out ov --device test "
                   "--config off1.json");
    t_check(rc == 0 && strstr(output, "after the backward pass (clipping"),
            "with clipping the update waits for the whole gradient: %.600s", output);
    // a step's update ends inside it: a checkpoint holds no update in flight
    resumed_equals_cpu("--model llama-tiny --precision bf16 --grad-clip 0 --grad-accum 2",
                       "off1.json", "ovh");
}

// Offloaded, interrupted after 2 steps and resumed to 4: the cpu's
// uninterrupted 4 steps.
static void test_resume_bitwise(void) {
    const char *m = "--model llama-tiny --precision bf16 --grad-accum 2";
    resumed_equals_cpu(m, "off1.json", "half");
    // NVMe under it: the state written to the checkpoint from the file, and back
    resumed_equals_cpu(m, "nvme.json", "halfn");
}

// The bytes per tag of the table after the line starting with `header`:
// column `col` (0-based after the tag's name) of each tag's row; only the
// rows named (a pinned table lists the tags that have some).
static void table_bytes(const char *text, const char *header, int col, size_t *bytes) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    const char *at = strstr(text, header);
    if (!at) return;
    for (at = strchr(at, '\n'); at && at[1] == ' ' && at[2] == ' '; at = strchr(at + 1, '\n')) {
        char name[32];
        double v[4] = {0};
        int n = sscanf(at + 1, " %31s %lf %lf %lf %lf", name, &v[0], &v[1], &v[2], &v[3]);
        for (int t = 0; t < FL_MEM_NTAGS && n > col + 1; t++)
            if (!strcmp(name, fl_mem_tag_name(t))) bytes[t] = (size_t)v[col];
    }
}

// `fitlm plan --device test` of flags equals the run's measured host
// (but other and workspace: data and tokenizer are measured at run time),
// pinned and device bytes per tag; returns the planned pinned weights'
// bytes (and every tag's in pins, unless NULL), `output` holding the run's.
static size_t plan_equals_measured(const char *flags, size_t *pins) {
    size_t host[FL_MEM_NTAGS], pinned[FL_MEM_NTAGS], device[FL_MEM_NTAGS];
    size_t m_host[FL_MEM_NTAGS], m_pinned[FL_MEM_NTAGS], m_device[FL_MEM_NTAGS];
    int rc = fitlm("plan " RUN " %s --steps 2 --device test", flags);
    t_check(rc == 0, "plan %s: %.600s", flags, output);
    table_bytes(output, "tag (per rank)", 0, host);
    table_bytes(output, "tag (per rank)", 1, device);
    table_bytes(output, "of the host's", 0, pinned);
    rc = fitlm("train " RUN " %s --steps 2 --out plan_run --mem-report --device test", flags);
    t_check(rc == 0, "train %s: %.600s", flags, output);
    table_bytes(output, "memory by tag (MiB)", 2, m_host);
    table_bytes(output, "of which pinned", 2, m_pinned);
    table_bytes(output, "device memory by tag", 2, m_device);
    for (int t = 0; t < FL_MEM_NTAGS; t++) {
        t_check(pinned[t] == m_pinned[t], "%s: planned pinned bytes of %s %zu = measured %zu",
                flags, fl_mem_tag_name(t), pinned[t], m_pinned[t]);
        t_check(device[t] == m_device[t], "%s: planned device bytes of %s %zu = measured %zu",
                flags, fl_mem_tag_name(t), device[t], m_device[t]);
        if (t != FL_MEM_OTHER && t != FL_MEM_WORKSPACE)
            t_check(host[t] == m_host[t], "%s: planned host bytes of %s %zu = measured %zu", flags,
                    fl_mem_tag_name(t), host[t], m_host[t]);
    }
    if (pins) memcpy(pins, pinned, sizeof pinned);
    return pinned[FL_MEM_PARAMS];
}

static void test_plan_equals_measured(void) {
    const char *cases[] = {
        "--model llama-tiny --precision bf16 --grad-accum 2 --config off1.json",
        "--model tiny --precision fp16 --activation-checkpointing block --config off2.json",
        "--model tiny --precision fp32 --optimizer sgd --momentum 0.9 --config off1.json",
        "--model llama-tiny --precision bf16 --grad-accum 2 --config nvme.json",
        "--model llama-tiny --precision bf16 --grad-accum 2 --config dpu.json",
        "--model llama-tiny --precision bf16 --grad-accum 2 --config ad.json",
        "--model tiny --precision fp32 --grad-accum 2 --config ad.json",
        "--model llama-tiny --precision bf16 --grad-accum 2 --config pin.json", // (w: the last's)
    };
    enum { N = sizeof cases / sizeof cases[0] };
    size_t pins[N][FL_MEM_NTAGS], w = 0;
    for (size_t c = 0; c < N; c++)
        t_check((w = plan_equals_measured(cases[c], pins[c])) > 0,
                "%s: the plan shows pinned bytes", cases[c]);
    // what is pinned (w: the bf16 weights' bytes, 2 a parameter): what the
    // copies move, the host copies of the weights and gradients; the state
    // only with pin_memory; with the fp32 sum made on the device that sum
    // (4 a parameter) and no copy of the 16-bit gradients
    const size_t *off = pins[0], *dpu = pins[4], *ad = pins[5], *ad32 = pins[6], *pin = pins[7];
    t_check(off[FL_MEM_GRADS] == w && !off[FL_MEM_MASTER] && !off[FL_MEM_OPTIM],
            "offload: the 16-bit gradients' copy pinned (%zu = %zu), not the state (%zu, %zu)",
            off[FL_MEM_GRADS], w, off[FL_MEM_MASTER], off[FL_MEM_OPTIM]);
    t_check(dpu[FL_MEM_GRADS] == w,
            "delayed update: its second buffer, a host fp32 sum, "
            "not pinned (%zu = %zu)",
            dpu[FL_MEM_GRADS], w);
    t_check(ad[FL_MEM_GRADS] == 2 * w && !ad[FL_MEM_MASTER],
            "accumulate_on_device: pinned gradients %zu = the fp32 sum %zu", ad[FL_MEM_GRADS],
            2 * w);
    // fp32 gradients are the sum: they come down into their pinned copy
    // (the fp32 weights' bytes, as the copy of the weights)
    t_check(ad32[FL_MEM_GRADS] == ad32[FL_MEM_PARAMS] && ad32[FL_MEM_GRADS] > 0,
            "accumulate_on_device, fp32: pinned gradients %zu = the fp32 weights' copy %zu",
            ad32[FL_MEM_GRADS], ad32[FL_MEM_PARAMS]);
    t_check(pin[FL_MEM_GRADS] == 3 * w && pin[FL_MEM_MASTER] == 2 * w && pin[FL_MEM_OPTIM] == 4 * w,
            "pin_memory: the state pinned too (grads %zu = %zu, master %zu = %zu, optim %zu = %zu)",
            pin[FL_MEM_GRADS], 3 * w, pin[FL_MEM_MASTER], 2 * w, pin[FL_MEM_OPTIM], 4 * w);
}

// Weight offload (ZeRO-3, offload_param cpu or nvme): the same run as the
// cpu's and `base`'s on the test device (the stage-1 offloaded one, or the
// pinned weight offload), bitwise (losses, norms, final weights).
static void weights_case(const char *flags, const char *base, const char *stage3) {
    const char *runs[3][2] = {{"cpu", ""}, {"test", base}, {"test", stage3}};
    char figures[3][1024];
    for (int i = 0; i < 3; i++) {
        int rc = fitlm("train " RUN " %s --out w%d --device %s%s%s", flags, i, runs[i][0],
                       *runs[i][1] ? " --config " : "", runs[i][1]);
        t_check(rc == 0, "%s on --device %s %s runs: %.600s", flags, runs[i][0], runs[i][1],
                output);
        char out[8];
        snprintf(out, sizeof out, "w%d", i);
        step_figures(out, figures[i], sizeof figures[i]);
        rc = fitlm("export w%d -o exw%d", i, i);
        t_check(rc == 0, "export of run %d: %.400s", i, output);
    }
    for (int i = 1; i < 3; i++) {
        t_check(*figures[0] && !strcmp(figures[0], figures[i]),
                "%s: --device test with %s: the cpu's losses and norms bitwise\n  cpu  %s\n  "
                "test %s",
                flags, runs[i][1], figures[0], figures[i]);
        t_check(same_file("exw0/model.safetensors",
                          i == 1 ? "exw1/model.safetensors" : "exw2/model.safetensors"),
                "%s: the final weights with %s are the cpu's bitwise", flags, runs[i][1]);
    }
}

static void test_weight_offload(void) {
    const char *common = "--grad-accum 2 --activation-checkpointing block --grad-clip 0.5 "
                         "--steps 3";
    char flags[512];
    const char *models[] = {"--model tiny --precision fp32", "--model llama-tiny --precision bf16"};
    for (int k = 0; k < 2; k++) {
        snprintf(flags, sizeof flags, "%s %s", models[k], common);
        weights_case(flags, "off1.json", "w3.json");
        weights_case(flags, "off1.json", "w3p.json");
    }
}

// NVMe weight offload: the pinned weight offload's run and the cpu's,
// bitwise: a ring of one unit read in pieces (staging buffers smaller than
// a unit), the default prefetch and reuse with DeepSpeed's buffer keys and
// with pieces,
// bf16/fp16/fp32, AdamW and SGD, clipping or the update during the
// backward pass.
static void test_weight_offload_nvme(void) {
    weights_case("--model llama-tiny --precision bf16 --grad-accum 2 --grad-clip 0.5 --steps 3",
                 "w3.json", "w3n.json");
    weights_case("--model tiny --precision fp32 --activation-checkpointing block --steps 3",
                 "w3p.json", "w3np.json");
    weights_case("--model tiny --precision fp16 --optimizer sgd --momentum 0.9 --steps 3",
                 "w3.json", "w3n.json");
    weights_case("--model llama-tiny --precision bf16 --grad-clip 0 --grad-accum 2 --steps 3",
                 "w3p.json", "w3np.json");
    // the prefetch through three buffers of 2000 elements: a prefetched
    // unit's pieces go up before it runs when their buffers are needed
    weights_case("--model llama-tiny --precision bf16 --activation-checkpointing block --steps 3",
                 "w3p.json", "w3nq.json");
    // interrupted and resumed: the weights written to the checkpoint from
    // the file, and back into it
    resumed_equals_cpu("--model llama-tiny --precision bf16 --grad-accum 2 --grad-clip 0.5",
                       "w3n.json", "wnhalf");
}

// Weight offload interrupted after 2 steps and resumed to 4: the cpu's
// uninterrupted run (the whole weights come back from the checkpoint into
// the pinned copy, and up unit by unit).
static void test_weight_offload_resume(void) {
    resumed_equals_cpu("--model llama-tiny --precision bf16 --grad-accum 2 --grad-clip 0.5",
                       "w3p.json", "whalf");
}

// The "current" MiB of tag params in the device's table of --mem-report.
static double device_params_now(const char *text) {
    const char *at = strstr(text, "device memory by tag");
    at = at ? strstr(at, "\n  params") : NULL;
    double now = -1.0;
    if (!at || sscanf(at, " params %lf", &now) != 1) return -1.0;
    return now;
}

// The plan equals the measured bytes per tag (host, pinned, device; the
// disk's bytes under NVMe), and the device never holds the whole weights:
// its peak of weights (the residents and the ring; the model is built in
// pinned host memory) is the plan's and, with a ring of a fraction of the
// units, under the model's; after set-up the same.
static void test_weight_offload_plan(void) {
    const char *cases[] = {
        "--model llama-tiny --precision bf16 --grad-accum 2 --config w3.json",
        "--model tiny --precision fp32 --activation-checkpointing block --config w3p.json",
        "--model llama-tiny --precision bf16 --grad-accum 2 --config w3n.json",
        "--model tiny --precision fp16 --config w3np.json",
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        // a ring of one unit (w3.json, w3n.json) holds under 3/4 of the weights here
        int one = strstr(cases[c], "w3.json") || strstr(cases[c], "w3n.json");
        size_t disk = 0;
        int rc = fitlm("plan " RUN " %s --steps 2 --device test", cases[c]);
        const char *at = strstr(output, "NVMe offload: ");
        if (rc == 0 && at) sscanf(at, "NVMe offload: %zu bytes", &disk);
        size_t whole = plan_equals_measured(cases[c], NULL); // the 16-bit weights' bytes
        size_t device[FL_MEM_NTAGS];
        table_bytes(output, "device memory by tag", 2, device);
        // (the default prefetch's ring on these 2-block models is not a
        // fraction of the units: only the plan's bytes)
        t_check(whole > 0 && device[FL_MEM_PARAMS] > 0 &&
                    (!one || device[FL_MEM_PARAMS] < whole / 2 + whole / 4),
                "%s: the device's peak of weights (%zu bytes, the plan's) is under 3/4 of the "
                "whole model's %zu",
                cases[c], device[FL_MEM_PARAMS], whole);
        // NVMe: the file holds the weights besides the fp32 master, m and v
        if (strstr(cases[c], "w3n"))
            t_check(disk >= 7 * whole,
                    "%s: the plan's %zu bytes on disk hold the weights (%zu) "
                    "and the master and state",
                    cases[c], disk, whole);
        // the pinned copy holds the whole weights; the device, after set-up,
        // less (a ring of one unit: w3.json)
        if (!one) continue;
        double now = device_params_now(output);
        t_check(now >= 0.0 && now * 1048576.0 < 0.75 * (double)whole,
                "%s: the device's weights after set-up (%.2f MiB) are under the whole model's "
                "(%.0f bytes)",
                cases[c], now, (double)whole);
    }
}

// The device holds no whole gradient: each unit's lives in a ring of two
// device buffers of the largest unit (the tied embedding's in its own from
// the LM head to the embedding) and goes down to the pinned copy; with
// accumulation the host sums as the cpu does (16-bit: each micro-batch's
// into the fp32 sum; fp32: the sum so far goes up into the unit's buffer
// and the backward adds to it, as the cpu's adds in place). Accumulation 1
// and 3 in fp32, bf16 and fp16, with and without weight offload (pinned
// and NVMe), recompute and the update during the backward pass: the cpu's
// run bitwise, and resumed bitwise.
static void test_grad_ring(void) {
    static const char *const models[] = {"--model tiny --precision fp32",
                                         "--model llama-tiny --precision bf16",
                                         "--model tiny --precision fp16"};
    char flags[512];
    for (int k = 0; k < 3; k++)
        for (int accum = 1; accum <= 3; accum += 2) {
            snprintf(flags, sizeof flags, "%s --grad-accum %d --steps 3", models[k], accum);
            weights_case(flags, "off1.json", "w3p.json");
        }
    // overlapped: each unit's fp32 sum goes up and down, the host updating
    // the units behind the backward pass
    weights_case("--model tiny --precision fp32 --grad-clip 0 --grad-accum 3 "
                 "--activation-checkpointing block --steps 3",
                 "off2.json", "w3.json");
    weights_case("--model llama-tiny --precision fp32 --grad-accum 3 --steps 3", "nvme.json",
                 "w3n.json");
    resumed_equals_cpu("--model tiny --precision fp32 --grad-accum 3", "w3p.json", "ringh");
    resumed_equals_cpu("--model llama-tiny --precision fp16 --grad-accum 3", "off1.json",
                       "ringh16");
}

// The device's peak of gradient bytes (--mem-report's grads row) is the
// ring's: the plan's (plan_equals_measured) and under the whole gradient's
// (the tied GPT-2's embedding buffer is most of its tiny model; on the
// LLaMA two units' buffers are under 3/4 of it).
static void test_grad_ring_plan(void) {
    const char *cases[] = {
        "--model llama-tiny --precision bf16 --grad-accum 3 --config off1.json",
        "--model tiny --precision fp32 --grad-accum 3 --config w3p.json",
        "--model llama-tiny --precision fp16 --activation-checkpointing block --config w3.json",
        "--model llama-tiny --precision fp32 --grad-accum 3 --config off2.json",
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t whole = plan_equals_measured(cases[c], NULL); // the 16-bit (or fp32) weights' bytes
        size_t device[FL_MEM_NTAGS];
        table_bytes(output, "device memory by tag", 2, device);
        size_t ring = device[FL_MEM_GRADS];
        int llama = strstr(cases[c], "llama") != NULL;
        t_check(ring > 0 && ring < whole && (!llama || ring < whole / 2 + whole / 4),
                "%s: the device's peak of gradients (%zu bytes, the plan's) is the ring's, under "
                "the whole gradient's %zu",
                cases[c], ring, whole);
    }
}

// The figure after `key` up to `end` in text, into out ("" when missing).
static void figure_after(const char *text, const char *key, char end, char *out, size_t size) {
    const char *at = strstr(text, key);
    size_t n = at ? strcspn(at + strlen(key), (char[]){end, '\n', 0}) : 0;
    snprintf(out, size, "%.*s", (int)(n < size ? n : size - 1), at ? at + strlen(key) : "");
}

// The device bytes a plan's output says it needs ("...: 3.31 GiB needed, fits").
static void planned_need(char *out, size_t size) {
    const char *need = strstr(output, " needed, fits"), *from = need;
    while (from && from > output && strncmp(from, ": ", 2)) from--;
    snprintf(out, size, "%.*s", need && from ? (int)(need - from - 2) : 0,
             need && from ? from + 2 : "");
}

// A device's run that does not fit its budget: what would fit names
// ZeRO-Offload and the weight offload (with the host bytes each moves
// there) and LOMO, each with the device bytes `fitlm plan` gives that run;
// under LoRA the frozen base's weight offload.
static void test_offload_advice(void) {
    const char *flags = "--model tinyllama-1.1b --precision bf16 --batch 4 --seq-len 64 "
                        "--activation-checkpointing block --device test";
    fails_with("What would fit", "train " RUN " %s --mem-limit 4GiB --steps 1", flags);
    static char advice[sizeof output];
    memcpy(advice, output, sizeof output);
    const struct {
        const char *key, *flags;
    } ways[] = {{"(ZeRO-Offload; host ", "--config off1.json"},
                {"(weight offload; host ", "--config w3d.json"},
                {"  --optimizer lomo", "--optimizer lomo"}};
    for (int k = 0; k < 3; k++) {
        char host[32] = "", device[32], planned[32];
        const char *after = strstr(advice, ways[k].key);
        if (k < 2) figure_after(advice, ways[k].key, ')', host, sizeof host);
        figure_after(after ? after : "", k < 2 ? "): " : ": ", '\n', device, sizeof device);
        // "device memory ... free on test (...): 3.31 GiB needed, fits"
        int rc = fitlm("plan " RUN " %s %s", flags, ways[k].flags);
        planned_need(planned, sizeof planned);
        t_check(rc == 0 && (k == 2 || *host) && *device && !strcmp(device, planned),
                "what would fit names %s%s: %s, the plan's %s with %s (%s)", ways[k].key, host,
                device, planned, ways[k].flags, advice);
    }
    // under LoRA the frozen base's weight offload alone (the adapters' state is small)
    fails_with("What would fit", "train " RUN " %s --lora --mem-limit 2GiB --steps 1", flags);
    const char *key = "(LoRA's frozen base offloaded; host ";
    char host[32] = "", device[32] = "", planned[32] = "";
    figure_after(output, key, ')', host, sizeof host);
    const char *after = strstr(output, key);
    figure_after(after ? after : "", "): ", '\n', device, sizeof device);
    int rc = fitlm("plan " RUN " %s --lora --config lw3d.json", flags);
    planned_need(planned, sizeof planned);
    t_check(rc == 0 && *host && *device && !strcmp(device, planned),
            "under LoRA what would fit names %s%s: %s, the plan's %s with lw3d.json", key, host,
            device, planned);
}

static void test_refusals(void) {
    // the pinned bytes over the host's memory (on a device --mem-limit is the
    // device's budget; the host has its available memory): with pin_memory
    // llama-7b's master weights and state are pinned too, over 100 GB; its
    // device bytes fit the test device: refused before allocating
    fails_with("of pinned host memory (the host copies of the weights and gradients, the "
               "master weights and optimizer state: offload_optimizer.pin_memory), more than",
               "train " RUN " --model llama-7b --precision bf16 --steps 1 --device test "
               "--config pin.json");
    // a partial offload (DeepSpeed's ratio) is not offered on a device
    fails_with("offload_optimizer.ratio 0.5: a partial offload (part of the optimizer state kept "
               "on the device) is not supported on --device test",
               "train " RUN " --model tiny --steps 1 --device test --config ratio.json");
    fails_with("offload_optimizer applies to ZeRO stages 1-3",
               "train " RUN " --model tiny --steps 1 --device test --config off0.json");
    // NVMe weight offload: no weights kept in host memory (max_in_cpu), at
    // most 64 staging buffers, the weights in the optimizer's file
    fails_with("offload_param.max_in_cpu 1e+06: fitlm keeps no weights in host memory",
               "train " RUN " --model tiny --steps 1 --device test --config paramnv.json");
    fails_with("offload_param.buffer_count 65",
               "train " RUN " --model tiny --steps 1 --device test --config paramnb.json");
    fails_with("offload_param.device nvme needs offload_optimizer.device nvme",
               "train " RUN " --model tiny --steps 1 --device test --config paramno.json");
    fails_with("without offload_optimizer.device cpu",
               "train " RUN " --model tiny --steps 1 --device test --config param3n.json");
    // the fp32 sum on the device: under accumulation, on a device
    fails_with("accumulate_on_device: there is no accumulation to sum",
               "train " RUN " --model tiny --precision bf16 --steps 1 --device test "
               "--config ad.json");
    fails_with("accumulate_on_device: it needs --device cuda (or test)",
               "train " RUN " --model tiny --precision bf16 --grad-accum 2 --steps 1 --device cpu "
               "--config ad.json");
}

// The share of the step the device waits on the host (issue 46). A run
// reports it per step (its line and metrics.jsonl) and after the last,
// between 0 and 100%; the cpu's run has none.
static void test_waits_reported(void) {
    const char *flags = "--model llama-tiny --precision bf16 --grad-accum 2 --steps 3";
    for (int overlap = 0; overlap < 2; overlap++) {
        int rc = fitlm("train " RUN " %s%s --out waits --device test --config off1.json", flags,
                       overlap ? " --grad-clip 0" : "");
        t_check(rc == 0, "%s: runs: %.600s", flags, output);
        int lines = 0, in_range = 1;
        for (const char *at = output; (at = strstr(at, "| waited on the cpu ")); at++, lines++) {
            double pct = atof(at + strlen("| waited on the cpu "));
            in_range &= pct >= 0.0 && pct <= 100.0;
        }
        const char *sum = strstr(output, "ZeRO-Offload: the test device waited on the cpu ");
        double total =
            sum ? atof(sum + strlen("ZeRO-Offload: the test device waited on the cpu ")) : -1.0;
        t_check(lines == 3 && in_range && total >= 0.0 && total <= 100.0,
                "%s%s: each step's line and the summary give the share of the step the device "
                "waited, within [0, 100]: %.900s",
                flags, overlap ? " (overlapped)" : "", output);
        char path[256], line[2048];
        snprintf(path, sizeof path, "%s/waits/metrics.jsonl", dir);
        FILE *f = fopen(path, "r");
        int recorded = 0, steps = 0;
        while (f && fgets(line, sizeof line, f)) {
            if (!strstr(line, "\"loss\":")) continue;
            steps++;
            const char *w = strstr(line, "\"device_wait\":");
            double share = w ? atof(w + strlen("\"device_wait\":")) : -1.0;
            recorded += share >= 0.0 && share <= 1.0;
        }
        if (f) fclose(f);
        t_check(steps == 3 && recorded == 3,
                "metrics.jsonl records device_wait within [0, 1] for each of its %d steps", steps);
    }
    int rc = fitlm("train " RUN " %s --out waits --device cpu", flags);
    t_check(rc == 0 && !strstr(output, "waited on the cpu"),
            "a run without offload reports no wait: %.600s", output);
}

// A step of the run by hand (train.c's plain step, one micro-batch), with
// `sleep_ms` of host work between the gradients' download and the update.
static void hand_step(fl_run *run, const int *in, const int *tg, int sleep_ms) {
    fl_model *m = &run->model;
    fl_optimizer *o = &run->optim;
    int B = run->cfg.micro_batch, T = run->cfg.seq_len;
    float dloss = fl_optimizer_scale(o) / (float)fl_batch_targets(o, tg, (size_t)B * T);
    fl_optimizer_zero_grad(o);
    fl_model_forward_train(m, in, tg, B, T, dloss);
    if (fl_optimizer_can_overlap(o)) fl_optimizer_begin_overlap(o, run->cfg.lr, m->loss);
    fl_model_backward(m, dloss);
    fl_optimizer_micro_done(o);
    struct timespec nap = {0, (long)sleep_ms * 1000000L};
    while (nanosleep(&nap, &nap) != 0) continue;
    fl_optimizer_step(o, run->cfg.lr);
}

// The share is measured, not made up: the offload's timed waits, read after
// each step, lie within the step's time, and host work the device waits for
// (a sleep between the download and the update) adds at least its length
// to the waits, with the update overlapped or not.
static void test_waits_measured(void) {
    static const char json[] = "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                               "{\"device\": \"cpu\"}}}";
    for (int overlap = 0; overlap < 2; overlap++) {
        fl_run run;
        t_run_open(&run, json,
                   overlap ? "--model llama-tiny --precision bf16 --batch 2 --seq-len 32 "
                             "--threads 2 --device test --tokenizer byte --out= --grad-clip 0"
                           : "--model llama-tiny --precision bf16 --batch 2 --seq-len 32 "
                             "--threads 2 --device test --tokenizer byte --out=",
                   0);
        enum { N = 64 };
        int *in = run.inputs, *tg = run.targets; // pinned: the step's tokens go up asynchronously
        t_rule_batch(5, N, run.model.config.vocab_size, in, tg);
        fl_dev_offload_waits w[3];
        fl_dev_offload_waits_get(run.dev_offload, &w[0]);
        fl_run_step_batch(&run, in, tg, run.cfg.lr); // the engine's step
        fl_dev_offload_waits_get(run.dev_offload, &w[1]);
        hand_step(&run, in, tg, 50);
        fl_dev_offload_waits_get(run.dev_offload, &w[2]);
        double wait1 = w[1].wait_ms, step1 = w[1].step_ms, wait2 = w[2].wait_ms - w[1].wait_ms,
               step2 = w[2].step_ms - w[1].step_ms;
        t_check(w[0].steps == 0 && w[1].steps == 1 && w[2].steps == 2,
                "%s: one timed step per step (%ld, %ld, %ld)", overlap ? "overlapped" : "after",
                w[0].steps, w[1].steps, w[2].steps);
        t_check(wait1 > 0.0 && wait1 <= step1,
                "%s: the engine's step waited %.3f ms of its %.3f ms on the host (the update)",
                overlap ? "overlapped" : "after", wait1, step1);
        t_check(wait2 >= 50.0 && wait2 <= step2,
                "%s: 50 ms more host work: the step waited %.3f ms of its %.3f ms",
                overlap ? "overlapped" : "after", wait2, step2);
        fl_run_close(&run);
    }
}

// The delayed update's reference, on the cpu without offload: the plain
// step, but computing with the weights one update old. Before the last
// micro-batch's backward pass reports a unit, the engine's step is done
// with the unit's old weights, so its rows of the latest ones go back into
// the model (the update reads fp32 weights there); after an update that
// the delayed run delays, the model computes again with those before it.
typedef struct {
    fl_optimizer *o;
    const char *latest; // the weights after every update so far
    size_t es;
} stale_ref;

static void stale_grad_ready(void *ctx, fl_model *m, int first, int n) {
    stale_ref *s = ctx;
    if (s->o->micro != s->o->cfg.grad_accum - 1) return;
    const fl_param_view *a = &m->table.views[first], *b = &m->table.views[first + n - 1];
    size_t lo = a->offset * s->es, hi = (b->offset + b->numel) * s->es;
    memcpy((char *)m->params + lo, s->latest + lo, hi - lo);
}

// `flags` for `steps` steps under offload_optimizer `offload` with
// delayed_update after `warmup` updates on the test device, against the
// reference: each step's loss, norm and skip bitwise, and after
// fl_run_flush the device's weights (and the master weights) those after
// every update. The reference must differ from the undelayed run. Returns
// the steps skipped (an fp16 overflow, a spike) while a delayed update ran
// in them.
static int delayed_case(const char *flags, const char *offload, int warmup, int steps) {
    char json[512], run_flags[512];
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {%s, "
             "\"delayed_update\": true, \"delayed_update_warmup\": %d}}}",
             offload, warmup);
    snprintf(run_flags, sizeof run_flags,
             "%s --batch 2 --seq-len 32 --threads 2 --tokenizer byte --out= --peak-tflops 1 "
             "--warmup 0 --lr 1e-2",
             flags);
    char dev_flags[600];
    snprintf(dev_flags, sizeof dev_flags, "%s --device test", run_flags);
    fl_run dpu, ref, plain;
    t_run_open(&dpu, json, dev_flags, 0);
    t_run_open(&ref, NULL, run_flags, 0);
    t_run_open(&plain, NULL, run_flags, 0);
    fl_model *m = &ref.model;
    size_t es = fl_dtype_size(m->dtype), bytes = m->table.numel * es;
    char *latest = malloc(bytes), *newest = malloc(bytes);
    memcpy(latest, m->params, bytes);
    stale_ref sr = {&ref.optim, latest, es};
    int micro = ref.cfg.grad_accum, V = m->config.vocab_size;
    size_t N = (size_t)micro * ref.cfg.micro_batch * ref.cfg.seq_len;
    int *in = dpu.inputs, *tg = dpu.targets; // pinned (the device's tokens go up asynchronously)
    int same = 1, differs = 0, delayed_steps = 0, skipped_after = 0, pending = 0;
    for (int step = 0; step < steps; step++) {
        t_rule_batch(100 + (uint64_t)step, N, V, in, tg);
        float lr = fl_lr_at(&ref.schedule, step);
        int delays = *fl_optim_step_count(ref.optim.rule) >= warmup;
        m->hooks = (fl_model_hooks){NULL, stale_grad_ready, &sr};
        fl_train_result want = fl_run_step_batch(&ref, in, tg, lr);
        m->hooks = (fl_model_hooks){0};
        fl_train_result got = fl_run_step_batch(&dpu, in, tg, lr);
        fl_train_result undelayed = fl_run_step_batch(&plain, in, tg, lr);
        int kept = !want.skipped && !want.spike.outlier; // an update was applied
        skipped_after += pending && !kept;
        pending = kept && delays;
        if (pending) { // the next step computes with the weights before it
            memcpy(newest, m->params, bytes);
            memcpy(m->params, latest, bytes);
            memcpy(latest, newest, bytes);
            delayed_steps++;
        } else {
            memcpy(latest, m->params, bytes);
        }
        same &=
            got.loss == want.loss && got.grad_norm == want.grad_norm && got.skipped == want.skipped;
        differs |= undelayed.loss != want.loss;
        if (got.loss != want.loss || got.grad_norm != want.grad_norm)
            printf("  step %d: loss %.9g norm %.9g skipped %d, the reference's %.9g %.9g %d\n",
                   step + 1, got.loss, got.grad_norm, got.skipped, want.loss, want.grad_norm,
                   want.skipped);
    }
    t_check(same,
            "%s under %s, delayed after %d: each step's loss, norm and skip are the "
            "reference's bitwise",
            flags, offload, warmup);
    t_check(delayed_steps > 0 && differs,
            "%s: %d updates were delayed, and the losses differ from the undelayed run's", flags,
            delayed_steps);
    fl_run_flush(&dpu);
    char *device = malloc(bytes);
    fl_dev_download(dpu.dev, device, dpu.model.params, bytes);
    t_check(!memcmp(device, latest, bytes),
            "%s under %s: after the flush the device's weights are those after every update", flags,
            offload);
    if (ref.optim.master) {
        fl_optimizer_map(&dpu.optim);
        t_check(!memcmp(dpu.optim.master, ref.optim.master, m->table.numel * sizeof(float)),
                "%s under %s: the master weights are the reference's", flags, offload);
        fl_optimizer_unmap(&dpu.optim);
    }
    free(device);
    free(latest);
    free(newest);
    fl_run_close(&plain);
    fl_run_close(&ref);
    fl_run_close(&dpu);
    return skipped_after;
}

// The delayed update runs in slices over the next step: after the first of
// its two micro-batches' forward pass some rows are updated, not all, the
// last first (the backward pass's order).
static void test_delayed_slices(void) {
    fl_run run;
    t_run_open(&run,
               "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": "
               "\"cpu\", \"delayed_update\": true, \"delayed_update_warmup\": 0}}}",
               "--model llama-tiny --precision bf16 --grad-accum 2 --batch 2 --seq-len 32 "
               "--threads 2 --device test --tokenizer byte --out=",
               0);
    enum { N = 2 * 64 };
    int *in = run.inputs, *tg = run.targets; // pinned
    t_rule_batch(9, N, run.model.config.vocab_size, in, tg);
    fl_run_step_batch(&run, in, tg, run.cfg.lr);
    fl_optimizer *o = &run.optim;
    t_check(o->delayed, "the first update is pending after its step");
    // a row is updated once its master weights changed
    const fl_param_table *t = &run.model.table;
    size_t bytes = t->numel * sizeof(float);
    float *before = malloc(bytes);
    memcpy(before, o->master, bytes);
    fl_optimizer_zero_grad(o);
    fl_model_forward_train(&run.model, in, tg, 2, 32, 1.0f / 128);
    int rows = t->count, done = 0, suffix = 1;
    for (int r = rows - 1; r >= 0; r--) { // the changed rows: a run from the last
        const fl_param_view *v = &t->views[r];
        int changed = memcmp(before + v->offset, o->master + v->offset, v->numel * sizeof(float));
        suffix &= !changed || done == rows - 1 - r;
        done += changed != 0;
    }
    t_check(done > 0 && done < rows && suffix,
            "after the next step's first forward pass %d of %d rows are updated, the last ones",
            done, rows);
    free(before);
    fl_run_close(&run);
}

// ZeRO-Offload's delayed update (offload_optimizer.delayed_update).
static void test_delayed_update(void) {
    test_delayed_slices();
    delayed_case("--model llama-tiny --precision bf16 --grad-accum 2", "\"device\": \"cpu\"", 1, 5);
    delayed_case("--model tiny --precision fp32", "\"device\": \"cpu\"", 0, 4);
    delayed_case("--model llama-tiny --precision fp32 --grad-accum 2", "\"device\": \"cpu\"", 1, 6);
    // the loss scale doubling after each clean step until an overflow skips one
    int skipped = delayed_case("--model tiny --precision fp16 --grad-accum 2 "
                               "--initial-scale-power 12 --loss-scale-window 1 --hysteresis 1",
                               "\"device\": \"cpu\"", 2, 12);
    t_check(skipped > 0, "fp16: %d steps skipped by an overflow while a delayed update ran in them",
            skipped);
    // a spike guard tight enough to skip steps (its loss and norm tests)
    skipped = delayed_case("--model tiny --precision fp32 --skip-update-lossz 0.2 "
                           "--skip-update-gradz 0.5 --skip-update-max-in-row 50 "
                           "--skip-update-min-steps 2",
                           "\"device\": \"cpu\"", 1, 12);
    t_check(skipped > 0, "spikes: %d steps skipped while a delayed update ran in them", skipped);
    delayed_case("--model llama-tiny --precision bf16 --optimizer sgd --momentum 0.9 "
                 "--activation-checkpointing block",
                 "\"device\": \"cpu\"", 1, 4);
    char nvme[300];
    snprintf(nvme, sizeof nvme, "\"device\": \"nvme\", \"nvme_path\": \"%s\"", dir);
    delayed_case("--model llama-tiny --precision bf16 --grad-accum 2", nvme, 1, 4);
    delayed_case("--model llama-tiny --precision bf16 --grad-accum 3",
                 "\"device\": \"cpu\", \"accumulate_on_device\": true", 1, 4);
    delayed_case("--model tiny --precision fp32 --grad-accum 2",
                 "\"device\": \"cpu\", \"accumulate_on_device\": true", 1, 4);

    // the run says so; a checkpoint holds the weights after every update
    // (the pending one runs first), so a resume is the straight run with
    // the same checkpoints bitwise
    const char *flags = "--model llama-tiny --precision bf16 --grad-accum 2 --lr 1e-2 --warmup 0 "
                        "--scheduler constant";
    int rc = fitlm("train " RUN " %s --steps 6 --save-every 3 --out dwhole --device test "
                   "--config dpu.json",
                   flags);
    t_check(rc == 0 && strstr(output, "the cpu updates during the next step (delayed_update)"),
            "a delayed run says how it updates: %.600s", output);
    rc = fitlm("train " RUN " %s --steps 3 --out dhalf --device test --config dpu.json", flags);
    t_check(rc == 0, "the first half: %.400s", output);
    rc = fitlm("train --data data --tokenizer byte --threads 2 --sample-tokens 0 --resume dhalf "
               "--steps 6 --device test --config dpu.json");
    t_check(rc == 0, "resumed: %.400s", output);
    char want[1024], got[1024];
    step_figures("dwhole", want, sizeof want);
    step_figures("dhalf", got, sizeof got);
    t_check(*want && !strcmp(want, got),
            "the delayed update resumed is the straight run bitwise\n  want %s\n  got  %s", want,
            got);
    t_check(fitlm("export dwhole -o exdw") == 0 && fitlm("export dhalf -o exdh") == 0 &&
                same_file("exdw/model.safetensors", "exdh/model.safetensors"),
            "the delayed update resumed ends with the straight run's weights bitwise");

    // the plan says what the run offloads and how it updates
    rc = fitlm("plan " RUN " --model llama-tiny --precision bf16 --grad-accum 2 --steps 1 "
               "--device test --config dpu.json");
    t_check(rc == 0 && strstr(output, "ZeRO stage 1 (one process: nothing to partition), "
                                      "optimizer offloaded to cpu, delayed update |"),
            "the plan names the delayed update: %.400s", output);
    rc = fitlm("plan " RUN " --model llama-tiny --precision bf16 --grad-accum 2 --steps 1 "
               "--device test --config w3ad.json");
    t_check(rc == 0 && strstr(output, "ZeRO stage 3 (one process: nothing to partition), "
                                      "optimizer offloaded to cpu, weights to cpu, fp32 sum on "
                                      "the device |"),
            "the plan names the weight offload and the device's sum: %.400s", output);

    // refused: no device, no offload, weights fetched from the host copy, a
    // warm-up without it
    fails_with("it needs --device cuda (or test)",
               "train " RUN " --model tiny --steps 1 --device cpu --config dpu.json");
    fails_with("offload_optimizer.delayed_update applies to an offload",
               "train " RUN " --model tiny --steps 1 --device test --config dpu_none.json");
    fails_with("offload_optimizer.delayed_update with offload_param.device cpu is not supported",
               "train " RUN " --model tiny --steps 1 --device test --config dpu_w3.json");
    fails_with("delayed_update_warmup applies to the delayed update",
               "train " RUN " --model tiny --steps 1 --device test --config dpu_warm.json");
}

// LoRA and QLoRA under ZeRO-Offload (device_adapters.c; the PEFT recipe of
// ZeRO-3 with CPU offload on one GPU): the adapters' optimizer in host
// memory, their gradients down and the adapters up whole each step; under
// ZeRO-3's offload_param the dense frozen base in pinned host memory, each
// unit up ahead of use, with or without the optimizer's offload. The cpu's
// figures and final weights bitwise (fp32, bf16 and fp16, accumulation,
// dropout, recompute), resumed bitwise; the plan the measured bytes, with
// the adapters' copies pinned (and the base's under weight offload) and
// the device under the whole base; the combinations it does not run refused.
static void test_lora_offload(void) {
    const char *lora = "--lora --lora-target-modules all-linear --lora-dropout 0.1";
    static const char *const cases[][2] = {
        {"--model llama-tiny --precision bf16 --grad-accum 2 --grad-clip 0 --steps 3", "off2.json"},
        {"--model tiny --precision fp32 --grad-accum 2 --grad-clip 0 --steps 3", "off1.json"},
        {"--model tiny --precision fp16 --steps 3", "off2.json"},
        {"--model llama-tiny --precision bf16 --quantize nf4 --grad-accum 2 --steps 3",
         "off2.json"},
        {"--model llama-tiny --precision bf16 --grad-accum 2 --activation-checkpointing block "
         "--steps 3",
         "w3.json"},
        {"--model tiny --precision fp32 --grad-accum 2 --steps 3", "lw3.json"},
        {"--model llama-tiny --precision bf16 --optimizer sgd --momentum 0.9 --steps 3",
         "w3p.json"},
    };
    char flags[512];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(flags, sizeof flags, "%s %s", cases[i][0], lora);
        check_case(flags, cases[i][1]);
    }
    snprintf(flags, sizeof flags, "--model tiny --precision bf16 %s", lora);
    int rc = fitlm("train " RUN " %s --steps 1 --out lo --device test --config w3.json", flags);
    t_check(rc == 0 && strstr(output, "the cpu updates the LoRA adapters after the backward") &&
                strstr(output, "the frozen base in pinned host memory"),
            "LoRA: the run says what it offloads: %.600s", output);
    snprintf(flags, sizeof flags, "--model llama-tiny --precision bf16 --grad-accum 2 %s", lora);
    resumed_equals_cpu(flags, "off1.json", "lhalf");
    resumed_equals_cpu(flags, "w3.json", "lhalfw");
    // the plan: the adapters' copies pinned (2 bytes each in bf16, the
    // weights' and the gradients'), the state in host memory; under weight
    // offload the base's copy pinned too and the device under the base
    size_t ad[FL_MEM_NTAGS], w3[FL_MEM_NTAGS], device[FL_MEM_NTAGS];
    snprintf(flags, sizeof flags, "--model llama-tiny --precision bf16 --grad-accum 2 %s", lora);
    char with[600];
    snprintf(with, sizeof with, "%s --config off2.json", flags);
    plan_equals_measured(with, ad);
    t_check(ad[FL_MEM_PARAMS] > 0 && ad[FL_MEM_GRADS] == ad[FL_MEM_PARAMS] && !ad[FL_MEM_MASTER] &&
                !ad[FL_MEM_OPTIM],
            "LoRA offload: the adapters' copies pinned (params %zu, grads %zu), not the state",
            ad[FL_MEM_PARAMS], ad[FL_MEM_GRADS]);
    snprintf(with, sizeof with, "%s --config w3.json", flags);
    plan_equals_measured(with, w3);
    table_bytes(output, "device memory by tag", 2, device);
    size_t base = w3[FL_MEM_PARAMS] - ad[FL_MEM_PARAMS];
    t_check(base > ad[FL_MEM_PARAMS] && device[FL_MEM_PARAMS] < base,
            "LoRA weight offload: the base's copy pinned (%zu bytes), the device's peak of "
            "weights under it (%zu)",
            base, device[FL_MEM_PARAMS]);
    snprintf(with, sizeof with, "--model tiny --precision fp32 --grad-accum 2 %s --config lw3.json",
             lora);
    plan_equals_measured(with, NULL);
    snprintf(with, sizeof with, "--model tiny --precision bf16 %s --config pin.json", lora);
    plan_equals_measured(with, NULL);
    // refused, naming why
    fails_with("offload_param under NF4 base weights",
               "train " RUN " --model tiny --lora --quantize nf4 --precision bf16 --steps 1 "
               "--device test --config w3.json");
    fails_with("offload_optimizer under LoRA with lora.base_optimizer",
               "train " RUN " --model tiny --lora --lora-base-optimizer lomo --precision bf16 "
               "--steps 1 --device test --config off1.json");
    fails_with("delayed_update with LoRA adapters is not supported",
               "train " RUN " --model tiny --lora --steps 1 --device test --config dpu.json");
    fails_with("accumulate_on_device: LoRA's adapters' gradients come down whole",
               "train " RUN " --model tiny --lora --grad-accum 2 --steps 1 --device test "
               "--config ad.json");
    fails_with("offload_optimizer.device nvme with LoRA adapters is not supported",
               "train " RUN " --model tiny --lora --steps 1 --device test --config nvme.json");
}

int main(void) {
    if (!getenv("FITLM_BINARY")) {
        printf("device_offload: FITLM_BINARY not set (run under ctest)\n");
        return 77;
    }
    t_check(mkdtemp(dir) != NULL, "mkdtemp");
    const char *src = getenv("FITLM_SOURCE_DIR");
    char readme[512];
    snprintf(readme, sizeof readme, "%s/README.md", src ? src : ".");
    t_check(fitlm("tokenize %s -o data --tokenizer byte --val-fraction 0.1", readme) == 0,
            "tokenize the README: %.300s", output);
    static const char *const configs[][2] = {
        {"off0.json", "{\"zero_optimization\": {\"stage\": 0, \"offload_optimizer\": "
                      "{\"device\": \"cpu\"}}}"},
        {"off1.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                      "{\"device\": \"cpu\"}}}"},
        {"w3d.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                     "{\"device\": \"cpu\"}, \"offload_param\": {\"device\": \"cpu\"}}}"},
        {"off2.json", "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": "
                      "{\"device\": \"cpu\"}}}"},
        {"off3.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                      "{\"device\": \"cpu\"}}}"},
        {"nvme.json", "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": "
                      "{\"device\": \"nvme\", \"nvme_path\": \".\"}}}"},
        {"paramnv.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                         "{\"device\": \"nvme\", \"nvme_path\": \".\"}, \"offload_param\": "
                         "{\"device\": \"nvme\", \"max_in_cpu\": 1e6}}}"},
        {"paramnb.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                         "{\"device\": \"nvme\", \"nvme_path\": \".\"}, \"offload_param\": "
                         "{\"device\": \"nvme\", \"buffer_count\": 65}}}"},
        {"paramno.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                         "{\"device\": \"cpu\"}, \"offload_param\": {\"device\": "
                         "\"nvme\", \"nvme_path\": \".\"}}}"},
        {"param3n.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                         "{\"device\": \"nvme\", \"nvme_path\": \".\"}, \"offload_param\": "
                         "{\"device\": \"cpu\"}}}"},
        // the fp32 gradient sum on the device
        {"ratio.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                       "{\"device\": \"cpu\", \"ratio\": 0.5}, \"offload_param\": "
                       "{\"device\": \"cpu\"}}}"},
        {"pin.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                     "{\"device\": \"cpu\", \"pin_memory\": true}}}"},
        {"ad.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                    "{\"device\": \"cpu\", \"accumulate_on_device\": true}}}"},
        {"w3ad.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                      "{\"device\": \"cpu\", \"accumulate_on_device\": true}, "
                      "\"offload_param\": {\"device\": \"cpu\"}}}"},
        // the delayed update after one update; and refused without an
        // offload, under weight offload, its warm-up alone
        {"dpu.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                     "{\"device\": \"cpu\", \"delayed_update\": true, "
                     "\"delayed_update_warmup\": 1}}}"},
        {"dpu_none.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                          "{\"delayed_update\": true}}}"},
        {"dpu_w3.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": "
                        "{\"device\": \"cpu\", \"delayed_update\": true}, \"offload_param\": "
                        "{\"device\": \"cpu\"}}}"},
        {"dpu_warm.json", "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": "
                          "{\"device\": \"cpu\", \"delayed_update_warmup\": 3}}}"},
        // weight offload: a ring of one unit (no prefetch), and the default
        // prefetch with reuse between the passes
        {"w3.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": 0, "
                    "\"stage3_param_persistence_threshold\": 0, "
                    "\"offload_optimizer\": {\"device\": \"cpu\"}, \"offload_param\": "
                    "{\"device\": \"cpu\"}}}"},
        // LoRA's base offloaded without the optimizer's offload: a ring of
        // one unit, and DeepSpeed's defaults
        {"lw3d.json", "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": "
                      "\"cpu\"}}}"},
        {"lw3.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": "
                     "0, \"stage3_param_persistence_threshold\": 0, \"offload_param\": "
                     "{\"device\": \"cpu\"}}}"},
        {"w3p.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_max_reuse_distance\": "
                     "1000000, \"stage3_param_persistence_threshold\": 0, \"offload_optimizer\": "
                     "{\"device\": \"cpu\"}, "
                     "\"offload_param\": {\"device\": \"cpu\"}}}"},
        // NVMe weight offload: a ring of one unit read through two staging
        // buffers of 3000 elements (a unit in pieces, buffers reused within
        // it); the default prefetch and reuse with DeepSpeed's buffer keys
        {"w3n.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": "
                     "0, \"stage3_param_persistence_threshold\": 0, \"offload_optimizer\": "
                     "{\"device\": \"nvme\", \"nvme_path\": \".\"}, \"offload_param\": "
                     "{\"device\": \"nvme\", \"buffer_count\": 2, \"buffer_size\": 3000}}}"},
        {"w3nq.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_max_reuse_distance\": "
                      "1000000, \"stage3_param_persistence_threshold\": 0, "
                      "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \".\"}, "
                      "\"offload_param\": {\"device\": \"nvme\", \"buffer_count\": 3, "
                      "\"buffer_size\": 2000}}}"},
        {"w3np.json", "{\"zero_optimization\": {\"stage\": 3, \"stage3_max_reuse_distance\": "
                      "1000000, \"stage3_param_persistence_threshold\": 0, "
                      "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \".\"}, "
                      "\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \".\", "
                      "\"buffer_count\": 5, \"buffer_size\": 1e8, \"pin_memory\": true}}}"},
    };
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        write_config(configs[i][0], configs[i][1]);
    test_equals_plain();
    test_overlap();
    test_resume_bitwise();
    test_plan_equals_measured();
    test_offload_advice();
    test_weight_offload();
    test_weight_offload_resume();
    test_weight_offload_nvme();
    test_weight_offload_plan();
    test_grad_ring();
    test_grad_ring_plan();
    test_refusals();
    test_waits_reported();
    test_waits_measured();
    test_delayed_update();
    test_lora_offload();
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", dir);
    return t_report();
}
