// test_reshard: sharded checkpoints of data-parallel runs (mpirun -np N
// fitlm train --zero-stage S) resume on any number of ranks, under any
// stage, and in one plain process, with the losses of the uninterrupted run;
// a single-file checkpoint resumes sharded; `fitlm export` gathers the
// shards; a failed save (injected full disk on one rank) stops every rank
// and leaves the previous checkpoint; a rank killed mid-run leaves the last
// complete checkpoint loadable; damaged or mismatched manifests and shards
// are clear errors; pruning spares another run's files. Tensor parallelism
// (mpirun -np N fitlm train --tensor-parallel t): a run saved at t = 2
// resumes at t = 1, t = 4, DP 4 and TP x DP (ZeRO inside, sequence
// parallel) with the tensors it saved, GPT-2 and LLaMA with grouped-query
// heads; its export gathers whole tensors; validation, the sample, saves
// and a resume under TP give one process's values; --tp-tcp (CTest's
// tp_tcp) runs one of its resumes over TCP, --tp the TP tests alone.
// Pipeline parallelism (--pp, CTest's pp_ckpt): a 3D run (t, p, d) =
// (2, 2, 2) loads under (1, 1, 1), (1, 4, 1), (2, 1, 2) and (1, 2, 2) the
// tensors it saved, bitwise; PP-only checkpoints continue as one process
// bitwise and export as it does.
//
// Tolerance: a run on another number of ranks sums each gradient in another
// order, so fp32 losses agree within 1e-5 (relative), and weights within
// 1.3e-3: AdamW moves a weight by about lr per step whatever its gradient's
// size, so an element whose gradient is ~0 may go either way (twice the sum
// of the 6 steps' lr, 6.3e-4); a misplaced piece would be off by the
// weights' own size (0.02). The same ranks and stage resume bit for bit.
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/comm.h"
#include "fitlm/config.h"
#include "fitlm/io.h"
#include "fitlm/run.h"
#include "fitlm/safetensors.h"
#include "testlib.h"

// (--peak-tflops: measuring the host's peak, 0.05 s a run, is test_metrics' subject)
#define TINY                                                                                       \
    "train --model tiny --data data/brown_byte --tokenizer byte --seq-len 32 --threads 1 "         \
    "--sample-tokens 0 --val-data none --peak-tflops 1"
#define SIX TINY " --steps 6 --save-every 3"

static char work[256];        // scratch directory
static char out[1 << 16];     // the last command's output
static double mpirun_seconds; // spent in commands

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *binary(void) {
    const char *b = getenv("FITLM_BINARY");
    return b ? b : "fitlm";
}

// Runs a shell command in the source tree (the data paths are relative),
// stdout and stderr into `out`. Returns its exit status (-1: no exit).
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[4096], full[4400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(full, sizeof full, "cd %s && { %s ; } 2>&1", t_source_path(""), cmd);
    double t0 = now();
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t got = fread(out, 1, sizeof out - 1, p);
    out[got] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int status = pclose(p);
    mpirun_seconds += now() - t0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// `fitlm ARGS` on np ranks (np 0: a plain process, no mpirun).
static int fitlm(int np, const char *args) {
    if (np == 0) return sh("%s %s", binary(), args);
    return sh("mpirun.openmpi -q --bind-to none -np %d %s %s", np, binary(), args);
}

static int fitlm_ok(int np, const char *args) {
    int rc = fitlm(np, args);
    t_check(rc == 0, "np %d: fitlm %s: status %d: %.1500s", np, args, rc, out);
    return rc == 0;
}

// Fails with status 1 saying `what` (and `also`, when given).
static void fitlm_fails(int np, const char *args, const char *what, const char *also) {
    int rc = fitlm(np, args);
    t_check(rc == 1 && strstr(out, "error:") && strstr(out, what) && (!also || strstr(out, also)),
            "np %d: fitlm %s should fail saying \"%s\"%s%s; status %d: %.1200s", np, args, what,
            also ? " and " : "", also ? also : "", rc, out);
}

// The losses of steps 1..max in DIR/log.txt (NAN where absent), as text
// (%.9g, exact) and as numbers.
typedef struct {
    char text[16][32];
    double v[16];
} losses;

static void read_losses(const char *dir, losses *l) {
    for (int i = 0; i < 16; i++) l->text[i][0] = 0, l->v[i] = NAN;
    char path[512];
    snprintf(path, sizeof path, "%s/%s/log.txt", work, dir);
    size_t n;
    char *text = (char *)t_read_file(path, &n);
    for (char *line = text; line && *line;) {
        int step;
        char loss[32];
        if (sscanf(line, "step %d loss %31s", &step, loss) == 2 && step >= 1 && step < 16) {
            snprintf(l->text[step], sizeof l->text[step], "%s", loss);
            l->v[step] = atof(loss);
        }
        char *nl = strchr(line, '\n');
        line = nl ? nl + 1 : NULL;
    }
    free(text);
}

// Steps [from, to] of run `got` against `want`: bitwise (exact) or within
// the relative tolerance.
static void same_losses(const char *what, const char *got_dir, const char *want_dir, int from,
                        int to, int exact, double rtol) {
    losses got, want;
    read_losses(got_dir, &got);
    read_losses(want_dir, &want);
    double worst = 0.0;
    int ok = 1;
    for (int s = from; s <= to; s++) {
        double d = fabs(got.v[s] - want.v[s]) / fabs(want.v[s]);
        if (!(d <= worst)) worst = d;
        if (exact ? strcmp(got.text[s], want.text[s]) != 0 || !*got.text[s] : !(d <= rtol)) ok = 0;
    }
    t_check(ok, "%s: steps %d-%d: losses %s those of %s (worst relative difference %.3g)", what,
            from, to, exact ? "bitwise equal to" : "within tolerance of", want_dir, worst);
    if (!ok)
        for (int s = from; s <= to; s++)
            printf("    step %d: %s vs %s\n", s, got.text[s], want.text[s]);
}

static int count_files(const char *dir, const char *part) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", work, dir);
    DIR *d = opendir(path);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strstr(e->d_name, part) != NULL;
    closedir(d);
    return n;
}

// The name of a file in DIR whose name holds both parts ("" when none).
static void find_file(const char *dir, const char *a, const char *b, char *name, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", work, dir);
    DIR *d = opendir(path);
    *name = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        if (strstr(e->d_name, a) && strstr(e->d_name, b) && strlen(e->d_name) < size)
            memcpy(name, e->d_name, strlen(e->d_name) + 1);
    if (d) closedir(d);
}

static void latest_is(const char *dir, const char *want) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/latest", work, dir);
    size_t n;
    char *text = (char *)t_read_file(path, &n);
    t_check(text && !strncmp(text, want, strlen(want)), "%s/latest names %s (it says %s)", dir,
            want, text ? text : "nothing");
    free(text);
}

