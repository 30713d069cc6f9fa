// testlib.c: see testlib.h.
#include "testlib.h"

#include "fitlm/optim.h"
#include "fitlm/safetensors.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int n_passed, n_failed;

int t_check(int ok, const char *fmt, ...) {
    if (ok) {
        n_passed++;
        return 1;
    }
    n_failed++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return 0;
}

#define T_CLOSE_BODY                                                                               \
    double max_diff = 0.0;                                                                         \
    size_t bad = n;                                                                                \
    for (size_t i = 0; i < n; i++) {                                                               \
        double g = got[i], w = want[i], d = fabs(g - w);                                           \
        if (!(d <= atol + rtol * fabs(w))) {                                                       \
            if (bad == n) bad = i;                                                                 \
        }                                                                                          \
        if (d > max_diff || d != d) max_diff = d;                                                  \
    }                                                                                              \
    printf("  %-32s n=%-8zu max|diff|=%.3e (atol %.1e, rtol %.1e)\n", name, n, max_diff, atol,     \
           rtol);                                                                                  \
    if (bad != n)                                                                                  \
        return t_check(0, "%s[%zu]: got %.9g want %.9g", name, bad, (double)got[bad],              \
                       (double)want[bad]);                                                         \
    return t_check(1, "%s", name);

int t_close(const char *name, const float *got, const float *want, size_t n, double atol,
            double rtol) {
    T_CLOSE_BODY
}

int t_close_d(const char *name, const double *got, const double *want, size_t n, double atol,
              double rtol) {
    T_CLOSE_BODY
}

float *t_weights_f32(fl_model *m, fl_dist *d) {
    size_t D = fl_dtype_size(m->dtype);
    float *out = malloc(m->table.numel * sizeof(float));
    void *row = malloc(m->table.numel * D);
    for (int r = 0; r < m->table.count; r++) {
        const fl_param_view *v = &m->table.views[r];
        if (d)
            fl_dist_gather_row(d, r, row);
        else
            memcpy(row, fl_at(m->dtype, m->params, v->offset), v->numel * D);
        fl_convert(FL_F32, out + v->offset, m->dtype, row, v->numel);
    }
    free(row);
    return out;
}

void t_run_open(fl_run *run, const char *json, const char *flags, int alone) {
    char *copy = strdup(flags), *argv[128];
    int argc = 0;
    for (char *w = strtok(copy, " "); w && argc < 128; w = strtok(NULL, " ")) argv[argc++] = w;
    fl_train_config cfg;
    fl_config_defaults(&cfg);
    if (json) fl_config_load_json_text(&cfg, json, strlen(json), "the test's config");
    fl_config_parse_args(&cfg, argc, argv);
    fl_run_options opt = {.own_batches = 1, .alone = alone};
    fl_run_open(run, &cfg, &opt);
    free(copy);
}

int t_cpu_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void t_check_expected_isa(void) {
    const char *expect = getenv("FITLM_TEST_EXPECT_ISA");
    if (expect)
        t_check(!strcmp(fl_isa_name(fl_cpu_isa()), expect), "the CPU's ISA is %s, expected %s",
                fl_isa_name(fl_cpu_isa()), expect);
}

int t_main_under_isa_caps(int (*run_all)(const char *isa), void (*across)(int avx2, int avx512)) {
    if (getenv("FITLM_NO_SIMD")) return run_all("portable (FITLM_NO_SIMD)");
    if (getenv("FITLM_ISA")) {
        t_check_expected_isa();
        return run_all(getenv("FITLM_ISA"));
    }
    int avx2 = t_cpu_avx2();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    if (across) across(avx2, avx2 && avx512);
    const char *caps[] = {"portable", "avx2"};
    for (int k = 0; k < (avx2 && avx512 ? 2 : 1); k++) { // the widest is the parent's
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) return t_check(0, "fork failed"), t_report();
        if (pid == 0) {
            setenv("FITLM_ISA", caps[k], 1);
            exit(run_all(caps[k]));
        }
        int status = 0;
        waitpid(pid, &status, 0);
        t_check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s-path run failed", caps[k]);
    }
    return run_all("native");
}

