// test_offload: NVMe offload of the optimizer (offload.h). A run whose
// master weights and optimizer state live in a file, paged through a few
// buffers with asynchronous I/O, gives bitwise the losses, weights, master
// and state of the same run with everything in RAM: under ZeRO-1/2/3, in
// fp32, bf16 and fp16, with AdamW and SGD, and under every I/O setting
// (one buffer or several, reads ahead and writes behind or not, chunks of
// one page or the whole range, one request at a time or a batch, several
// I/O threads). CTest runs it alone and under mpirun with 2 ranks. Alone it
// also checks the errors: a missing, unusable or full nvme_path, a file cut
// short under a run; and through `fitlm train`, that a resume from a
// checkpoint of an offloaded run is bitwise the uninterrupted run, with or
// without offload. optimizer_in_backward (AdamW updated unit by unit from
// the backward pass) is checked the same way, offloaded against in RAM, and
// in RAM against the usual step: bitwise without clipping; with clipping
// (its two passes sum the norm row by row) within 1e-6 relative.
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cjson/cJSON.h>

#include "fitlm/comm.h"
#include "fitlm/io.h"
#include "fitlm/run.h"
#include "testlib.h"

enum { B = 2, T = 16, STEPS = 6, V = 97 };

static char nvme_dir[] = "/tmp/fitlm-offload-XXXXXX";

typedef struct {
    const char *name;
    fl_dtype dt;
    int stage, accum;
    fl_optim_kind kind; // AdamW, or SGD with momentum
    int buffers, read_ahead, write_behind, threads, single_submit, batches, queue_depth;
    double chunk;
    int weights;     // ZeRO-3's weights offloaded too (offload_param)
    int in_backward; // optimizer_in_backward (1), and that against the usual step (2)
} offload_case;

// The case as `fitlm train` opens it: a config file with its
// zero_optimization stage and (paged) NVMe offload's settings, and flags
// for the rest: a small GPT-2, AdamW or SGD with momentum, constant lr.
static void open_run(const offload_case *c, fl_dtype dt, int seed, int paged, int in_backward,
                     fl_run *run) {
    char json[1024];
    int n = snprintf(json, sizeof json, "{\"zero_optimization\": {\"stage\": %d", c->stage);
    if (paged)
        n += snprintf(json + n, sizeof json - (size_t)n,
                      ", \"sub_group_size\": %.17g, \"offload_optimizer\": {\"device\": "
                      "\"nvme\", \"nvme_path\": \"%s\", \"buffer_count\": %d, "
                      "\"pipeline_read\": %s, \"pipeline_write\": %s}%s}, \"aio\": "
                      "{\"block_size\": 4096, \"queue_depth\": %d, \"thread_count\": %d, "
                      "\"single_submit\": %s, \"overlap_events\": %s",
                      c->chunk, nvme_dir, c->buffers, c->read_ahead ? "true" : "false",
                      c->write_behind ? "true" : "false",
                      c->weights ? ", \"offload_param\": {\"device\": \"nvme\"}" : "",
                      c->queue_depth ? c->queue_depth : 8, c->threads ? c->threads : 1,
                      c->single_submit ? "true" : "false", c->batches ? "false" : "true");
    snprintf(json + n, sizeof json - (size_t)n, "}}");
    char flags[1024];
    snprintf(flags, sizeof flags,
             "--model tiny --n-layer 2 --n-head 4 --n-embd 32 --max-seq-len %d --tokenizer byte "
             "--precision %s --batch %d --seq-len %d --grad-accum %d --optimizer %s --lr %g "
             "--scheduler constant --warmup 0 --seed %d --threads 1 --sample-tokens 0 --out=%s%s%s",
             T, fl_dtype_name(dt), B, T, c->accum ? c->accum : 1,
             c->kind == FL_OPT_SGD ? "sgd" : "adamw", c->kind == FL_OPT_SGD ? 0.05f : 2e-3f, seed,
             c->kind == FL_OPT_SGD ? " --momentum 0.9" : "",
             in_backward ? " --optimizer-in-backward" : "",
             c->in_backward == 2 ? " --grad-clip 0" : ""); // no clipping: bitwise
    t_run_open(run, json, flags, 0);
}

