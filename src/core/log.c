// log.c: fatal errors and warnings. One place decides how the engine says
// that something is wrong, so every message has the same shape.
#include "fitlm/core.h"

#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

// Set by the communicator (src/parallel/comm.c) when several ranks run: messages
// name the rank, and a fatal error ends every rank at once.
static int log_rank = -1;
static void (*die_hook)(int code);

void fl_log_set_rank(int rank, void (*on_die)(int code)) {
    log_rank = rank;
    die_hook = on_die;
}

static void prefix(const char *kind) {
    if (log_rank >= 0)
        fprintf(stderr, "fitlm: rank %d: %s: ", log_rank, kind);
    else
        fprintf(stderr, "fitlm: %s: ", kind);
}

void fl_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    prefix("error");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    if (die_hook) die_hook(EXIT_FAILURE);
    // The process ends here, at once: every stream flushed, no exit handler
    // run (as fl_comm_finalize ends an MPI process). What the failed reader
    // or step still held (a file's text, a parsed JSON tree, a library's
    // caches) goes with the process; LeakSanitizer's exit check, which would
    // report it as lost, stays for the runs that end normally.
    fflush(NULL);
    _exit(EXIT_FAILURE);
}

void fl_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    prefix("warning");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

int fl_errorf(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}
