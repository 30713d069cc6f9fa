// test_metrics.c: a run's metrics.jsonl and `fitlm plot`. The line logs'
// resume rules and the reader's errors as library calls; then the built
// binary (FITLM_BINARY) trains a tiny model, whose metrics.jsonl must agree
// with its log.txt, keep those rules across a resume, and plot into PNGs of
// the stated size and SVGs with the expected number of series.
#include <cairo.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/metrics.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_metrics_XXXXXX";
static char output[65536];

// Runs `fitlm ARGS` in dir with stdout and stderr captured; the exit status.
static int fitlm(const char *args) {
    return t_fitlm(dir, args, 1, output, sizeof output);
}

static const char *in_dir(const char *name) {
    static char path[4][1300];
    static int k;
    k = (k + 1) % 4;
    snprintf(path[k], sizeof path[k], "%s/%s", dir, name);
    return path[k];
}

static char *slurp(const char *name) {
    size_t n;
    char *text = (char *)t_read_file(in_dir(name), &n);
    return text ? text : calloc(1, 1);
}

// ----------------------------------------------------------------------------
// library level

static void test_resume_keeps_complete_lines_up_to_the_step(void) {
    const char *path = in_dir("lines.jsonl");
    t_write_text(path, "{\"step\":1,\"loss\":1}\n{\"step\":2,\"val_loss\":1}\nnot json\n"
                       "{\"step\":3,\"loss\":1}\n{\"step\":4,\"loss\":1}\n{\"step\":2,\"lo");
    fl_line_log log;
    fl_line_log_open(&log, path, "metrics log", 3, fl_metrics_line_step);
    fl_line_log_printf(&log, "{\"step\":4,\"loss\":2}\n");
    fl_line_log_close(&log);
    char *text = slurp("lines.jsonl");
    t_check(!strcmp(text, "{\"step\":1,\"loss\":1}\n{\"step\":2,\"val_loss\":1}\n"
                          "{\"step\":3,\"loss\":1}\n{\"step\":4,\"loss\":2}\n"),
            "a resume at step 3 keeps steps 1-3, drops step 4, a torn and a foreign line: %s",
            text);
    free(text);
    // log.txt's lines, by the same mechanism
    path = in_dir("lines.txt");
    t_write_text(path, "step 0 val 5\nstep 1 loss 4\nstep 2 loss 3\nstep 2 val 3.5\nstep 3 lo");
    fl_line_log_open(&log, path, "training log", 2, fl_text_line_step);
    fl_line_log_close(&log);
    text = slurp("lines.txt");
    t_check(!strcmp(text, "step 0 val 5\nstep 1 loss 4\nstep 2 loss 3\nstep 2 val 3.5\n"),
            "log.txt: a torn last line is dropped: %s", text);
    free(text);
}

static void test_reader_skips_a_torn_line_and_reads_null_as_nan(void) {
    const char *path = in_dir("read.jsonl");
    t_write_text(path, "{\"step\":0,\"run\":{\"peak_flops\":null}}\n"
                       "{\"step\":1,\"tokens\":64,\"loss\":2.5,\"lr\":0.001,\"grad_norm\":1,"
                       "\"loss_scale\":1,\"skipped\":0,\"tokens_per_s\":9,\"ms\":1,\"mfu\":null,"
                       "\"memory\":{\"params\":1048576,\"rss\":2097152}}\n"
                       "{\"step\":1,\"tokens\":64,\"val_loss\":2.25}\n"
                       "{\"step\":2,\"tokens\":128,\"loss\":2");
    fl_metrics m;
    fl_metrics_read(path, &m);
    t_check(m.n_steps == 1 && m.n_evals == 1 && m.n_memory == 1,
            "one step, one evaluation, one memory record (the torn step 2 skipped): %d %d %d",
            m.n_steps, m.n_evals, m.n_memory);
    if (m.n_steps == 1 && m.n_evals == 1 && m.n_memory == 1)
        t_check(m.steps[0].loss == 2.5f && isnan(m.steps[0].mfu) && m.evals[0].val_loss == 2.25f &&
                    m.memory[0].tag[FL_MEM_PARAMS] == 1048576.0 && isnan(m.memory[0].tag[1]) &&
                    m.memory[0].rss == 2097152.0,
                "the values read back; null and absent read as NAN");
    fl_metrics_free(&m);
}