// This rank's micro-batches of a step: a learnable rule with a few masked targets.
static void batch(int step, int n, int *inputs, int *targets) {
    t_rule_batch(0x9E3779B97F4A7C15ull * (uint64_t)(step + 1) + (uint64_t)fl_comm_rank(), (size_t)n,
                 V, inputs, targets);
}

typedef struct {
    float loss[STEPS], norm[STEPS];
    float *weights; // whole, fp32
    size_t numel;
    float *state; // this rank's master and state tensors, one after another
    size_t state_n;
} run_result;

static void train(const offload_case *c, int paged, int in_backward, run_result *out) {
    fl_run run;
    open_run(c, c->dt, 42, paged, in_backward, &run);
    size_t n = (size_t)c->accum * B * T;
    for (int step = 0; step < STEPS; step++) {
        batch(step, (int)n, run.inputs, run.targets);
        fl_train_result r = fl_run_step_batch(&run, run.inputs, run.targets, run.cfg.lr);
        out->loss[step] = r.loss;
        out->norm[step] = r.grad_norm;
    }
    out->weights = t_weights_f32(&run.model, run.strategy);
    out->numel = run.model.table.numel;
    // the master and the state, through the mapping when paged
    fl_optimizer *o = &run.optim;
    fl_optimizer_map(o);
    size_t begin = o->rule->state_begin, span = o->rule->state_end - begin;
    int k0 = o->master ? -1 : 0, nstate = fl_optim_state_count(o->rule);
    out->state_n = (size_t)(nstate - k0) * span;
    out->state = malloc((out->state_n ? out->state_n : 1) * sizeof(float));
    for (int k = k0; k < nstate && span; k++)
        memcpy(out->state + (size_t)(k - k0) * span,
               k < 0 ? o->master : fl_optim_state_ptr(o->rule, k, begin), span * sizeof(float));
    fl_optimizer_unmap(o);
    fl_run_close(&run);
}

static void check_case(const offload_case *c) {
    run_result got, want;
    // offloaded against in RAM; or (in_backward 2) in RAM, in the backward
    // pass against the usual step
    train(c, c->in_backward != 2, c->in_backward != 0, &got);
    train(c, 0, c->in_backward == 1, &want);
    int rank = fl_comm_rank(), world = fl_comm_size();
    size_t numel = got.numel;
    t_check(!memcmp(got.loss, want.loss, sizeof got.loss) &&
                !memcmp(got.norm, want.norm, sizeof got.norm),
            "rank %d/%d %s: losses and norms bitwise (%.6f vs %.6f)", rank, world, c->name,
            got.loss[STEPS - 1], want.loss[STEPS - 1]);
    t_check(!memcmp(got.weights, want.weights, numel * sizeof(float)),
            "rank %d/%d %s: final weights bitwise", rank, world, c->name);
    t_check(got.state_n == want.state_n &&
                !memcmp(got.state, want.state, got.state_n * sizeof(float)),
            "rank %d/%d %s: master and optimizer state bitwise (%zu floats)", rank, world, c->name,
            got.state_n);
    t_check(got.loss[STEPS - 1] < got.loss[0], "rank %d/%d %s: the loss falls (%.4f -> %.4f)", rank,
            world, c->name, got.loss[0], got.loss[STEPS - 1]);
    free(got.weights);
    free(want.weights);
    free(got.state);
    free(want.state);
}

// ----------------------------------------------------------------------------
// errors (one process)

static void check_path(void *arg) {
    const char *dir = arg;
    fl_offload_check_path("nvme_path", dir, 4096);
}

static void check_huge(void *arg) {
    fl_offload_check_path("nvme_path", arg, (size_t)1 << 62);
}

// An offloaded optimizer over a small model, one process: its run.
static void small_open(fl_run *run, int buffers) {
    offload_case c = {.dt = FL_BF16, .stage = 1, .accum = 1, .buffers = buffers, .chunk = 4096};
    open_run(&c, FL_BF16, 7, 1, 0, run);
}

static void full_disk(void *arg) {
    (void)arg;
    // a file size limit: the space reserved at start is refused, as on a full disk
    struct rlimit lim = {16384, 16384};
    signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    fl_run run;
    small_open(&run, 2);
}

