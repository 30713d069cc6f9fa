// alloc.c: the tagged allocator. Each block carries a small header (its tag
// and size) in front of the 64-byte aligned pointer handed out, so fl_free
// can uncount it without a lookup table. Counters are updated under a lock;
// allocation is rare (set-up time), never inside a kernel.
//
// Blocks of HUGE_PAGE bytes or more start on a 2 MiB boundary and are backed by
// transparent huge pages where the kernel offers them (madvise mode, the
// Debian default, gives them only to regions that ask). The GEMMs' packing
// walks down columns of large row-major matrices (a row of the LM head's
// logits is 200 KiB): with 4 KiB pages nearly every row it touches is a TLB
// miss. FITLM_THP=0 turns this off (for comparison).
#include "fitlm/core.h"

#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>

#define ALIGN     64
#define HUGE_PAGE ((size_t)2 << 20)

typedef struct {
    size_t bytes;
    uint32_t tag;
    uint32_t magic;
} block_header;

#define HEADER_MAGIC 0xf17a110cu

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t current[FL_MEM_NTAGS], peak[FL_MEM_NTAGS], total_current, total_peak;
// the same for device memory (fl_mem_device_count)
static size_t dev_current[FL_MEM_NTAGS], dev_peak[FL_MEM_NTAGS], dev_total_current, dev_total_peak;
static size_t dev_cap;      // --mem-limit on a device: the most its blocks may total (0: none)
static size_t dev_reserved; // what the device holds outside its blocks (its context), under the cap
// the part of the host's that is pinned (fl_mem_pinned_count)
static size_t pin_current[FL_MEM_NTAGS], pin_peak[FL_MEM_NTAGS], pin_total_peak, pin_total_current;

static const char *tag_names[FL_MEM_NTAGS] = {
    "params", "grads", "master", "optim", "acts", "workspace", "comm", "offload", "other",
};

const char *fl_mem_tag_name(fl_mem_tag tag) {
    return (unsigned)tag < FL_MEM_NTAGS ? tag_names[tag] : "?";
}

// FITLM_THP: 1 (default) or 0; read at each large allocation (they are few)
static int huge_pages_wanted(void) {
    const char *v = getenv("FITLM_THP");
    if (v && strcmp(v, "0") && strcmp(v, "1")) fl_die("FITLM_THP must be 0 or 1, got '%s'", v);
    return !v || v[0] == '1';
}

