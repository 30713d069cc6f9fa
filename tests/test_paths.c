// test_paths.c: fitlm writes, replaces and deletes only what it can prove
// its own (fitlm/io.h, "what fitlm may write"): a user's files named like a
// killed writer's leftovers (DIR.old.2024, DIR.tmp.1, NAME.tmp.<n>) are left
// alone, while real leftovers are still recovered; links, hard links and
// FIFOs planted in an output directory are never written through; and an
// error about a file that failed validation never echoes its bytes.
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_paths_XXXXXX";
static char output[1 << 16];
static char run_args[1024];

#define SECRET "SECRET-do-not-touch\n"

static int fitlmf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fitlmf(const char *fmt, ...) {
    char args[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return t_fitlm(dir, args, 1, output, sizeof output);
}

static const char *at(const char *name) {
    static char paths[8][2048];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, sizeof paths[0], "%s/%s", dir, name);
    return p;
}

static void put(const char *name, const char *text) {
    t_write_text(at(name), text);
}

// Whether the file holds exactly text (read without following a link at
// its own name: a link is checked through its target by the caller).
static int holds(const char *name, const char *text) {
    size_t n;
    unsigned char *b = t_read_file(at(name), &n);
    int ok = b && n == strlen(text) && !memcmp(b, text, n);
    free(b);
    return ok;
}

static int is_link(const char *name) {
    struct stat st;
    return lstat(at(name), &st) == 0 && S_ISLNK(st.st_mode);
}

static int exists(const char *name) {
    struct stat st;
    return lstat(at(name), &st) == 0;
}

static void mkd(const char *name) {
    mkdir(at(name), 0755);
}

// A pid no process has: a child that has exited and been reaped.
static long dead_pid(void) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    waitpid(pid, NULL, 0);
    return (long)pid;
}

// Whether pid is a zombie (exited, not reaped).
static int is_zombie(pid_t pid) {
    char path[64], text[512] = "";
    snprintf(path, sizeof path, "/proc/%ld/stat", (long)pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    text[n] = 0;
    const char *p = strrchr(text, ')');
    return p && p[1] && p[2] == 'Z';
}

// The marker a living process (pid) would have written: its real boot id
// and start time (start + skew: a pid reused by another process).
static void mark_living(const char *name, long pid, long long skew) {
    char path[1200], text[256], boot[64] = "", stat[1024] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f && fgets(boot, sizeof boot, f)) boot[strcspn(boot, "\n")] = 0;
    if (f) fclose(f);
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    f = fopen(path, "r");
    size_t n = f ? fread(stat, 1, sizeof stat - 1, f) : 0;
    if (f) fclose(f);
    stat[n] = 0;
    unsigned long long t = 0;
    const char *p = strrchr(stat, ')');
    if (p)
        sscanf(p + 1,
               " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
               &t);
    mkd(name);
    snprintf(path, sizeof path, "%s/.fitlm-dir", at(name));
    snprintf(text, sizeof text, "fitlm temporary directory\npid %ld\nboot %s\nstart %llu\n", pid,
             boot, t + (unsigned long long)skew);
    t_write_text(path, text);
}

// ----------------------------------------------------------------------------
// item 2: directory transactions and temporary files touch only their own

// User's directories and files beside DIR named like leftovers; each holds
// SECRET. Returns how many were planted (names in out).
static int plant_lookalikes(const char *base, char names[][128]) {
    long dead = dead_pid(), other = dead_pid(), living = (long)getppid();
    int n = 0;
    char inner[300];
    // directories without a marker: numbers like years, pid 1 (alive),
    // a dead pid, a living one
    const long dirs[] = {2024, 1, dead, living};
    const char *kinds[] = {"old", "tmp"};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 4; i++) {
            snprintf(names[n], 128, "%s.%s.%ld", base, kinds[k], dirs[i]);
            mkd(names[n]);
            snprintf(inner, sizeof inner, "%s/x", names[n++]);
            put(inner, SECRET);
        }
    // regular files so named
    snprintf(names[n], 128, "%s.tmp.%ld", base, other);
    put(names[n++], SECRET);
    snprintf(names[n], 128, "%s.old.2023", base);
    put(names[n++], SECRET);
    // a marked directory whose marker names another pid than its name
    snprintf(names[n], 128, "%s.old.%ld", base, dead + 100000);
    t_mark_temporary(at(names[n]), other);
    snprintf(inner, sizeof inner, "%s/x", names[n++]);
    put(inner, SECRET);
    // a marker that is a link to a valid marker
    snprintf(names[n], 128, "%s.tmp.%ld", base, other + 100000);
    mkd(names[n]);
    snprintf(inner, sizeof inner, "%s/.fitlm-dir", names[n]);
    put("valid_mark", "fitlm temporary directory\npid 1\nboot x\nstart 0\n");
    symlink(at("valid_mark"), at(inner));
    snprintf(inner, sizeof inner, "%s/x", names[n++]);
    put(inner, SECRET);
    return n;
}