// The worst differences of the tensors of checkpoint b whose names start
// with `prefix` from checkpoint a's: elementwise (max |a - b|) and per
// tensor (|a - b| / |b|, 2-norms).
static void tensors_diff(const char *a_path, const char *b_path, const char *prefix,
                         double *max_abs, double *max_rel) {
    fl_ckpt *a = fl_ckpt_open(a_path), *b = fl_ckpt_open(b_path);
    *max_abs = *max_rel = 0.0;
    for (int i = 0; i < fl_ckpt_tensor_count(b); i++) {
        const char *name = fl_ckpt_tensor_name(b, i);
        if (strncmp(name, prefix, strlen(prefix))) continue;
        size_t n = fl_ckpt_numel(b, name);
        float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
        fl_ckpt_read(a, name, FL_F32, x, n);
        fl_ckpt_read(b, name, FL_F32, y, n);
        double d2 = 0.0, y2 = 0.0;
        for (size_t k = 0; k < n; k++) {
            double d = fabs((double)x[k] - y[k]);
            *max_abs = fmax(*max_abs, d);
            d2 += d * d;
            y2 += (double)y[k] * y[k];
        }
        if (d2 > 0.0) *max_rel = fmax(*max_rel, y2 > 0.0 ? sqrt(d2 / y2) : INFINITY);
        free(x);
        free(y);
    }
    fl_ckpt_close(a);
    fl_ckpt_close(b);
}

// Max |a - b| of the weights ("model/<row>") of two checkpoints.
static double weights_diff(const char *a_path, const char *b_path) {
    double abs, rel;
    tensors_diff(a_path, b_path, "model/", &abs, &rel);
    return abs;
}

// ----------------------------------------------------------------------------

// One process, single-file checkpoints (the reference), and 4 ranks of
// ZeRO-2, sharded: the same losses; the files are what they should be.
static void test_layouts(void) {
    char args[1024];
    snprintf(args, sizeof args, SIX " --batch 8 --out %s/d1", work);
    fitlm_ok(0, args);
    snprintf(args, sizeof args, SIX " --batch 2 --zero-stage 2 --out %s/d4", work);
    fitlm_ok(4, args);
    t_check(count_files("d1", ".rank") == 0 && count_files("d1", ".fitlm") == 2,
            "one process writes single files (%d shard files)", count_files("d1", ".rank"));
    t_check(count_files("d4", "-of-4.fitlm") == 8 && count_files("d4", ".fitlm") == 10,
            "4 ranks of ZeRO-2 write a manifest and 4 shard files per checkpoint (%d shard "
            "files)",
            count_files("d4", "-of-4.fitlm"));
    latest_is("d4", "ckpt_00000006.fitlm");
    same_losses("4 ranks x batch 2 (ZeRO-2) vs 1 x 8", "d4", "d1", 1, 6, 0, 1e-5);
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/d4", work);
    snprintf(b, sizeof b, "%s/d1", work);
    double d = weights_diff(a, b);
    t_check(d <= 1.3e-3, "the sharded checkpoint's gathered weights equal one process's (%.3g)", d);
}

// Resumes of the step-3 checkpoints on other worlds and stages.
static void test_resume(void) {
    static const struct {
        int np, batch, stage;
        const char *from, *dir;
        int exact;
    } cases[] = {
        {4, 2, 2, "d4", "same4", 1}, // the same world and stage: bit for bit
        {2, 4, 3, "d4", "r2z3", 0},  // 4 -> 2 ranks, ZeRO-2 -> ZeRO-3
        {0, 8, 0, "d4", "r1", 0},    // 4 ranks -> one plain process
        {2, 4, 0, "d4", "r2ddp", 0}, // 4 -> 2 ranks of DDP (which writes single files)
        {4, 2, 1, "d1", "r4z1", 0},  // a single file -> 4 ranks of ZeRO-1
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[1024], what[128];
        snprintf(args, sizeof args,
                 TINY " --resume %s/%s/ckpt_00000003.fitlm --batch %d --zero-stage %d --out %s/%s",
                 work, cases[i].from, cases[i].batch, cases[i].stage, work, cases[i].dir);
        snprintf(what, sizeof what, "%s (%d ranks, stage %d) from %s", cases[i].dir, cases[i].np,
                 cases[i].stage, cases[i].from);
        if (fitlm_ok(cases[i].np, args))
            same_losses(what, cases[i].dir, cases[i].from, 4, 6, cases[i].exact, 1e-5);
    }
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/same4", work);
    snprintf(b, sizeof b, "%s/d4", work);
    t_check(weights_diff(a, b) == 0.0, "the same ranks resumed end with the same weights, bitwise");
    t_check(count_files("r2ddp", ".rank") == 0 && count_files("r2ddp", ".fitlm") == 1,
            "DDP over 2 ranks writes a single file (rank 0)");
    t_check(count_files("r2z3", "-of-2.fitlm") == 2, "ZeRO-3 over 2 ranks writes 2 shard files");
    // back from 2 ranks to 4, in bf16 (the fp32 master is what is sharded)
    char args[1024];
    snprintf(args, sizeof args, SIX " --precision bf16 --batch 4 --zero-stage 1 --out %s/b2", work);
    fitlm_ok(2, args);
    snprintf(args, sizeof args,
             TINY " --resume %s/b2/ckpt_00000003.fitlm --batch 2 --zero-stage 3 --out %s/b4", work,
             work);
    if (fitlm_ok(4, args))
        same_losses("bf16, 2 ranks (ZeRO-1) -> 4 (ZeRO-3)", "b4", "b2", 4, 6, 0, 2e-3);
    // saved by 4 ranks of ZeRO-3 (each rank's 16-bit shard) and by 4 of
    // ZeRO-1, resumed on one process and on 2 ranks of another stage
    snprintf(args, sizeof args, SIX " --batch 2 --zero-stage 3 --out %s/z3", work);
    if (fitlm_ok(4, args))
        same_losses("4 ranks x batch 2 (ZeRO-3) vs 1 x 8", "z3", "d1", 1, 6, 0, 1e-5);
    static const struct {
        int np, batch, stage;
        const char *from, *step, *dir, *want;
        int last;
    } more[] = {
        {0, 8, 0, "z3", "3", "z3r1", "d1", 6},    // 4 ranks of ZeRO-3 -> one process
        {2, 4, 1, "z3", "3", "z3r2z1", "d1", 6},  // -> 2 ranks of ZeRO-1
        {0, 8, 0, "r4z1", "6", "z1r1", "d1x", 8}, // 4 ranks of ZeRO-1 (step 6) -> one process
    };
    // the reference for steps 7-8: one process continuing its own step 6
    snprintf(args, sizeof args, TINY " --resume %s/d1/ckpt_00000006.fitlm --steps 8 --out %s/d1x",
             work, work);
    fitlm_ok(0, args);
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
        char what[128];
        snprintf(args, sizeof args,
                 TINY " --resume %s/%s/ckpt_0000000%s.fitlm --batch %d --zero-stage %d --steps %d "
                      "--out %s/%s",
                 work, more[i].from, more[i].step, more[i].batch, more[i].stage, more[i].last, work,
                 more[i].dir);
        snprintf(what, sizeof what, "%s (%d ranks, stage %d) from %s", more[i].dir, more[i].np,
                 more[i].stage, more[i].from);
        if (fitlm_ok(more[i].np, args))
            same_losses(what, more[i].dir, more[i].want, atoi(more[i].step) + 1, more[i].last, 0,
                        1e-5);
    }
    // a position of 24 windows cannot be split over 5 ranks
    snprintf(args, sizeof args, TINY " --resume %s/d4/ckpt_00000003.fitlm --out %s/r5", work, work);
    fitlm_fails(5, args, "cannot split evenly", "ckpt_00000003.fitlm");
}

