// stage.c: a pipeline stage's rows (model.h, fl_model_stage_table): the
// rows of the units its chunks run, in table order, so a stage is a table
// and a flat buffer of its own, and every loop over rows or ranges (the
// optimizer, ZeRO's shards, checkpoints by name) works on it unchanged.
#include <string.h>

#include "arch.h"

// Whether block l is in one of the stage's chunks.
static int holds_block(const fl_pp_stage *s, int l) {
    for (int c = 0; c < s->chunks; c++)
        if (l >= s->first[c] && l < s->first[c] + s->count[c]) return 1;
    return 0;
}

void fl_model_stage_table(fl_param_table *local, const fl_param_table *t,
                          const fl_model_config *cfg, const fl_pp_stage *s, int *row_global) {
    int L = cfg->n_layer, first = s->rank == 0, last = s->rank == s->size - 1;
    int *keep = fl_alloc(FL_MEM_WORKSPACE, (size_t)t->count * sizeof(int));
    int copy = -1; // the tied embedding's row the last stage copies
    for (int r = 0; r < t->count; r++) {
        int u = t->views[r].unit;
        keep[r] = u == FL_UNIT_EMBED ? first : u == FL_UNIT_HEAD(L) ? last : holds_block(s, u);
        // the LM head reads the embedding's first row when tied
        if (u == FL_UNIT_EMBED && r == 0 && cfg->tie_embeddings && last && !first)
            keep[r] = 1, copy = r;
    }
    fl_params_select(local, t, keep);
    // the copy only passes the head's gradient on: stage 0 computes its weight's
    if (copy >= 0) local->views[0].flags |= FL_PARAM_TIED_COPY | FL_PARAM_FROZEN;
    if (row_global)
        for (int r = 0, k = 0; r < t->count; r++)
            if (keep[r]) row_global[k++] = r;
    fl_free(keep);
}
