// metrics.h: a run's records as it trains: OUT/log.txt (plain text, one
// line per step and evaluation) and OUT/metrics.jsonl (one JSON object per
// line: per step, per evaluation, per start of a run), and the reader of
// metrics.jsonl that `fitlm plot` draws from.
//
// Both files are line logs with the same crash and resume rules: a line is
// flushed as it is written (a line a crash loses is a step the next resume
// repeats); a resume keeps the complete lines up to its checkpoint's step and
// drops the rest, a torn last line included; a failed write stops the run
// naming the file.
#ifndef FITLM_METRICS_H
#define FITLM_METRICS_H

#include <stddef.h>
#include <stdio.h>

#include "fitlm/config.h"
#include "fitlm/core.h"

// ----------------------------------------------------------------------------
// line logs

typedef struct {
    FILE *f; // NULL: a closed log, writes do nothing
    char path[FL_PATH_MAX + 32];
    const char *what; // "training log": names the file in errors
} fl_line_log;

// The step a complete line records (without its '\n'), or -1: such a line
// is dropped on resume.
typedef int (*fl_line_step_fn)(const char *line, size_t len);
int fl_text_line_step(const char *line, size_t len);    // log.txt: "step N ..."
int fl_metrics_line_step(const char *line, size_t len); // metrics.jsonl: {"step": N, ...}

// Opens path for writing: a new log (resume_step < 0), or the lines of the
// existing one with step <= resume_step, replaced atomically, then appended
// to. An empty path gives a closed log. Dies naming the file.
void fl_line_log_open(fl_line_log *log, const char *path, const char *what, int resume_step,
                      fl_line_step_fn step_of);
void fl_line_log_printf(fl_line_log *log, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void fl_line_log_close(fl_line_log *log);

// ----------------------------------------------------------------------------
// metrics.jsonl records. Floats are written with 9 significant digits (they
// read back to the same float); a non-finite value is written as null and
// reads back as NAN.

typedef struct {
    int step;      // 1-based: the step just done
    double tokens; // tokens trained on so far (B x T x accumulation per step)
    float loss, lr, grad_norm, loss_scale;
    int skipped; // nothing was updated (fp16 overflow, a non-finite step or a spike)
    double tokens_per_s, ms;
    long skipped_steps; // steps the spike guard skipped so far (written when not 0)
    double mfu;         // model FLOPs / (time x peak); NAN when there is no peak
    // ZeRO-Offload on a device: the share of the step the device waited on
    // the host, 0 to 1 (written when finite; NAN: not timed)
    double device_wait;
    // on a device: the host's waits in the step behind work it had queued,
    // where the device may idle (device.h's host_stalls; written when >= 0,
    // -1: not counted)
    long host_waits;
} fl_metrics_step;

typedef struct {
    int step; // evaluated after this many steps
    double tokens;
    float val_loss;
} fl_metrics_eval;

// Bytes: current per allocator tag, tagged total, process RSS and peak RSS.
typedef struct {
    int step;
    double tag[FL_MEM_NTAGS];
    double tagged, rss, peak_rss;
} fl_metrics_memory;

// What a run's MFU is quoted against, written once per start (and resume).
typedef struct {
    int step;               // the step the run starts at
    double params;          // parameters, padded vocabulary included
    double flops_per_token; // model FLOPs of one trained token (forward + backward)
    double tokens_per_step;
    double peak_flops; // FLOP/s of the whole run's threads; 0: none
    const char *peak;  // how the peak was obtained
} fl_metrics_run;

// {"step":..,"tokens":..,"loss":..,"lr":..,"grad_norm":..,"loss_scale":..,
//  "skipped":..[,"skipped_steps":..],"tokens_per_s":..,"ms":..,"mfu":..[,"device_wait":..]
//  [, "memory":{...}]}; with
// with_memory, the allocator's tags and the RSS as they are now.
void fl_metrics_write_step(fl_line_log *log, const fl_metrics_step *s, int with_memory);
void fl_metrics_write_eval(fl_line_log *log,
                           const fl_metrics_eval *e); // {"step","val_loss","tokens"}
void fl_metrics_write_run(fl_line_log *log, const fl_metrics_run *r); // {"step","run":{...}}

// A metrics.jsonl read back: its step and evaluation records in file order,
// and the memory of the steps that carry it.
typedef struct {
    fl_metrics_step *steps;
    int n_steps;
    fl_metrics_eval *evals;
    int n_evals;
    fl_metrics_memory *memory;
    int n_memory;
} fl_metrics;

// Reads path; a torn last line (no '\n') is skipped; a line that is not a
// JSON object with an integer "step", or a value of the wrong type, dies
// naming path:line.
void fl_metrics_read(const char *path, fl_metrics *m);
void fl_metrics_free(fl_metrics *m);

#endif
