// size_text.c: byte counts as messages print them (core.h), one way for
// every message: an error that compares two sizes must never read "needs
// 0.01 GB, only 0.01 GB are free".
#include <stdio.h>
#include <string.h>

#include "fitlm/core.h"

const char *fl_size_text(size_t bytes, char *buf) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (bytes < 1024) {
        snprintf(buf, FL_SIZE_TEXT, "%zu bytes", bytes);
        return buf;
    }
    double v = (double)bytes / 1024.0;
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    // three significant digits, as rounded (9.996 is "10.0", not "10.00")
    int decimals = v < 9.995 ? 2 : v < 99.95 ? 1 : 0;
    snprintf(buf, FL_SIZE_TEXT, "%.*f %s", decimals, v, units[u]);
    return buf;
}

void fl_size_text_pair(size_t a, size_t b, char *text_a, char *text_b) {
    fl_size_text(a, text_a);
    fl_size_text(b, text_b);
    if (a != b && !strcmp(text_a, text_b)) {
        snprintf(text_a, FL_SIZE_TEXT, "%zu bytes", a);
        snprintf(text_b, FL_SIZE_TEXT, "%zu bytes", b);
    }
}
