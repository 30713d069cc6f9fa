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

void fl_params_init_each(const fl_param_table *table, uint64_t seed, fl_params_sink sink,
                         void *ctx) {
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    float block[FL_PARAMS_INIT_CHUNK];
    for (int i = 0; i < table->count; i++) {
        const fl_param_view *v = &table->views[i];
        size_t row = v->numel / v->shape[0];
        size_t drawn = v->live_rows ? v->live_rows * row : v->numel;
        for (size_t j0 = 0; j0 < v->numel; j0 += FL_PARAMS_INIT_CHUNK) {
            size_t len =
                v->numel - j0 < FL_PARAMS_INIT_CHUNK ? v->numel - j0 : FL_PARAMS_INIT_CHUNK;
            for (size_t j = 0; j < len; j++)
                block[j] = v->init == FL_INIT_ONES     ? 1.0f
                           : j0 + j >= drawn           ? 0.0f
                           : v->init == FL_INIT_NORMAL ? v->std * fl_rng_normal(&rng)
                           : v->init == FL_INIT_UNIFORM
                               ? v->std * (2.0f * fl_rng_uniform(&rng) - 1.0f)
                               : 0.0f;
            sink(ctx, i, j0, block, len);
        }
    }
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