void *fl_alloc(fl_mem_tag tag, size_t bytes) {
    FL_ASSERT((unsigned)tag < FL_MEM_NTAGS);
    if (bytes > SIZE_MAX - 2 * HUGE_PAGE)
        fl_die("allocation of %zu bytes (%s) is too large", bytes, fl_mem_tag_name(tag));
    void *raw = NULL;
    int huge = bytes >= HUGE_PAGE && huge_pages_wanted();
    if (posix_memalign(&raw, huge ? HUGE_PAGE : ALIGN, ALIGN + bytes) != 0) fl_die_oom(bytes, tag);
#ifdef MADV_HUGEPAGE
    // a hint, before the first touch: where the kernel has no huge pages to
    // give, the block keeps small ones
    if (huge) (void)madvise(raw, (ALIGN + bytes) / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
#endif
    memset(raw, 0, ALIGN + bytes);
    block_header *h = (block_header *)((char *)raw + ALIGN - sizeof(block_header));
    h->bytes = bytes;
    h->tag = (uint32_t)tag;
    h->magic = HEADER_MAGIC;
    pthread_mutex_lock(&lock);
    current[tag] += bytes;
    if (current[tag] > peak[tag]) peak[tag] = current[tag];
    total_current += bytes;
    if (total_current > total_peak) total_peak = total_current;
    pthread_mutex_unlock(&lock);
    return (char *)raw + ALIGN;
}

static __thread const char *context; // what this thread reads, or NULL

void fl_mem_context(const char *what) {
    context = what;
}

void fl_die_oom(size_t bytes, fl_mem_tag tag) {
    char want[FL_SIZE_TEXT], have[FL_SIZE_TEXT];
    fl_die("out of memory allocating %s for %s%s%s (%s already allocated)",
           fl_size_text(bytes, want), fl_mem_tag_name(tag), context ? " while reading " : "",
           context ? context : "", fl_size_text(fl_mem_total_current(), have));
}

void *fl_reserve(fl_mem_tag tag, void *p, size_t *cap, size_t used, size_t need, size_t elem) {
    if (need <= *cap) return p;
    size_t grown = *cap ? *cap : 64;
    while (grown < need) grown *= 2;
    void *q = fl_alloc(tag, grown * elem);
    if (used) memcpy(q, p, used * elem);
    fl_free(p);
    *cap = grown;
    return q;
}

void fl_free(void *ptr) {
    if (!ptr) return;
    block_header *h = (block_header *)((char *)ptr - sizeof(block_header));
    FL_ASSERT(h->magic == HEADER_MAGIC);
    h->magic = 0;
    pthread_mutex_lock(&lock);
    current[h->tag] -= h->bytes;
    total_current -= h->bytes;
    pthread_mutex_unlock(&lock);
    free((char *)ptr - ALIGN);
}

// a counter, read under the lock
static size_t locked_read(const size_t *counter) {
    pthread_mutex_lock(&lock);
    size_t v = *counter;
    pthread_mutex_unlock(&lock);
    return v;
}

size_t fl_mem_current(fl_mem_tag tag) {
    return locked_read(&current[tag]);
}

size_t fl_mem_peak(fl_mem_tag tag) {
    return locked_read(&peak[tag]);
}

size_t fl_mem_total_current(void) {
    return locked_read(&total_current);
}

size_t fl_mem_total_peak(void) {
    return locked_read(&total_peak);
}

void fl_mem_device_set_cap(size_t bytes) {
    pthread_mutex_lock(&lock);
    dev_cap = bytes;
    pthread_mutex_unlock(&lock);
}

void fl_mem_device_set_reserved(size_t bytes) {
    pthread_mutex_lock(&lock);
    dev_reserved = bytes;
    pthread_mutex_unlock(&lock);
}

void fl_mem_device_count(fl_mem_tag tag, long long bytes) {
    FL_ASSERT((unsigned)tag < FL_MEM_NTAGS);
    pthread_mutex_lock(&lock);
    // the cap holds even where the plan misjudged the run
    if (bytes > 0 && dev_cap && dev_reserved + dev_total_current + (size_t)bytes > dev_cap) {
        size_t held = dev_total_current, cap = dev_cap, outside = dev_reserved;
        pthread_mutex_unlock(&lock);
        char want[FL_SIZE_TEXT], have[FL_SIZE_TEXT], limit[FL_SIZE_TEXT], ctx[FL_SIZE_TEXT];
        char context[FL_SIZE_TEXT + 48] = "";
        if (outside)
            snprintf(context, sizeof context, ", and %s the device holds itself (its context)",
                     fl_size_text(outside, ctx));
        fl_die("device memory cap of %s (--mem-limit) exceeded allocating %s for %s (%s already "
               "allocated there%s)",
               fl_size_text(cap, limit), fl_size_text((size_t)bytes, want), fl_mem_tag_name(tag),
               fl_size_text(held, have), context);
    }
    FL_ASSERT(bytes >= 0 || (size_t)-bytes <= dev_current[tag]);
    dev_current[tag] += (size_t)bytes; // wraps down for a negative count
    dev_total_current += (size_t)bytes;
    if (dev_current[tag] > dev_peak[tag]) dev_peak[tag] = dev_current[tag];
    if (dev_total_current > dev_total_peak) dev_total_peak = dev_total_current;
    pthread_mutex_unlock(&lock);
}

void fl_mem_pinned_count(fl_mem_tag tag, long long bytes) {
    FL_ASSERT((unsigned)tag < FL_MEM_NTAGS);
    pthread_mutex_lock(&lock);
    FL_ASSERT(bytes >= 0 || (size_t)-bytes <= pin_current[tag]);
    // host memory first (wrapping down for a negative count), then its pinned part
    current[tag] += (size_t)bytes;
    total_current += (size_t)bytes;
    if (current[tag] > peak[tag]) peak[tag] = current[tag];
    if (total_current > total_peak) total_peak = total_current;
    pin_current[tag] += (size_t)bytes;
    pin_total_current += (size_t)bytes;
    if (pin_current[tag] > pin_peak[tag]) pin_peak[tag] = pin_current[tag];
    if (pin_total_current > pin_total_peak) pin_total_peak = pin_total_current;
    pthread_mutex_unlock(&lock);
}

size_t fl_mem_pinned_peak(fl_mem_tag tag) {
    return locked_read(&pin_peak[tag]);
}

size_t fl_mem_pinned_total_peak(void) {
    return locked_read(&pin_total_peak);
}

void fl_die_device_oom(const char *device, size_t bytes, fl_mem_tag tag) {
    char want[FL_SIZE_TEXT], have[FL_SIZE_TEXT];
    size_t held = locked_read(&dev_total_current);
    fl_die("out of %s device memory allocating %s for %s (%s already allocated there)", device,
           fl_size_text(bytes, want), fl_mem_tag_name(tag), fl_size_text(held, have));
}

size_t fl_mem_device_current(fl_mem_tag tag) {
    return locked_read(&dev_current[tag]);
}

size_t fl_mem_device_peak(fl_mem_tag tag) {
    return locked_read(&dev_peak[tag]);
}

size_t fl_mem_device_total_peak(void) {
    return locked_read(&dev_total_peak);
}

size_t fl_mem_peak_rss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

void fl_mem_report(FILE *out) {
    // the peak in bytes too, last: what a plan is checked against exactly
    fprintf(out, "memory by tag (MiB):   %10s %10s %14s\n", "current", "peak", "peak bytes");
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        fprintf(out, "  %-20s %10.2f %10.2f %14zu\n", tag_names[t], fl_mem_current(t) / 1048576.0,
                fl_mem_peak(t) / 1048576.0, fl_mem_peak(t));
    size_t rss = fl_mem_peak_rss(), tagged = fl_mem_total_peak();
    fprintf(out, "  %-20s %10.2f %10.2f\n", "total tagged", fl_mem_total_current() / 1048576.0,
            tagged / 1048576.0);
    fprintf(out,
            "  process peak RSS     %10s %10.2f (untracked overhead %.2f MiB: code, libraries, "
            "BLAS buffers)\n",
            "", rss / 1048576.0, ((double)rss - (double)tagged) / 1048576.0);
    if (fl_mem_pinned_total_peak()) {
        fprintf(out, "of which pinned (MiB):  %10s %10s %14s\n", "current", "peak", "peak bytes");
        for (int t = 0; t < FL_MEM_NTAGS; t++)
            if (fl_mem_pinned_peak(t))
                fprintf(out, "  %-20s %10.2f %10.2f %14zu\n", tag_names[t],
                        locked_read(&pin_current[t]) / 1048576.0, fl_mem_pinned_peak(t) / 1048576.0,
                        fl_mem_pinned_peak(t));
    }
    if (!fl_mem_device_total_peak()) return;
    fprintf(out, "device memory by tag (MiB): %5s %10s %14s\n", "current", "peak", "peak bytes");
    for (int t = 0; t < FL_MEM_NTAGS; t++)
        fprintf(out, "  %-20s %10.2f %10.2f %14zu\n", tag_names[t],
                fl_mem_device_current(t) / 1048576.0, fl_mem_device_peak(t) / 1048576.0,
                fl_mem_device_peak(t));
    fprintf(out, "  %-20s %10s %10.2f %14zu\n", "total device", "",
            fl_mem_device_total_peak() / 1048576.0, fl_mem_device_total_peak());
}