// On a device, the host's waits behind queued work and ZeRO-Offload's share
// of the step the device waited: written only when counted or timed (a run
// without them writes what it always has), read back.
static void test_device_wait_round_trips(void) {
    fl_line_log log;
    const char *path = in_dir("wait.jsonl");
    fl_line_log_open(&log, path, "metrics log", -1, fl_metrics_line_step);
    fl_metrics_step s = {
        .step = 1, .loss = 2.0f, .mfu = NAN, .device_wait = 0.375, .host_waits = 1};
    fl_metrics_write_step(&log, &s, 0);
    s.step = 2, s.device_wait = NAN, s.host_waits = -1;
    fl_metrics_write_step(&log, &s, 0);
    fl_line_log_close(&log);
    char *text = slurp("wait.jsonl");
    const char *second = text ? strchr(text, '\n') : NULL;
    t_check(text && strstr(text, ",\"host_waits\":1,\"device_wait\":0.375}") && second &&
                !strstr(second, "device_wait") && !strstr(second, "host_waits"),
            "host_waits and device_wait are written when counted, not otherwise: %s",
            text ? text : "(none)");
    free(text);
    fl_metrics m;
    fl_metrics_read(path, &m);
    t_check(m.n_steps == 2 && m.steps[0].device_wait == 0.375 && isnan(m.steps[1].device_wait) &&
                m.steps[0].host_waits == 1 && m.steps[1].host_waits == -1,
            "device_wait and host_waits read back (NAN and -1 when absent)");
    fl_metrics_free(&m);
}

static void read_bad(void *path) {
    fl_metrics m;
    fl_metrics_read(path, &m);
}

static void test_reader_names_the_bad_line(void) {
    char path[600];
    snprintf(path, sizeof path, "%s", in_dir("bad.jsonl"));
    t_write_text(path,
                 "{\"step\":1,\"loss\":1}\n{\"step\":2,\"loss\":1}\n{\"step\":3,\"loss\":1,}\n"
                 "{\"step\":4,\"loss\":1}\n");
    char want[700];
    snprintf(want, sizeof want, "%s:3: not a JSON object", path);
    t_dies("a line that is not JSON", read_bad, path, want);
    t_write_text(path, "{\"step\":1,\"loss\":1}\n{\"loss\":1}\n");
    snprintf(want, sizeof want, "%s:2: no \"step\"", path);
    t_dies("a record without a step", read_bad, path, want);
    t_write_text(path, "{\"step\":1,\"loss\":\"low\"}\n");
    snprintf(want, sizeof want, "%s:1: \"loss\" is not a number", path);
    t_dies("a value of the wrong type", read_bad, path, want);
}

// LF and CRLF line ends read the same, and a blank line (nothing but white
// space) is skipped, as in JSON Lines data; errors count every line.
static void test_reader_line_ends(void) {
    static const char *const records[] = {
        "{\"step\":1,\"loss\":2.5}", "{\"step\":1,\"val_loss\":3}", "{\"step\":2,\"loss\":1.5}"};
    static const char *const joins[] = {"\n", "\r\n", "\n\n", "\r\n\r\n", "\r\n \t\r\n", "\n\r\n"};
    const char *path = in_dir("ends.jsonl");
    for (size_t j = 0; j < sizeof joins / sizeof joins[0]; j++) {
        char text[512] = "";
        for (int r = 0; r < 3; r++) {
            strcat(text, records[r]);
            strcat(text, joins[j]);
        }
        t_write_text(path, text);
        fl_metrics m;
        fl_metrics_read(path, &m);
        t_check(m.n_steps == 2 && m.n_evals == 1 && m.steps[1].loss == 1.5f &&
                    m.evals[0].val_loss == 3.0f,
                "line ends %zu: 2 steps and 1 evaluation read (got %d, %d)", j, m.n_steps,
                m.n_evals);
        fl_metrics_free(&m);
    }
    char want[700];
    t_write_text(path, "{\"step\":1,\"loss\":1}\r\n\r\n{\"step\":2,\"loss\":1,}\r\n");
    snprintf(want, sizeof want, "%s:3: not a JSON object", path);
    t_dies("a bad line after a blank one", read_bad, (void *)path, want);
}

