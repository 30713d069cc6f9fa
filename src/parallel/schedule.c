// schedule.c: pipeline parallelism's schedules (the order each rank runs its
// forwards and backwards in) and the validator that runs every rank's list
// against the others'. Pure C: no communication happens here.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "fitlm/core.h"
#include "fitlm/pipeline.h"

static const char *const schedule_names[] = {"gpipe", "1f1b", "interleaved"};

int fl_pp_schedule_kind(const char *name) {
    for (int k = 0; k < 3; k++)
        if (strcmp(name, schedule_names[k]) == 0) return k;
    return -1;
}

const char *fl_pp_schedule_name(int kind) {
    return kind >= 0 && kind < 3 ? schedule_names[kind] : "unknown";
}

int fl_pp_schedule_check(int kind, int p, int m, int v, char *why, size_t n) {
    if (kind < 0 || kind > 2)
        return fl_errorf(why, n,
                         "--pipeline-schedule: no schedule number %d (gpipe, 1f1b, "
                         "interleaved)",
                         kind);
    const char *name = schedule_names[kind];
    if (p < 1) return fl_errorf(why, n, "--pipeline-parallel must be 1 or more, got %d", p);
    if (m < 1)
        return fl_errorf(why, n,
                         "--grad-accum (gradient_accumulation_steps, the micro-batches of a "
                         "pipeline step) must be 1 or more, got %d",
                         m);
    if (v < 1) return fl_errorf(why, n, "--virtual-stages must be 1 or more, got %d", v);
    if (kind != FL_PP_INTERLEAVED && v != 1)
        return fl_errorf(why, n,
                         "--pipeline-schedule %s runs one chunk a rank: --virtual-stages must be "
                         "1, got %d (--pipeline-schedule interleaved runs several)",
                         name, v);
    if (kind == FL_PP_INTERLEAVED && v < 2)
        return fl_errorf(why, n,
                         "--pipeline-schedule interleaved needs --virtual-stages 2 or more, got "
                         "%d (1: --pipeline-schedule 1f1b)",
                         v);
    if (kind == FL_PP_INTERLEAVED && m % p != 0)
        return fl_errorf(why, n,
                         "--pipeline-schedule interleaved takes the micro-batches in groups of "
                         "--pipeline-parallel %d: --grad-accum (gradient_accumulation_steps) %d "
                         "must be a multiple of %d (Megatron's rule)",
                         p, m, p);
    return 0;
}

// Warm-up forwards, before the steady rounds: 1f1b min(p - r - 1, m) (Megatron's
// forward_backward_pipelining_without_interleaving); interleaved
// 2(p - r - 1) + (v - 1)p capped at m v (its get_pp_rank_microbatches with
// microbatch_group_size_per_vp_stage = p); gpipe all of them.
static int warmup_count(int kind, int p, int m, int v, int rank) {
    int total = m * v, w = total;
    if (kind == FL_PP_1F1B) w = p - rank - 1;
    if (kind == FL_PP_INTERLEAVED) w = 2 * (p - rank - 1) + (v - 1) * p;
    return w < total ? w : total;
}

// The k-th forward (backward) of a rank: micro-batches in groups of p, each
// group through chunk 0, then chunk 1, ... (Megatron's get_model_chunk_id
// and get_microbatch_id_in_model_chunk); backwards take the same order with
// the chunks reversed. v = 1 gives micro-batch k on chunk 0.
static fl_pp_action nth_action(int direction, int p, int v, int k) {
    int in_group = k % (p * v), chunk = in_group / p;
    fl_pp_action a = {direction, k / (p * v) * p + in_group % p, chunk};
    if (direction == FL_PP_BACKWARD) a.chunk = v - 1 - chunk;
    return a;
}

int fl_pp_schedule(int kind, int p, int m, int v, int rank, fl_pp_action *out) {
    char why[512];
    if (fl_pp_schedule_check(kind, p, m, v, why, sizeof why) != 0) fl_die("%s", why);
    if (rank < 0 || rank >= p)
        fl_die("pipeline schedule: rank %d is not one of the %d pipeline ranks", rank, p);
    // warm-up forwards, steady rounds of one forward and the oldest pending
    // backward, cool-down backwards
    int total = m * v, w = warmup_count(kind, p, m, v, rank), count = 0;
    for (int k = 0; k < w; k++) out[count++] = nth_action(FL_PP_FORWARD, p, v, k);
    for (int k = w; k < total; k++) {
        out[count++] = nth_action(FL_PP_FORWARD, p, v, k);
        out[count++] = nth_action(FL_PP_BACKWARD, p, v, k - w);
    }
    for (int k = total - w; k < total; k++) out[count++] = nth_action(FL_PP_BACKWARD, p, v, k);
    return count;
}