int t_dies(const char *name, void (*fn)(void *), void *arg, const char *expect) {
    int fds[2];
    if (pipe(fds) != 0) return t_check(0, "%s: pipe failed", name);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        fn(arg);
        _exit(0); // returned: did not die
    }
    close(fds[1]);
    char msg[4096];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof msg - 1 && (r = read(fds[0], msg + n, sizeof msg - 1 - n)) > 0)
        n += (size_t)r;
    msg[n] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 1 && strstr(msg, expect);
    if (ok) printf("  %-32s refused: %s", name, msg);
    return t_check(ok, "%s: expected exit 1 with \"%s\", got status %d and: %s", name, expect,
                   status, msg);
}

int t_quick(void) {
    const char *q = getenv("FITLM_TEST_QUICK");
    return q && strcmp(q, "0") != 0;
}

int t_report(void) {
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 && n_passed > 0 ? 0 : 1;
}

void t_fill(float *x, size_t n, unsigned seed, float scale) {
    unsigned long long s = seed * 2654435761ull + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = scale * (2.0f * (float)((s >> 40) & 0xffffff) / 16777216.0f - 1.0f);
    }
}

static unsigned long long splitmix(unsigned long long *s) {
    unsigned long long z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void put_le(unsigned char *out, size_t len, size_t at, size_t k, unsigned long long v) {
    for (size_t i = 0; i < k && at + k <= len; i++) out[at + i] = (unsigned char)(v >> (8 * i));
}

size_t t_mutate(const unsigned char *in, size_t n, unsigned long long seed, unsigned char *out,
                size_t cap) {
    static const unsigned char bytes[] = {0x00, 0xff, '9', '"', '{', '}',  '[', ']',
                                          ',',  ':',  '-', '.', 'e', '\\', 0x80};
    const unsigned long long wide[] = {
        0, 1, 7, 8, n - 8, n - 7, n, n + 1, 100000001ull, 1ull << 31, 1ull << 63, ~0ull};
    const size_t n_wide = sizeof wide / sizeof wide[0];
    unsigned long long s = seed;
    size_t len = n < cap ? n : cap;
    memcpy(out, in, len);
    int edits = 1 + (int)(splitmix(&s) % 4);
    for (int e = 0; e < edits; e++) {
        size_t at = len ? (size_t)(splitmix(&s) % len) : 0, k;
        switch (splitmix(&s) % 9) {
        case 0: // bit flip
            if (len) out[at] ^= (unsigned char)(1u << (splitmix(&s) % 8));
            break;
        case 1: // an interesting byte
            if (len) out[at] = bytes[splitmix(&s) % sizeof bytes];
            break;
        case 2: // truncation
            len = at;
            break;
        case 3: // insertion of 1-8 bytes
            k = 1 + (size_t)(splitmix(&s) % 8);
            if (len + k > cap) break;
            memmove(out + at + k, out + at, len - at);
            for (size_t i = 0; i < k; i++) out[at + i] = bytes[splitmix(&s) % sizeof bytes];
            len += k;
            break;
        case 4: // deletion of up to 16 bytes
            k = (size_t)(splitmix(&s) % 17);
            if (k > len - at) k = len - at;
            memmove(out + at, out + at + k, len - at - k);
            len -= k;
            break;
        case 5: // a range copied over another place
            k = (size_t)(splitmix(&s) % 64);
            if (len && k <= len) {
                size_t from = (size_t)(splitmix(&s) % (len - k + 1)),
                       to = (size_t)(splitmix(&s) % (len - k + 1));
                memmove(out + to, out + from, k);
            }
            break;
        case 6: // the 8-byte length prefix
            put_le(out, len, 0, 8, wide[splitmix(&s) % n_wide]);
            break;
        case 7: // a 32- or 64-bit field, 4-aligned
            k = splitmix(&s) % 2 ? 8 : 4;
            put_le(out, len, at & ~(size_t)3, k, wide[splitmix(&s) % n_wide]);
            break;
        default: // a random byte
            if (len) out[at] = (unsigned char)splitmix(&s);
        }
    }
    return len;
}

const char *t_source_path(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("FITLM_SOURCE_DIR");
    snprintf(buf, sizeof buf, "%s/%s", dir ? dir : ".", rel);
    return buf;
}

// t_fitlm, ended by coreutils' timeout after `seconds` (0: no limit)
static int fitlm_within(const char *dir, const char *args, int seconds, int with_stderr, char *out,
                        size_t size) {
    const char *bin = getenv("FITLM_BINARY");
    size_t n = strlen(dir) + strlen(args) + (bin ? strlen(bin) : 5) + 64;
    char *cmd = malloc(n);
    char limit[32] = "";
    if (seconds > 0) snprintf(limit, sizeof limit, "timeout -k 2 %d ", seconds);
    snprintf(cmd, n, "cd %s && %s%s %s %s", dir, limit, bin ? bin : "fitlm", args,
             with_stderr ? "2>&1" : "2>/dev/null");
    FILE *p = popen(cmd, "r");
    free(cmd);
    if (!p) return -1;
    size_t got = fread(out, 1, size - 1, p);
    out[got] = 0;
    char sink[4096]; // the rest is read, so the command never blocks on a full pipe
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int t_fitlm(const char *dir, const char *args, int with_stderr, char *out, size_t size) {
    return fitlm_within(dir, args, 0, with_stderr, out, size);
}

int t_fitlm_fails_within(const char *dir, const char *args, int seconds, const char *what,
                         char *out, size_t size) {
    int rc = fitlm_within(dir, args, seconds, 1, out, size);
    // the sanitizer build's: an error exit reports no leak (LeakSanitizer's
    // exit status, 23, is not 1 either)
    return t_check(rc == 1 && strstr(out, "fitlm: error:") && strstr(out, what) &&
                       !strstr(out, "LeakSanitizer"),
                   "'fitlm %s' should fail saying \"%s\"; got status %d%s and: %.400s", args, what,
                   rc, rc == 124 ? " (still running at the time limit)" : "", out);
}

int t_fitlm_fails(const char *dir, const char *args, const char *what, char *out, size_t size) {
    return t_fitlm_fails_within(dir, args, 0, what, out, size);
}

float t_adamw_step_fp32(void *adamw, const void *table, float *params, const float *grads, float lr,
                        float max_norm) {
    const fl_param_table *t = table;
    fl_optim_rule *rule = &((fl_adamw *)adamw)->rule;
    float norm = fl_grad_norm(FL_F32, grads, t->numel), coef = fl_clip_coef(norm, max_norm);
    fl_optim_begin_step(rule, lr);
    for (int i = 0; i < t->count; i++) {
        const fl_param_view *v = &t->views[i];
        fl_update_args a = {.params = params + v->offset,
                            .grads = grads + v->offset,
                            .grads_dtype = FL_F32,
                            .grad_scale = coef};
        fl_optim_update(rule, v, v->offset, v->numel, &a);
    }
    fl_optim_end_step(rule);
    return norm;
}

unsigned char *t_read_file(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(size > 0 ? (size_t)size + 1 : 1);
    if (size > 0 && fread(b, 1, (size_t)size, f) == (size_t)size) *n = (size_t)size;
    b[*n] = 0;
    fclose(f);
    return b;
}

void t_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(data, 1, n, f);
    fclose(f);
}

void t_write_text(const char *path, const char *text) {
    t_write_file(path, text, strlen(text));
}

void t_mark_temporary(const char *path, long pid) {
    char mark[4200], text[128];
    mkdir(path, 0755);
    snprintf(mark, sizeof mark, "%s/.fitlm-dir", path);
    snprintf(text, sizeof text, "fitlm temporary directory\npid %ld\nboot x\nstart 0\n", pid);
    t_write_text(mark, text);
}

int t_remove_dir(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

void t_mutations(const char *what, const char *path, int count, unsigned long long seed,
                 int (*parse)(const unsigned char *, size_t, char *, size_t)) {
    size_t n;
    unsigned char *good = t_read_file(path, &n);
    char err[512];
    if (!t_check(good && n > 0 && parse(good, n, err, sizeof err) == 0, "%s: %s parses: %s", what,
                 path, err)) {
        free(good);
        return;
    }
    size_t cap = n + 64;
    unsigned char *scratch = malloc(cap);
    int ok = 0, refused = 0, bad = 0;
    for (int i = 0; i < count; i++) {
        size_t len = t_mutate(good, n, seed + (unsigned long long)i, scratch, cap);
        // an exact-size copy, so that ASan sees any read past the end
        unsigned char *b = malloc(len ? len : 1);
        memcpy(b, scratch, len);
        err[0] = 0;
        int rc = parse(b, len, err, sizeof err);
        if (rc == 0)
            ok++;
        else if (rc == -1 && err[0])
            refused++;
        else if (bad++ == 0)
            t_check(0, "%s: mutation %d: rc %d, message '%s'", what, i, rc, err);
        free(b);
    }
    printf("  %-22s %d mutations: %d accepted, %d refused with a message\n", what, count, ok,
           refused);
    t_check(bad == 0 && refused > count / 2, "%s: %d mutations, %d broken results", what, count,
            bad);
    free(scratch), free(good);
}

void t_write_st(const char *path, const char *header, size_t data) {
    size_t h = strlen(header);
    unsigned char *b = calloc(1, 8 + h + data);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    t_write_file(path, b, 8 + h + data);
    free(b);
}

typedef struct {
    const fl_safetensors *src;
    const fl_st_tensor *from[64]; // source tensor of each output tensor
    int flip;
} rewrite_ctx;

static void rewrite_fill(void *p, int i, void *dst) {
    const rewrite_ctx *x = p;
    const fl_st_tensor *t = x->from[i];
    memcpy(dst, x->src->data + t->begin, t->end - t->begin);
    if (x->flip && x->from[i + 1] == NULL) ((unsigned char *)dst)[0] ^= 1;
}

void t_st_rewrite(const char *src_path, const char *out, const t_st_edit *e) {
    fl_safetensors src;
    fl_safetensors_open(&src, src_path);
    fl_st_tensor ts[64];
    rewrite_ctx x = {.src = &src, .flip = e->flip};
    int n = 0;
    for (int i = 0; i < src.count && n < 62; i++) {
        const fl_st_tensor *t = &src.tensors[i];
        if (e->drop && strcmp(t->name, e->drop) == 0) continue;
        ts[n] = *t;
        if (e->from && strcmp(t->name, e->from) == 0) ts[n].name = e->to;
        if (e->transpose && strcmp(t->name, e->transpose) == 0)
            ts[n].shape[0] = t->shape[1], ts[n].shape[1] = t->shape[0];
        x.from[n++] = t;
    }
    if (e->copy) {
        const fl_st_tensor *c = fl_safetensors_find(&src, e->copy);
        t_check(c != NULL, "rewrite: '%s' is in %s", e->copy, src_path);
        ts[n] = *c;
        ts[n].name = e->copy_as;
        x.from[n++] = c;
    }
    x.from[n] = NULL;
    fl_safetensors_write(out, ts, n, rewrite_fill, &x);
    fl_safetensors_free(&src);
}

void t_st_stored(const fl_safetensors *st, const char *what, const char *name, int ndim,
                 uint64_t d0, uint64_t d1) {
    const fl_st_tensor *t = fl_safetensors_find(st, name);
    if (ndim == 0) {
        t_check(!t, "%s: '%s' is not stored", what, name);
        return;
    }
    t_check(t && t->ndim == ndim && t->shape[0] == d0 && (ndim == 1 || t->shape[1] == d1),
            "%s: '%s' is stored with shape [%llu, %llu]", what, name, (unsigned long long)d0,
            (unsigned long long)d1);
}

void t_rule_batch(uint64_t seed, size_t n, int V, int *inputs, int *targets) {
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        inputs[i] = (int)(s % (uint64_t)V);
        targets[i] = (s >> 20) % 11 == 0 ? -1 : (inputs[i] * 7 + 3) % V;
    }
}

typedef struct {
    const float *whole;
    float *out;
} slice_copy;

static void copy_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                       size_t count) {
    slice_copy *s = ctx;
    for (size_t k = 0; k < count / run; k++)
        memcpy(s->out + local + k * run, s->whole + first + k * stride, run * sizeof(float));
}

void t_slice_row(const fl_param_table *lt, int row, const float *whole_row, float *out_row) {
    slice_copy s = {whole_row, out_row};
    fl_params_blocks(lt, row, 0, lt->views[row].numel, copy_block, &s);
}

double t_rel_diff(const float *a, const float *b, size_t n) {
    double d = 0.0, s = 0.0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        s += (double)b[i] * b[i];
    }
    return sqrt(d / s);
}