// Cuts the offload file to nothing through a descriptor of this process
// (found by its unlinked name; the read-only one cannot). Whether it could.
static int truncate_open_file(const char *path) {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int done = 0;
    while (d && (e = readdir(d))) {
        char link[300], target[PATH_MAX + 16];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (!strncmp(target, path, strlen(path)) && ftruncate(atoi(e->d_name), 0) == 0) done = 1;
    }
    if (d) closedir(d);
    return done;
}

static void short_read(void *arg) {
    (void)arg;
    fl_run run;
    small_open(&run, 1);
    if (!truncate_open_file(fl_offload_path(run.offload))) exit(3); // the test itself failed
    batch(0, B * T, run.inputs, run.targets);
    fl_run_step_batch(&run, run.inputs, run.targets, 1e-3f);
}

// A change to the file under the run, by something else than the run.
typedef enum {
    CUT_TO_NOTHING,
    CUT_AND_EXTENDED, // cut to nothing, then its last page written: a late write-back's race
    CUT_TO_HALF,
    CUT_LAST_PAGE,
    ZERO_PAGES,
    FLIP_BYTE,
    OLD_COPY
} tamper;

typedef struct {
    const char *name;
    tamper how;
    int stage, weights; // ZeRO stage; offload_param (the weights in the file too)
    int buffers, pipelined;
    size_t region; // ZERO_PAGES, FLIP_BYTE: the offset's tensor region (0: master)
    int then_save; // then a checkpoint's read of the state (fl_optimizer_map), not a step
} tamper_case;

// A descriptor of this process's offload file opened for writing anew (as
// anyone can through /proc), or -1.
static int reopen_offload_file(const char *path) {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int fd = -1;
    while (d && fd < 0 && (e = readdir(d))) {
        char link[300], target[PATH_MAX + 16];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (!strncmp(target, path, strlen(path))) fd = open(link, O_RDWR);
    }
    if (d) closedir(d);
    return fd;
}

static void tamper_run(void *arg) {
    const tamper_case *c = arg;
    offload_case oc = {.dt = FL_BF16,
                       .stage = c->stage,
                       .accum = 1,
                       .buffers = c->buffers,
                       .read_ahead = c->pipelined,
                       .write_behind = c->pipelined,
                       .chunk = 4096,
                       .weights = c->weights};
    fl_run run;
    open_run(&oc, FL_BF16, 7, 1, 0, &run);
    int fd = reopen_offload_file(fl_offload_path(run.offload));
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) exit(3); // the test itself failed
    // the middle of a tensor's region: a chunk no buffer holds between steps
    // (the fp32 master and state regions, then the bf16 weights' of half
    // their size)
    size_t size = (size_t)st.st_size, f32 = size * 2 / (c->weights ? 7 : 6);
    size_t at = c->region < 3 ? f32 * c->region + f32 / 2 : f32 * 3 + f32 / 4;
    at += 100;
    unsigned char *old = malloc(size), byte;
    static const char zeros[3 * 4096];
    for (int step = 0; step < 4; step++) {
        batch(step, B * T, run.inputs, run.targets);
        fl_run_step_batch(&run, run.inputs, run.targets, 1e-3f);
        if (step == 0 && pread(fd, old, size, 0) != (ssize_t)size) exit(3);
        if (step != 1) continue;
        // after a step: its last chunks are still to be written back
        int ok = 1;
        if (c->how == CUT_TO_NOTHING || c->how == CUT_AND_EXTENDED) ok = ftruncate(fd, 0) == 0;
        if (c->how == CUT_AND_EXTENDED) // the size is right again, the rest reads as zeros
            ok = ok && pwrite(fd, old + size - 4096, 4096, (off_t)(size - 4096)) == 4096;
        if (c->how == CUT_TO_HALF) ok = ftruncate(fd, (off_t)(size / 2)) == 0;
        if (c->how == CUT_LAST_PAGE) ok = ftruncate(fd, (off_t)(size - 4096)) == 0;
        if (c->how == ZERO_PAGES) ok = pwrite(fd, zeros, sizeof zeros, (off_t)at) == sizeof zeros;
        if (c->how == FLIP_BYTE)
            ok = pread(fd, &byte, 1, (off_t)at) == 1 && (byte ^= 0x10, 1) &&
                 pwrite(fd, &byte, 1, (off_t)at) == 1;
        if (c->how == OLD_COPY) ok = pwrite(fd, old, size, 0) == (ssize_t)size; // step 1's file
        if (!ok) exit(3);
        if (c->then_save) {
            fl_optimizer_map(&run.optim);
            fl_optimizer_unmap(&run.optim);
        }
    }
    exit(0); // trained on: the test fails
}