static int lookalikes_intact(char names[][128], int n) {
    int ok = 1;
    char inner[300];
    for (int i = 0; i < n; i++) {
        struct stat st;
        if (lstat(at(names[i]), &st) != 0) {
            printf("  %s is gone\n", names[i]);
            ok = 0;
            continue;
        }
        snprintf(inner, sizeof inner, "%s/x", names[i]);
        int same = S_ISDIR(st.st_mode) ? holds(inner, SECRET) : holds(names[i], SECRET);
        if (!same) printf("  %s changed\n", names[i]);
        ok &= same;
    }
    return ok;
}

static int in_set_all(const char *name) {
    (void)name;
    return 1;
}

// One transaction on DIR writing f = text.
static void write_set(const char *name, const char *text) {
    fl_dir_txn t;
    const char *to = fl_dir_begin(&t, at(name), in_set_all);
    char path[1200];
    snprintf(path, sizeof path, "%s/f", to);
    fl_file_write_all(path, text, strlen(text));
    fl_dir_commit(&t);
}

static void test_dir_transactions_touch_only_their_own(void) {
    char names[32][128];
    // DIR present, then DIR absent: the look-alikes stay as they are, and
    // DIR is the new set (never a user's DIR.old.<n> renamed into it)
    for (int absent = 0; absent < 2; absent++) {
        const char *base = absent ? "gone" : "set";
        if (!absent) write_set(base, "first\n");
        int n = plant_lookalikes(base, names);
        for (int pass = 0; pass < 2; pass++) write_set(base, pass ? "third\n" : "second\n");
        char f[200];
        snprintf(f, sizeof f, "%s/f", base);
        t_check(lookalikes_intact(names, n) && holds(f, "third\n"),
                "DIR %s: %d directories and files named like leftovers (%s.old.2024, .tmp.1, of "
                "dead pids, unmarked or mismarked) are untouched; DIR is the new set",
                absent ? "absent" : "present", n, base);
        snprintf(f, sizeof f, "%s/x", base);
        t_check(!exists(f), "DIR %s: no look-alike was renamed into it", base);
    }
    // real leftovers still go: marked by a dead writer, by a living pid
    // whose start time differs (reused), or empty (killed before marking)
    long dead = dead_pid(), empty = dead_pid();
    char a[128], b[128], c[128], d[128], e[128], inner[300];
    write_set("real", "v1\n");
    snprintf(a, sizeof a, "real.tmp.%ld", dead);
    t_mark_temporary(at(a), dead);
    snprintf(inner, sizeof inner, "%s/f", a);
    put(inner, "partial");
    snprintf(b, sizeof b, "real.old.%ld", dead);
    t_mark_temporary(at(b), dead);
    snprintf(c, sizeof c, "real.old.%ld", (long)getppid());
    mark_living(c, (long)getppid(), 0); // a writer still at work
    snprintf(d, sizeof d, "real.tmp.%ld", (long)getppid());
    mark_living(d, (long)getppid(), 12345); // its pid reused since
    snprintf(e, sizeof e, "real.tmp.%ld", empty);
    mkd(e);
    write_set("real", "v2\n");
    t_check(!exists(a) && !exists(b) && exists(c) && !exists(d) && !exists(e) &&
                holds("real/f", "v2\n"),
            "a dead writer's marked leftovers (and an empty one) are removed, a living "
            "writer's stays, a reused pid's goes");
    fl_tmp_remove_tree(at(c));
    // a writer killed but not yet reaped (a zombie: its parent, mpirun say,
    // exited first and left it to init) cannot write: its leftover goes
    pid_t zombie = fork();
    if (zombie == 0) _exit(0);
    char z[128];
    snprintf(z, sizeof z, "real.tmp.%ld", (long)zombie);
    for (int i = 0; i < 500 && !is_zombie(zombie); i++) usleep(2000);
    mark_living(z, (long)zombie, 0);
    snprintf(inner, sizeof inner, "%s/f", z);
    put(inner, "partial");
    fl_tmp_clean(dir);
    t_check(is_zombie(zombie) && !exists(z), "a zombie writer's marked leftover is removed");
    waitpid(zombie, NULL, 0);
    // an empty leftover (a writer killed between its mkdir and its marker)
    // whose pid a process took since, started after the directory was made,
    // goes; an empty one of a process that started before it stays
    pid_t later = fork();
    if (later == 0) {
        pause();
        _exit(0);
    }
    char taken[128], own[128];
    snprintf(taken, sizeof taken, "real.tmp.%ld", (long)later);
    mkd(taken);
    struct timespec ago[2] = {{time(NULL) - 60, 0}, {time(NULL) - 60, 0}};
    t_check(utimensat(AT_FDCWD, at(taken), ago, 0) == 0, "date %s a minute back", taken);
    snprintf(own, sizeof own, "real.tmp.%ld", (long)getppid());
    mkd(own);
    write_set("real", "v2\n");
    t_check(!exists(taken) && exists(own),
            "an empty leftover of a pid reused since goes, a running writer's own stays");
    kill(later, SIGKILL);
    waitpid(later, NULL, 0);
    rmdir(at(own));
    // DIR missing beside a marked DIR.old.<dead>: a kill between the two
    // renames; the old set is restored, its marker removed
    t_check(rename(at("real"), at(b)) == 0, "move real aside");
    t_mark_temporary(at(b), dead);
    fl_dir_recover(at("real"));
    t_check(holds("real/f", "v2\n") && !exists("real/.fitlm-dir") && !exists(b),
            "a marked DIR.old.<dead pid> with DIR missing is restored, without its marker");
    // a link named like a leftover, to a marked directory: neither followed
    // nor removed
    snprintf(a, sizeof a, "real.tmp.%ld", dead);
    t_mark_temporary(at("elsewhere"), dead);
    put("elsewhere/x", SECRET);
    symlink(at("elsewhere"), at(a));
    write_set("real", "v3\n");
    t_check(is_link(a) && holds("elsewhere/x", SECRET) && exists("elsewhere/.fitlm-dir"),
            "a link named DIR.tmp.<dead pid> to a marked directory is left alone");
}