int fl_pp_in_flight_bound(int kind, int p, int m, int v, int rank) {
    int total = m * v, bound = total; // gpipe: every forward before a backward
    if (kind == FL_PP_1F1B) bound = p - rank;
    if (kind == FL_PP_INTERLEAVED) bound = 2 * (p - rank - 1) + (v - 1) * p + 1;
    return bound < total ? bound : total;
}

int fl_pp_chunk_in_flight(int kind, int p, int m, int v, int rank, int chunk) {
    if (chunk < 0 || chunk >= v)
        fl_die("pipeline schedule: chunk %d is not one of the %d chunks a rank holds", chunk, v);
    fl_pp_action *list = fl_alloc(FL_MEM_OTHER, (size_t)2 * m * v * sizeof *list);
    int count = fl_pp_schedule(kind, p, m, v, rank, list), now = 0, most = 0;
    for (int i = 0; i < count; i++) {
        if (list[i].chunk != chunk) continue;
        now += list[i].kind == FL_PP_FORWARD ? 1 : -1;
        if (now > most) most = now;
    }
    fl_free(list);
    return most;
}

// ----------------------------------------------------------------------------
// validator

typedef struct {
    int kind, p, m, v;
    char *why;
    size_t n;
} check_ctx;

// why = "<kind> p=.. m=.. v=..: <message>"; returns -1
static int fail(const check_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const check_ctx *c, const char *fmt, ...) {
    if (c->n == 0) return -1;
    int at = snprintf(c->why, c->n, "%s p=%d m=%d v=%d: ", fl_pp_schedule_name(c->kind), c->p, c->m,
                      c->v);
    if (at >= 0 && (size_t)at < c->n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why + at, c->n - (size_t)at, fmt, ap);
        va_end(ap);
    }
    return -1;
}

// "forward of micro-batch 3 on chunk 1 (virtual stage 5)"
static const char *action_text(const check_ctx *c, int rank, fl_pp_action a, char *buf, size_t n) {
    snprintf(buf, n, "%s of micro-batch %d on chunk %d (virtual stage %d)",
             a.kind == FL_PP_FORWARD ? "forward" : "backward", a.micro, a.chunk,
             a.chunk * c->p + rank);
    return buf;
}

// One rank's list on its own: every action well-formed, each (micro-batch,
// chunk) forward and backward exactly once, each backward after its forward,
// the micro-batches in flight never above the bound. seen holds 2 m v ints.
static int check_rank(const check_ctx *c, int rank, const fl_pp_action *list, int count,
                      int *seen) {
    int m = c->m, v = c->v, bound = fl_pp_in_flight_bound(c->kind, c->p, m, v, rank), now = 0;
    char text[128];
    memset(seen, 0, (size_t)2 * m * v * sizeof *seen);
    for (int i = 0; i < count; i++) {
        fl_pp_action a = list[i];
        if ((a.kind != FL_PP_FORWARD && a.kind != FL_PP_BACKWARD) || a.micro < 0 || a.micro >= m ||
            a.chunk < 0 || a.chunk >= v)
            return fail(c,
                        "rank %d: action %d is kind %d, micro-batch %d, chunk %d: not a "
                        "forward or backward of micro-batch 0..%d on chunk 0..%d",
                        rank, i, a.kind, a.micro, a.chunk, m - 1, v - 1);
        action_text(c, rank, a, text, sizeof text);
        int *f = &seen[a.chunk * m + a.micro], *b = f + m * v;
        if (a.kind == FL_PP_FORWARD ? *f : *b)
            return fail(c, "rank %d: action %d, the %s, runs a second time", rank, i, text);
        if (a.kind == FL_PP_BACKWARD && !*f)
            return fail(c, "rank %d: action %d, the %s, comes before its forward", rank, i, text);
        if (a.kind == FL_PP_FORWARD)
            *f = 1;
        else
            *b = 1;
        now += a.kind == FL_PP_FORWARD ? 1 : -1;
        if (now > bound)
            return fail(c,
                        "rank %d: %d micro-batches in flight after action %d, the %s: above "
                        "the schedule's bound of %d",
                        rank, now, i, text, bound);
    }
    for (int i = 0; i < 2 * m * v; i++)
        if (!seen[i]) {
            fl_pp_action a = {i < m * v ? FL_PP_FORWARD : FL_PP_BACKWARD, i % m, i % (m * v) / m};
            return fail(c, "rank %d: the %s is missing", rank,
                        action_text(c, rank, a, text, sizeof text));
        }
    return 0;
}

