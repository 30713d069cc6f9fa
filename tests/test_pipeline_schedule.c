// test_pipeline_schedule.c: pipeline parallelism's schedules (no MPI): the
// validator over every small (p, m, v) of gpipe, 1f1b and interleaved 1F1B;
// exact lists against ones worked out by hand from Megatron's loops; the
// in-flight bounds; the validator refusing broken lists; and the refusals
// of fl_pp_schedule_check.
#include <stdio.h>
#include <string.h>

#include "fitlm/pipeline.h"
#include "testlib.h"

enum { MAX_ACTIONS = 2 * 16 * 4 };

// "F0c0 F1c0 B0c0 ...": kind, micro-batch, chunk
static const char *list_text(const fl_pp_action *list, int count, char *buf, size_t n) {
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < count && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%c%dc%d", i ? " " : "",
                               list[i].kind == FL_PP_FORWARD ? 'F' : 'B', list[i].micro,
                               list[i].chunk);
    return buf;
}

static void check_list(int kind, int p, int m, int v, int rank, const char *want) {
    fl_pp_action list[MAX_ACTIONS];
    char got[2048];
    int count = fl_pp_schedule(kind, p, m, v, rank, list);
    list_text(list, count, got, sizeof got);
    t_check(count == 2 * m * v && strcmp(got, want) == 0,
            "%s p=%d m=%d v=%d rank %d:\n  got  %s\n  want %s", fl_pp_schedule_name(kind), p, m, v,
            rank, got, want);
}

// The list read as warm-up forwards, steady rounds of one forward and one
// backward, cool-down backwards (the first steady round's forward also comes
// before any backward): the three counts; a list of another shape fails.
static void check_phases(int p, int m, int rank, int warm, int steady, int cool) {
    fl_pp_action list[MAX_ACTIONS];
    int count = fl_pp_schedule(FL_PP_1F1B, p, m, 1, rank, list), w = 0;
    while (w < count && list[w].kind == FL_PP_FORWARD) w++;
    if (w < m) w--; // the first steady round's forward
    int s = m - w, shaped = 1;
    for (int i = 0; i < count; i++) {
        int forward = i < w || (i < w + 2 * s && (i - w) % 2 == 0);
        shaped &= (list[i].kind == FL_PP_FORWARD) == forward;
    }
    if (!shaped) w = s = -1;
    t_check(w == warm && s == steady && count - w - 2 * s == cool,
            "1f1b p=%d m=%d rank %d: warm-up/steady/cool-down %d/%d/%d, want %d/%d/%d", p, m, rank,
            w, s, count - w - 2 * s, warm, steady, cool);
}

static void test_names(void) {
    for (int k = FL_PP_GPIPE; k <= FL_PP_INTERLEAVED; k++)
        t_check(fl_pp_schedule_kind(fl_pp_schedule_name(k)) == k, "%s names schedule %d",
                fl_pp_schedule_name(k), k);
    t_check(fl_pp_schedule_kind("1F1B") == -1 && fl_pp_schedule_kind("zb") == -1,
            "other names are no schedule");
}

// Megatron's loops by hand. 1f1b p=4 m=8: warm-up min(p - r - 1, m).
// Interleaved p=2 m=4 v=2: forwards k = 0..7 take groups of p = 2 micro-
// batches through chunk 0 then chunk 1: (0,0) (1,0) (0,1) (1,1) (2,0) (3,0)
// (2,1) (3,1); backwards the same with the chunks reversed; warm-up
// 2(p - r - 1) + (v - 1)p = 4 on rank 0, 2 on rank 1.
static void test_exact_lists(void) {
    check_list(FL_PP_1F1B, 4, 8, 1, 0,
               "F0c0 F1c0 F2c0 F3c0 B0c0 F4c0 B1c0 F5c0 B2c0 F6c0 B3c0 F7c0 B4c0 B5c0 B6c0 B7c0");
    check_list(FL_PP_1F1B, 4, 8, 1, 3,
               "F0c0 B0c0 F1c0 B1c0 F2c0 B2c0 F3c0 B3c0 F4c0 B4c0 F5c0 B5c0 F6c0 B6c0 F7c0 B7c0");
    check_phases(4, 8, 0, 3, 5, 3);
    check_phases(4, 8, 1, 2, 6, 2);
    check_phases(4, 8, 3, 0, 8, 0);
    check_phases(4, 2, 0, 2, 0, 2); // warm-up capped at m
    check_list(FL_PP_GPIPE, 2, 3, 1, 1, "F0c0 F1c0 F2c0 B0c0 B1c0 B2c0");
    check_list(FL_PP_INTERLEAVED, 2, 4, 2, 0,
               "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0");
    check_list(FL_PP_INTERLEAVED, 2, 4, 2, 1,
               "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0");
    // one process holding every virtual stage: chunk after chunk per micro-batch
    check_list(FL_PP_INTERLEAVED, 1, 2, 2, 0, "F0c0 F0c1 B0c1 F1c0 B0c0 F1c1 B1c1 B1c0");
}