// `fitlm export` of a sharded checkpoint: the gathered fp32 weights, the
// same as the checkpoint's (bitwise) and as one process's (within tolerance).
static void test_export(void) {
    char args[1024];
    snprintf(args, sizeof args, "export %s/d4 -o %s/hf4", work, work);
    if (!fitlm_ok(0, args)) return;
    char path[512];
    snprintf(path, sizeof path, "%s/hf4/model.safetensors", work);
    fl_safetensors st;
    fl_safetensors_open(&st, path);
    snprintf(path, sizeof path, "%s/d4", work);
    fl_ckpt *ck = fl_ckpt_open(path);
    int same = 1, n = 0;
    const char *rows[] = {"wte.weight", "h.1.mlp.c_proj.bias", "ln_f.weight"};
    for (int i = 0; i < 3; i++) {
        char name[128], hf[128];
        snprintf(name, sizeof name, "model/%s", rows[i]);
        snprintf(hf, sizeof hf, "transformer.%s", rows[i]);
        const fl_st_tensor *t = fl_safetensors_find(&st, hf);
        size_t numel = fl_ckpt_numel(ck, name);
        if (!t || !numel || t->dtype != FL_F32 || t->numel > numel) {
            same = 0;
            continue;
        }
        float *want = malloc(numel * sizeof(float));
        fl_ckpt_read(ck, name, FL_F32, want, numel);
        // wte's rows past the vocabulary (padding) are not exported
        same &= !memcmp(st.data + t->begin, want, t->numel * sizeof(float));
        n++;
        free(want);
    }
    t_check(same && n == 3, "the export of a sharded checkpoint holds its weights (%d tensors)", n);
    fl_ckpt_close(ck);
    fl_safetensors_free(&st);
}

// A sharded checkpoint holds its run's tokenizer in the manifest, with the
// meta: export writes it from there, whatever became of the file the run
// read (issue 42).
static void test_tokenizer_in_manifest(void) {
    sh("mkdir -p %s/tok && cp tests/fixtures/hf_tokenizer_97/tokenizer.json %s/tok/ && "
       "head -c 30000 data/brown.txt > %s/tok.txt",
       work, work, work);
    char args[2048];
    snprintf(args, sizeof args,
             "tokenize %s/tok.txt -o %s/tokdata --tokenizer hf --tokenizer-path %s/tok "
             "--val-fraction 0",
             work, work, work);
    if (!fitlm_ok(0, args)) return;
    snprintf(args, sizeof args,
             "train --model tiny --data %s/tokdata --tokenizer hf --tokenizer-path %s/tok "
             "--seq-len 32 --threads 1 --sample-tokens 0 --val-data none --steps 1 "
             "--zero-stage 2 --out %s/hz",
             work, work, work);
    if (!fitlm_ok(2, args)) return;
    sh("echo '{\"model\": 1}' > %s/tok/tokenizer.json", work); // changed after training
    snprintf(args, sizeof args, "export %s/hz -o %s/hzhf", work, work);
    if (!fitlm_ok(0, args)) return;
    size_t n, m, k = 0;
    unsigned char *want =
        t_read_file(t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json"), &n);
    char path[512];
    snprintf(path, sizeof path, "%s/hzhf/tokenizer.json", work);
    unsigned char *got = t_read_file(path, &m);
    snprintf(path, sizeof path, "%s/hz", work);
    fl_ckpt *ck = fl_ckpt_open(path);
    uint8_t *stored = fl_ckpt_file_read(ck, "tokenizer/tokenizer.json", &k);
    t_check(fl_ckpt_shards(ck) == 2 && stored && k == n && !memcmp(stored, want, n) && got &&
                m == n && !memcmp(got, want, n),
            "the sharded checkpoint's manifest holds the tokenizer trained with, and export "
            "writes it (%zu, %zu, %zu bytes)",
            n, k, m);
    fl_free(stored);
    fl_ckpt_close(ck);
    free(want);
    free(got);
}

// A copy of run `from` to damage.
static void copy_of(const char *from, const char *name) {
    sh("rm -rf %s/%s && cp -r %s/%s %s/%s && rm -f %s/%s/.lock", work, name, work, from, work, name,
       work, name);
}

// A copy of run `from` as `name` without one shard file of its step-6
// checkpoint (the one whose name has `rank`, e.g. "rank1-of-2"), named in shard.
static void copy_without_shard(const char *from, const char *name, const char *rank, char *shard,
                               size_t size) {
    copy_of(from, name);
    find_file(name, "ckpt_00000006.", rank, shard, size);
    sh("rm -f %s/%s/%s", work, name, shard);
}

// Damaged or mismatched files: a clear error naming the file, status 1.
static void test_damage(void) {
    char args[1024], shard[128], path[512], other[128];
    // a bad manifest: a flipped byte in its header
    copy_of("d4", "bad1");
    snprintf(path, sizeof path, "%s/bad1/ckpt_00000006.fitlm", work);
    size_t n;
    unsigned char *m = t_read_file(path, &n);
    if (m && n > 40) {
        m[40] ^= 0x20;
        t_write_file(path, m, n);
    }
    free(m);
    snprintf(args, sizeof args, TINY " --resume %s/bad1 --steps 9", work);
    fitlm_fails(0, args, "ckpt_00000006.fitlm", "corrupt");
    snprintf(args, sizeof args, "export %s/bad1 -o %s/hfbad", work, work);
    fitlm_fails(0, args, "ckpt_00000006.fitlm", "corrupt");
    // a missing shard file, on 2 ranks
    copy_without_shard("d4", "bad2", "rank2-of-4", shard, sizeof shard);
    snprintf(args, sizeof args, TINY " --resume %s/bad2 --steps 9", work);
    fitlm_fails(2, args, shard, "missing");
    // a shard of another step under this step's name
    copy_of("d4", "bad3");
    find_file("bad3", "ckpt_00000006.", "rank1-of-4", shard, sizeof shard);
    find_file("bad3", "ckpt_00000003.", "rank1-of-4", other, sizeof other);
    sh("cp %s/bad3/%s %s/bad3/%s", work, other, work, shard);
    snprintf(args, sizeof args, TINY " --resume %s/bad3 --steps 9", work);
    fitlm_fails(0, args, shard, "step 3");
    // a shard of another run (r4z1: 4 ranks, step 6, d1's run)
    copy_of("d4", "bad4");
    find_file("bad4", "ckpt_00000006.", "rank3-of-4", shard, sizeof shard);
    find_file("r4z1", "ckpt_00000006.", "rank3-of-4", other, sizeof other);
    sh("cp %s/r4z1/%s %s/bad4/%s", work, other, work, shard);
    snprintf(args, sizeof args, "export %s/bad4 -o %s/hfbad", work, work);
    fitlm_fails(0, args, shard, "of run");
    // a flipped bit in a shard's data: the tensor's CRC-32
    copy_of("d4", "bad5");
    find_file("bad5", "ckpt_00000006.", "rank0-of-4", shard, sizeof shard);
    snprintf(path, sizeof path, "%s/bad5/%s", work, shard);
    m = t_read_file(path, &n);
    size_t data = m && n > 28 ? 28 + (size_t)fl_get_u32(m + 12) : n; // past prefix and header
    if (data + 100 < n) { // the first tensor: weights, which export reads
        m[data + 10] ^= 1;
        t_write_file(path, m, n);
    }
    free(m);
    snprintf(args, sizeof args, "export %s/bad5 -o %s/hfbad", work, work);
    fitlm_fails(0, args, shard, "corrupt");
    // one shard file on its own is not a checkpoint
    snprintf(args, sizeof args, "export %s/bad5/%s -o %s/hfbad", work, shard, work);
    fitlm_fails(0, args, "rank 0's shard", "ckpt_00000006.fitlm");
}

// A full disk on rank 1 at the step-4 save: every rank stops, naming rank
// 1 and its file; `latest` still names step 2; nothing of step 4 is left;
// the run resumes from there.
static void test_failed_save(void) {
    char args[1024];
    snprintf(args, sizeof args,
             "mpirun.openmpi -q --bind-to none -np 2 -x FITLM_CKPT_FAULT=1:4 %s " TINY
             " --steps 6 --save-every 2 --batch 4 --zero-stage 1 --out %s/f",
             binary(), work);
    int rc = sh("%s", args);
    t_check(rc != 0 && strstr(out, "rank 1 could not write") && strstr(out, "rank1-of-2.fitlm") &&
                strstr(out, "No space left on device"),
            "a full disk on rank 1 stops the run naming the rank and file (status %d): %.1200s", rc,
            out);
    latest_is("f", "ckpt_00000002.fitlm");
    t_check(count_files("f", "ckpt_00000004") == 0 && count_files("f", ".tmp") == 0,
            "the failed save left no file of step 4 and no temporary file (%d, %d)",
            count_files("f", "ckpt_00000004"), count_files("f", ".tmp"));
    snprintf(args, sizeof args, TINY " --resume %s/f --batch 4 --zero-stage 1", work);
    if (fitlm_ok(2, args)) latest_is("f", "ckpt_00000006.fitlm");
}

// The pid of rank `rank` of the job started by mpirun `parent`, 0 if none.
static pid_t rank_pid(pid_t parent, int rank) {
    DIR *d = opendir("/proc");
    char want[64], path[300], buf[1 << 15];
    int wlen = snprintf(want, sizeof want, "OMPI_COMM_WORLD_RANK=%d", rank);
    pid_t found = 0;
    for (struct dirent *e; d && !found && (e = readdir(d));) {
        if (!isdigit((unsigned char)e->d_name[0])) continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY), ppid = 0;
        ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) close(fd);
        buf[n > 0 ? n : 0] = 0;
        char *paren = strrchr(buf, ')');
        if (!paren || sscanf(paren + 1, " %*c %d", &ppid) != 1 || ppid != parent) continue;
        snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
        fd = open(path, O_RDONLY);
        n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) close(fd);
        for (ssize_t i = 0; i < n; i += (ssize_t)strlen(buf + i) + 1)
            if (!strncmp(buf + i, want, (size_t)wlen) && buf[i + wlen] == 0)
                found = (pid_t)atoi(e->d_name);
    }
    if (d) closedir(d);
    return found;
}

