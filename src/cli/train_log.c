// train_log.c: the records and lines of `fitlm train`'s steps (train_log.h).
// log.txt holds exact values (%.9g round-trips a float) as plain text;
// metrics.jsonl the same and more (tokens, throughput, MFU, memory) as JSON
// for `fitlm plot`.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/mfu.h"
#include "train_log.h"

// Tokens trained on by the kept records of a resumed metrics.jsonl (its last
// step's), or `fallback` when it has none.
static double tokens_so_far(const char *path, double fallback) {
    if (access(path, F_OK) != 0) return fallback;
    fl_metrics m;
    fl_metrics_read(path, &m);
    double tokens = m.n_steps && isfinite(m.steps[m.n_steps - 1].tokens)
                        ? m.steps[m.n_steps - 1].tokens
                        : fallback;
    fl_metrics_free(&m);
    return tokens;
}

void run_log_open(run_log *log, const fl_run *run) {
    const fl_train_config *cfg = &run->cfg;
    memset(log, 0, sizeof *log);
    log->tty = isatty(STDOUT_FILENO);
    size_t micro_tokens = (size_t)cfg->micro_batch * cfg->seq_len;
    log->tokens_per_step = (double)micro_tokens * cfg->grad_accum * run->world; // every rank's
    const char *out_dir = run->lead ? cfg->out_dir : ""; // world rank 0 writes the shared files
    int resume_step = run->resumed ? run->start : -1;
    char path[FL_PATH_MAX + 32] = "";
    if (*out_dir) snprintf(path, sizeof path, "%s/log.txt", out_dir);
    fl_line_log_open(&log->text, path, "training log", resume_step, fl_text_line_step);
    if (*out_dir) snprintf(path, sizeof path, "%s/metrics.jsonl", out_dir);
    fl_line_log_open(&log->json, path, "metrics log", resume_step, fl_metrics_line_step);
    log->tokens = run->start * log->tokens_per_step;
    if (*path && resume_step > 0) log->tokens = tokens_so_far(path, log->tokens);
    // MFU's numerator and denominator, recorded with the run (the peak is
    // measured only when there is a metrics log to write it in)
    log->flops_per_token =
        fl_mfu_flops_per_token(&run->model, cfg->seq_len, run->lora && !run->train_base);
    if (*out_dir) {
        char how[128] = "given (--peak-tflops)";
        // a device's GEMMs run on it, not on the host's multiply-adds: its
        // peak is the one given, else unknown (no MFU)
        if (cfg->peak_tflops > 0)
            log->peak_flops = cfg->peak_tflops * 1e12;
        else if (!run->dev->host) {
            log->peak_flops = 0.0;
            snprintf(how, sizeof how, "unknown on the %s device: give --peak-tflops",
                     run->dev->name);
        } else
            log->peak_flops = fl_mfu_peak(cfg->dtype, fl_threads(), how, sizeof how);
        fl_metrics_run record = {.step = run->start,
                                 .params = (double)run->model.table.numel,
                                 .flops_per_token = log->flops_per_token,
                                 .tokens_per_step = log->tokens_per_step,
                                 .peak_flops = log->peak_flops,
                                 .peak = how};
        fl_metrics_write_run(&log->json, &record);
    }
}

void run_log_eval(run_log *log, int step, float val_loss) {
    fl_line_log_printf(&log->text, "step %d val %.9g\n", step, val_loss);
    fl_metrics_eval e = {step, log->tokens, val_loss};
    fl_metrics_write_eval(&log->json, &e);
}

void run_log_close(run_log *log) {
    fl_line_log_close(&log->text);
    fl_line_log_close(&log->json);
}

void run_log_comm(run_log *log, const fl_comm_stats *before) {
    fl_comm_stats now = fl_comm_get_stats();
    log->comm.elements += now.elements - before->elements;
    log->comm.bytes += now.bytes - before->bytes;
    log->comm.wait_seconds += now.wait_seconds - before->wait_seconds;
    log->comm.collectives += now.collectives - before->collectives;
}