static void test_in_flight(void) {
    t_check(fl_pp_in_flight_bound(FL_PP_1F1B, 4, 8, 1, 0) == 4, "1f1b p=4 m=8: stage 0 holds 4");
    t_check(fl_pp_in_flight_bound(FL_PP_1F1B, 4, 2, 1, 0) == 2, "1f1b p=4 m=2: stage 0 holds 2");
    t_check(fl_pp_in_flight_bound(FL_PP_1F1B, 4, 8, 1, 3) == 1, "1f1b p=4 m=8: stage 3 holds 1");
    t_check(fl_pp_in_flight_bound(FL_PP_GPIPE, 4, 8, 1, 3) == 8, "gpipe p=4 m=8: stage 3 holds 8");
    t_check(fl_pp_in_flight_bound(FL_PP_INTERLEAVED, 2, 4, 2, 0) == 5,
            "interleaved p=2 m=4 v=2: rank 0 holds warm-up 4 + 1");
    t_check(fl_pp_in_flight_bound(FL_PP_INTERLEAVED, 4, 4, 2, 0) == 8,
            "interleaved p=4 m=4 v=2: rank 0's 11 capped at m v = 8");
    t_check(fl_pp_chunk_in_flight(FL_PP_1F1B, 4, 8, 1, 0, 0) == 4, "1f1b p=4 m=8 stage 0: 4 sets");
    // the lists of test_exact_lists: chunk 0 of rank 0 runs F0-F3 before B0
    t_check(fl_pp_chunk_in_flight(FL_PP_INTERLEAVED, 2, 4, 2, 0, 0) == 4 &&
                fl_pp_chunk_in_flight(FL_PP_INTERLEAVED, 2, 4, 2, 0, 1) == 2 &&
                fl_pp_chunk_in_flight(FL_PP_INTERLEAVED, 2, 4, 2, 1, 1) == 1,
            "interleaved p=2 m=4 v=2: chunk activation sets 4, 2 on rank 0, 1 on rank 1's last");
}

// Every (p <= 8, m <= 16, v <= 4) the check accepts: the validator passes,
// each chunk's forwards and backwards take the micro-batches in increasing
// order, the bound is reached (it is the schedule's, not a loose one), and
// no chunk needs more activation sets than the rank's bound.
static int check_sweep_case(int kind, int p, int m, int v) {
    char why[2048];
    if (!t_check(fl_pp_validate(kind, p, m, v, why, sizeof why) == 0, "%s", why)) return 0;
    int ok = 1;
    for (int r = 0; r < p; r++) {
        fl_pp_action list[MAX_ACTIONS];
        int count = fl_pp_schedule(kind, p, m, v, r, list), next[2][4] = {{0}}, now = 0, most = 0;
        for (int i = 0; i < count; i++) {
            ok &= list[i].micro == next[list[i].kind][list[i].chunk]++;
            now += list[i].kind == FL_PP_FORWARD ? 1 : -1;
            most = now > most ? now : most;
        }
        int bound = fl_pp_in_flight_bound(kind, p, m, v, r);
        ok &= most == bound;
        for (int c = 0; c < v; c++) {
            int sets = fl_pp_chunk_in_flight(kind, p, m, v, r, c);
            ok &= sets >= 1 && sets <= bound && sets <= m;
        }
        if (kind == FL_PP_1F1B) ok &= most == (p - r < m ? p - r : m);
    }
    return t_check(ok, "%s p=%d m=%d v=%d: micro-batch order, bound reached, activation sets",
                   fl_pp_schedule_name(kind), p, m, v);
}