// The step `latest` names in DIR, or -1.
static int latest_step(const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/latest", work, dir);
    size_t n;
    char *text = (char *)t_read_file(path, &n);
    int step = -1;
    if (!text || sscanf(text, "ckpt_%d.fitlm", &step) != 1) step = -1;
    free(text);
    return step;
}

// A rank killed (SIGKILL) while the run saves at every step: the last
// complete checkpoint loads and the run resumes from it; the resumed run's
// pruning then removes what the killed save left.
static void test_kill(int victim) {
    char dir[16], cmd[2048];
    snprintf(dir, sizeof dir, "k%d", victim);
    snprintf(cmd, sizeof cmd,
             "exec mpirun.openmpi -q --bind-to none -np 2 %s " TINY
             " --steps 100000 --save-every 1 --batch 4 --zero-stage 2 --out %s/%s >%s/%s.log 2>&1",
             binary(), work, dir, work, dir);
    fflush(stdout);
    double t0 = now();
    pid_t job = fork();
    if (job == 0) {
        if (chdir(t_source_path("")) != 0) _exit(126);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    // wait for a few checkpoints, then kill the rank in the middle of one
    pid_t pid = 0;
    while (now() - t0 < 60 && (latest_step(dir) < 3 || !(pid = rank_pid(job, victim))))
        usleep(20000);
    int killed = pid > 0 && kill(pid, SIGKILL) == 0;
    int status = 0;
    for (double t1 = now(); waitpid(job, &status, WNOHANG) == 0;) {
        if (now() - t1 > 30) kill(job, SIGKILL); // never hangs the test
        usleep(20000);
    }
    mpirun_seconds += now() - t0;
    t_check(killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0),
            "rank %d of a run saving at every step killed after step %d (mpirun status %d)", victim,
            latest_step(dir), status);
    int step = latest_step(dir);
    char args[1024];
    snprintf(args, sizeof args, TINY " --resume %s/%s --steps %d --batch 4 --zero-stage 2", work,
             dir, step + 2);
    if (fitlm_ok(2, args)) {
        t_check(strstr(out, "resumed from step") != NULL, "resumed from the last checkpoint");
        // every shard file left belongs to a manifest: 2 per kept checkpoint
        int manifests = count_files(dir, ".fitlm") - count_files(dir, ".rank");
        t_check(count_files(dir, ".rank") == 2 * manifests && count_files(dir, ".tmp") == 0,
                "after the resume: %d shard files for %d checkpoints, %d temporary files",
                count_files(dir, ".rank"), manifests, count_files(dir, ".tmp"));
    }
}

// A run started over another in the same directory (--overwrite) prunes its
// own checkpoints only: the other's step-6 checkpoint stays whole.
static void test_prune(void) {
    char args[1024];
    snprintf(args, sizeof args, SIX " --batch 4 --zero-stage 3 --out %s/p", work);
    fitlm_ok(2, args);
    snprintf(args, sizeof args,
             TINY " --steps 4 --save-every 1 --batch 4 --zero-stage 1 --seed 7 --overwrite --out "
                  "%s/p",
             work);
    fitlm_ok(2, args);
    latest_is("p", "ckpt_00000004.fitlm");
    t_check(count_files("p", "ckpt_00000001") == 0 && count_files("p", "ckpt_00000002") == 0,
            "the new run pruned its own old checkpoints");
    snprintf(args, sizeof args, "export %s/p/ckpt_00000006.fitlm -o %s/hfp", work, work);
    fitlm_ok(0, args); // the other run's checkpoint, shards included, is intact
}