// The file is unlinked once open: a file put at its name later is never
// read (the run goes on bitwise as without it) and is left as it is.
static void check_file_at_its_name(void) {
    float loss[2][4];
    char path[PATH_MAX] = "";
    for (int put = 0; put < 2; put++) {
        fl_run run;
        small_open(&run, 1);
        for (int step = 0; step < 4; step++) {
            batch(step, B * T, run.inputs, run.targets);
            loss[put][step] = fl_run_step_batch(&run, run.inputs, run.targets, 1e-3f).loss;
            if (put && step == 1) {
                snprintf(path, sizeof path, "%s", fl_offload_path(run.offload));
                t_write_text(path, "not the state");
            }
        }
        fl_run_close(&run);
    }
    size_t n = 0;
    unsigned char *text = t_read_file(path, &n);
    t_check(!memcmp(loss[0], loss[1], sizeof loss[0]) && text && n == 13 &&
                !memcmp(text, "not the state", 13),
            "a file put at the offload file's name is neither read nor touched");
    free(text);
    remove(path);
}

static void check_errors(void) {
    char file[64];
    snprintf(file, sizeof file, "%s/plain-file", nvme_dir);
    t_write_text(file, "x");
    t_dies("missing nvme_path", check_path, "/nonexistent/fitlm-nvme", "No such file or directory");
    t_dies("nvme_path a file", check_path, file, "is not a directory");
    t_dies("nvme_path where nothing can be created", check_path, "/proc",
           "cannot create files there");
    t_dies("nvme_path without room", check_huge, nvme_dir, "only");
    t_dies("nvme_path without room: the sizes", check_huge, nvme_dir,
           "needs 4.00 EiB of disk, only ");
    t_dies("a full disk at start", full_disk, NULL, "cannot reserve");
    t_dies("a file cut short under the run", short_read, NULL, "a short transfer");
    remove(file);
    // any change to the file under the run is an error naming it, never a
    // wrong number: between steps, with the last chunks still to be written
    // back (whose write-back extends a cut file again, its holes reading as
    // zeros), or before a checkpoint reads the state
    const tamper_case tampers[] = {
        {"cut to nothing", CUT_TO_NOTHING, 1, 0, 1, 0, 0, 0},
        {"cut, then extended by a write", CUT_AND_EXTENDED, 1, 0, 1, 0, 0, 0},
        {"cut, then extended, pipelined", CUT_AND_EXTENDED, 2, 0, 4, 1, 0, 0},
        {"cut, then extended, then saved", CUT_AND_EXTENDED, 2, 0, 2, 1, 0, 1},
        {"ZeRO-3: cut, then extended", CUT_AND_EXTENDED, 3, 1, 3, 1, 0, 0},
        {"cut to half", CUT_TO_HALF, 1, 0, 2, 1, 0, 0},
        {"the last page cut", CUT_LAST_PAGE, 1, 0, 3, 0, 0, 0},
        {"three pages zeroed", ZERO_PAGES, 1, 0, 1, 0, 1, 0},
        {"one byte flipped", FLIP_BYTE, 1, 0, 4, 1, 2, 0},
        {"an older copy put back", OLD_COPY, 2, 0, 3, 1, 0, 0},
        {"one byte flipped, then saved", FLIP_BYTE, 1, 0, 2, 0, 0, 1},
        {"cut to half, then saved", CUT_TO_HALF, 1, 0, 1, 0, 0, 1},
        {"ZeRO-3: a weight's byte flipped", FLIP_BYTE, 3, 1, 2, 1, 3, 0},
        {"ZeRO-3: weights zeroed", ZERO_PAGES, 3, 1, 4, 1, 3, 0},
        {"ZeRO-3: cut to nothing", CUT_TO_NOTHING, 3, 1, 1, 0, 0, 0},
    };
    char names_file[160];
    snprintf(names_file, sizeof names_file, "NVMe offload file %s/fitlm-optimizer-", nvme_dir);
    for (size_t i = 0; i < sizeof tampers / sizeof tampers[0]; i++)
        t_dies(tampers[i].name, tamper_run, (void *)&tampers[i], names_file);
    check_file_at_its_name();
}

