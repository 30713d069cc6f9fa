// schedule.c: pipeline parallelism's schedules (pipeline.h). Here only the
// names and the check of (kind, p, m, v) that the config checks read; the
// action lists and their validator come with branch pp-sched, whose file
// replaces this one.
#include <stdio.h>
#include <string.h>

#include "fitlm/pipeline.h"

static const char *const names[] = {"gpipe", "1f1b", "interleaved"}; // by FL_PP_*

int fl_pp_schedule_kind(const char *name) {
    for (int k = 0; k < 3; k++)
        if (!strcmp(name, names[k])) return k;
    return -1;
}

int fl_pp_schedule_check(int kind, int p, int m, int v, char *why, size_t n) {
    if (kind < 0 || kind > FL_PP_INTERLEAVED) {
        snprintf(why, n, "no schedule of kind %d", kind);
        return -1;
    }
    if (p < 1 || m < 1 || v < 1) {
        snprintf(why, n, "p %d, m %d and v %d must each be at least 1", p, m, v);
        return -1;
    }
    if (kind != FL_PP_INTERLEAVED && v != 1) {
        snprintf(why, n, "%s runs one chunk a rank (v 1), not v %d", names[kind], v);
        return -1;
    }
    if (kind == FL_PP_INTERLEAVED && v < 2) {
        snprintf(why, n, "interleaved takes v >= 2 chunks a rank, not v %d", v);
        return -1;
    }
    if (kind == FL_PP_INTERLEAVED && m % p) {
        snprintf(why, n,
                 "interleaved takes the micro-batches in groups of p: m %d is not a multiple "
                 "of p %d (%d %% %d = %d)",
                 m, p, m, p, m % p);
        return -1;
    }
    return 0;
}
