// metrics.c: the run's line logs (log.txt, metrics.jsonl): writing them with
// their crash and resume rules, the JSON records, and reading metrics.jsonl
// back for `fitlm plot`. See fitlm/metrics.h.
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "fitlm/metrics.h"

// ----------------------------------------------------------------------------
// line logs

int fl_text_line_step(const char *line, size_t len) {
    (void)len; // the line ends at its '\n', which sscanf stops at
    int step;
    return sscanf(line, "step %d", &step) == 1 ? step : -1;
}

int fl_metrics_line_step(const char *line, size_t len) {
    const char *why;
    size_t at;
    cJSON *o = fl_json_parse(line, len, &why, &at);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
    int step = cJSON_IsNumber(s) ? s->valueint : -1;
    cJSON_Delete(o);
    return step;
}

// Rewrites path with its complete lines of step <= resume_step (temporary
// file + rename: a crash here leaves the old log whole).
static void keep_lines(const char *path, const char *what, int resume_step,
                       fl_line_step_fn step_of) {
    size_t n;
    char *text = (char *)fl_file_read_all(path, (size_t)1 << 30, &n, what);
    fl_file f;
    fl_file_begin(&f, path);
    for (char *line = text; line < text + n;) {
        char *end = memchr(line, '\n', (size_t)(text + n - line));
        size_t len = end ? (size_t)(end - line) + 1 : (size_t)(text + n - line);
        int step = end ? step_of(line, len - 1) : -1; // a torn last line is dropped
        if (step >= 0 && step <= resume_step) fl_file_write(&f, line, len);
        line += len;
    }
    fl_file_commit(&f);
    fl_free(text);
}

void fl_line_log_open(fl_line_log *log, const char *path, const char *what, int resume_step,
                      fl_line_step_fn step_of) {
    memset(log, 0, sizeof *log);
    log->what = what;
    if (!*path) return;
    if (strlen(path) >= sizeof log->path) fl_die("%s path is too long: %s", what, path);
    strcpy(log->path, path);
    // never through a link, FIFO or device planted at the name: the log is
    // (re)made as a new file of ours (temporary + rename), then appended to
    struct stat st;
    int exists = lstat(path, &st) == 0;
    if (exists && !S_ISREG(st.st_mode))
        fl_die("%s %s is not a regular file (a link, FIFO or device): fitlm does not write "
               "through it; remove it",
               what, path);
    if (resume_step >= 0 && exists)
        keep_lines(path, what, resume_step, step_of);
    else
        fl_file_write_all(path, "", 0);
    log->f = fl_fopen_append(path, what);
}

void fl_line_log_printf(fl_line_log *log, const char *fmt, ...) {
    if (!log->f) return;
    va_list ap;
    va_start(ap, fmt);
    int rc = vfprintf(log->f, fmt, ap);
    va_end(ap);
    if (rc < 0 || fflush(log->f) != 0)
        fl_die("writing the %s %s failed: %s", log->what, log->path, strerror(errno));
}

void fl_line_log_close(fl_line_log *log) {
    if (log->f && fclose(log->f) != 0)
        fl_die("writing the %s %s failed: %s", log->what, log->path, strerror(errno));
    log->f = NULL;
}

// ----------------------------------------------------------------------------
// writing records

// A JSON number (%.9g: a float reads back exactly) or null when not finite.
static const char *num(char *buf, double v) {
    if (!isfinite(v)) return "null";
    snprintf(buf, 32, "%.9g", v);
    return buf;
}

// Current and peak RSS from /proc/self/status (0 when unknown).
static void read_rss(double *rss, double *peak) {
    *rss = *peak = 0.0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    char line[256];
    size_t kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "VmRSS: %zu kB", &kb) == 1) *rss = kb * 1024.0;
        if (sscanf(line, "VmHWM: %zu kB", &kb) == 1) *peak = kb * 1024.0;
    }
    fclose(f);
}