// ----------------------------------------------------------------------------
// resume, through `fitlm train`

// (--peak-tflops: measuring the host's peak, 0.05 s a run, is test_metrics' subject)
#define RUN_ANY_STAGE                                                                              \
    "train --model tiny --data data/brown_byte --tokenizer byte --seq-len 32 --threads 1 "         \
    "--batch 2 --precision bf16 --sample-tokens 0 --eval-every 0 --peak-tflops 1"
#define RUN RUN_ANY_STAGE " --zero-stage 2"

// The "step N loss ... norm ..." lines of DIR/log.txt for steps > from.
static void log_steps(const char *dir, int from, char *out, size_t size) {
    char path[512];
    snprintf(path, sizeof path, "%s/log.txt", dir);
    size_t n = 0;
    unsigned char *text = t_read_file(path, &n);
    out[0] = 0;
    size_t used = 0;
    for (char *line = text ? strtok((char *)text, "\n") : NULL; line; line = strtok(NULL, "\n")) {
        int step;
        if (sscanf(line, "step %d loss", &step) == 1 && step > from &&
            used + strlen(line) + 2 < size)
            used += (size_t)snprintf(out + used, size - used, "%s\n", line);
    }
    free(text);
}

// Sets zero_optimization.<block> (and `aio` when given) in the config that
// checkpoint `path` records, as an older fitlm or anyone could have written
// it: the header rewritten, its CRC-32 recomputed.
static void ckpt_set_config(const char *path, const char *block, const char *json,
                            const char *aio) {
    size_t n = 0;
    unsigned char *file = t_read_file(path, &n);
    uint32_t header_len = file ? fl_get_u32(file + 12) : 0;
    cJSON *root = file ? cJSON_ParseWithLength((const char *)file + 28, header_len) : NULL;
    cJSON *cfg = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "meta"), "config");
    cJSON *zero = cJSON_GetObjectItem(cfg, "zero_optimization");
    if (!zero) {
        t_check(0, "%s records no zero_optimization block", path);
        cJSON_Delete(root);
        free(file);
        return;
    }
    cJSON_DeleteItemFromObject(zero, block);
    cJSON_AddItemToObject(zero, block, cJSON_Parse(json));
    cJSON_DeleteItemFromObject(cfg, "aio");
    if (aio) cJSON_AddItemToObject(cfg, "aio", cJSON_Parse(aio));
    char *header = cJSON_PrintUnformatted(root);
    size_t len = strlen(header);
    fl_put_u32(file + 12, (uint32_t)len);
    fl_put_u32(file + 24, fl_crc32(fl_crc32(0, file, 24), header, len));
    FILE *out = fopen(path, "wb");
    size_t data = n - 28 - header_len;
    int ok = out && fwrite(file, 1, 28, out) == 28 && fwrite(header, 1, len, out) == len &&
             fwrite(file + 28 + header_len, 1, data, out) == data;
    if (out && fclose(out) != 0) ok = 0;
    t_check(ok, "rewriting %s", path);
    cJSON_free(header);
    cJSON_Delete(root);
    free(file);
}