// ----------------------------------------------------------------------------
// a real run

#define STEPS           12
#define TOKENS_PER_STEP (2 * 16)

static char run_args[2048];

static int train(const char *extra) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s", run_args, extra);
    return fitlm(cmd);
}

// Parses log.txt's "step N loss L lr R norm G scale S" lines into arrays
// indexed by step; returns how many.
static int read_log_steps(const char *name, float loss[], float lr[], float norm[]) {
    char *text = slurp(name);
    int n = 0;
    for (char *line = text; *line;) {
        int step;
        float a, b, c, d;
        if (sscanf(line, "step %d loss %f lr %f norm %f scale %f", &step, &a, &b, &c, &d) == 5 &&
            step >= 1 && step <= STEPS) {
            loss[step] = a, lr[step] = b, norm[step] = c;
            n++;
        }
        char *end = strchr(line, '\n');
        line = end ? end + 1 : line + strlen(line);
    }
    free(text);
    return n;
}

static const char *step_keys[] = {
    "\"step\":",       "\"tokens\":",  "\"loss\":",         "\"lr\":", "\"grad_norm\":",
    "\"loss_scale\":", "\"skipped\":", "\"tokens_per_s\":", "\"ms\":", "\"mfu\":"};

static void test_every_step_and_evaluation_is_recorded(void) {
    int rc = train("--out m1 --save-every 6");
    t_check(rc == 0, "the tiny run trains (status %d): %.500s", rc, output);
    char *text = slurp("m1/metrics.jsonl");
    int step_lines = 0, keys_ok = 1;
    for (char *line = text; *line; line = strchr(line, '\n') + 1) {
        char *end = strchr(line, '\n');
        if (!end) break;
        *end = 0;
        if (strstr(line, "\"loss\":")) {
            step_lines++;
            for (size_t k = 0; k < sizeof step_keys / sizeof step_keys[0]; k++)
                keys_ok &= strstr(line, step_keys[k]) != NULL;
        }
        *end = '\n';
    }
    t_check(step_lines == STEPS && keys_ok, "%d step objects (want %d), each with every key",
            step_lines, STEPS);
    t_check(!strncmp(text, "{\"step\":0,\"run\":{\"params\":", 26) &&
                strstr(text, "\"peak_flops\":") && strstr(text, "\"flops_per_token\":"),
            "the first line records the run's FLOPs per token and peak: %.200s", text);
    free(text);

    fl_metrics m;
    fl_metrics_read(in_dir("m1/metrics.jsonl"), &m);
    float loss[STEPS + 1] = {0}, lr[STEPS + 1] = {0}, norm[STEPS + 1] = {0};
    int logged = read_log_steps("m1/log.txt", loss, lr, norm);
    int same = logged == STEPS && m.n_steps == STEPS, ordered = 1, mfu_ok = 1;
    for (int i = 0; same && i < m.n_steps; i++) {
        const fl_metrics_step *s = &m.steps[i];
        ordered &= s->step == i + 1 && s->tokens == (double)TOKENS_PER_STEP * (i + 1);
        same &= s->loss == loss[s->step] && s->lr == lr[s->step] && s->grad_norm == norm[s->step];
        mfu_ok &= s->mfu > 0.0 && s->mfu < 10.0 && s->ms > 0.0 && s->tokens_per_s > 0.0;
    }
    t_check(same && ordered,
            "metrics.jsonl's loss, lr and norm are log.txt's, exactly, step "
            "1..%d with tokens = step x B x T",
            STEPS);
    t_check(mfu_ok, "each step has a positive time, throughput and MFU");
    // evaluations at 0, 5, 10 and the final one at 12
    int evals_ok = m.n_evals == 4;
    static const int eval_steps[] = {0, 5, 10, 12};
    for (int i = 0; evals_ok && i < 4; i++)
        evals_ok = m.evals[i].step == eval_steps[i] &&
                   m.evals[i].tokens == (double)TOKENS_PER_STEP * eval_steps[i] &&
                   isfinite(m.evals[i].val_loss);
    t_check(evals_ok, "an evaluation object at steps 0, 5, 10 and 12 (got %d)", m.n_evals);
    // memory at the first step and every 10
    int mem_ok = m.n_memory == 2 && m.memory[0].step == 1 && m.memory[1].step == 10;
    for (int i = 0; mem_ok && i < m.n_memory; i++) {
        double sum = 0.0;
        for (int t = 0; t < FL_MEM_NTAGS; t++) sum += m.memory[i].tag[t];
        mem_ok = m.memory[i].tag[FL_MEM_PARAMS] > 0 && m.memory[i].tag[FL_MEM_ACTS] > 0 &&
                 sum == m.memory[i].tagged && m.memory[i].rss >= m.memory[i].tagged &&
                 m.memory[i].peak_rss >= m.memory[i].rss;
    }
    t_check(mem_ok,
            "memory per tag at steps 1 and 10, the tags summing to the tagged total, "
            "RSS above it (got %d records)",
            m.n_memory);
    fl_metrics_free(&m);
}

