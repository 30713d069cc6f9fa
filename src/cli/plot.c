// plot.c: `fitlm plot OUT... [-o DIR] [--width W] [--height H]`: figures of
// runs' metrics.jsonl (fitlm/metrics.h), drawn with cairo as PNG and SVG:
// loss against step and against tokens (training, and validation dashed
// with markers), learning rate, gradient norm, tokens/s, and memory per
// allocator tag and RSS. Several runs overlay in each figure, named by
// their directories in the legend.
//
// Each series is drawn once as a line and once as its legend swatch; the
// swatches are the only strokes SWATCH_WIDTH wide, so the series of an SVG
// can be counted (tests/test_metrics.c does).
#include <cairo-svg.h>
#include <cairo.h>
#include <errno.h>
#include <fontconfig/fontconfig.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "helpers.h"
#include "fitlm/io.h"
#include "fitlm/metrics.h"

#define SWATCH_WIDTH 2.5
#define LINE_WIDTH   1.6

typedef struct {
    char label[FL_PATH_MAX + 32];
    double *x, *y; // n points; a non-finite y breaks the line
    int n;
    int color, dash; // palette index; dash pattern index (0: solid)
    int markers;     // a dot on each point (evaluations: few, far apart)
} series;

typedef struct {
    const char *name, *title, *xlabel, *ylabel;
    int y_from_zero; // quantities that start at 0: the axis does too
    series *s;
    int n, cap;
} figure;

static void usage(FILE *out) {
    fprintf(out,
            "usage: fitlm plot OUT... [-o DIR] [--width W] [--height H]\n\n"
            "Draws the metrics.jsonl of one or more run directories (fitlm train --out OUT) as\n"
            "PNG and SVG figures: loss (against step and against tokens), lr, grad_norm,\n"
            "tokens_per_s and memory (per allocator tag and RSS). Several runs overlay, one\n"
            "legend entry per run directory.\n\n"
            "  -o DIR        where the figures go (default: OUT for one run, ./plots for more)\n"
            "  --width W     image width in pixels (default: 900)\n"
            "  --height H    image height in pixels (default: 540)\n");
}

// ----------------------------------------------------------------------------
// building the figures

static series *add_series(figure *f, const char *run, const char *what, int n) {
    if (f->n == f->cap) {
        int cap = f->cap ? 2 * f->cap : 16;
        series *s = fl_alloc(FL_MEM_OTHER, (size_t)cap * sizeof(series));
        if (f->n) memcpy(s, f->s, (size_t)f->n * sizeof(series));
        fl_free(f->s);
        f->s = s;
        f->cap = cap;
    }
    series *s = &f->s[f->n++];
    memset(s, 0, sizeof *s);
    snprintf(s->label, sizeof s->label, "%s%s%s", run, *what ? " " : "", what);
    s->x = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(double));
    s->y = fl_alloc(FL_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(double));
    s->n = n;
    return s;
}

static void free_figure(figure *f) {
    for (int i = 0; i < f->n; i++) {
        fl_free(f->s[i].x);
        fl_free(f->s[i].y);
    }
    fl_free(f->s);
}

// Which field of a step record a figure draws.
typedef enum { Y_LOSS, Y_LR, Y_NORM, Y_TOK_S } step_field;

static double step_value(const fl_metrics_step *s, step_field f) {
    switch (f) {
    case Y_LOSS:
        return s->loss;
    case Y_LR:
        return s->lr;
    case Y_NORM:
        return s->grad_norm;
    default:
        return s->tokens_per_s;
    }
}

// One series of a step field for run r, against step (or tokens).
static void add_steps(figure *f, const fl_metrics *m, const char *run, int r, step_field field,
                      int by_tokens, const char *what) {
    series *s = add_series(f, run, what, m->n_steps);
    s->color = r;
    for (int i = 0; i < m->n_steps; i++) {
        s->x[i] = by_tokens ? m->steps[i].tokens : m->steps[i].step;
        s->y[i] = step_value(&m->steps[i], field);
    }
}

static void add_loss(figure *f, const fl_metrics *m, const char *run, int r, int by_tokens) {
    add_steps(f, m, run, r, Y_LOSS, by_tokens, "train");
    if (!m->n_evals) return;
    series *s = add_series(f, run, "val", m->n_evals);
    s->color = r;
    s->dash = 1;
    s->markers = 1;
    for (int i = 0; i < m->n_evals; i++) {
        s->x[i] = by_tokens ? m->evals[i].tokens : m->evals[i].step;
        s->y[i] = m->evals[i].val_loss;
    }
}