// The terminal's progress line: a bar, the step, loss, throughput and the
// time left at the median of the last steps' times (a median: an evaluation
// or checkpoint step does not throw it).
static void progress_line(int step, int steps, float loss, double tok_s, const double *recent_ms,
                          int n_recent) {
    double sorted[RECENT];
    int n = n_recent < RECENT ? n_recent : RECENT;
    memcpy(sorted, recent_ms, sizeof(double) * (size_t)n);
    for (int i = 1; i < n; i++) // insertion sort: at most RECENT values
        for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
            double t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    long eta = lround((steps - step) * sorted[n / 2] / 1e3);
    char bar[21];
    int filled = (int)((long)20 * step / steps);
    for (int i = 0; i < 20; i++) bar[i] = i < filled ? '#' : '.';
    bar[20] = 0;
    printf("\r\033[K[%s] %3d%% step %d/%d | loss %.4f | %.0f tok/s | ETA %ld:%02ld:%02ld", bar,
           (int)(100L * step / steps), step, steps, loss, tok_s, eta / 3600, eta / 60 % 60,
           eta % 60);
}

// ZeRO-Offload on a device: the share of the step (of the steps timed
// since the last read: a skipped step's counts with the next) the device
// waited on the host, 0 to 1; NAN when none was timed.
static double device_wait(run_log *log, const fl_run *run) {
    if (!run->dev_offload) return NAN;
    fl_dev_offload_waits w, *was = &log->waits;
    fl_dev_offload_waits_get(run->dev_offload, &w);
    double share = w.steps > was->steps && w.step_ms > was->step_ms
                       ? (w.wait_ms - was->wait_ms) / (w.step_ms - was->step_ms)
                       : NAN;
    if (!was->steps && w.steps) log->waits_first = w;
    *was = w;
    return share;
}

static void print_device_waits(const run_log *log, const fl_run *run) {
    fl_dev_offload_waits w = log->waits, from = log->waits_first;
    if (!run->dev_offload || !w.steps) return;
    if (w.steps == from.steps) from = (fl_dev_offload_waits){0};
    long steps = w.steps - from.steps;
    double wait = (w.wait_ms - from.wait_ms) / steps, step = (w.step_ms - from.step_ms) / steps;
    printf("ZeRO-Offload: the %s device waited on the cpu %.1f%% of the step (%.2f of %.2f ms a "
           "step, timed on the device over %ld step%s%s)\n",
           run->dev->name, step > 0 ? 100.0 * wait / step : 0.0, wait, step, steps,
           steps == 1 ? "" : "s", from.steps ? ", after the first" : "");
}

void run_log_step(run_log *log, const fl_run *run, int step, float lr, const fl_train_result *r,
                  double ms, long host_waits) {
    const fl_train_config *cfg = &run->cfg;
    double wait = device_wait(log, run);
    int start = run->start;
    float loss = r->loss;
    log->skipped += r->skipped;
    log->spikes = r->spikes_skipped;
    log->step_seconds += ms / 1e3;
    double tok_s = log->tokens_per_step / (ms / 1e3);
    log->recent_ms[(step - start) % RECENT] = ms;
    if (log->tty) { // rewritten in place
        progress_line(step + 1, cfg->steps, loss, tok_s, log->recent_ms, step - start + 1);
        if (cfg->dtype == FL_F16 && log->skipped) printf(" | skipped %d", log->skipped);
    } else if ((step + 1) % cfg->steps_per_print == 0 || step + 1 == cfg->steps) {
        // one plain line per step (or every steps_per_print, and the last):
        // what scripts and tests read
        printf("step %5d/%d | loss %.4f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s", step + 1,
               cfg->steps, loss, lr, r->grad_norm, ms, tok_s);
        if (cfg->dtype == FL_F16)
            printf(" | scale %g%s | skipped %d", r->loss_scale, r->skipped ? " OVERFLOW" : "",
                   log->skipped);
        if (log->spikes)
            printf(" | %sskipped_steps %ld", r->spike.outlier ? "SPIKE " : "", log->spikes);
        if (isfinite(wait)) printf(" | waited on the cpu %.1f%%", 100.0 * wait);
        printf("\n");
    }
    char spikes[48] = ""; // only once the guard has skipped: the recorded logs stay as they are
    if (log->spikes) snprintf(spikes, sizeof spikes, " skipped_steps %ld", log->spikes);
    fl_line_log_printf(&log->text, "step %d loss %.9g lr %.9g norm %.9g scale %.9g%s\n", step + 1,
                       (float)loss, lr, r->grad_norm, r->loss_scale, spikes);
    log->tokens += log->tokens_per_step;
    double flops = log->flops_per_token * tok_s;
    fl_metrics_step m = {.step = step + 1,
                         .tokens = log->tokens,
                         .loss = loss,
                         .lr = lr,
                         .grad_norm = r->grad_norm,
                         .loss_scale = r->loss_scale,
                         .skipped = r->skipped || r->spike.outlier,
                         .skipped_steps = log->spikes,
                         .tokens_per_s = tok_s,
                         .ms = ms,
                         .mfu = log->peak_flops > 0.0 ? flops / log->peak_flops : NAN,
                         .device_wait = wait,
                         .host_waits = host_waits};
    if (host_waits >= 0 && step > start) log->host_waits += host_waits, log->waits_steps++;
    int memory = step == start || (step + 1) % cfg->metrics_memory_every == 0 ||
                 (cfg->mem_report_every && (step + 1) % cfg->mem_report_every == 0);
    fl_metrics_write_step(&log->json, &m, memory);
}

