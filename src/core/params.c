// params.c: the parameter table. Views are appended in the order the model
// uses them, each at the end of the flat buffer, so a view's offset is the
// sum of the sizes before it.
#include "fitlm/params.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fl_params_add(fl_param_table *table, const char *name, unsigned flags, int ndim,
                  const size_t *shape) {
    FL_ASSERT(ndim >= 1 && ndim <= FL_MAX_DIMS);
    FL_ASSERT(strlen(name) < FL_PARAM_NAME_MAX);
    if (table->count == table->capacity) {
        int capacity = table->capacity ? 2 * table->capacity : 64;
        fl_param_view *views = fl_alloc(FL_MEM_OTHER, (size_t)capacity * sizeof(fl_param_view));
        if (table->count) memcpy(views, table->views, (size_t)table->count * sizeof(fl_param_view));
        fl_free(table->views);
        table->views = views;
        table->capacity = capacity;
    }
    fl_param_view *v = &table->views[table->count];
    memset(v, 0, sizeof *v);
    strcpy(v->name, name);
    v->ndim = ndim;
    v->numel = 1;
    for (int d = 0; d < ndim; d++) {
        v->shape[d] = shape[d];
        v->numel *= shape[d];
    }
    v->offset = table->numel;
    v->flags = flags;
    v->init = FL_INIT_NORMAL;
    v->std = 0.02f;
    v->unit = FL_UNIT_EMBED;
    v->tp_dim = -1;
    v->tp_parts = 1;
    table->numel += v->numel;
    return table->count++;
}

void fl_params_reserve(fl_param_table *table, int capacity) {
    FL_ASSERT(table->count == 0 && table->views == NULL);
    table->views = fl_alloc(FL_MEM_OTHER, (size_t)capacity * sizeof(fl_param_view));
    table->capacity = capacity;
}

int fl_params_find(const fl_param_table *table, const char *name) {
    for (int i = 0; i < table->count; i++)
        if (strcmp(table->views[i].name, name) == 0) return i;
    return -1;
}

void fl_params_free(fl_param_table *table) {
    fl_free(table->views);
    memset(table, 0, sizeof *table);
}

char *fl_params_canonical(const fl_param_table *table, fl_dtype dt) {
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) fl_die("out of memory");
    // the totals first: a different shape shows there before it shows in a row
    fprintf(f, "params.dtype=%s\nparams.numel=%zu\nparams.rows=%d\n", fl_dtype_name(dt),
            table->numel, table->count);
    for (int i = 0; i < table->count; i++) {
        const fl_param_view *v = &table->views[i];
        fprintf(f, "param.%s=shape ", v->name);
        for (int d = 0; d < v->ndim; d++) fprintf(f, "%s%zu", d ? "x" : "", v->shape[d]);
        fprintf(f, " offset %zu flags %u init %d std %.9g unit %d live_rows %zu\n", v->offset,
                v->flags, (int)v->init, (double)v->std, v->unit, v->live_rows);
    }
    if (fclose(f)) fl_die("out of memory");
    return text;
}

// A row's draws per element (its rule's) and the elements that draw.
static uint64_t draws_per(const fl_param_view *v) {
    return v->init == FL_INIT_NORMAL ? 2 : v->init == FL_INIT_UNIFORM ? 1 : 0;
}

static size_t drawn_of(const fl_param_view *v) {
    return v->live_rows ? v->live_rows * (v->numel / v->shape[0]) : v->numel;
}

// Elements [j0, j0 + len) of row v from rng, positioned at the first's draw.
static void draw_values(const fl_param_view *v, size_t j0, size_t len, fl_rng *rng, float *out) {
    size_t drawn = drawn_of(v);
    for (size_t j = 0; j < len; j++)
        out[j] = v->init == FL_INIT_ONES      ? 1.0f
                 : j0 + j >= drawn            ? 0.0f
                 : v->init == FL_INIT_NORMAL  ? v->std * fl_rng_normal(rng)
                 : v->init == FL_INIT_UNIFORM ? v->std * (2.0f * fl_rng_uniform(rng) - 1.0f)
                                              : 0.0f;
}