// One series per allocator tag the run used (and RSS): colour by tag, dash by run.
static void add_memory(figure *f, const fl_metrics *m, const char *run, int r) {
    for (int t = 0; t <= FL_MEM_NTAGS; t++) { // t == FL_MEM_NTAGS: RSS
        int used = 0;
        for (int i = 0; i < m->n_memory; i++) {
            double v = t < FL_MEM_NTAGS ? m->memory[i].tag[t] : m->memory[i].rss;
            used |= isfinite(v) && v > 0.0;
        }
        if (!used) continue;
        series *s = add_series(f, run, t < FL_MEM_NTAGS ? fl_mem_tag_name(t) : "rss", m->n_memory);
        s->color = t;
        s->dash = r;
        for (int i = 0; i < m->n_memory; i++) {
            s->x[i] = m->memory[i].step;
            double v = t < FL_MEM_NTAGS ? m->memory[i].tag[t] : m->memory[i].rss;
            s->y[i] = v / 1048576.0;
        }
        // the last value in the legend: equal tags (params and grads) draw
        // one line over the other
        size_t n = strlen(s->label);
        snprintf(s->label + n, sizeof s->label - n, " %.3g MiB", s->y[s->n - 1]);
    }
}

// ----------------------------------------------------------------------------
// drawing

// Tableau's 10 colours (matplotlib's default cycle).
static void set_color(cairo_t *cr, int i) {
    static const unsigned rgb[10] = {0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd,
                                     0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22, 0x17becf};
    unsigned c = rgb[i % 10];
    cairo_set_source_rgb(cr, (c >> 16) / 255.0, (c >> 8 & 255) / 255.0, (c & 255) / 255.0);
}

static void set_dash(cairo_t *cr, int i) {
    static const double patterns[][2] = {{6, 4}, {2, 3}, {10, 3}};
    if (i <= 0)
        cairo_set_dash(cr, NULL, 0, 0);
    else
        cairo_set_dash(cr, patterns[(i - 1) % 3], 2, 0);
}

// A tick step of 1, 2 or 5 times a power of ten giving about `want` ticks.
static double nice_step(double range, int want) {
    double raw = range / want, p = pow(10.0, floor(log10(raw))), f = raw / p;
    return (f < 1.5 ? 1.0 : f < 3.5 ? 2.0 : f < 7.5 ? 5.0 : 10.0) * p;
}