// The validation lines ("step N val LOSS") of a run's log.txt.
static void val_lines(const char *dir, char *out, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/log.txt", work, dir);
    size_t n, k = 0;
    char *text = (char *)t_read_file(path, &n);
    out[0] = 0;
    for (char *line = text; line && *line && k < size;) {
        char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) + 1 : strlen(line);
        if (strstr(line, " val ") && strstr(line, " val ") < line + len)
            k += (size_t)snprintf(out + k, size - k, "%.*s", (int)len, line);
        line = nl ? nl + 1 : NULL;
    }
    free(text);
}

// Validation under data parallelism: the ranks share the evaluation batches
// of the whole step's batch, the windows one process with the global batch
// evaluates: the same losses (to print precision), 3 batches over 2 and 4 ranks.
static void test_eval(void) {
    char args[1024], one[512], two[512], four[512];
    const char *eval = " --steps 4 --eval-every 2 --eval-iters 3 --val-data data/brown_byte";
    snprintf(args, sizeof args, TINY "%s --batch 8 --out %s/e1", eval, work);
    fitlm_ok(0, args);
    snprintf(args, sizeof args, TINY "%s --batch 4 --zero-stage 3 --out %s/e2", eval, work);
    fitlm_ok(2, args);
    snprintf(args, sizeof args, TINY "%s --batch 2 --out %s/e4", eval, work);
    fitlm_ok(4, args);
    val_lines("e1", one, sizeof one);
    val_lines("e2", two, sizeof two);
    val_lines("e4", four, sizeof four);
    t_check(*one && !strcmp(one, two) && !strcmp(one, four),
            "validation on 2 (ZeRO-3) and 4 ranks (DDP) = one process:\n%s---\n%s---\n%s", one, two,
            four);
}

// ----------------------------------------------------------------------------
// Tensor parallelism: each rank saves its slices as strided pieces of the
// whole rows under their global names, so a run saved at t = 2 resumes at
// t = 1, t = 4, DP 4 and TP x DP, ZeRO inside, with no conversion step.

// GPT-2 (tiny: 4 heads) and LLaMA with grouped-query heads (8 query, 4 KV:
// t = 4 splits both), each run's model flags.
static const char *const tp_model[2] = {
    "", " --arch llama --n-head 8 --n-kv-head 4 --intermediate-size 128"};

// The checkpoint of step `step` in run DIR, as a path.
static void ckpt_path(char *path, size_t size, const char *dir, int step) {
    snprintf(path, size, "%s/%s/ckpt_%08d.fitlm", work, dir, step);
}

// A model saved at t = 2 (its step-3 checkpoint), resumed on other layouts:
// the loaded tensors are the saved ones bitwise (a resume at lr 0 saves
// them back after a step that moves nothing), and the continuation is the
// uninterrupted run's (bitwise on the same layout). The step-6 weights and
// AdamW moments are the uninterrupted run's within the bounds above (the
// moments within 1e-4 of their size: a misplaced slice is off by its whole
// size). `tcp`: the cases the TCP transport runs (CTest's tp_tcp) alone.
static void test_tp_resume(int llama, int tcp) {
    const char *m = tp_model[llama], *arch = llama ? "llama" : "gpt2";
    char args[1024], from[512], a[512], b[512], what[256];
    char saved[8];
    snprintf(saved, sizeof saved, "%ct2", arch[0]);
    snprintf(args, sizeof args, SIX "%s --batch 8 --tensor-parallel 2 --out %s/%s", m, work, saved);
    if (!fitlm_ok(2, args)) return;
    t_check(count_files(saved, "-of-2.fitlm") == 4 && count_files(saved, ".fitlm") == 6,
            "%s at t = 2 writes a manifest and 2 shard files per checkpoint (%d shard files)", arch,
            count_files(saved, "-of-2.fitlm"));
    ckpt_path(from, sizeof from, saved, 3);
    static const struct {
        int np;
        const char *flags, *dir;
        int exact, lr0, gpt2_only, tcp;
    } cases[] = {
        {2, "--tensor-parallel 2 --batch 8", "same", 1, 0, 0, 0},
        {0, "--tensor-parallel 1 --batch 8", "t1", 0, 1, 0, 0},
        {4, "--tensor-parallel 4 --batch 8", "t4", 0, 1, 0, 0},
        {4, "--tensor-parallel 1 --batch 2 --zero-stage 1", "dp4z1", 0, 0, 1, 0},
        {4, "--tensor-parallel 1 --batch 2 --zero-stage 3", "dp4z3", 0, 1, 0, 0},
        {4, "--tensor-parallel 2 --batch 4 --zero-stage 1 --sequence-parallel", "tdz1", 0, 0, 0, 1},
        {4, "--tensor-parallel 2 --batch 4 --zero-stage 3", "tdz3", 0, 0, 1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if ((llama && cases[i].gpt2_only) || (tcp && !cases[i].tcp)) continue;
        char dir[32];
        snprintf(dir, sizeof dir, "%c%s", arch[0], cases[i].dir);
        char where[32] = "in one process";
        if (cases[i].np) snprintf(where, sizeof where, "on %d ranks", cases[i].np);
        snprintf(what, sizeof what, "%s saved at t = 2, resumed %s with %s", arch, where,
                 cases[i].flags);
        snprintf(args, sizeof args, TINY "%s --resume %s %s --out %s/%s", m, from, cases[i].flags,
                 work, dir);
        if (!fitlm_ok(cases[i].np, args)) continue;
        same_losses(what, dir, saved, 4, 6, cases[i].exact, 1e-5);
        double wd, wrel, md, mrel;
        ckpt_path(a, sizeof a, dir, 6);
        ckpt_path(b, sizeof b, saved, 6);
        tensors_diff(a, b, "model/", &wd, &wrel);
        tensors_diff(a, b, "optim/", &md, &mrel);
        if (cases[i].exact)
            t_check(wd == 0.0 && md == 0.0,
                    "%s: the step-6 weights and moments bitwise (%.3g, %.3g)", what, wd, md);
        else
            t_check(wd <= 1.3e-3 && mrel <= 1e-4,
                    "%s: the step-6 weights within 1.3e-3 (%.3g), the moments within 1e-4 "
                    "relative (%.3g)",
                    what, wd, mrel);
        if (!cases[i].lr0) continue;
        // one step at lr 0 and its checkpoint: the tensors this layout loaded
        snprintf(args, sizeof args, TINY "%s --resume %s %s --steps 4 --lr 0 --out %s/%s0", m, from,
                 cases[i].flags, work, dir);
        if (!fitlm_ok(cases[i].np, args)) continue;
        snprintf(a, sizeof a, "%s/%s0/ckpt_00000004.fitlm", work, dir);
        tensors_diff(a, from, "model/", &wd, &wrel);
        t_check(wd == 0.0, "%s: loads the saved weights bitwise (%.3g)", what, wd);
    }
}

// Every tensor of safetensors file b in a with the same shape; the worst
// |a - b|.
static double st_diff(const char *a_dir, const char *b_dir, int *same_shapes) {
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s/model.safetensors", work, a_dir);
    snprintf(pb, sizeof pb, "%s/%s/model.safetensors", work, b_dir);
    fl_safetensors x, y;
    fl_safetensors_open(&x, pa);
    fl_safetensors_open(&y, pb);
    double worst = 0.0;
    *same_shapes = x.count == y.count && y.count > 0;
    for (int i = 0; i < y.count; i++) {
        const fl_st_tensor *u = fl_safetensors_find(&x, y.tensors[i].name), *v = &y.tensors[i];
        if (!u || u->ndim != v->ndim || memcmp(u->shape, v->shape, sizeof u->shape) ||
            u->dtype != FL_F32 || v->dtype != FL_F32) {
            *same_shapes = 0;
            continue;
        }
        for (size_t k = 0; k < v->numel; k++) {
            float p, q;
            memcpy(&p, x.data + u->begin + k * sizeof p, sizeof p);
            memcpy(&q, y.data + v->begin + k * sizeof q, sizeof q);
            worst = fmax(worst, fabs((double)p - q));
        }
    }
    fl_safetensors_free(&x);
    fl_safetensors_free(&y);
    return worst;
}

// `fitlm export` of the t = 2 checkpoint gathers whole tensors: the same
// Hugging Face names and shapes (the vocabulary's padding stripped) as the
// export of the model trained in one process, the values within the
// weights' bound; the export loads back at t = 2 (--init-from) to the same
// tensors bitwise (a step at lr 0, exported again).
static void test_tp_export(int llama) {
    const char *m = tp_model[llama], *arch = llama ? "llama" : "gpt2";
    char args[1024], one[8], saved[8], hf[8], hf1[8], init[8], hfi[8];
    snprintf(one, sizeof one, "%c1", arch[0]);
    snprintf(saved, sizeof saved, "%ct2", arch[0]);
    snprintf(hf, sizeof hf, "%chf2", arch[0]);
    snprintf(hf1, sizeof hf1, "%chf1", arch[0]);
    snprintf(init, sizeof init, "%ci2", arch[0]);
    snprintf(hfi, sizeof hfi, "%chfi", arch[0]);
    snprintf(args, sizeof args, SIX "%s --batch 8 --out %s/%s", m, work, one);
    if (!fitlm_ok(0, args)) return;
    same_losses(llama ? "llama t = 2 vs one process" : "gpt2 t = 2 vs one process", saved, one, 1,
                6, 0, 1e-5);
    snprintf(args, sizeof args, "export %s/%s -o %s/%s", work, saved, work, hf);
    if (!fitlm_ok(0, args)) return;
    snprintf(args, sizeof args, "export %s/%s -o %s/%s", work, one, work, hf1);
    if (!fitlm_ok(0, args)) return;
    int same;
    double d = st_diff(hf, hf1, &same);
    char path[512];
    snprintf(path, sizeof path, "%s/%s/model.safetensors", work, hf);
    fl_safetensors st;
    fl_safetensors_open(&st, path);
    const fl_st_tensor *e =
        fl_safetensors_find(&st, llama ? "model.embed_tokens.weight" : "transformer.wte.weight");
    t_check(same && d <= 1.3e-3 && e && e->shape[0] == 257,
            "%s: the export at t = 2 has the tensors of one process's (names and shapes %s, "
            "embedding rows %d) within 1.3e-3 (%.3g)",
            arch, same ? "the same" : "differ", e ? (int)e->shape[0] : -1, d);
    fl_safetensors_free(&st);
    snprintf(args, sizeof args,
             TINY "%s --init-from %s/%s --steps 1 --lr 0 --batch 8 --tensor-parallel 2 --out %s/%s",
             m, work, hf, work, init);
    if (!fitlm_ok(2, args)) return;
    snprintf(args, sizeof args, "export %s/%s -o %s/%s", work, init, work, hfi);
    if (!fitlm_ok(0, args)) return;
    d = st_diff(hfi, hf, &same);
    t_check(same && d == 0.0, "%s: the export loads back at t = 2 bitwise (%.3g)", arch, d);
}

// How often `part` occurs in `text`.
static int occurrences(const char *text, const char *part) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, part)); p += strlen(part)) n++;
    return n;
}