static void train_small(const char *out, const char *extra) {
    int rc = fitlmf("%s --steps 2 --out %s %s", run_args, out, extra);
    t_check(rc == 0, "train into %s: %.300s", out, output);
}

static void test_cli_leaves_lookalikes(void) {
    char names[32][128];
    // export -o results, with results present and absent
    for (int absent = 0; absent < 2; absent++) {
        const char *base = absent ? "exp" : "results";
        if (!absent) fitlmf("export run0 -o %s", base);
        int n = plant_lookalikes(base, names);
        // the user's files inside it named like the export's own
        const char *inside[] = {"config.json.bak", "model-card.md", "model.safetensors.orig"};
        for (int i = 0; i < 3 && !absent; i++) {
            snprintf(names[n], 128, "%s/%s", base, inside[i]);
            put(names[n++], SECRET);
        }
        int rc = fitlmf("export run0 -o %s", base);
        char cfg[200];
        snprintf(cfg, sizeof cfg, "%s/config.json", base);
        struct stat st;
        t_check(rc == 0 && lookalikes_intact(names, n) && lstat(at(cfg), &st) == 0 &&
                    !strstr(output, "restored"),
                "export -o %s (%s): the user's look-alikes are untouched: %.300s", base,
                absent ? "absent" : "present", output);
    }
    // OUT/adapter, the set a LoRA run writes: present (a run again) and absent
    for (int absent = 0; absent < 2; absent++) {
        const char *run = absent ? "lora1" : "lora0";
        if (absent)
            mkd(run);
        else
            train_small(run, "--lora");
        char base[64], cfg[96];
        snprintf(base, sizeof base, "%s/adapter", run);
        snprintf(cfg, sizeof cfg, "%s/adapter_config.json", base);
        int n = plant_lookalikes(base, names);
        if (absent) unlink(at(cfg));
        train_small(run, "--lora --overwrite");
        t_check(lookalikes_intact(names, n) && exists(cfg),
                "%s (%s): the user's look-alikes beside it are untouched", base,
                absent ? "absent" : "present");
    }
    // OUT/adapter planted as a link to the user's directory: refused, its
    // target untouched (the run names OUT; OUT/adapter is fitlm's own)
    mkd("lora2");
    mkd("victim");
    put("victim/adapter_config.json", SECRET);
    symlink(at("victim"), at("lora2/adapter"));
    int rc = fitlmf("%s --steps 2 --out lora2 --lora", run_args);
    t_check(rc == 1 && strstr(output, "lora2/adapter is a symbolic link") &&
                holds("victim/adapter_config.json", SECRET) &&
                !exists("victim/adapter_model.safetensors") && is_link("lora2/adapter"),
            "a link at OUT/adapter is not followed (status %d): %.300s", rc, output);
    // tokenize -o tok
    put("in.txt", "one document\n\nanother document\n\na third one here\n");
    fitlmf("tokenize in.txt -o tok --tokenizer byte --val-fraction 0");
    int n = plant_lookalikes("tok", names);
    const char *inside[] = {"train_notes.txt", "val_old.bin", "train_000000.bin.orig"};
    for (int i = 0; i < 3; i++) {
        snprintf(names[n], 128, "tok/%s", inside[i]);
        put(names[n++], SECRET);
    }
    rc = fitlmf("tokenize in.txt -o tok --tokenizer byte --val-fraction 0");
    t_check(rc == 0 && lookalikes_intact(names, n) && exists("tok/train_000000.bin"),
            "tokenize -o tok: the user's look-alikes are untouched: %.300s", output);
    // a run directory: files named like fitlm's temporaries that are not
    // (no marker) stay; a killed writer's marked one and an empty one go
    mkd("r2");
    long dead = dead_pid();
    char user[6][128], inner[300];
    snprintf(user[0], 128, "r2/log.txt.tmp.2024");
    snprintf(user[1], 128, "r2/ckpt_00000001.fitlm.tmp.1");
    snprintf(user[2], 128, "r2/latest.tmp.%ld", dead);
    snprintf(user[3], 128, "r2/metrics.jsonl.tmp.%ld", dead);
    snprintf(user[4], 128, "r2/notes.tmp.%ld", dead);
    for (int i = 0; i < 3; i++) put(user[i], SECRET);
    for (int i = 3; i < 5; i++) {
        mkd(user[i]);
        snprintf(inner, sizeof inner, "%s/x", user[i]);
        put(inner, SECRET);
    }
    char real[128], hollow[128];
    snprintf(real, sizeof real, "r2/ckpt_00000099.fitlm.tmp.%ld", dead);
    t_mark_temporary(at(real), dead);
    snprintf(inner, sizeof inner, "%s/ckpt_00000099.fitlm", real);
    put(inner, "partial");
    snprintf(hollow, sizeof hollow, "r2/latest.tmp.%ld", dead_pid());
    mkd(hollow);
    train_small("r2", "--overwrite");
    int ok = 1;
    for (int i = 0; i < 5; i++) {
        snprintf(inner, sizeof inner, "%s/x", user[i]);
        ok &= i < 3 ? holds(user[i], SECRET) : holds(inner, SECRET);
    }
    t_check(ok && !exists(real) && !exists(hollow),
            "a run directory: the user's NAME.tmp.<n> files and directories stay, a killed "
            "writer's marked (and an empty) temporary goes");
}