static void tick_label(char *buf, size_t size, double v, double step) {
    static const struct {
        double at;
        const char *suffix;
    } si[] = {{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
    if (fabs(v) < step * 1e-6) v = 0.0; // k * step's rounding error
    for (size_t i = 0; i < sizeof si / sizeof si[0]; i++)
        if (fabs(step) >= si[i].at) {
            snprintf(buf, size, "%g%s", v / si[i].at, si[i].suffix);
            return;
        }
    snprintf(buf, size, "%.6g", v);
}

// The finite data range of a figure along x (axis 0) or y (axis 1).
static void data_range(const figure *f, int axis, double *lo, double *hi) {
    *lo = INFINITY;
    *hi = -INFINITY;
    for (int i = 0; i < f->n; i++)
        for (int k = 0; k < f->s[i].n; k++) {
            double v = axis ? f->s[i].y[k] : f->s[i].x[k];
            if (!isfinite(v)) continue;
            *lo = fmin(*lo, v);
            *hi = fmax(*hi, v);
        }
    if (!(*lo <= *hi)) *lo = 0.0, *hi = 1.0; // no data
    if (axis && f->y_from_zero && *lo > 0.0) *lo = 0.0;
    if (*hi - *lo < 1e-12 * fmax(1.0, fabs(*hi))) { // one value: a band around it
        double pad = *hi ? fabs(*hi) * 0.1 : 1.0;
        *lo -= pad;
        *hi += pad;
    }
}

static void text_at(cairo_t *cr, double x, double y, const char *s, double align_x,
                    double align_y) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    cairo_move_to(cr, x - e.x_advance * align_x, y + e.height * align_y);
    cairo_show_text(cr, s);
}

static void draw(cairo_t *cr, const figure *f, double W, double H) {
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, 12);
    // the legend, right of the plot: as wide as its longest label
    double legend_w = 0.0;
    for (int i = 0; i < f->n; i++) {
        cairo_text_extents_t e;
        cairo_text_extents(cr, f->s[i].label, &e);
        legend_w = fmax(legend_w, e.x_advance);
    }
    legend_w = fmin(legend_w + 44.0, W * 0.45);
    double x0 = 72, x1 = W - 16 - legend_w, y0 = 40, y1 = H - 52;
    double xlo, xhi, ylo, yhi;
    data_range(f, 0, &xlo, &xhi);
    data_range(f, 1, &ylo, &yhi);
    double xs = nice_step(xhi - xlo, 6), ys = nice_step(yhi - ylo, 6);
    xlo = floor(xlo / xs) * xs, xhi = ceil(xhi / xs) * xs;
    ylo = floor(ylo / ys) * ys, yhi = ceil(yhi / ys) * ys;
#define PX(v) (x0 + ((v)-xlo) / (xhi - xlo) * (x1 - x0))
#define PY(v) (y1 - ((v)-ylo) / (yhi - ylo) * (y1 - y0))
    // grid and tick labels
    char label[64];
    cairo_set_line_width(cr, 1.0);
    for (double v = xlo; v <= xhi + xs * 1e-9; v += xs) {
        cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
        cairo_move_to(cr, PX(v), y0);
        cairo_line_to(cr, PX(v), y1);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        tick_label(label, sizeof label, v, xs);
        text_at(cr, PX(v), y1 + 8, label, 0.5, 1.0);
    }
    for (double v = ylo; v <= yhi + ys * 1e-9; v += ys) {
        cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
        cairo_move_to(cr, x0, PY(v));
        cairo_line_to(cr, x1, PY(v));
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
        tick_label(label, sizeof label, v, ys);
        text_at(cr, x0 - 6, PY(v), label, 1.0, 0.5);
    }
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
    cairo_stroke(cr);
    // title and axis labels
    cairo_set_font_size(cr, 15);
    text_at(cr, (x0 + x1) / 2, 14, f->title, 0.5, 1.0);
    cairo_set_font_size(cr, 12);
    text_at(cr, (x0 + x1) / 2, H - 26, f->xlabel, 0.5, 1.0);
    cairo_save(cr);
    cairo_translate(cr, 16, (y0 + y1) / 2);
    cairo_rotate(cr, -M_PI / 2);
    text_at(cr, 0, 0, f->ylabel, 0.5, 1.0);
    cairo_restore(cr);
    // the series, clipped to the plot
    cairo_save(cr);
    cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
    cairo_clip(cr);
    cairo_set_line_width(cr, LINE_WIDTH);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    for (int i = 0; i < f->n; i++) {
        const series *s = &f->s[i];
        set_color(cr, s->color);
        set_dash(cr, s->dash);
        int pen = 0;
        for (int k = 0; k < s->n; k++) {
            if (!isfinite(s->x[k]) || !isfinite(s->y[k])) {
                pen = 0;
                continue;
            }
            if (pen)
                cairo_line_to(cr, PX(s->x[k]), PY(s->y[k]));
            else
                cairo_move_to(cr, PX(s->x[k]), PY(s->y[k]));
            pen = 1;
        }
        cairo_stroke(cr);
        for (int k = 0; s->markers && k < s->n; k++) {
            if (!isfinite(s->x[k]) || !isfinite(s->y[k])) continue;
            cairo_new_sub_path(cr);
            cairo_arc(cr, PX(s->x[k]), PY(s->y[k]), 3.0, 0, 2 * M_PI);
        }
        cairo_fill(cr);
    }
    cairo_restore(cr);
#undef PX
#undef PY
    // the legend: a swatch and the label per series
    cairo_set_line_width(cr, SWATCH_WIDTH);
    for (int i = 0; i < f->n; i++) {
        const series *s = &f->s[i];
        double lx = x1 + 12, ly = y0 + 8 + 16 * i;
        set_color(cr, s->color);
        set_dash(cr, s->dash);
        cairo_move_to(cr, lx, ly);
        cairo_line_to(cr, lx + 24, ly);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0, 0, 0);
        text_at(cr, lx + 30, ly, s->label, 0.0, 0.4);
    }
    cairo_set_dash(cr, NULL, 0, 0);
}

static void check(cairo_status_t st, const char *path) {
    if (st != CAIRO_STATUS_SUCCESS) fl_die("cannot write %s: %s", path, cairo_status_to_string(st));
}

// cairo's output, into a crash-safe file (fitlm/io.h): a link planted at the
// image's name is replaced, never written through
static cairo_status_t to_file(void *f, const unsigned char *data, unsigned int n) {
    fl_file_write(f, data, n);
    return CAIRO_STATUS_SUCCESS;
}