// The sample of the last command's output ("" when none).
static void sample_of(char *text, size_t size) {
    const char *b = strstr(out, "--- sample"), *e = b ? strstr(b, "\n---\n") : NULL;
    snprintf(text, size, "%.*s", e ? (int)(e - b) : 0, b ? b : "");
}

// The lines of DIR's log.txt and metrics.jsonl for step `step`, counted:
// rank 0 alone writes them, once.
static void written_once(const char *dir, int step) {
    char path[512], line[64], metric[64];
    size_t n;
    snprintf(path, sizeof path, "%s/%s/log.txt", work, dir);
    char *log = (char *)t_read_file(path, &n);
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", work, dir);
    char *jsonl = (char *)t_read_file(path, &n);
    snprintf(line, sizeof line, "step %d loss ", step);
    snprintf(metric, sizeof metric, "{\"step\":%d,\"tokens\"", step);
    int a = log ? occurrences(log, line) : -1, b = jsonl ? occurrences(jsonl, metric) : -1;
    t_check(a == 1 && b == 1, "%s: step %d is in log.txt and metrics.jsonl once (%d, %d)", dir,
            step, a, b);
    free(log);
    free(jsonl);
}

// The command line under TP (with sequence parallelism): validation, the
// final sample (generation gathers the vocabulary-parallel logits),
// checkpoints and a resume give one process's values; rank 0 alone writes
// the logs and prints the sample.
static void test_tp_cli(void) {
    const char *cli = TINY " --save-every 2 --eval-every 2 --eval-iters 2 --val-data "
                           "data/brown_byte --sample-tokens 16 --batch 8";
    char args[1024], one[512], two[512], s1[256], s2[256];
    snprintf(args, sizeof args, "%s --steps 4 --out %s/c1", cli, work);
    if (!fitlm_ok(0, args)) return;
    sample_of(s1, sizeof s1);
    snprintf(args, sizeof args, "%s --steps 4 --tensor-parallel 2 --sequence-parallel --out %s/c2",
             cli, work);
    if (!fitlm_ok(2, args)) return;
    sample_of(s2, sizeof s2);
    t_check(*s1 && !strcmp(s1, s2) && occurrences(out, "--- sample") == 1,
            "t = 2 (SP) prints one process's sample, once:\n%s\n---\n%s", s1, s2);
    t_check(count_files("c2", "-of-2.fitlm") == 4, "t = 2 saved steps 2 and 4 as shards (%d)",
            count_files("c2", "-of-2.fitlm"));
    snprintf(args, sizeof args, "%s --steps 6 --resume %s/c1", cli, work);
    fitlm_ok(0, args);
    snprintf(args, sizeof args, "%s --steps 6 --resume %s/c2", cli, work);
    if (!fitlm_ok(2, args)) return;
    same_losses("t = 2 (SP) and its resume vs one process", "c2", "c1", 1, 6, 0, 1e-5);
    val_lines("c1", one, sizeof one);
    val_lines("c2", two, sizeof two);
    t_check(occurrences(one, " val ") == 4 && !strcmp(one, two),
            "validation at t = 2 (SP) and after its resume = one process:\n%s---\n%s", one, two);
    written_once("c2", 1);
    written_once("c2", 5);
}

