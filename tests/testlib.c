// testlib.c: see testlib.h.
#include "testlib.h"

#include "fitlm/optim.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

const char *t_source_path(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("FITLM_SOURCE_DIR");
    snprintf(buf, sizeof buf, "%s/%s", dir ? dir : ".", rel);
    return buf;
}

float t_adamw_step_fp32(void *adamw, const void *table, float *params, const float *grads, float lr,
                        float max_norm) {
    const fl_param_table *t = table;
    float norm = fl_grad_norm(FL_F32, grads, t->numel);
    fl_update_args a = {.params = params,
                        .grads = grads,
                        .grads_dtype = FL_F32,
                        .grad_scale = fl_clip_coef(norm, max_norm)};
    fl_adamw_step(adamw, t, &a, lr);
    return norm;
}