static void test_resume_truncates_metrics_like_the_log(void) {
    char *whole = slurp("m1/metrics.jsonl");
    // a torn line as a killed writer leaves it
    FILE *f = fopen(in_dir("m1/metrics.jsonl"), "a");
    fputs("{\"step\":13,\"tokens\":41", f);
    fclose(f);
    int rc = fitlm("train --resume m1/ckpt_00000006.fitlm --threads 1");
    t_check(rc == 0 && strstr(output, "resumed from step 6"),
            "resume from step 6 (status %d): %.400s", rc, output);
    fl_metrics a, b;
    fl_metrics_read(in_dir("m1/metrics.jsonl"), &b);
    t_write_text(in_dir("whole.jsonl"), whole);
    fl_metrics_read(in_dir("whole.jsonl"), &a);
    int same = a.n_steps == STEPS && b.n_steps == STEPS && a.n_evals == b.n_evals;
    for (int i = 0; same && i < STEPS; i++)
        same = a.steps[i].step == b.steps[i].step && a.steps[i].loss == b.steps[i].loss &&
               a.steps[i].tokens == b.steps[i].tokens && a.steps[i].lr == b.steps[i].lr;
    for (int i = 0; same && i < a.n_evals; i++)
        same = a.evals[i].step == b.evals[i].step && a.evals[i].val_loss == b.evals[i].val_loss;
    t_check(same,
            "after the resume, one record per step and evaluation, the resumed steps' "
            "the same as the first run's (%d and %d steps, %d and %d evaluations)",
            a.n_steps, b.n_steps, a.n_evals, b.n_evals);
    char *text = slurp("m1/metrics.jsonl");
    t_check(strstr(text, "{\"step\":6,\"run\":") != NULL && !strstr(text, "\"tokens\":41\n"),
            "the resume records its own start at step 6 and drops the torn line");
    free(text);
    free(whole);
    fl_metrics_free(&a);
    fl_metrics_free(&b);
}

// ----------------------------------------------------------------------------
// plots

static const char *figures[] = {"loss", "loss_tokens", "lr", "grad_norm", "tokens_per_s", "memory"};

// The series of an SVG: its legend swatches, the only strokes 2.5 wide.
static int svg_series(const char *name) {
    char *text = slurp(name);
    int n = 0;
    for (const char *p = text; (p = strstr(p, "stroke-width:2.5;")); p++) n++;
    int well_formed = !strncmp(text, "<?xml", 5) && strstr(text, "<svg") &&
                      strstr(text, "</svg>") && !strstr(strstr(text, "</svg>") + 6, "<");
    free(text);
    return well_formed ? n : -1;
}

// Whether DIR/<figure>.png is a PNG of W x H.
static int png_is(const char *name, int W, int H) {
    cairo_surface_t *s = cairo_image_surface_create_from_png(in_dir(name));
    int ok = cairo_surface_status(s) == CAIRO_STATUS_SUCCESS &&
             cairo_image_surface_get_width(s) == W && cairo_image_surface_get_height(s) == H;
    cairo_surface_destroy(s);
    return ok;
}

