// shape.c: the names of architectures and recomputation policies.
#include <string.h>

#include "fitlm/shape.h"

static const char *const ARCH_NAMES[] = {"gpt2", "llama"}; // by fl_arch_kind
static const char *const RECOMPUTE_NAMES[] = {"none", "selective", "block"};

static int find(const char *const *names, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

const char *fl_arch_name(fl_arch_kind arch) {
    return ARCH_NAMES[arch];
}

int fl_arch_parse(const char *name, fl_arch_kind *out) {
    int i = find(ARCH_NAMES, 2, name);
    if (i >= 0) *out = (fl_arch_kind)i;
    return i < 0 ? -1 : 0;
}

const char *fl_recompute_name(fl_recompute r) {
    return RECOMPUTE_NAMES[r];
}

int fl_recompute_parse(const char *name, fl_recompute *out) {
    int i = find(RECOMPUTE_NAMES, 3, name);
    if (i >= 0) *out = (fl_recompute)i;
    return i < 0 ? -1 : 0;
}