// Divergence: a non-finite loss or norm that is not an fp16 overflow the
// scaler skipped. Skipped steps changed nothing (fl_optimizer_step, or
// LOMO's first pass); a single-pass LOMO step has already updated.
void run_check_finite(run_log *log, const fl_train_config *cfg, int step,
                      const fl_train_result *r) {
    float loss = r->loss;
    int overflow = r->skipped && cfg->dtype == FL_F16;
    if (overflow || !(r->skipped || !isfinite(loss) || !isfinite(r->grad_norm))) return;
    if (log->tty) printf("\n");
    char norm[32]; // a fused first pass that skipped reports no norm
    if (r->skipped && isfinite(r->grad_norm))
        snprintf(norm, sizeof norm, "inf or NaN");
    else
        snprintf(norm, sizeof norm, "%g", r->grad_norm);
    if (!r->skipped)
        fl_die("training diverged at step %d: loss %g, gradient norm %s, and the update "
               "was already applied (LOMO/AdaLomo, and ZeRO-Offload's update during the "
               "backward pass, without clipping check the norm only after updating: set "
               "--grad-clip for a step that can skip). No "
               "checkpoint is written for it%s%s%s",
               step + 1, loss, norm, *cfg->out_dir ? ": " : "", cfg->out_dir,
               *cfg->out_dir ? "/latest, if any, stays the last good one" : "");
    if (++log->nonfinite > cfg->skip_nonfinite)
        fl_die("training diverged at step %d: loss %g, gradient norm %s (not finite; the "
               "step was not applied%s). No checkpoint is written for it%s%s%s. Lower "
               "the learning rate, or let --skip-nonfinite N skip up to N such steps",
               step + 1, loss, norm,
               cfg->skip_nonfinite ? ", and --skip-nonfinite's budget is spent" : "",
               *cfg->out_dir ? ": " : "", cfg->out_dir,
               *cfg->out_dir ? "/latest, if any, stays the last good one" : "");
    printf("%sstep %d skipped: loss %g, gradient norm %s: not finite (%d of "
           "--skip-nonfinite %d)\n",
           log->tty ? "\n" : "", step + 1, loss, norm, log->nonfinite, cfg->skip_nonfinite);
}

// The spike guard's outlier (DeepSpeed's "OVERFLOW! Skipping step"), and
// the stop after skip_update_max_in_row in a row: the weights, not a batch,
// are then the likely cause, and nothing is saved from them.
void run_check_spike(run_log *log, const fl_train_config *cfg, int step, const fl_train_result *r) {
    if (!r->spike.outlier) return;
    char why[160];
    if (r->spike.loss_z > cfg->skip_update_lossz)
        snprintf(why, sizeof why, "loss %g (z-score %.3g > --skip-update-lossz %g)", r->loss,
                 r->spike.loss_z, cfg->skip_update_lossz);
    else
        snprintf(why, sizeof why, "gradient norm %g (z-score %.3g > --skip-update-gradz %g)",
                 r->grad_norm, r->spike.grad_z, cfg->skip_update_gradz);
    if (log->tty) printf("\n");
    printf("[fitlm] SPIKE! Skipping step %d: %s; %d in a row (at most %d), %ld skipped in all\n",
           step + 1, why, r->spikes_in_row, cfg->skip_update_max_in_row, r->spikes_skipped);
    if (r->spikes_in_row >= cfg->skip_update_max_in_row)
        fl_die("training stopped at step %d: %d steps in a row were skipped as spikes (the last: "
               "%s). The weights an earlier update made are the likely cause (a learning rate "
               "too high?); no checkpoint is written from them%s%s%s. If the loss or norm "
               "moved for a known reason (another batch size or data on a resume), raise the "
               "thresholds or turn the guard off (--skip-update-lossz 0 --skip-update-gradz 0)",
               step + 1, r->spikes_in_row, why, *cfg->out_dir ? ": " : "", cfg->out_dir,
               *cfg->out_dir ? "/latest, if any, is from before the spikes" : "");
}