// What action a of `rank` waits for and has not got yet: the virtual stage
// whose forward (backward) of the same micro-batch must have run; -1 when
// it can run. fwd and bwd: [stage * m + micro], 1 once run. A backward's
// own forward has run: check_rank put it earlier in the same list.
static int waits_for(const check_ctx *c, int rank, fl_pp_action a, const char *fwd,
                     const char *bwd) {
    int s = a.chunk * c->p + rank, last = c->p * c->v - 1;
    if (a.kind == FL_PP_FORWARD) return s > 0 && !fwd[(s - 1) * c->m + a.micro] ? s - 1 : -1;
    return s < last && !bwd[(s + 1) * c->m + a.micro] ? s + 1 : -1;
}

// Runs all ranks at once, each its list strictly in order, an action once
// what it receives has been sent (sends never block), until none can move.
static int simulate(const check_ctx *c, const fl_pp_action *const *lists, const int *counts,
                    char *fwd, char *bwd, int *pos) {
    int p = c->p, m = c->m, moved = 1;
    while (moved) {
        moved = 0;
        for (int r = 0; r < p; r++)
            while (pos[r] < counts[r] && waits_for(c, r, lists[r][pos[r]], fwd, bwd) < 0) {
                fl_pp_action a = lists[r][pos[r]++];
                char *done = a.kind == FL_PP_FORWARD ? fwd : bwd;
                done[(a.chunk * p + r) * m + a.micro] = 1;
                moved = 1;
            }
    }
    char stuck[1024] = "";
    size_t at = 0;
    int deadlock = 0;
    for (int r = 0; r < p; r++) {
        if (pos[r] == counts[r]) continue;
        deadlock = 1;
        fl_pp_action a = lists[r][pos[r]];
        int s = waits_for(c, r, a, fwd, bwd);
        char text[128];
        int w = snprintf(stuck + at, sizeof stuck - at,
                         "%srank %d at action %d, the %s, waits for the %s of virtual stage %d "
                         "(rank %d)",
                         at ? "; " : "", r, pos[r], action_text(c, r, a, text, sizeof text),
                         a.kind == FL_PP_FORWARD ? "forward" : "backward", s, s % p);
        if (w < 0 || (size_t)w >= sizeof stuck - at) break; // the first ones say enough
        at += (size_t)w;
    }
    return deadlock ? fail(c, "deadlock: %s", stuck) : 0;
}

int fl_pp_validate_lists(int kind, int p, int m, int v, const fl_pp_action *const *lists,
                         const int *counts, char *why, size_t n) {
    if (fl_pp_schedule_check(kind, p, m, v, why, n) != 0) return -1;
    check_ctx c = {kind, p, m, v, why, n};
    int *seen = fl_alloc(FL_MEM_OTHER, (size_t)2 * m * v * sizeof *seen);
    int rc = 0;
    for (int r = 0; r < p && rc == 0; r++) rc = check_rank(&c, r, lists[r], counts[r], seen);
    fl_free(seen);
    if (rc != 0) return rc;
    size_t cells = (size_t)p * v * m;
    char *fwd = fl_alloc(FL_MEM_OTHER, 2 * cells), *bwd = fwd + cells;
    int *pos = fl_alloc(FL_MEM_OTHER, (size_t)p * sizeof *pos);
    rc = simulate(&c, lists, counts, fwd, bwd, pos);
    fl_free(pos);
    fl_free(fwd);
    return rc;
}

int fl_pp_validate(int kind, int p, int m, int v, char *why, size_t n) {
    if (fl_pp_schedule_check(kind, p, m, v, why, n) != 0) return -1;
    size_t each = (size_t)2 * m * v;
    fl_pp_action *all = fl_alloc(FL_MEM_OTHER, (size_t)p * each * sizeof *all);
    const fl_pp_action **lists = fl_alloc(FL_MEM_OTHER, (size_t)p * sizeof *lists);
    int *counts = fl_alloc(FL_MEM_OTHER, (size_t)p * sizeof *counts);
    for (int r = 0; r < p; r++) {
        counts[r] = fl_pp_schedule(kind, p, m, v, r, all + r * each);
        lists[r] = all + r * each;
    }
    int rc = fl_pp_validate_lists(kind, p, m, v, lists, counts, why, n);
    fl_free(counts);
    fl_free(lists);
    fl_free(all);
    return rc;
}