// NVMe offload's blocks belong to the invocation: a checkpoint's config,
// whatever wrote it, never names the directory a resume writes in.
static void check_resume_nvme_path(const char *work, const char *cfg) {
    const char *src = t_source_path(".");
    char args[2048], out[16384], ck[300], elsewhere[300];
    static char text[1 << 16];
    snprintf(ck, sizeof ck, "%s/off/ckpt_00000003.fitlm", work);
    size_t n = 0;
    unsigned char *file = t_read_file(ck, &n);
    snprintf(text, sizeof text, "%.*s", file ? (int)fl_get_u32(file + 12) : 0,
             file ? (const char *)file + 28 : "");
    free(file);
    t_check(*text && !strstr(text, "nvme_path") && !strstr(text, "offload_optimizer"),
            "a checkpoint of an offloaded run records no NVMe offload block");
    // a directory named by the checkpoint: absent, then one that exists
    snprintf(elsewhere, sizeof elsewhere, "%s/elsewhere", work);
    char json[512];
    snprintf(json, sizeof json,
             "{\"device\": \"nvme\", \"nvme_path\": \"%s\", \"buffer_count\": 2}", elsewhere);
    ckpt_set_config(ck, "offload_optimizer", json, "{\"block_size\": 4096}");
    for (int exists = 0; exists < 2; exists++) {
        if (exists && mkdir(elsewhere, 0700) != 0) t_check(0, "mkdir %s", elsewhere);
        snprintf(args, sizeof args, RUN " --steps 4 --resume %s --out %s/named%d", ck, work,
                 exists);
        int rc = t_fitlm(src, args, 1, out, sizeof out);
        t_check(rc == 0 && !strstr(out, "NVMe offload") && !strstr(out, elsewhere),
                "a resume of a checkpoint naming nvme_path %s (%s) runs in RAM, nothing there "
                "(status %d):\n%s",
                elsewhere, exists ? "a directory" : "absent", rc, out);
    }
    t_check(rmdir(elsewhere) == 0, "nothing was created in %s", elsewhere);
    // this invocation's --config decides: its directory, not the checkpoint's
    snprintf(args, sizeof args, RUN " --steps 4 --config %s --resume %s --out %s/given", cfg, ck,
             work);
    int rc = t_fitlm(src, args, 1, out, sizeof out);
    char here[300];
    snprintf(here, sizeof here, "NVMe offload per step (%s/fitlm-optimizer-", nvme_dir);
    t_check(rc == 0 && strstr(out, here) && access(elsewhere, F_OK) != 0,
            "a resume with --config offloads where that config says (status %d):\n%s", rc, out);
    // ZeRO-3's offload_param block and aio from the checkpoint: not taken either
    snprintf(ck, sizeof ck, "%s/z3off/ckpt_00000003.fitlm", work);
    ckpt_set_config(ck, "offload_param", "{\"device\": \"nvme\", \"nvme_path\": \"/\"}",
                    "{\"queue_depth\": 3}");
    snprintf(args, sizeof args, RUN_ANY_STAGE " --steps 4 --resume %s --out %s/z3named", ck, work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0 && !strstr(out, "NVMe offload"),
            "a ZeRO-3 resume of a checkpoint naming offload_param.nvme_path / runs in RAM "
            "(status %d):\n%s",
            rc, out);
}