void rank_memory_report(void) {
    int world = fl_comm_size();
    for (int r = 0; r < world; r++) {
        if (r == fl_comm_rank()) {
            // one write: mpirun forwards each rank's pipe on its own, so a
            // report written line by line (stderr is unbuffered) can come
            // out interleaved with the next rank's despite the barrier
            char *text = NULL;
            size_t n = 0;
            FILE *m = open_memstream(&text, &n);
            if (!m) fl_die("out of memory");
            if (world > 1) fprintf(m, "memory of rank %d:\n", r);
            fl_mem_report(m);
            fclose(m);
            FILE *out = r == 0 ? stdout : stderr;
            fwrite(text, 1, n, out);
            fflush(out);
            free(text);
        }
        fl_comm_barrier(fl_comm_world());
    }
}

// NVMe offload's traffic per training step, and how much of it the step
// waited for (the rest was hidden behind the update and the next chunks').
static void print_offload(const fl_offload *f, const fl_offload_stats *from, int steps,
                          double step_seconds) {
    fl_offload_stats s;
    fl_offload_stats_get(f, &s);
    double rd = (double)(s.bytes_read - from->bytes_read) / steps,
           wr = (double)(s.bytes_written - from->bytes_written) / steps,
           wait = (s.wait_s - from->wait_s) / steps, busy = (s.busy_s - from->busy_s) / steps;
    char read[FL_SIZE_TEXT], written[FL_SIZE_TEXT];
    printf("NVMe offload per step (%s%s): read %s, written %s, I/O %.2f s (%.2f GB/s); "
           "the step waited %.2f s of its %.2f s for it (%.0f%% of the I/O time hidden)",
           fl_offload_path(f), fl_offload_direct(f) ? ", O_DIRECT" : "",
           fl_size_text((size_t)rd, read), fl_size_text((size_t)wr, written), busy,
           busy > 0 ? (rd + wr) / busy / 1e9 : 0.0, wait, step_seconds / steps,
           busy > 0 ? 100.0 * (1.0 - (wait < busy ? wait : busy) / busy) : 100.0);
    double weights = (s.weights_s - from->weights_s) / steps;
    if (weights > 0) printf("; ZeRO-3's reads of offloaded weights waited %.2f s", weights);
    printf("\n");
}

void run_print_traffic(const run_log *log, const fl_run *run, const fl_offload_stats *io0,
                       int steps_run) {
    const fl_comm_stats *comm = &log->comm;
    size_t numel = run->model.table.numel; // this rank's (under TP, its slices; PP, its stage's)
    // every rank of the job: the data-parallel ones, and each one's TP group
    // and pipeline (its point-to-point sends count their bytes)
    if (run->world * run->tp.size * run->stage.size > 1 && steps_run > 0)
        printf("communication per step and rank: %.4g elements (%.3f x the %zu parameters), "
               "%.4g MB, %.1f collectives; %.1f%% of the step time waiting on them\n",
               comm->elements / steps_run, comm->elements / steps_run / (double)numel, numel,
               comm->bytes / steps_run / 1e6, (double)comm->collectives / steps_run,
               100.0 * comm->wait_seconds / log->step_seconds);
    if (run->offload && steps_run > 0)
        print_offload(run->offload, io0, steps_run, log->step_seconds);
    print_device_waits(log, run);
    if (log->waits_steps)
        printf("device: the host waited behind the %s device's queued work %.2f times a step "
               "(over %ld steps after the first; a step's verdict is read once)\n",
               run->dev->name, (double)log->host_waits / log->waits_steps, log->waits_steps);
}
