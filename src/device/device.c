// device.c: the devices by name, and the one new models and optimizers use.
#include "fitlm/device.h"

#include <stdio.h>
#include <string.h>

static const fl_device *chosen;

const fl_device *fl_device_cpu(void) {
    return fl_device_cpu_table();
}

const fl_device *fl_device_default(void) {
    return chosen ? chosen : fl_device_cpu_table();
}

void fl_device_use(const fl_device *d) {
    chosen = d;
}

static void *clock_mark(void *ctx) {
    const fl_device *d = ctx;
    return d->event_record_timed(d, NULL);
}

static double clock_seconds(void *ctx, void *a, void *b) {
    const fl_device *d = ctx;
    double ms = d->event_elapsed_ms(d, a, b);
    d->event_destroy(d, a);
    d->event_destroy(d, b);
    return ms / 1e3;
}

const fl_profile_clock *fl_device_profile_clock(const fl_device *d) {
    static fl_profile_clock clock = {clock_mark, clock_seconds, NULL};
    if (d->host) return NULL;
    clock.ctx = (void *)d;
    return &clock;
}

static const fl_device *lookup(const char *name, char *why, size_t why_size) {
    if (!strcmp(name, "cpu")) return fl_device_cpu_table();
    if (!strcmp(name, "test")) return fl_device_test_table();
    if (!strcmp(name, "cuda")) return fl_device_cuda_table(why, why_size);
    snprintf(why, why_size,
             "unknown device '%s' (cpu, cuda, or test: the cpu's kernels on "
             "memory only the device table may touch)",
             name);
    return NULL;
}

int fl_device_available(const char *name, char *why, size_t why_size) {
    return lookup(name, why, why_size) != NULL;
}

const fl_device *fl_device_get(const char *name) {
    char why[256] = "";
    const fl_device *d = lookup(name, why, sizeof why);
    if (!d) fl_die("device: %s", why);
    return d;
}

// d's host_alloc and host_free behind the cpu table's alloc and free
static void *pinned_alloc(const fl_device *p, fl_mem_tag tag, size_t bytes) {
    const fl_device *d = p->state;
    return d->host_alloc(d, tag, bytes);
}

static void pinned_free(const fl_device *p, void *ptr) {
    const fl_device *d = p->state;
    d->host_free(d, ptr);
}

const fl_device *fl_device_pinned(const fl_device *d) {
    static fl_device t; // one device per process
    FL_ASSERT(!t.state || t.state == d);
    if (t.state) return &t;
    t = *fl_device_cpu_table();
    t.alloc = pinned_alloc;
    t.free = pinned_free;
    t.state = (void *)d;
    return &t;
}