static void check_resume(void) {
    char work[256], cfg[300], args[2048], out[16384];
    snprintf(work, sizeof work, "%s/runs", nvme_dir);
    if (mkdir(work, 0700) != 0) t_check(0, "mkdir %s", work);
    snprintf(cfg, sizeof cfg, "%s/offload.json", work);
    char json[512];
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"stage\": 2, \"sub_group_size\": 100000, "
             "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\", "
             "\"buffer_count\": 3, \"pipeline_read\": true, \"pipeline_write\": true}}}",
             nvme_dir);
    t_write_text(cfg, json);
    const char *src = t_source_path(".");
    snprintf(args, sizeof args, RUN " --steps 6 --save-every 3 --config %s --out %s/off", cfg,
             work);
    int rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0 && strstr(out, "NVMe offload per step"),
            "an offloaded run trains and reports its I/O (status %d)", rc);
    snprintf(args, sizeof args, RUN " --steps 6 --out %s/ram", work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0, "the same run in RAM (status %d)", rc);
    snprintf(args, sizeof args,
             RUN " --steps 6 --config %s --resume %s/off/ckpt_00000003.fitlm --out %s/off_r", cfg,
             work, work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0, "an offloaded run resumes offloaded (status %d)", rc);
    snprintf(args, sizeof args, RUN " --steps 6 --resume %s/off/ckpt_00000003.fitlm --out %s/ram_r",
             work, work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0, "an offloaded run's checkpoint resumes in RAM (status %d)", rc);
    static char ram[4096], off[4096], off_r[4096], ram_r[4096];
    char dir[300];
    snprintf(dir, sizeof dir, "%s/ram", work);
    log_steps(dir, 3, ram, sizeof ram);
    snprintf(dir, sizeof dir, "%s/off", work);
    log_steps(dir, 0, off, sizeof off);
    snprintf(dir, sizeof dir, "%s/off_r", work);
    log_steps(dir, 3, off_r, sizeof off_r);
    snprintf(dir, sizeof dir, "%s/ram_r", work);
    log_steps(dir, 3, ram_r, sizeof ram_r);
    char ram_all[4096];
    snprintf(dir, sizeof dir, "%s/ram", work);
    log_steps(dir, 0, ram_all, sizeof ram_all);
    t_check(*ram && !strcmp(off, ram_all), "offloaded and in-RAM runs log the same 6 steps");
    t_check(!strcmp(off_r, ram), "the offloaded resume continues bitwise:\n%s---\n%s", off_r, ram);
    t_check(!strcmp(ram_r, ram), "the in-RAM resume of its checkpoint continues bitwise");
    // the final checkpoints' weights and state: the same file but for the config text
    snprintf(args, sizeof args, "export %s/off_r --out %s/off_r.safetensors", work, work);
    int e1 = t_fitlm(src, args, 1, out, sizeof out);
    snprintf(args, sizeof args, "export %s/ram --out %s/ram.safetensors", work, work);
    int e2 = t_fitlm(src, args, 1, out, sizeof out);
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/off_r.safetensors/model.safetensors", work);
    snprintf(b, sizeof b, "%s/ram.safetensors/model.safetensors", work);
    size_t na = 0, nb = 0;
    unsigned char *fa = t_read_file(a, &na), *fb = t_read_file(b, &nb);
    t_check(e1 == 0 && e2 == 0 && fa && fb && na == nb && !memcmp(fa, fb, na),
            "the resumed offloaded run's final weights equal the uninterrupted run's, bitwise");
    free(fa);
    free(fb);
    // ZeRO-3 with the weights in the file too: its resume continues bitwise
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"stage\": 3, \"sub_group_size\": 100000, "
             "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\", "
             "\"pipeline_read\": true}, \"offload_param\": {\"device\": \"nvme\"}}}",
             nvme_dir);
    t_write_text(cfg, json);
    snprintf(args, sizeof args,
             RUN_ANY_STAGE " --steps 6 --save-every 3 --config %s --out %s/z3off", cfg, work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    t_check(rc == 0, "ZeRO-3 with offloaded weights trains (status %d)", rc);
    snprintf(args, sizeof args, RUN_ANY_STAGE " --steps 6 --zero-stage 3 --out %s/z3ram", work);
    rc = t_fitlm(src, args, 1, out, sizeof out);
    snprintf(args, sizeof args,
             RUN_ANY_STAGE " --steps 6 --config %s --resume %s/z3off/ckpt_00000003.fitlm --out "
                           "%s/z3off_r",
             cfg, work, work);
    int rc2 = t_fitlm(src, args, 1, out, sizeof out);
    static char z3ram[4096], z3off[4096], z3off_r[4096];
    snprintf(dir, sizeof dir, "%s/z3ram", work);
    log_steps(dir, 0, z3ram, sizeof z3ram);
    snprintf(dir, sizeof dir, "%s/z3off", work);
    log_steps(dir, 0, z3off, sizeof z3off);
    snprintf(dir, sizeof dir, "%s/z3off_r", work);
    log_steps(dir, 3, z3off_r, sizeof z3off_r);
    snprintf(dir, sizeof dir, "%s/z3ram", work);
    log_steps(dir, 3, ram, sizeof ram);
    t_check(rc == 0 && rc2 == 0 && *z3ram && !strcmp(z3off, z3ram) && !strcmp(z3off_r, ram),
            "ZeRO-3 with offloaded weights logs the in-RAM run's 6 steps, and its resume "
            "continues bitwise (status %d, %d)",
            rc, rc2);
    // the plan refuses a directory it cannot use before anything is allocated
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": "
             "\"nvme\", \"nvme_path\": \"/proc\"}}}");
    t_write_text(cfg, json);
    snprintf(args, sizeof args, RUN " --steps 6 --config %s --out ''", cfg);
    t_fitlm_fails(src, args, "nvme_path /proc: cannot create files there", out, sizeof out);
    snprintf(args, sizeof args, "plan --model gpt2-xl --precision bf16 --config %s", cfg);
    t_fitlm_fails(src, args, "nvme_path /proc: cannot create files there", out, sizeof out);
    // the first config again: the stage-2 offload under nvme_dir
    snprintf(json, sizeof json,
             "{\"zero_optimization\": {\"stage\": 2, \"sub_group_size\": 100000, "
             "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}}",
             nvme_dir);
    t_write_text(cfg, json);
    check_resume_nvme_path(work, cfg);
}