// ----------------------------------------------------------------------------
// item 3: links, hard links and FIFOs planted in output directories

static int secret_intact(void) {
    return holds("secret", SECRET);
}

static void plant(const char *name, int kind) { // 0 symlink, 1 hard link, 2 FIFO
    unlink(at(name));
    if (kind == 0) symlink(at("secret"), at(name));
    if (kind == 1) link(at("secret"), at(name));
    if (kind == 2) mkfifo(at(name), 0644);
}

static void test_run_dir_links(void) {
    const char *kinds[] = {"a symlink", "a hard link", "a FIFO"};
    const struct {
        const char *name, *refusal[3];
    } cases[] = {
        {".lock", {"is a symbolic link", "not a regular file of one link", "not a regular file"}},
        {"log.txt", {"is not a regular file", NULL, "is not a regular file"}},
        {"metrics.jsonl", {"is not a regular file", NULL, "is not a regular file"}},
    };
    train_small("linked_run", "--save-every 1");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int k = 0; k < 3; k++)
            for (int resume = 0; resume < 2; resume++) {
                char name[200];
                snprintf(name, sizeof name, "links/%s", cases[c].name);
                fl_tmp_remove_tree(at("links"));
                char cmd[300]; // a copy of one run, to resume
                snprintf(cmd, sizeof cmd, "cp -a %s %s", at("linked_run"), at("links"));
                if (resume && system(cmd) != 0) t_check(0, "%s", cmd);
                mkd("links");
                plant(name, k);
                int rc = resume ? fitlmf("%s --resume links --steps 3", run_args)
                                : fitlmf("%s --steps 2 --out links --overwrite", run_args);
                const char *want = cases[c].refusal[k];
                int ok = want ? rc == 1 && strstr(output, want) && strstr(output, name)
                              : rc == 0 && !is_link(name);
                t_check(ok && secret_intact() && !strstr(output, "SECRET"),
                        "%s at RUN/%s (%s): %s, the target unchanged (status %d): %.300s", kinds[k],
                        cases[c].name, resume ? "resume" : "new run", want ? "refused" : "replaced",
                        rc, output);
            }
    fl_tmp_remove_tree(at("links"));
}