// Elements a thread draws at once when the threads share the drawing: each
// piece starts from the stream's state at its first draw (fl_rng_jump), so
// the values are the one stream's, whatever the threads.
enum { INIT_PIECE = 16 * FL_PARAMS_INIT_CHUNK, INIT_PARALLEL = 1 << 20 };

size_t fl_params_init_bytes(size_t numel, int threads) {
    return numel >= INIT_PARALLEL && threads > 1 ? (size_t)threads * INIT_PIECE * sizeof(float) : 0;
}

void fl_params_init_each(const fl_param_table *table, uint64_t seed, fl_params_sink sink,
                         void *ctx) {
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    int threads = fl_threads();
    size_t bytes = fl_params_init_bytes(table->numel, threads), span = bytes / sizeof(float);
    if (!bytes) { // one thread draws the stream in order
        float block[FL_PARAMS_INIT_CHUNK];
        for (int i = 0; i < table->count; i++) {
            const fl_param_view *v = &table->views[i];
            for (size_t j0 = 0; j0 < v->numel; j0 += FL_PARAMS_INIT_CHUNK) {
                size_t len =
                    v->numel - j0 < FL_PARAMS_INIT_CHUNK ? v->numel - j0 : FL_PARAMS_INIT_CHUNK;
                draw_values(v, j0, len, &rng, block);
                sink(ctx, i, j0, block, len);
            }
        }
        return;
    }
    float *buf = fl_alloc(FL_MEM_WORKSPACE, bytes); // the host's transient workspace (plan.c)
    uint64_t before = 0;                            // the stream's draws before row i
    for (int i = 0; i < table->count; i++) {
        const fl_param_view *v = &table->views[i];
        uint64_t per = draws_per(v);
        size_t drawn = drawn_of(v);
        for (size_t j0 = 0; j0 < v->numel; j0 += span) {
            size_t n = v->numel - j0 < span ? v->numel - j0 : span;
            int pieces = (int)((n + INIT_PIECE - 1) / INIT_PIECE);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
            for (int k = 0; k < pieces; k++) {
                size_t a = j0 + (size_t)k * INIT_PIECE, len = j0 + n - a;
                if (len > INIT_PIECE) len = INIT_PIECE;
                fl_rng r = rng;
                fl_rng_jump(&r, before + per * (a < drawn ? a : drawn));
                draw_values(v, a, len, &r, buf + (size_t)k * INIT_PIECE);
            }
            sink(ctx, i, j0, buf, n); // in table order, the span at once (a device's copies)
        }
        before += per * drawn;
    }
    fl_free(buf);
}

typedef struct {
    const fl_param_table *table;
    fl_dtype dt;
    void *params;
} flat_sink;

static void store_flat(void *ctx, int row, size_t first, const float *values, size_t n) {
    const flat_sink *f = ctx;
    fl_store_f32(f->dt, fl_at(f->dt, f->params, f->table->views[row].offset + first), values, n);
}

void fl_params_init(const fl_param_table *table, fl_dtype dt, void *params, uint64_t seed) {
    flat_sink f = {table, dt, params};
    fl_params_init_each(table, seed, store_flat, &f);
}

void fl_params_split(fl_param_table *t, int row, int dim, int parts) {
    FL_ASSERT(row >= 0 && row < t->count && (dim == 0 || dim == 1) && parts >= 1);
    FL_ASSERT(dim < t->views[row].ndim && (dim == 0 || parts == 1));
    t->views[row].tp_dim = dim;
    t->views[row].tp_parts = parts;
}

size_t fl_params_vocab_rows(size_t V, int t) {
    size_t unit = 128 * (size_t)t;
    return (V + unit - 1) / unit * unit / (size_t)t;
}