int main(int argc, char **argv) {
    fl_comm_init(&argc, &argv);
    fl_set_threads(1);
    int world = fl_comm_size();
    if (!mkdtemp(nvme_dir)) return t_check(0, "mkdtemp"), fl_comm_finalize(t_report());
    const offload_case cases[] = {
        {"fp32 ZeRO-1, 4 buffers, read ahead and write behind, 3 KiB chunks", FL_F32, 1, 1,
         FL_OPT_ADAMW, 4, 1, 1, 1, 0, 0, 0, 3000, 0, 0},
        {"bf16 ZeRO-2, accumulation, 4 buffers pipelined", FL_BF16, 2, 2, FL_OPT_ADAMW, 4, 1, 1, 1,
         0, 0, 0, 3000, 0, 0},
        {"fp16 ZeRO-3, 2 buffers, read ahead, 2 threads, single submit, batches of 1", FL_F16, 3, 1,
         FL_OPT_ADAMW, 2, 1, 0, 2, 1, 1, 1, 5000, 0, 0},
        {"bf16 ZeRO-3, one buffer, one chunk, nothing overlapped", FL_BF16, 3, 1, FL_OPT_ADAMW, 1,
         0, 0, 1, 0, 0, 0, 1e9, 0, 0},
        {"fp32 SGD momentum ZeRO-1, 3 buffers, write behind, one-page chunks", FL_F32, 1, 1,
         FL_OPT_SGD, 3, 0, 1, 1, 0, 0, 0, 1024, 0, 0},
        {"bf16 ZeRO-1, accumulation, 3 buffers, one-page chunks", FL_BF16, 1, 2, FL_OPT_ADAMW, 3, 1,
         1, 1, 0, 0, 4, 1024, 0, 0},
        {"bf16 ZeRO-3 with the weights offloaded too, 4 buffers pipelined", FL_BF16, 3, 1,
         FL_OPT_ADAMW, 4, 1, 1, 1, 0, 0, 0, 3000, 1, 0},
        {"fp32 ZeRO-3 with the weights offloaded too, 2 buffers, one-page chunks", FL_F32, 3, 1,
         FL_OPT_ADAMW, 2, 1, 0, 1, 0, 0, 0, 2048, 1, 0},
        {"fp16 ZeRO-3 with the weights offloaded too, accumulation, one buffer", FL_F16, 3, 2,
         FL_OPT_ADAMW, 1, 0, 0, 1, 0, 0, 0, 1e9, 1, 0},
        {.name = "in the backward pass, bf16 ZeRO-1, pipelined",
         .dt = FL_BF16,
         .stage = 1,
         .accum = 1,
         .buffers = 4,
         .read_ahead = 1,
         .write_behind = 1,
         .chunk = 3000,
         .in_backward = 1},
        {.name = "in the backward pass, fp16 ZeRO-3 with the weights offloaded too",
         .dt = FL_F16,
         .stage = 3,
         .accum = 1,
         .buffers = 3,
         .read_ahead = 1,
         .write_behind = 1,
         .chunk = 2048,
         .weights = 1,
         .in_backward = 1},
        {.name = "in the backward pass against the usual step, fp32 ZeRO-1",
         .dt = FL_F32,
         .stage = 1,
         .accum = 1,
         .in_backward = 2},
        {.name = "in the backward pass against the usual step, bf16 ZeRO-2",
         .dt = FL_BF16,
         .stage = 2,
         .accum = 1,
         .in_backward = 2},
        {.name = "in the backward pass against the usual step, fp16 ZeRO-1",
         .dt = FL_F16,
         .stage = 1,
         .accum = 1,
         .in_backward = 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
    if (world == 1) {
        check_errors();
        check_resume();
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", nvme_dir);
    if (system(cmd) != 0) t_check(0, "removing %s", nvme_dir);
    return fl_comm_finalize(t_report());
}