// In a child (t_dies): a link at this process's temporary name of path,
// then a write of path.
static void write_through_planted_tmp(void *arg) {
    const char *path = arg;
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    symlink(at("secretdir"), tmp);
    fl_file_write_all(path, "new\n", 4);
}

static void ckpt_through_planted_tmp(void *arg) {
    (void)arg;
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s/latest.tmp.%ld", at("ck"), (long)getpid());
    symlink(at("secretdir"), tmp);
    static const float x[2] = {1, 2};
    fl_ckpt_tensor t = {"x", FL_F32, x, 2};
    fl_ckpt_write(at("ck"), 1, NULL, &t, 1, 0);
}

static void test_file_temporaries(void) {
    mkd("secretdir");
    put("secretdir/x", SECRET);
    mkd("tmps");
    mkd("ck");
    t_dies("a link at a file's temporary name", write_through_planted_tmp,
           (void *)at("tmps/metrics.jsonl"), "already there");
    t_dies("a link at `latest`'s temporary name", ckpt_through_planted_tmp, NULL, "latest");
    t_check(holds("secretdir/x", SECRET) && !exists("secretdir/metrics.jsonl") &&
                !exists("secretdir/latest") && !exists("secretdir/.fitlm-dir"),
            "nothing is written through a link at a temporary's name");
}

static void test_outputs_replace_links(void) {
    // plot: every image over a link
    const char *imgs[] = {"loss.png", "loss.svg", "lr.png", "memory.svg"};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 4; i++) {
            char name[100];
            snprintf(name, sizeof name, "run0/%s", imgs[i]);
            plant(name, k);
        }
        int rc = fitlmf("plot run0");
        t_check(rc == 0 && secret_intact() && !is_link("run0/loss.png") &&
                    exists("run0/memory.svg"),
                "plot over %s at its images: written beside, the target unchanged: %.300s",
                k ? "hard links" : "symlinks", output);
    }
    // export in place (a directory with a subdirectory is not swapped whole)
    mkd("inplace");
    mkd("inplace/sub");
    plant("inplace/model.safetensors", 0);
    plant("inplace/config.json", 1);
    int rc = fitlmf("export run0 -o inplace");
    t_check(rc == 0 && secret_intact() && !is_link("inplace/model.safetensors"),
            "export in place over planted links: the targets unchanged: %.300s", output);
    // tokenize in place, with a learnt vocabulary
    put("in.txt", "one document\n\nanother document\n\na third one here\n");
    mkd("tokin");
    mkd("tokin/sub");
    plant("tokin/train_000000.bin", 0);
    plant("tokin/encoder.json", 0);
    plant("tokin/vocab.bpe", 1);
    rc = fitlmf("tokenize in.txt -o tokin --learn-vocab 260 --val-fraction 0");
    t_check(rc == 0 && secret_intact() && !is_link("tokin/train_000000.bin"),
            "tokenize in place over planted links: the targets unchanged: %.300s", output);
}