void fl_params_slice(fl_param_table *local, const fl_param_table *whole, int t, int rank) {
    FL_ASSERT(t >= 1 && rank >= 0 && rank < t);
    memset(local, 0, sizeof *local);
    fl_params_reserve(local, whole->count);
    for (int r = 0; r < whole->count; r++) {
        fl_param_view v = whole->views[r];
        if (v.tp_dim >= 0) {
            size_t ext = v.shape[v.tp_dim];
            v.tp_global = ext;
            if (v.live_rows && v.tp_dim == 0) { // the vocabulary, padded for t ranks
                size_t per = fl_params_vocab_rows(v.live_rows, t), at = per * (size_t)rank;
                v.shape[0] = per;
                v.live_rows = v.live_rows > at ? v.live_rows - at : 0;
                if (v.live_rows > per) v.live_rows = per;
            } else {
                if (ext % ((size_t)v.tp_parts * t))
                    fl_die("tensor parallelism: %s's dimension %d (%zu) does not split into %d x "
                           "%d parts",
                           v.name, v.tp_dim, ext, v.tp_parts, t);
                v.shape[v.tp_dim] = ext / t;
            }
            v.numel = 1;
            for (int d = 0; d < v.ndim; d++) v.numel *= v.shape[d];
        }
        v.offset = local->numel;
        local->views[local->count++] = v;
        local->numel += v.numel;
    }
    local->tp_size = t;
    local->tp_rank = rank;
}

void fl_params_select(fl_param_table *local, const fl_param_table *from, const int *keep) {
    int n = 0;
    for (int r = 0; r < from->count; r++) n += keep[r] != 0;
    memset(local, 0, sizeof *local);
    fl_params_reserve(local, n);
    for (int r = 0; r < from->count; r++) {
        if (!keep[r]) continue;
        fl_param_view v = from->views[r];
        v.offset = local->numel;
        local->views[local->count++] = v;
        local->numel += v.numel;
    }
    local->tp_size = from->tp_size;
    local->tp_rank = from->tp_rank;
}

size_t fl_params_whole_numel(const fl_param_table *t, int row) {
    const fl_param_view *v = &t->views[row];
    if (t->tp_size <= 1 || v->tp_dim < 0) return v->numel;
    return v->numel / v->shape[v->tp_dim] * v->tp_global;
}

typedef struct {
    size_t lo, hi;
    fl_params_block_fn fn;
    void *ctx;
} block_clip;

// A block's elements inside [lo, hi): a partial first run, whole runs, a
// partial last run.
static void clip_block(const block_clip *c, size_t L, size_t F, size_t run, size_t stride,
                       size_t count) {
    size_t a = c->lo > L ? c->lo : L, b = c->hi < L + count ? c->hi : L + count;
    while (a < b) {
        size_t k = (a - L) / run, j = (a - L) % run, g = F + k * stride + j;
        if (j || b - a < run) { // within one run
            size_t end = L + (k + 1) * run < b ? L + (k + 1) * run : b;
            c->fn(c->ctx, a, g, end - a, stride, end - a);
            a = end;
        } else {
            size_t n = (b - a) / run * run;
            c->fn(c->ctx, a, g, run, stride, n);
            a += n;
        }
    }
}

void fl_params_blocks(const fl_param_table *t, int row, size_t lo, size_t hi, fl_params_block_fn fn,
                      void *ctx) {
    const fl_param_view *v = &t->views[row];
    block_clip c = {lo, hi < v->numel ? hi : v->numel, fn, ctx};
    if (t->tp_size <= 1 || v->tp_dim < 0) {
        clip_block(&c, 0, 0, v->numel, v->numel, v->numel);
    } else if (v->tp_dim == 1) { // each dim-0 index: a run of the rank's columns
        size_t cols = v->shape[1], inner = v->numel / (v->shape[0] * cols);
        clip_block(&c, 0, (size_t)t->tp_rank * cols * inner, cols * inner, v->tp_global * inner,
                   v->numel);
    } else { // each part: a run of the rank's dim-0 indices (fewer at vocabulary padding)
        size_t inner = v->numel / v->shape[0], per = v->shape[0] / (size_t)v->tp_parts;
        size_t gper = v->tp_global / (size_t)v->tp_parts, at = per * (size_t)t->tp_rank;
        size_t valid = gper > at ? (gper - at < per ? gper - at : per) : 0;
        for (int p = 0; p < v->tp_parts && valid; p++)
            clip_block(&c, p * per * inner, (p * gper + at) * inner, valid * inner, valid * inner,
                       valid * inner);
    }
}