void fl_metrics_write_step(fl_line_log *log, const fl_metrics_step *s, int with_memory) {
    char a[32], b[32], c[32], d[32], e[32], f[32], g[32];
    char mem[1024] = "";
    if (with_memory) {
        size_t k = (size_t)snprintf(mem, sizeof mem, ",\"memory\":{");
        for (int t = 0; t < FL_MEM_NTAGS; t++)
            k += (size_t)snprintf(mem + k, sizeof mem - k, "\"%s\":%zu,", fl_mem_tag_name(t),
                                  fl_mem_current(t));
        double rss, peak;
        read_rss(&rss, &peak);
        snprintf(mem + k, sizeof mem - k, "\"tagged\":%zu,\"rss\":%.0f,\"peak_rss\":%.0f}",
                 fl_mem_total_current(), rss, peak);
    }
    char spikes[48] = ""; // DeepSpeed's skipped_steps, for the spike guard's
    if (s->skipped_steps)
        snprintf(spikes, sizeof spikes, ",\"skipped_steps\":%ld", s->skipped_steps);
    char wait[96] = ""; // on a device only: the recorded logs stay as they are
    size_t w = 0;
    if (s->host_waits >= 0)
        w += (size_t)snprintf(wait, sizeof wait, ",\"host_waits\":%ld", s->host_waits);
    if (isfinite(s->device_wait))
        snprintf(wait + w, sizeof wait - w, ",\"device_wait\":%.9g", s->device_wait);
    fl_line_log_printf(
        log,
        "{\"step\":%d,\"tokens\":%.0f,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,"
        "\"loss_scale\":%s,\"skipped\":%d%s,\"tokens_per_s\":%s,\"ms\":%s,\"mfu\":%s%s%s}\n",
        s->step, s->tokens, num(a, s->loss), num(b, s->lr), num(c, s->grad_norm),
        num(d, s->loss_scale), s->skipped, spikes, num(e, s->tokens_per_s), num(f, s->ms),
        num(g, s->mfu), wait, mem);
}

void fl_metrics_write_eval(fl_line_log *log, const fl_metrics_eval *e) {
    char a[32];
    fl_line_log_printf(log, "{\"step\":%d,\"tokens\":%.0f,\"val_loss\":%s}\n", e->step, e->tokens,
                       num(a, e->val_loss));
}

void fl_metrics_write_run(fl_line_log *log, const fl_metrics_run *r) {
    // the peak's description goes through cJSON: it is text
    cJSON *peak = cJSON_CreateString(r->peak);
    char *text = cJSON_PrintUnformatted(peak);
    char a[32];
    fl_line_log_printf(log,
                       "{\"step\":%d,\"run\":{\"params\":%.0f,\"flops_per_token\":%.0f,"
                       "\"tokens_per_step\":%.0f,\"peak_flops\":%s,\"peak\":%s}}\n",
                       r->step, r->params, r->flops_per_token, r->tokens_per_step,
                       num(a, r->peak_flops > 0.0 ? r->peak_flops : NAN), text);
    free(text);
    cJSON_Delete(peak);
}

// ----------------------------------------------------------------------------
// reading metrics.jsonl

typedef struct {
    const char *path;
    int line;
} where;

// A number field: NAN for null or absent (optional), else dies.
static double field(const cJSON *o, const char *key, const where *w) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) return NAN;
    if (!cJSON_IsNumber(v)) fl_die("%s:%d: \"%s\" is not a number or null", w->path, w->line, key);
    return v->valuedouble;
}

// Grows *items (of `size` bytes each) to hold one more; returns the new slot.
static void *push(void **items, int *n, int *cap, size_t size) {
    if (*n == *cap) {
        int grown = *cap ? 2 * *cap : 64;
        void *p = fl_alloc(FL_MEM_OTHER, (size_t)grown * size);
        if (*n) memcpy(p, *items, (size_t)*n * size);
        fl_free(*items);
        *items = p;
        *cap = grown;
    }
    return (char *)*items + (size_t)(*n)++ * size;
}