// A TP checkpoint with a shard file missing or damaged: a clear error
// naming the file.
static void test_tp_damage(void) {
    char args[1024], shard[128], path[512];
    copy_without_shard("gt2", "tbad1", "rank1-of-2", shard, sizeof shard);
    snprintf(args, sizeof args, TINY " --resume %s/tbad1 --steps 9 --tensor-parallel 4", work);
    fitlm_fails(4, args, shard, "missing");
    copy_of("gt2", "tbad2");
    find_file("tbad2", "ckpt_00000006.", "rank0-of-2", shard, sizeof shard);
    snprintf(path, sizeof path, "%s/tbad2/%s", work, shard);
    size_t n;
    unsigned char *m = t_read_file(path, &n);
    size_t data = m && n > 28 ? 28 + (size_t)fl_get_u32(m + 12) : n; // past prefix and header
    if (data + 100 < n) {
        m[data + 10] ^= 1;
        t_write_file(path, m, n);
    }
    free(m);
    snprintf(args, sizeof args, "export %s/tbad2 -o %s/hfbad", work, work);
    fitlm_fails(0, args, shard, "corrupt");
    snprintf(args, sizeof args, TINY " --resume %s/tbad2 --steps 9 --tensor-parallel 1", work);
    fitlm_fails(0, args, shard, "corrupt");
}

// ----------------------------------------------------------------------------
// Pipeline parallelism: a stage's table holds only its rows, saved and
// read by name, so any (t, p, d) layout loads any other's checkpoint.

#define PP_TINY TINY " --n-layer 4 --grad-accum 2"
#define PP_FOUR PP_TINY " --steps 4 --save-every 2"

// --resave train FLAGS... --resume CKPT (under mpirun): a run opened from CKPT
// as `fitlm train` opens it, saved at once to its --out: the tensors the
// layout FLAGS loaded (after the pipeline's and ZeRO's set-up), as that
// layout writes them.
static int resave(int argc, char **argv) {
    fl_comm_init(NULL, NULL);
    if (fl_comm_rank() > 0 && !freopen("/dev/null", "w", stdout)) return 1;
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    fl_run_resume res;
    fl_run_resume_open(&res, argv[argc - 1], &cfg);
    fl_config_parse_args(&cfg, argc - 3, argv + 3);
    fl_run_options opt = {.resume = &res, .out_given = 1};
    fl_run run;
    fl_run_open(&run, &cfg, &opt);
    fl_run_save(&run, run.start);
    fl_run_close(&run);
    return fl_comm_finalize(0);
}

// Every tensor of checkpoint `want` in `got` bitwise, and no other: each
// read whole (a piece written twice or by no rank is an error of its own);
// AdamW's m and v of every row (adamw), else some optimizer state for every
// row (AdaLomo's row and column statistics, or a vector's).
static void same_tensors(const char *what, const char *got_path, const char *want_path, int adamw) {
    fl_ckpt *a = fl_ckpt_open(got_path), *b = fl_ckpt_open(want_path);
    int n = fl_ckpt_tensor_count(b), differ = 0, kinds[3] = {0, 0, 0};
    const char *first = "";
    for (int i = 0; i < n; i++) {
        const char *name = fl_ckpt_tensor_name(b, i);
        size_t k = fl_ckpt_numel(b, name);
        kinds[0] += !strncmp(name, "model/", 6);
        kinds[1] += !strncmp(name, "optim/", 6);
        if (!fl_ckpt_has(a, name) || fl_ckpt_numel(a, name) != k) {
            if (!differ++) first = name;
            continue;
        }
        float *x = malloc(k * sizeof(float)), *y = malloc(k * sizeof(float));
        fl_ckpt_read(a, name, FL_F32, x, k);
        fl_ckpt_read(b, name, FL_F32, y, k);
        if (memcmp(x, y, k * sizeof(float)) && !differ++) first = name;
        free(x);
        free(y);
    }
    int rows = kinds[0];
    t_check(!differ && fl_ckpt_tensor_count(a) == n && rows > 0 &&
                (adamw ? kinds[1] == 2 * rows : kinds[1] >= rows),
            "%s: the %d tensors (%d rows' weights, %s) bitwise, no other (%d differ, the first "
            "%s; %d tensors, %d of state)",
            what, n, rows, adamw ? "AdamW's m and v" : "their state", differ, first,
            fl_ckpt_tensor_count(a), kinds[1]);
    fl_ckpt_close(a);
    fl_ckpt_close(b);
}

// The 3D run (ZeRO-1 inside each data-parallel group) saved at step 2, its
// checkpoint loaded under other layouts (ZeRO-1, and DDP where data-parallel
// rank 0 alone writes) and saved at once: the same tensors bitwise (under
// bf16 the weights saved are the fp32 master). The stages' rows, TP slices
// and ZeRO shards all differ from the saving run's.
static void test_pp_layouts(int bf16) {
    const char *saved = bf16 ? "b3d" : "p3d", *prec = bf16 ? "bf16" : "fp32";
    char args[1024], from[512], a[512], what[160];
    snprintf(args, sizeof args,
             PP_FOUR " --batch 4 --tensor-parallel 2 --pipeline-parallel 2 --zero-stage 1 "
                     "--precision %s --out %s/%s",
             prec, work, saved);
    if (!fitlm_ok(8, args)) return;
    t_check(count_files(saved, "-of-8.fitlm") == 16,
            "(2, 2, 2) writes 8 shard files per checkpoint (%d)",
            count_files(saved, "-of-8.fitlm"));
    ckpt_path(from, sizeof from, saved, 2);
    static const struct {
        int np;
        const char *flags, *dir;
    } cases[] = {
        {1, "--tensor-parallel 1 --pipeline-parallel 1 --batch 8 --zero-stage 0", "111"},
        {4, "--tensor-parallel 1 --pipeline-parallel 4 --batch 8 --zero-stage 1", "141"},
        {4, "--tensor-parallel 2 --pipeline-parallel 1 --batch 4 --zero-stage 1", "212"},
        {4, "--tensor-parallel 1 --pipeline-parallel 2 --batch 4 --zero-stage 0", "122"},
    };
    char self[512];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    self[len > 0 ? len : 0] = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[16];
        snprintf(dir, sizeof dir, "%s%s", saved, cases[i].dir);
        snprintf(what, sizeof what, "%s saved at (2, 2, 2), loaded with %s", prec, cases[i].flags);
        int rc = sh("mpirun.openmpi -q --bind-to none -np %d %s --resave " PP_TINY
                    " %s --steps 4 --out %s/%s --resume %s",
                    cases[i].np, self, cases[i].flags, work, dir, from);
        if (!t_check(rc == 0, "%s: status %d: %.1500s", what, rc, out)) continue;
        ckpt_path(a, sizeof a, dir, 2);
        same_tensors(what, a, from, 1);
    }
}