static void test_sweep(void) {
    int accepted[3] = {0}, passed[3] = {0};
    char why[512];
    for (int kind = FL_PP_GPIPE; kind <= FL_PP_INTERLEAVED; kind++)
        for (int p = 1; p <= 8; p++)
            for (int m = 1; m <= 16; m++)
                for (int v = 1; v <= 4; v++) {
                    if (fl_pp_schedule_check(kind, p, m, v, why, sizeof why) != 0) continue;
                    accepted[kind]++;
                    passed[kind] += check_sweep_case(kind, p, m, v);
                }
    // gpipe and 1f1b: 8 x 16 (v = 1); interleaved: v = 2..4 and m a multiple
    // of p: 3 x (16 + 8 + 5 + 4 + 3 + 2 + 2 + 2)
    t_check(accepted[0] == 128 && accepted[1] == 128 && accepted[2] == 126,
            "the check accepts 128, 128, 126 cases: %d, %d, %d", accepted[0], accepted[1],
            accepted[2]);
    t_check(passed[0] == accepted[0] && passed[1] == accepted[1] && passed[2] == accepted[2],
            "every accepted case validates");
}

static void expect_refused(int kind, int p, int m, int v, const fl_pp_action *const *lists,
                           const int *counts, const char *want, const char *want_too) {
    char why[2048] = "";
    int rc = fl_pp_validate_lists(kind, p, m, v, lists, counts, why, sizeof why);
    t_check(rc == -1 && strstr(why, want) && strstr(why, want_too),
            "refused with '%s' and '%s': %s", want, want_too, why);
}

#define F(k)                                                                                       \
    { FL_PP_FORWARD, k, 0 }
#define B(k)                                                                                       \
    { FL_PP_BACKWARD, k, 0 }

// p = 2, m = 2, one chunk: 1f1b's lists pass; each broken copy is refused
// naming the schedule, the numbers, the rank and the action
static void test_validator_refuses(void) {
    fl_pp_action r0[] = {F(0), F(1), B(0), B(1)}, r1[] = {F(0), B(0), F(1), B(1)};
    const fl_pp_action *lists[] = {r0, r1};
    int counts[] = {4, 4};
    char why[512];
    t_check(fl_pp_validate_lists(FL_PP_1F1B, 2, 2, 1, lists, counts, why, sizeof why) == 0,
            "1f1b p=2 m=2 by hand passes");

    fl_pp_action early[] = {B(0), F(0), F(1), B(1)};
    lists[1] = early;
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts, "1f1b p=2 m=2 v=1: rank 1: action 0",
                   "backward of micro-batch 0 on chunk 0 (virtual stage 1), comes before its "
                   "forward");
    fl_pp_action twice[] = {F(0), B(0), F(0), B(1)};
    lists[1] = twice;
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts, "rank 1: action 2",
                   "forward of micro-batch 0 on chunk 0 (virtual stage 1), runs a second time");
    lists[1] = r1;
    counts[1] = 3;
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts, "rank 1: the backward of micro-batch 1",
                   "is missing");
    counts[1] = 4;
    fl_pp_action off[] = {F(0), B(0), F(2), B(1)};
    lists[1] = off;
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts, "rank 1: action 2",
                   "not a forward or backward of micro-batch 0..1");

    // rank 0 waits for rank 1's backward of 0; rank 1 for rank 0's forward of 1
    fl_pp_action cross0[] = {F(0), B(0), F(1), B(1)}, cross1[] = {F(1), B(1), F(0), B(0)};
    lists[0] = cross0;
    lists[1] = cross1;
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts,
                   "deadlock: rank 0 at action 1, the backward of micro-batch 0 on chunk 0 "
                   "(virtual stage 0), waits for the backward of virtual stage 1 (rank 1)",
                   "; rank 1 at action 0, the forward of micro-batch 1 on chunk 0 (virtual stage "
                   "1), waits for the forward of virtual stage 0 (rank 0)");

    // gpipe's lists: within gpipe's bound, above 1f1b's (rank 1 holds 1)
    fl_pp_action all0[] = {F(0), F(1), B(0), B(1)}, all1[] = {F(0), F(1), B(0), B(1)};
    lists[0] = all0;
    lists[1] = all1;
    t_check(fl_pp_validate_lists(FL_PP_GPIPE, 2, 2, 1, lists, counts, why, sizeof why) == 0,
            "gpipe's lists pass as gpipe");
    expect_refused(FL_PP_1F1B, 2, 2, 1, lists, counts,
                   "rank 1: 2 micro-batches in flight after action 1",
                   "above the schedule's bound of 1");
    expect_refused(FL_PP_INTERLEAVED, 2, 2, 1, lists, counts, "--virtual-stages 2 or more",
                   "got 1");
}