static void read_memory(fl_metrics_memory *m, const cJSON *o, int step, const where *w) {
    if (!cJSON_IsObject(o)) fl_die("%s:%d: \"memory\" is not an object", w->path, w->line);
    m->step = step;
    for (int t = 0; t < FL_MEM_NTAGS; t++) m->tag[t] = field(o, fl_mem_tag_name(t), w);
    m->tagged = field(o, "tagged", w);
    m->rss = field(o, "rss", w);
    m->peak_rss = field(o, "peak_rss", w);
}

void fl_metrics_read(const char *path, fl_metrics *m) {
    memset(m, 0, sizeof *m);
    size_t n;
    char *text = (char *)fl_file_read_all(path, (size_t)1 << 31, &n, "metrics file");
    int cap_steps = 0, cap_evals = 0, cap_memory = 0;
    where w = {path, 0};
    for (char *line = text; line < text + n;) {
        char *end = memchr(line, '\n', (size_t)(text + n - line));
        if (!end) break; // a torn last line: the writer died inside it
        w.line++;
        size_t len = (size_t)(end - line);
        if (fl_line_is_blank((const uint8_t *)line, len)) { // as in JSON Lines data
            line = end + 1;
            continue;
        }
        const char *why;
        size_t at;
        cJSON *o = fl_json_parse(line, len, &why, &at);
        line = end + 1;
        if (!o)
            fl_die("%s:%d: not a JSON object (%s at byte %zu of the line; each line of "
                   "metrics.jsonl is one)",
                   path, w.line, why, at);
        if (!cJSON_IsObject(o))
            fl_die("%s:%d: not a JSON object (each line of metrics.jsonl is one)", path, w.line);
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
        if (!cJSON_IsNumber(s) || s->valuedouble != (double)s->valueint || s->valueint < 0)
            fl_die("%s:%d: no \"step\" (a whole number >= 0)", path, w.line);
        int step = s->valueint;
        if (cJSON_GetObjectItemCaseSensitive(o, "loss")) {
            fl_metrics_step *r =
                push((void **)&m->steps, &m->n_steps, &cap_steps, sizeof(fl_metrics_step));
            r->step = step;
            r->tokens = field(o, "tokens", &w);
            r->loss = (float)field(o, "loss", &w);
            r->lr = (float)field(o, "lr", &w);
            r->grad_norm = (float)field(o, "grad_norm", &w);
            r->loss_scale = (float)field(o, "loss_scale", &w);
            double skipped = field(o, "skipped", &w);
            r->skipped = isfinite(skipped) ? (int)skipped : 0;
            r->tokens_per_s = field(o, "tokens_per_s", &w);
            r->ms = field(o, "ms", &w);
            r->mfu = field(o, "mfu", &w);
            r->device_wait = field(o, "device_wait", &w);
            double waits = field(o, "host_waits", &w);
            r->host_waits = isfinite(waits) ? (long)waits : -1;
            const cJSON *mem = cJSON_GetObjectItemCaseSensitive(o, "memory");
            if (mem)
                read_memory(
                    push((void **)&m->memory, &m->n_memory, &cap_memory, sizeof(fl_metrics_memory)),
                    mem, step, &w);
        } else if (cJSON_GetObjectItemCaseSensitive(o, "val_loss")) {
            fl_metrics_eval *e =
                push((void **)&m->evals, &m->n_evals, &cap_evals, sizeof(fl_metrics_eval));
            e->step = step;
            e->tokens = field(o, "tokens", &w);
            e->val_loss = (float)field(o, "val_loss", &w);
        } // else a run record (or a newer kind): nothing to draw
        cJSON_Delete(o);
    }
    fl_free(text);
}

void fl_metrics_free(fl_metrics *m) {
    fl_free(m->steps);
    fl_free(m->evals);
    fl_free(m->memory);
    memset(m, 0, sizeof *m);
}