// A run saved under (1, 2, 1) (interleaved, v = 2: a stage's blocks are
// not contiguous) continues in one process, and the 3D run's
// checkpoint under (1, 1, 1) and (1, 4, 1) alike, bitwise as the run that
// never stopped (pipeline-only fp32 is one process's arithmetic); the
// exports of the pipeline's checkpoint and one process's are the same bytes.
static void test_pp_resume(void) {
    char args[2048], a[512], b[512];
    snprintf(args, sizeof args, PP_FOUR " --batch 8 --out %s/pone", work);
    if (!fitlm_ok(0, args)) return;
    char whole[64] = ""; // "N parameters", the line's start
    const char *end = strstr(out, " parameters ("), *line = end;
    while (line && line > out && line[-1] != '\n') line--;
    if (end && end - line < 32)
        snprintf(whole, sizeof whole, "%.*s parameters", (int)(end - line), line);
    snprintf(args, sizeof args,
             PP_FOUR " --batch 8 --pipeline-parallel 2 --pipeline-schedule interleaved "
                     "--virtual-stages 2 --out %s/pp2",
             work);
    if (!fitlm_ok(2, args)) return;
    // the run's line: the whole model's count, then the first stage's
    t_check(*whole && strstr(out, whole) && strstr(out, "; pipeline parallel 2: ") &&
                strstr(out, " per rank of the first stage"),
            "(1, 2, 1) prints the whole model's parameters (%s) and the first stage's: %.300s",
            whole, out);
    same_losses("(1, 2, 1) vs one process", "pp2", "pone", 1, 4, 1, 0);
    snprintf(args, sizeof args,
             PP_TINY
             " --steps 4 --batch 8 --pipeline-parallel 1 --resume %s/pp2/ckpt_00000002.fitlm "
             "--out %s/pp2r",
             work, work);
    if (!fitlm_ok(0, args)) return;
    same_losses("saved at (1, 2, 1), resumed in one process", "pp2r", "pone", 3, 4, 1, 0);
    ckpt_path(a, sizeof a, "pp2r", 4);
    ckpt_path(b, sizeof b, "pone", 4);
    same_tensors("saved at (1, 2, 1), resumed in one process: step 4", a, b, 1);
    // the 3D checkpoint continued in one process and over 4 stages
    ckpt_path(b, sizeof b, "p3d", 2);
    snprintf(args, sizeof args,
             PP_TINY " --steps 4 --batch 8 --tensor-parallel 1 "
                     "--pipeline-parallel 1 --zero-stage 0 --resume %s --out %s/p3r1",
             b, work);
    if (!fitlm_ok(0, args)) return;
    snprintf(args, sizeof args,
             PP_TINY " --steps 4 --batch 8 --tensor-parallel 1 "
                     "--pipeline-parallel 4 --zero-stage 0 --resume %s --out %s/p3r4",
             b, work);
    if (!fitlm_ok(4, args)) return;
    same_losses("saved at (2, 2, 2), resumed at (1, 4, 1) vs (1, 1, 1)", "p3r4", "p3r1", 3, 4, 1,
                0);
    ckpt_path(a, sizeof a, "p3r4", 4);
    ckpt_path(b, sizeof b, "p3r1", 4);
    same_tensors("saved at (2, 2, 2), resumed at (1, 4, 1) vs (1, 1, 1): step 4", a, b, 1);
    // AdaLomo (one micro-batch a step): its per-row state by name too
    snprintf(args, sizeof args,
             TINY " --n-layer 4 --optimizer adalomo --steps 4 --save-every 2 "
                  "--batch 8 --out %s/aone",
             work);
    if (!fitlm_ok(0, args)) return;
    snprintf(args, sizeof args,
             TINY " --n-layer 4 --steps 4 --batch 8 --pipeline-parallel 2 "
                  "--resume %s/aone/ckpt_00000002.fitlm --out %s/ap2",
             work, work);
    if (!fitlm_ok(2, args)) return;
    same_losses("AdaLomo saved in one process, resumed at (1, 2, 1)", "ap2", "aone", 3, 4, 1, 0);
    ckpt_path(a, sizeof a, "ap2", 4);
    ckpt_path(b, sizeof b, "aone", 4);
    same_tensors("AdaLomo saved in one process, resumed at (1, 2, 1): step 4", a, b, 0);
    snprintf(args, sizeof args, "export %s/pp2 -o %s/pphf2", work, work);
    if (!fitlm_ok(0, args)) return;
    snprintf(args, sizeof args, "export %s/pone -o %s/pphf1", work, work);
    if (!fitlm_ok(0, args)) return;
    int same;
    double d = st_diff("pphf2", "pphf1", &same);
    t_check(same && d == 0.0,
            "the export of (1, 2, 1)'s checkpoint is one process's bitwise (%.3g)", d);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--resave")) return resave(argc, argv);
    // --tp: the tensor-parallel tests alone; --tp-tcp: CTest's tp_tcp, the
    // TCP transport's tensor-parallel case; --pp: the pipeline's alone
    int tcp = argc > 1 && !strcmp(argv[1], "--tp-tcp"),
        tp = tcp || (argc > 1 && !strcmp(argv[1], "--tp")),
        pp = argc > 1 && !strcmp(argv[1], "--pp");
    if (argc > 2 || (argc > 1 && !tp && !pp)) {
        fprintf(stderr, "usage: test_reshard [--tp | --tp-tcp | --pp]\n");
        return 2;
    }
    snprintf(work, sizeof work, "/tmp/fitlm_test_reshard_%d", (int)getpid());
    t_remove_dir(work);
    mkdir(work, 0755);
    double t0 = now();
    if (pp) { // test_pp_resume continues test_pp_layouts' 3D checkpoint
        test_pp_layouts(0);
        if (!t_quick()) test_pp_layouts(1); // bf16's master too (the sanitizers: fp32's path)
        test_pp_resume();
    }
    if (!tp && !pp) {
        test_layouts();
        test_eval();
        test_resume();
        test_export();
        test_tokenizer_in_manifest();
        test_damage();
        test_failed_save();
        test_kill(1);
        test_kill(0);
        test_prune();
    }
    double t1 = now();
    // The sanitizer build's quick list (FITLM_TEST_QUICK) leaves the TP
    // layouts to the release build: under the sanitizers test_tp saves and
    // resumes TP checkpoints, and tp_tcp runs its case here
    int tp_tests = tp || (!pp && !t_quick());
    for (int llama = 0; llama < (tp_tests ? 2 - tcp : 0); llama++) {
        test_tp_resume(llama, tcp);
        if (!tcp) test_tp_export(llama);
    }
    if (!tcp && tp_tests) {
        test_tp_cli();
        test_tp_damage();
    }
    printf("test_reshard: %.1f s, tensor parallelism %.1f s (%.1f s in fitlm and mpirun)\n",
           now() - t0, now() - t1, mpirun_seconds);
    int rc = t_report();
    if (rc == 0) t_remove_dir(work); // kept for a look when something failed
    return rc;
}