// Tags (and RSS) with a non-zero value in a run's memory records.
static int memory_series(const char *run) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    fl_metrics m;
    fl_metrics_read(in_dir(path), &m);
    int n = 0;
    for (int t = 0; t <= FL_MEM_NTAGS; t++) {
        int used = 0;
        for (int i = 0; i < m.n_memory; i++)
            used |= (t < FL_MEM_NTAGS ? m.memory[i].tag[t] : m.memory[i].rss) > 0;
        n += used;
    }
    fl_metrics_free(&m);
    return n;
}

static void check_plots(const char *out, int runs, const int *per_figure, int W, int H) {
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++) {
        char png[600], svg[600];
        snprintf(png, sizeof png, "%s/%s.png", out, figures[i]);
        snprintf(svg, sizeof svg, "%s/%s.svg", out, figures[i]);
        t_check(png_is(png, W, H), "%s is a %dx%d PNG", png, W, H);
        int n = svg_series(svg);
        t_check(n == per_figure[i], "%s is well-formed SVG with %d series for %d run%s (got %d)",
                svg, per_figure[i], runs, runs == 1 ? "" : "s", n);
    }
}

static void test_plot_one_and_two_runs(void) {
    int rc = train("--out m2 --optimizer sgd --lr 0.05");
    t_check(rc == 0, "a second run trains (status %d): %.300s", rc, output);
    rc = fitlm("plot m1 --width 640 --height 400");
    t_check(rc == 0 && strstr(output, "written to m1"), "plot one run into it (status %d): %.300s",
            rc, output);
    int mem1 = memory_series("m1"), mem2 = memory_series("m2");
    t_check(mem1 >= 5, "the run used several tags (%d series)", mem1);
    // loss and loss_tokens: train and val per run; lr, norm, tok/s: one per run
    int one[] = {2, 2, 1, 1, 1, mem1};
    check_plots("m1", 1, one, 640, 400);
    rc = fitlm("plot m1 m2/ -o cmp");
    t_check(rc == 0, "plot two runs (status %d): %.300s", rc, output);
    int two[] = {4, 4, 2, 2, 2, mem1 + mem2};
    check_plots("cmp", 2, two, 900, 540);
    rc = fitlm("plot m1 m2");
    t_check(rc == 0 && access(in_dir("plots/loss.svg"), F_OK) == 0,
            "several runs plot into ./plots by default");
}

static void test_plot_errors_name_the_problem(void) {
    int rc = fitlm("plot nowhere");
    t_check(rc == 1 && strstr(output, "run directory nowhere: No such file"),
            "a missing run directory: %.300s", output);
    t_write_text(in_dir("m3/metrics.jsonl"), "{\"step\":1,\"loss\":1}\n{\"step\":2,\"loss\":1\n"
                                             "{\"step\":3,\"loss\":1}\n");
    rc = fitlm("plot m3");
    t_check(rc == 1 && strstr(output, "m3/metrics.jsonl:2: not a JSON object"),
            "a bad JSON line, named by file and line: %.300s", output);
    rc = fitlm("plot m1 --widht 3");
    t_check(rc == 1 && strstr(output, "unknown option --widht"), "an unknown option: %.300s",
            output);
    rc = fitlm("plot m1 --width 5");
    t_check(rc == 1 && strstr(output, "--width"), "a width out of range: %.300s", output);
    rc = fitlm("plot");
    t_check(rc == 1 && strstr(output, "at least one run directory"), "no run: %.300s", output);
}

int main(void) {
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char sub[600];
    snprintf(sub, sizeof sub, "%s/m3", dir);
    mkdir(sub, 0755);
    snprintf(run_args, sizeof run_args,
             "train --model tiny --tokenizer byte --data %s --batch 2 --seq-len 16 --steps %d "
             "--eval-every 5 --eval-iters 2 --sample-tokens 0 --threads 1",
             t_source_path("data/brown_byte"), STEPS);
    test_resume_keeps_complete_lines_up_to_the_step();
    test_reader_skips_a_torn_line_and_reads_null_as_nan();
    test_device_wait_round_trips();
    test_reader_names_the_bad_line();
    test_reader_line_ends();
    test_every_step_and_evaluation_is_recorded();
    test_resume_truncates_metrics_like_the_log();
    test_plot_one_and_two_runs();
    test_plot_errors_name_the_problem();
    int rc = t_report();
    if (rc == 0) t_remove_dir(dir);
    return rc;
}