static void expect_check(int kind, int p, int m, int v, const char *want) {
    char why[512] = "";
    int rc = fl_pp_schedule_check(kind, p, m, v, why, sizeof why);
    t_check(rc == -1 && strstr(why, want), "%s p=%d m=%d v=%d refused with '%s': %s",
            fl_pp_schedule_name(kind), p, m, v, want, why);
}

static void schedule_bad_m(void *arg) {
    (void)arg;
    fl_pp_action list[MAX_ACTIONS];
    fl_pp_schedule(FL_PP_INTERLEAVED, 4, 6, 2, 0, list);
}

static void schedule_bad_rank(void *arg) {
    (void)arg;
    fl_pp_action list[MAX_ACTIONS];
    fl_pp_schedule(FL_PP_1F1B, 4, 6, 1, 4, list);
}

static void chunk_past_v(void *arg) {
    (void)arg;
    fl_pp_chunk_in_flight(FL_PP_INTERLEAVED, 2, 4, 2, 0, 2);
}

static void test_check_refusals(void) {
    expect_check(FL_PP_1F1B, 0, 4, 1, "--pipeline-parallel must be 1 or more, got 0");
    expect_check(FL_PP_1F1B, 2, 0, 1, "--grad-accum (gradient_accumulation_steps");
    expect_check(FL_PP_1F1B, 2, 0, 1, "must be 1 or more, got 0");
    expect_check(FL_PP_GPIPE, 2, 4, 0, "--virtual-stages must be 1 or more, got 0");
    expect_check(FL_PP_1F1B, 2, 4, 2,
                 "--pipeline-schedule 1f1b runs one chunk a rank: --virtual-stages must be 1, "
                 "got 2");
    expect_check(FL_PP_GPIPE, 2, 4, 3, "--pipeline-schedule gpipe runs one chunk a rank");
    expect_check(FL_PP_INTERLEAVED, 2, 4, 1,
                 "--pipeline-schedule interleaved needs --virtual-stages 2 or more, got 1");
    expect_check(FL_PP_INTERLEAVED, 4, 6, 2,
                 "--grad-accum (gradient_accumulation_steps) 6 must be a multiple of 4 "
                 "(Megatron's rule)");
    expect_check(7, 2, 4, 1, "no schedule number 7");
    t_dies("fl_pp_schedule refuses what the check refuses", schedule_bad_m, NULL,
           "must be a multiple of 4");
    t_dies("fl_pp_schedule refuses a rank past p", schedule_bad_rank, NULL,
           "rank 4 is not one of the 4 pipeline ranks");
    t_dies("fl_pp_chunk_in_flight refuses a chunk past v", chunk_past_v, NULL,
           "chunk 2 is not one of the 2 chunks a rank holds");
}

int main(void) {
    test_names();
    test_exact_lists();
    test_in_flight();
    test_sweep();
    test_validator_refuses();
    test_check_refusals();
    return t_report();
}