// Writes DIR/<name>.png and DIR/<name>.svg.
static void render(const figure *f, const char *dir, int W, int H) {
    char path[FL_PATH_MAX + 64];
    fl_file out;
    snprintf(path, sizeof path, "%s/%s.png", dir, f->name);
    cairo_surface_t *png = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, W, H);
    cairo_t *cr = cairo_create(png);
    draw(cr, f, W, H);
    cairo_destroy(cr);
    fl_file_begin(&out, path);
    check(cairo_surface_write_to_png_stream(png, to_file, &out), path);
    fl_file_commit(&out);
    cairo_surface_destroy(png);
    snprintf(path, sizeof path, "%s/%s.svg", dir, f->name);
    fl_file_begin(&out, path);
    cairo_surface_t *svg = cairo_svg_surface_create_for_stream(to_file, &out, W, H);
    cr = cairo_create(svg);
    draw(cr, f, W, H);
    cairo_destroy(cr);
    cairo_surface_finish(svg); // writes the file
    check(cairo_surface_status(svg), path);
    cairo_surface_destroy(svg);
    fl_file_commit(&out);
}

// ----------------------------------------------------------------------------
// the command

// A run's name in legends: its directory without trailing slashes.
static void run_name(char *out, size_t size, const char *dir) {
    snprintf(out, size, "%s", dir);
    for (size_t n = strlen(out); n > 1 && out[n - 1] == '/'; n--) out[n - 1] = 0;
}

int cmd_plot(int argc, char **argv) {
    if (wants_help(argc, argv)) {
        usage(stdout);
        return 0;
    }
    const char *out_dir = NULL;
    int W = 900, H = 540, n_runs = 0;
    const char **runs = fl_alloc(FL_MEM_OTHER, (size_t)(argc ? argc : 1) * sizeof(char *));
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int value = !strcmp(a, "-o") || !strcmp(a, "--width") || !strcmp(a, "--height");
        if (value && i + 1 >= argc) fl_die("option %s needs a value", a);
        if (!strcmp(a, "-o"))
            out_dir = argv[++i];
        else if (!strcmp(a, "--width"))
            W = cli_whole(a, argv[++i], 200, 10000);
        else if (!strcmp(a, "--height"))
            H = cli_whole(a, argv[++i], 150, 10000);
        else if (a[0] == '-' && a[1])
            fl_die("unknown option %s for 'fitlm plot' (see fitlm plot --help)", a);
        else
            runs[n_runs++] = a;
    }
    if (!n_runs) {
        usage(stderr);
        fl_die("fitlm plot needs at least one run directory");
    }
    if (!out_dir) out_dir = n_runs == 1 ? runs[0] : "plots";
    figure figs[] = {
        {"loss", "Loss", "step", "loss (nats/token)", 0, NULL, 0, 0},
        {"loss_tokens", "Loss against tokens", "tokens", "loss (nats/token)", 0, NULL, 0, 0},
        {"lr", "Learning rate", "step", "learning rate", 1, NULL, 0, 0},
        {"grad_norm", "Gradient norm (before clipping)", "step", "gradient norm", 1, NULL, 0, 0},
        {"tokens_per_s", "Throughput", "step", "tokens/s", 1, NULL, 0, 0},
        {"memory", "Memory per allocator tag and RSS", "step", "MiB", 1, NULL, 0, 0},
    };
    for (int r = 0; r < n_runs; r++) {
        struct stat st;
        if (stat(runs[r], &st) != 0) fl_die("run directory %s: %s", runs[r], strerror(errno));
        if (!S_ISDIR(st.st_mode)) fl_die("%s is not a run directory", runs[r]);
        char path[FL_PATH_MAX + 32], name[FL_PATH_MAX];
        snprintf(path, sizeof path, "%s/metrics.jsonl", runs[r]);
        run_name(name, sizeof name, runs[r]);
        fl_metrics m;
        fl_metrics_read(path, &m);
        add_loss(&figs[0], &m, name, r, 0);
        add_loss(&figs[1], &m, name, r, 1);
        add_steps(&figs[2], &m, name, r, Y_LR, 0, "");
        add_steps(&figs[3], &m, name, r, Y_NORM, 0, "");
        add_steps(&figs[4], &m, name, r, Y_TOK_S, 0, "");
        add_memory(&figs[5], &m, name, r);
        fl_metrics_free(&m);
    }
    fl_mkdir_parents(out_dir);
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        fl_die("cannot create output directory %s: %s", out_dir, strerror(errno));
    for (size_t i = 0; i < sizeof figs / sizeof figs[0]; i++) {
        render(&figs[i], out_dir, W, H);
        free_figure(&figs[i]);
    }
    printf("%zu figures (PNG and SVG, %dx%d) of %d run%s written to %s\n",
           sizeof figs / sizeof figs[0], W, H, n_runs, n_runs == 1 ? "" : "s", out_dir);
    fl_free(runs);
    // cairo's font caches and fontconfig's: freed, so a leak checker sees
    // only what is ours
    cairo_debug_reset_static_data();
    FcFini();
    return 0;
}