// ----------------------------------------------------------------------------
// item 12: `latest` is read only as fitlm writes it, and never echoed

static void test_latest_never_echoed(void) {
    train_small("lat", "");
    rename(at("lat/latest"), at("lat/latest.good"));
    const struct {
        const char *text, *want;
    } cases[] = {
        {NULL, "is a symbolic link"},
        {"hunter2-secret-key\n", "19 bytes that are not a name"},
        {"ckpt_00000002.fitlm\nSECRET", "26 bytes that are not a name"},
        {"-----BEGIN KEY-----\nSECRET\n", "bytes that are not a name"},
        {"ckpt_9.bin\n", "'ckpt_9.bin'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unlink(at("lat/latest"));
        if (cases[i].text)
            put("lat/latest", cases[i].text);
        else
            plant("lat/latest", 0);
        int rc = fitlmf("sample --checkpoint lat --tokens 2");
        int rc2 = fitlmf("%s --resume lat --steps 3", run_args);
        t_check(rc == 1 && rc2 == 1 && strstr(output, cases[i].want) && !strstr(output, "SECRET") &&
                    !strstr(output, "hunter2") && secret_intact(),
                "a `latest` of %s: refused without echoing it (%s): %.300s",
                cases[i].text ? "bad bytes" : "a link", cases[i].want, output);
    }
    rename(at("lat/latest.good"), at("lat/latest"));
    // the lock's holder: only a pid is quoted
    int fd = open(at("lat/.lock"), O_RDWR);
    t_check(fd >= 0 && flock(fd, LOCK_EX) == 0 && pwrite(fd, "SECRET\n", 7, 0) == 7,
            "hold lat/.lock");
    int rc = fitlmf("%s --resume lat --steps 3", run_args);
    t_check(rc == 1 && strstr(output, "in use by another fitlm run (process unknown)") &&
                !strstr(output, "SECRET"),
            "a held lock holding no pid: not quoted: %.300s", output);
    close(fd);
}

// An output path whose parents are missing is made whole (mkdir -p, as
// os.makedirs): --out, export -o, tokenize -o and plot -o; a parent that is
// a file is an error naming it.
static void test_output_parents(void) {
    train_small("deep/er/run", "");
    int rc = fitlmf("export run0 -o e1/e2/exp");
    int rc2 = fitlmf("tokenize in.txt -o t1/t2/tok --tokenizer byte --val-fraction 0");
    int rc3 = fitlmf("plot run0 -o p1/p2");
    t_check(exists("deep/er/run/latest") && rc == 0 && exists("e1/e2/exp/config.json") &&
                rc2 == 0 && exists("t1/t2/tok/train_000000.bin") && rc3 == 0 &&
                exists("p1/p2/loss.png"),
            "missing parents are made (status %d %d %d): %.300s", rc, rc2, rc3, output);
    put("afile", "x");
    rc = fitlmf("export run0 -o afile/sub/exp");
    t_check(rc == 1 && strstr(output, "afile") && holds("afile", "x"),
            "a parent that is a file is an error naming it (status %d): %.300s", rc, output);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    snprintf(run_args, sizeof run_args,
             "train --model tiny --tokenizer byte --data %s --batch 2 --seq-len 16 "
             "--eval-every 0 --sample-tokens 0 --threads 1 --peak-tflops 1",
             t_source_path("data/brown_byte"));
    put("secret", SECRET);
    train_small("run0", "");
    test_dir_transactions_touch_only_their_own();
    test_cli_leaves_lookalikes();
    test_run_dir_links();
    test_file_temporaries();
    test_outputs_replace_links();
    test_latest_never_echoed();
    test_output_parents();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
