// offload.c: the optimizer's master weights and state (and under
// offload_param the weights) paged from a scratch file (offload.h). The
// file holds each tensor (master, the rule's state tensors, the weights) in
// a region of its own, padded to whole 4 KiB pages; chunk c is the same
// element range of every tensor. Buffers cache chunks:
// acquiring a chunk already in a buffer costs no read. I/O runs on
// thread_count threads, each owning an io_uring ring: the step's thread
// queues requests (block_size bytes each) and waits only for the chunk it
// needs, so reads ahead and writes behind proceed while it computes.
// Every page of the file has a checksum in RAM, taken (on an I/O thread)
// from what is written there and checked against what is read back: a file
// changed under the run by anything else (cut short and extended again by a
// write-back, zeroed, overwritten, an old copy put back) stops it naming the
// file and the offset, never trains on what it reads.
#define _GNU_SOURCE
#include "fitlm/offload.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "fitlm/comm.h"

// chunks and tensors start on whole pages, 2-byte weights' too
enum {
    PAGE = 4096,
    GRANULE = PAGE / 2,
    MAX_THREADS = 64,
    MAX_TENSORS = FL_OPTIM_MAX_TENSORS + 1,
    MAX_READS = 80, // weight reads in flight: stage 3's ring (64) and a few more
};

// A read of paged weights for ZeRO-3's gathers, done by the reader thread.
typedef enum { READ_FREE, READ_QUEUED, READ_DONE } read_state;
typedef struct {
    read_state state;
    uint64_t order; // queued reads run in the order they were asked for
    size_t first, n;
    void *dst;
    int err;    // errno, -1: the file ended early, -2: page `bad` differs from what was written
    size_t bad; // offset in the file
} weight_read;

typedef struct request {
    struct request *next;
    int write, buffer;
    size_t offset, len; // in the file
    char *addr;
} request;

typedef struct {
    int chunk;      // held (valid once its read landed), or -1
    int pending;    // requests queued or in flight
    int writing;    // they are a write-back
    int dirty;      // updated since its last write-back
    uint64_t stamp; // last use, for eviction
} buffer;

// Where the tensors are: the fp32 ones (master, state), then with paged
// weights the model's weights (of their dtype); in the file, each in a
// region of `padded` elements; in a buffer, each in `chunk` elements.
typedef struct {
    int n, weights;           // tensors; whether the last is the weights
    size_t size[MAX_TENSORS]; // bytes per element
    size_t chunk, padded;     // elements
    size_t file_at[MAX_TENSORS], buf_at[MAX_TENSORS];
    size_t file_bytes, stride; // the file; one buffer
    size_t requests;           // one chunk's transfer, in block_size requests
} layout;

typedef struct {
    struct io_uring ring;
    pthread_t thread;
    int in_flight;
    double busy_since;
} io_thread;

struct fl_offload {
    fl_offload_config cfg;
    fl_optimizer *o;
    fl_optim_pager pager;
    char path[FL_PATH_MAX + 64];
    int fd, direct;
    int fd_buffered;     // the same file without O_DIRECT: reads of any range of the weights
    size_t begin, numel; // the range of the flat buffer
    layout y;
    int n_chunks;
    char *raw;     // FL_MEM_OFFLOAD: the buffers, page-aligned inside
    char *buffers; // buffer_count x y.stride bytes
    buffer *buf;
    int active; // the buffer acquired, or -1
    uint64_t clock;
    void *map; // fl_optimizer_map's mapping, or NULL
    // the request queue and completions, under lock
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    request *head, *tail;
    request *reqs; // per buffer, y.requests of them
    int stop;
    int error; // errno of the first failed request (EIO for a short one, EBADMSG for a changed
               // page)
    char error_what[256];
    size_t bad_at;          // with EBADMSG: the changed page's offset
    uint32_t *sums;         // per page of the file: the checksum of what was last written there
    uint32_t key[PAGE / 4]; // page_sum's, from a fixed seed
    io_thread threads[MAX_THREADS];
    int n_threads;
    // paged weights: reads through the page cache on a thread of their own
    pthread_t reader;
    pthread_cond_t reads_queued;
    weight_read reads[MAX_READS];
    uint64_t reads_asked;
    fl_offload_stats stats;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static size_t round_up(size_t x, size_t to) {
    return (x + to - 1) / to * to;
}

// ----------------------------------------------------------------------------
// page checksums

// A page's checksum: NH (UMAC's hash, Black et al. 1999) over its 32-bit
// words in pairs with the offload's fixed key, four sums at once, mixed
// down to 32 bits. It vectorizes (pmuludq): about 6 times fl_crc32's
// slicing-by-8 here (bench/README.md, "NVMe offload"), and the I/O threads
// take it, not the step's.
static uint32_t page_sum(const fl_offload *f, const char *page) {
    const uint32_t *k = f->key;
    uint64_t s[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < PAGE / 4; i += 8)
        for (size_t j = 0; j < 4; j++) {
            uint32_t a, b;
            memcpy(&a, page + 4 * (i + 2 * j), 4);
            memcpy(&b, page + 4 * (i + 2 * j + 1), 4);
            s[j] += (uint64_t)(uint32_t)(a + k[i + 2 * j]) * (uint32_t)(b + k[i + 2 * j + 1]);
        }
    uint64_t h = s[0] ^ s[1] * 0x9E3779B185EBCA87ull ^ s[2] * 0xC2B2AE3D27D4EB4Full ^
                 s[3] * 0x165667B19E3779F9ull;
    h ^= h >> 33;
    h *= 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 29;
    return (uint32_t)(h ^ h >> 32);
}

static void sum_pages(fl_offload *f, const char *data, size_t at, size_t bytes) {
    for (size_t i = 0; i < bytes; i += PAGE) f->sums[(at + i) / PAGE] = page_sum(f, data + i);
}

// The offset of the first page of file range [at, at + bytes) (held at
// data) that is not what was written there, or SIZE_MAX.
static size_t changed_page(const fl_offload *f, const char *data, size_t at, size_t bytes) {
    for (size_t i = 0; i < bytes; i += PAGE)
        if (page_sum(f, data + i) != f->sums[(at + i) / PAGE]) return at + i;
    return SIZE_MAX;
}

// The error of a changed page (the file's size says whether it was cut).
static void die_changed(const fl_offload *f, const char *what, size_t at) {
    struct stat st;
    char size[96] = "";
    if (fstat(f->fd, &st) == 0 && (size_t)st.st_size != f->y.file_bytes)
        snprintf(size, sizeof size, "; the file is %lld bytes, not the %zu written",
                 (long long)st.st_size, f->y.file_bytes);
    fl_die("NVMe offload file %s: %s: the page at offset %zu reads back other bytes than were "
           "written there%s (the file was changed under the run: truncated, zeroed or "
           "overwritten)",
           f->path, what, at, size);
}

fl_offload_config fl_offload_config_of(const fl_train_config *cfg) {
    const fl_zero_extra *x = &cfg->zero_extra;
    fl_offload_config c = {.buffer_count = x->opt_buffer_count,
                           .pipeline_read = x->opt_pipeline_read,
                           .pipeline_write = x->opt_pipeline_write,
                           .chunk = x->sub_group_size,
                           .block_size = x->aio_block_size,
                           .queue_depth = x->aio_queue_depth,
                           .thread_count = x->aio_thread_count,
                           .single_submit = x->aio_single_submit,
                           .overlap_events = x->aio_overlap_events};
    snprintf(c.dir, sizeof c.dir, "%s", x->opt_nvme_path);
    c.staging_count = x->param_buffer_count;
    c.staging_size = x->param_buffer_size;
    return c;
}

size_t fl_offload_chunk(const fl_offload_config *cfg, size_t numel) {
    double want = cfg->chunk < GRANULE ? GRANULE : cfg->chunk;
    size_t c = want >= (double)numel ? numel : (size_t)want;
    return round_up(c ? c : 1, GRANULE);
}

static size_t block_bytes(const fl_offload_config *cfg) {
    return round_up((size_t)cfg->block_size, PAGE);
}

static void layout_of(const fl_offload_config *cfg, size_t numel, int nf32, size_t weight_size,
                      layout *y) {
    memset(y, 0, sizeof *y);
    y->weights = weight_size > 0;
    y->n = nf32 + y->weights;
    FL_ASSERT(y->n >= 1 && y->n <= MAX_TENSORS);
    y->chunk = fl_offload_chunk(cfg, numel ? numel : 1);
    y->padded = round_up(numel ? numel : 1, GRANULE);
    size_t block = block_bytes(cfg);
    for (int k = 0; k < y->n; k++) {
        y->size[k] = k < nf32 ? sizeof(float) : weight_size;
        y->file_at[k] = y->file_bytes;
        y->buf_at[k] = y->stride;
        y->file_bytes += y->padded * y->size[k];
        y->stride += y->chunk * y->size[k];
        y->requests += (y->chunk * y->size[k] + block - 1) / block;
    }
}

void fl_offload_memory(const fl_offload_config *cfg, size_t numel, int ntensors, size_t weight_size,
                       size_t bytes[FL_MEM_NTAGS], size_t *disk) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    layout y;
    layout_of(cfg, numel, ntensors, weight_size, &y);
    size_t nbuf = (size_t)cfg->buffer_count;
    bytes[FL_MEM_OFFLOAD] = nbuf * y.stride + PAGE;
    bytes[FL_MEM_OTHER] = sizeof(fl_offload) +
                          nbuf * (sizeof(buffer) + y.requests * sizeof(request)) +
                          y.file_bytes / PAGE * sizeof(uint32_t); // the page checksums
    *disk = y.file_bytes;
}

void fl_offload_check_path(const char *key, const char *dir, size_t disk) {
    struct stat st;
    if (!*dir) fl_die("%s is empty: NVMe offload needs a directory to keep its files in", key);
    if (stat(dir, &st) != 0)
        fl_die("%s %s: %s (NVMe offload needs an existing directory)", key, dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) fl_die("%s %s is not a directory", key, dir);
    struct statvfs vs;
    if (statvfs(dir, &vs) != 0) fl_die("%s %s: %s", key, dir, strerror(errno));
    if (vs.f_flag & ST_RDONLY) fl_die("%s %s is on a read-only filesystem", key, dir);
    char probe[FL_PATH_MAX + 64]; // permissions alone do not tell (root, /proc)
    snprintf(probe, sizeof probe, "%s/.fitlm-probe-%ld", dir, (long)getpid());
    int fd = open(probe, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) fl_die("%s %s: cannot create files there: %s", key, dir, strerror(errno));
    close(fd);
    unlink(probe);
    double free_bytes = (double)vs.f_bavail * (double)vs.f_frsize;
    size_t avail = free_bytes >= (double)SIZE_MAX ? SIZE_MAX : (size_t)free_bytes;
    if (avail < disk) {
        char need[FL_SIZE_TEXT], have[FL_SIZE_TEXT];
        fl_size_text_pair(disk, avail, need, have);
        fl_die("%s %s: the offloaded optimizer needs %s of disk, only %s are free there", key, dir,
               need, have);
    }
}

// ----------------------------------------------------------------------------
// the I/O threads

static request *pop_request(fl_offload *f) {
    request *r = f->head;
    if (r) {
        f->head = r->next;
        if (!f->head) f->tail = NULL;
    }
    return r;
}

static void fail(fl_offload *f, int err, const request *r, long got) {
    if (f->error) return;
    f->error = err;
    int n = snprintf(f->error_what, sizeof f->error_what, "%s of %zu bytes at offset %zu",
                     r->write ? "write" : "read", r->len, r->offset);
    if (got >= 0)
        snprintf(f->error_what + n, sizeof f->error_what - (size_t)n,
                 " returned %ld bytes (a short transfer)", got);
}

// A whole read's changed page (checked outside the lock), or SIZE_MAX.
static size_t check_read(fl_offload *f, struct io_uring_cqe *cqe) {
    const request *r = io_uring_cqe_get_data(cqe);
    if (r->write || cqe->res < 0 || (size_t)cqe->res != r->len) return SIZE_MAX;
    return changed_page(f, r->addr, r->offset, r->len);
}

// One completion, under the lock; bad: check_read's.
static void complete(fl_offload *f, io_thread *t, struct io_uring_cqe *cqe, size_t bad) {
    request *r = io_uring_cqe_get_data(cqe);
    if (cqe->res < 0)
        fail(f, -cqe->res, r, -1);
    else if ((size_t)cqe->res != r->len)
        fail(f, EIO, r, cqe->res);
    else if (bad != SIZE_MAX && !f->error) {
        fail(f, EBADMSG, r, -1);
        f->bad_at = bad;
    } else if (r->write)
        f->stats.bytes_written += r->len;
    else
        f->stats.bytes_read += r->len;
    f->buf[r->buffer].pending--;
    if (--t->in_flight == 0) f->stats.busy_s += now_s() - t->busy_since;
    pthread_cond_broadcast(&f->done);
}

static void *io_main(void *arg) {
    fl_offload *f = arg;
    io_thread *t = NULL;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < f->n_threads; i++)
        if (pthread_equal(f->threads[i].thread, pthread_self())) t = &f->threads[i];
    FL_ASSERT(t);
    for (;;) {
        // overlap_events false: a batch is submitted only once the last one is done
        int may = f->cfg.overlap_events || t->in_flight == 0, prepared = 0;
        request *mine = NULL, **end = &mine;
        while (may && f->head && t->in_flight < f->cfg.queue_depth) {
            request *r = pop_request(f);
            r->next = NULL;
            *end = r;
            end = &r->next;
            if (t->in_flight++ == 0) t->busy_since = now_s();
            prepared++;
        }
        // checksums and submissions outside the lock: the step's thread
        // queues and waits meanwhile (the buffers stay put while pending)
        if (mine) pthread_mutex_unlock(&f->lock);
        for (request *r = mine, *next; r; r = next) {
            next = r->next;
            struct io_uring_sqe *sqe = io_uring_get_sqe(&t->ring);
            FL_ASSERT(sqe); // the ring has queue_depth entries
            if (r->write) {
                sum_pages(f, r->addr, r->offset, r->len);
                io_uring_prep_write(sqe, f->fd, r->addr, (unsigned)r->len, (off_t)r->offset);
            } else {
                io_uring_prep_read(sqe, f->fd, r->addr, (unsigned)r->len, (off_t)r->offset);
            }
            io_uring_sqe_set_data(sqe, r);
            if (f->cfg.single_submit) io_uring_submit(&t->ring);
        }
        if (prepared && !f->cfg.single_submit) io_uring_submit(&t->ring);
        if (mine) pthread_mutex_lock(&f->lock);
        if (t->in_flight == 0) {
            if (f->stop) break;
            pthread_cond_wait(&f->work, &f->lock);
            continue;
        }
        pthread_mutex_unlock(&f->lock);
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&t->ring, &cqe);
        if (rc == 0) {
            do { // this one and every other one ready, each checked first
                size_t bad = check_read(f, cqe);
                pthread_mutex_lock(&f->lock);
                complete(f, t, cqe, bad);
                pthread_mutex_unlock(&f->lock);
                io_uring_cqe_seen(&t->ring, cqe);
            } while (io_uring_peek_cqe(&t->ring, &cqe) == 0);
        }
        FL_ASSERT(rc == 0 || rc == -EINTR);
        pthread_mutex_lock(&f->lock);
    }
    pthread_mutex_unlock(&f->lock);
    return NULL;
}

// Queues the transfer of chunk c between the file and buffer b, tensor by
// tensor (only tensor `only` when >= 0), in block_size requests.
static void start_io(fl_offload *f, int b, int c, int write, int only) {
    const layout *y = &f->y;
    size_t lo = (size_t)c * y->chunk, n = f->numel - lo < y->chunk ? f->numel - lo : y->chunk;
    size_t block = block_bytes(&f->cfg);
    request *next = f->reqs + (size_t)b * y->requests;
    pthread_mutex_lock(&f->lock);
    FL_ASSERT(f->buf[b].pending == 0);
    f->buf[b].chunk = c;
    f->buf[b].writing = write;
    for (int k = 0; k < y->n; k++) {
        if (only >= 0 && k != only) continue;
        size_t bytes = round_up(n, GRANULE) * y->size[k];
        char *addr = f->buffers + (size_t)b * y->stride + y->buf_at[k];
        size_t at = y->file_at[k] + lo * y->size[k];
        for (size_t s = 0; s < bytes; s += block) {
            request *r = next++;
            *r = (request){NULL, write, b, at + s, bytes - s < block ? bytes - s : block, addr + s};
            if (f->tail)
                f->tail->next = r;
            else
                f->head = r;
            f->tail = r;
            f->buf[b].pending++;
        }
    }
    pthread_cond_broadcast(&f->work);
    pthread_mutex_unlock(&f->lock);
}

// Waits for buffer b's transfers (every buffer's with b = -1, every
// write-back with b = -2).
static void wait_buffer(fl_offload *f, int b) {
    double t0 = now_s();
    pthread_mutex_lock(&f->lock);
    for (;;) {
        int busy = 0;
        for (int i = 0; i < f->cfg.buffer_count; i++)
            if ((b == -1 || i == b || (b == -2 && f->buf[i].writing)) && f->buf[i].pending)
                busy = 1;
        if (!busy || f->error) break;
        pthread_cond_wait(&f->done, &f->lock);
    }
    int err = f->error;
    size_t bad = f->bad_at;
    f->stats.wait_s += now_s() - t0;
    pthread_mutex_unlock(&f->lock);
    if (err == EBADMSG) die_changed(f, f->error_what, bad);
    if (err)
        fl_die("NVMe offload file %s: %s failed: %s", f->path, f->error_what,
               err == EIO ? "I/O error or end of file (was the file truncated?)" : strerror(err));
}

static int idle(fl_offload *f, int b) {
    pthread_mutex_lock(&f->lock);
    int p = f->buf[b].pending;
    pthread_mutex_unlock(&f->lock);
    return p == 0;
}

static void forget_buffers(fl_offload *f) {
    for (int b = 0; b < f->cfg.buffer_count; b++) f->buf[b] = (buffer){-1, 0, 0, 0, 0};
}

// Starts the write-back of every updated chunk but `keep` (-1: all), and
// without pipeline_write waits for it. Written lazily, a chunk the backward
// pass updates for two units in a row (it straddles them) goes to disk once.
static void flush(fl_offload *f, int keep) {
    int dirty = 0;
    for (int b = 0; b < f->cfg.buffer_count; b++)
        dirty |= f->buf[b].dirty && f->buf[b].chunk != keep;
    if (!dirty) return;
    // no read of the weights may be under way while a write-back changes them
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < MAX_READS; i++)
        while (f->reads[i].state == READ_QUEUED) pthread_cond_wait(&f->done, &f->lock);
    pthread_mutex_unlock(&f->lock);
    for (int b = 0; b < f->cfg.buffer_count; b++) {
        if (!f->buf[b].dirty || f->buf[b].chunk == keep) continue;
        f->buf[b].dirty = 0;
        start_io(f, b, f->buf[b].chunk, 1, -1);
        if (!f->cfg.pipeline_write) wait_buffer(f, b);
    }
}

// ----------------------------------------------------------------------------
// the pager

static int holding(const fl_offload *f, int c) {
    for (int b = 0; b < f->cfg.buffer_count; b++)
        if (f->buf[b].chunk == c) return b;
    return -1;
}

// The least recently used buffer other than the active one (an empty one
// first); only_idle: only among those with no transfer in flight.
static int victim(fl_offload *f, int only_idle) {
    int best = -1;
    for (int b = 0; b < f->cfg.buffer_count; b++) {
        if (b == f->active || (only_idle && !idle(f, b))) continue;
        if (best < 0 || f->buf[b].stamp < f->buf[best].stamp) best = b;
    }
    return best;
}

// Buffer b's fp32 tensors, and its weights (NULL when they are not paged).
static void tensors_of(fl_offload *f, int b, float **t, void **weights) {
    const layout *y = &f->y;
    char *base = f->buffers + (size_t)b * y->stride;
    for (int k = 0; k < y->n - y->weights; k++) t[k] = (float *)(void *)(base + y->buf_at[k]);
    *weights = y->weights ? base + y->buf_at[y->n - 1] : NULL;
}

static void pager_acquire(void *ctx, int c, size_t *lo, size_t *hi, float **tensors,
                          void **weights) {
    fl_offload *f = ctx;
    FL_ASSERT(f->active < 0 && c >= 0 && c < f->n_chunks);
    flush(f, c);
    int b = holding(f, c);
    if (b < 0) {
        b = victim(f, 0);
        wait_buffer(f, b); // its write-back
        start_io(f, b, c, 0, -1);
    }
    wait_buffer(f, b);
    f->active = b;
    f->buf[b].stamp = ++f->clock;
    // read ahead (chunks go from the last to the first) into buffers with
    // nothing in flight, keeping one for the write-back of this chunk; past
    // the first chunk, the next step's last ones, read while the forward
    // pass runs
    int ahead = f->cfg.buffer_count - 1 - (f->cfg.pipeline_write ? 1 : 0);
    for (int i = 1; f->cfg.pipeline_read && i <= ahead && i < f->n_chunks; i++) {
        int n = (c - i + f->n_chunks) % f->n_chunks;
        if (holding(f, n) >= 0) continue;
        int v = victim(f, 1);
        if (v < 0 || f->buf[v].stamp == f->clock) break;
        f->buf[v].stamp = f->clock;
        start_io(f, v, n, 0, -1);
    }
    size_t chunk = f->y.chunk, first = (size_t)c * chunk;
    *lo = f->begin + first;
    *hi = f->begin + (f->numel - first < chunk ? f->numel : first + chunk);
    tensors_of(f, b, tensors, weights);
}

static void pager_release(void *ctx, int c) {
    fl_offload *f = ctx;
    int b = f->active;
    FL_ASSERT(b >= 0 && f->buf[b].chunk == c);
    f->active = -1;
    f->buf[b].dirty = 1; // written when another chunk is acquired, or before a read of the file
}

static void pager_map(void *ctx, float **tensors, void **weights) {
    fl_offload *f = ctx;
    FL_ASSERT(!f->map && f->active < 0);
    flush(f, -1);
    wait_buffer(f, -1);
    size_t bytes = f->y.file_bytes;
    struct stat st; // a mapping past the end would die of SIGBUS
    if (fstat(f->fd, &st) != 0) fl_die("NVMe offload file %s: fstat: %s", f->path, strerror(errno));
    if ((size_t)st.st_size != bytes)
        fl_die("NVMe offload file %s is %lld bytes, not the %zu written (the file was changed "
               "under the run: truncated or extended)",
               f->path, (long long)st.st_size, bytes);
    f->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        fl_die("NVMe offload file %s: cannot map its %zu bytes: %s", f->path, bytes,
               strerror(errno));
    }
    madvise(f->map, bytes, MADV_SEQUENTIAL);
    // a checkpoint reads the state through the mapping: never a changed one
    size_t bad = changed_page(f, f->map, 0, bytes);
    if (bad != SIZE_MAX) die_changed(f, "mapping the state", bad);
    for (int k = 0; k < f->y.n - f->y.weights; k++)
        tensors[k] = (float *)(void *)((char *)f->map + f->y.file_at[k]);
    *weights = f->y.weights ? (char *)f->map + f->y.file_at[f->y.n - 1] : NULL;
}

static void pager_unmap(void *ctx) {
    fl_offload *f = ctx;
    size_t bytes = f->y.file_bytes;
    if (msync(f->map, bytes, MS_SYNC) != 0)
        fl_die("NVMe offload file %s: writing back the mapped state failed: %s", f->path,
               strerror(errno));
    sum_pages(f, f->map, 0, bytes); // a resume wrote the state through it
    munmap(f->map, bytes);
    f->map = NULL;
    forget_buffers(f); // what the mapping wrote is newer than what they hold
}

// ----------------------------------------------------------------------------

static void open_file(fl_offload *f) {
    static int serial;
    snprintf(f->path, sizeof f->path, "%s/fitlm-optimizer-%ld-rank%d-%d.swp", f->cfg.dir,
             (long)getpid(), fl_comm_rank(), serial++);
    f->direct = 1;
    f->fd = open(f->path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (f->fd < 0 && errno == EINVAL) { // the filesystem has no O_DIRECT (tmpfs)
        f->direct = 0;
        f->fd = open(f->path, O_RDWR | O_CREAT | O_EXCL, 0600);
    }
    if (f->fd < 0)
        fl_die("zero_optimization.offload_optimizer.nvme_path: cannot create %s: %s", f->path,
               strerror(errno));
    // reads of any range of the weights go through the page cache
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", f->fd);
    f->fd_buffered = open(self, O_RDONLY);
    if (f->fd_buffered < 0) fl_die("NVMe offload: cannot reopen %s: %s", f->path, strerror(errno));
    unlink(f->path); // scratch: gone with the process, however it ends
    size_t bytes = f->y.file_bytes;
    int rc = posix_fallocate(f->fd, 0, (off_t)bytes);
    char size[FL_SIZE_TEXT];
    if (rc != 0)
        fl_die("zero_optimization.offload_optimizer.nvme_path: cannot reserve %s for %s: %s",
               fl_size_text(bytes, size), f->path, strerror(rc));
}

// Writes each chunk of the file (only tensor `only` when >= 0) from what
// fill(ctx, chunk first element, count, tensors, weights) puts in a zeroed buffer.
static void write_chunks(fl_offload *f, int only,
                         void (*fill)(fl_offload *f, size_t first, size_t n, float **t, void *w,
                                      const void *arg),
                         const void *arg) {
    flush(f, -1);
    wait_buffer(f, -1);
    forget_buffers(f);
    size_t chunk = f->y.chunk;
    for (int c = 0; c < f->n_chunks; c++) {
        int b = c % f->cfg.buffer_count;
        wait_buffer(f, b);
        float *t[FL_OPTIM_MAX_TENSORS];
        void *w;
        tensors_of(f, b, t, &w);
        memset(f->buffers + (size_t)b * f->y.stride, 0, f->y.stride);
        size_t first = (size_t)c * chunk, n = f->numel - first < chunk ? f->numel - first : chunk;
        fill(f, first, n, t, w, arg);
        start_io(f, b, c, 1, only);
    }
    wait_buffer(f, -1);
    forget_buffers(f); // a partial write leaves no buffer a whole chunk
}

// The file's first contents: the master (and paged weights) from the
// optimizer's weights, the state zeros.
static void fill_start(fl_offload *f, size_t first, size_t n, float **t, void *w, const void *arg) {
    (void)arg;
    const fl_optimizer *o = f->o;
    const void *src = fl_at_const(o->dtype, o->params, f->begin + first - o->params_first);
    if (o->dtype != FL_F32) fl_convert(FL_F32, t[0], o->dtype, src, n); // the master
    if (w) memcpy(w, src, n * fl_dtype_size(o->dtype));
}

static void fill_weights(fl_offload *f, size_t first, size_t n, float **t, void *w,
                         const void *arg) {
    (void)t;
    size_t D = f->y.size[f->y.n - 1];
    memcpy(w, (const char *)arg + first * D, n * D);
}

void fl_offload_write_weights(fl_offload *f, const void *src) {
    FL_ASSERT(f->y.weights && f->active < 0 && !f->map);
    write_chunks(f, f->y.n - 1, fill_weights, src);
}

// Reads n bytes from the buffered descriptor at `at` whole (a short
// transfer is retried); 0, errno, or -1: the file ended early.
static int pread_all(const fl_offload *f, char *dst, size_t n, size_t at) {
    for (size_t done = 0; done < n;) {
        ssize_t got = pread(f->fd_buffered, dst + done, n - done, (off_t)(at + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return got < 0 ? errno : -1;
        done += (size_t)got;
    }
    return 0;
}

// File range [at, at + n) into dst, every page it touches checked against
// its checksum (a partial first or last one through a page of its own): 0,
// pread_all's error, or -2 with *bad the changed page's offset.
static int read_checked(const fl_offload *f, char *dst, size_t at, size_t n, size_t *bad) {
    size_t end = at + n, whole_lo = round_up(at, PAGE), whole_hi = end / PAGE * PAGE;
    char edge[PAGE];
    for (size_t p = at / PAGE * PAGE; p < end;) {
        if (p >= whole_lo && p < whole_hi) { // the whole pages, straight into dst
            int err = pread_all(f, dst + (p - at), whole_hi - p, p);
            if (err) return err;
            if ((*bad = changed_page(f, dst + (p - at), p, whole_hi - p)) != SIZE_MAX) return -2;
            p = whole_hi;
            continue;
        }
        int err = pread_all(f, edge, PAGE, p);
        if (err) return err;
        if ((*bad = changed_page(f, edge, p, PAGE)) != SIZE_MAX) return -2;
        size_t lo = p > at ? p : at, hi = p + PAGE < end ? p + PAGE : end;
        memcpy(dst + (lo - at), edge + (lo - p), hi - lo);
        p += PAGE;
    }
    return 0;
}

// The reader thread: queued weight reads, oldest first, each read whole
// and checked (read_checked), then dropped from the page cache.
static void *reader_main(void *arg) {
    fl_offload *f = arg;
    size_t D = f->y.size[f->y.n - 1];
    pthread_mutex_lock(&f->lock);
    for (;;) {
        weight_read *r = NULL;
        for (int i = 0; i < MAX_READS; i++)
            if (f->reads[i].state == READ_QUEUED && (!r || f->reads[i].order < r->order))
                r = &f->reads[i];
        if (!r) {
            if (f->stop) break;
            pthread_cond_wait(&f->reads_queued, &f->lock);
            continue;
        }
        weight_read job = *r;
        pthread_mutex_unlock(&f->lock);
        size_t bytes = job.n * D, bad = 0;
        size_t at = f->y.file_at[f->y.n - 1] + (job.first - f->begin) * D;
        int err = read_checked(f, job.dst, at, bytes, &bad);
        // the page cache need not keep what RAM is meant not to hold
        posix_fadvise(f->fd_buffered, (off_t)at, (off_t)bytes, POSIX_FADV_DONTNEED);
        pthread_mutex_lock(&f->lock);
        r->err = err;
        r->bad = bad;
        r->state = READ_DONE;
        f->stats.bytes_read += err ? 0 : bytes;
        pthread_cond_broadcast(&f->done);
    }
    pthread_mutex_unlock(&f->lock);
    return NULL;
}

int fl_offload_read_weights_async(fl_offload *f, size_t first, size_t n, void *dst) {
    FL_ASSERT(f->y.weights && first >= f->begin && first + n <= f->begin + f->numel);
    flush(f, -1);
    wait_buffer(f, -2); // the last step's new weights are on disk
    pthread_mutex_lock(&f->lock);
    int t = 0;
    while (t < MAX_READS && f->reads[t].state != READ_FREE) t++;
    FL_ASSERT(t < MAX_READS);
    f->reads[t] = (weight_read){READ_QUEUED, f->reads_asked++, first, n, dst, 0, 0};
    pthread_cond_broadcast(&f->reads_queued);
    pthread_mutex_unlock(&f->lock);
    return t;
}

int fl_offload_read_done(fl_offload *f, int ticket) {
    pthread_mutex_lock(&f->lock);
    int done = f->reads[ticket].state == READ_DONE;
    pthread_mutex_unlock(&f->lock);
    return done;
}

void fl_offload_wait_read(fl_offload *f, int ticket) {
    weight_read *r = &f->reads[ticket];
    double t0 = now_s();
    pthread_mutex_lock(&f->lock);
    FL_ASSERT(r->state != READ_FREE);
    while (r->state != READ_DONE) pthread_cond_wait(&f->done, &f->lock);
    int err = r->err;
    size_t D = f->y.size[f->y.n - 1], bytes = r->n * D, bad = r->bad;
    size_t at = f->y.file_at[f->y.n - 1] + (r->first - f->begin) * D;
    r->state = READ_FREE;
    f->stats.weights_s += now_s() - t0;
    pthread_mutex_unlock(&f->lock);
    char what[96];
    snprintf(what, sizeof what, "read of %zu bytes of weights at offset %zu", bytes, at);
    if (err == -2) die_changed(f, what, bad);
    if (err)
        fl_die("NVMe offload file %s: read of %zu bytes of weights at offset %zu %s", f->path,
               bytes, at, err > 0 ? strerror(err) : "ended early (was the file truncated?)");
}

void fl_offload_read_weights(fl_offload *f, size_t first, size_t n, void *dst) {
    fl_offload_wait_read(f, fl_offload_read_weights_async(f, first, n, dst));
}

fl_offload *fl_offload_optimizer(fl_optimizer *o, const fl_offload_config *cfg, int weights) {
    FL_ASSERT(o->cfg.paged && !o->pager);
    FL_ASSERT(cfg->buffer_count >= 1 && cfg->queue_depth >= 1 && cfg->block_size >= 1);
    FL_ASSERT(cfg->thread_count >= 1 && cfg->thread_count <= MAX_THREADS);
    fl_offload *f = fl_alloc(FL_MEM_OTHER, sizeof *f);
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    f->o = o;
    f->begin = o->rule->state_begin;
    f->numel = o->rule->state_end - f->begin;
    layout_of(cfg, f->numel, fl_optimizer_paged_tensors(&o->cfg, o->dtype),
              weights ? fl_dtype_size(o->dtype) : 0, &f->y);
    f->n_chunks = f->numel ? (int)((f->numel + f->y.chunk - 1) / f->y.chunk) : 0;
    f->active = -1;
    size_t nbuf = (size_t)cfg->buffer_count;
    f->raw = fl_alloc(FL_MEM_OFFLOAD, nbuf * f->y.stride + PAGE);
    f->buffers = f->raw + (PAGE - (uintptr_t)f->raw % PAGE) % PAGE;
    f->buf = fl_alloc(FL_MEM_OTHER, nbuf * sizeof(buffer));
    f->reqs = fl_alloc(FL_MEM_OTHER, nbuf * f->y.requests * sizeof(request));
    f->sums = fl_alloc(FL_MEM_OTHER, f->y.file_bytes / PAGE * sizeof(uint32_t));
    uint64_t seed = 0x9E3779B97F4A7C15ull; // splitmix64
    for (size_t i = 0; i < PAGE / 4; i++) {
        uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
        z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ z >> 27) * 0x94D049BB133111EBull;
        f->key[i] = (uint32_t)(z ^ z >> 31);
    }
    forget_buffers(f);
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->work, NULL);
    pthread_cond_init(&f->done, NULL);
    pthread_cond_init(&f->reads_queued, NULL);
    open_file(f);
    f->n_threads = cfg->thread_count;
    pthread_mutex_lock(&f->lock); // the threads find themselves once all are started
    for (int i = 0; i < f->n_threads; i++) {
        int rc = io_uring_queue_init((unsigned)cfg->queue_depth, &f->threads[i].ring, 0);
        if (rc < 0)
            fl_die("NVMe offload: io_uring is not available (%s); it needs Linux 5.1 or later "
                   "and a kernel that allows io_uring_setup",
                   strerror(-rc));
        if (pthread_create(&f->threads[i].thread, NULL, io_main, f) != 0)
            fl_die("NVMe offload: cannot start an I/O thread");
    }
    if (weights && pthread_create(&f->reader, NULL, reader_main, f) != 0)
        fl_die("NVMe offload: cannot start the weights' reader thread");
    pthread_mutex_unlock(&f->lock);
    write_chunks(f, -1, fill_start, NULL);
    memset(&f->stats, 0, sizeof f->stats);
    f->pager = (fl_optim_pager){f,         f->n_chunks, weights,   pager_acquire, pager_release,
                                pager_map, pager_unmap, f->y.chunk};
    o->pager = &f->pager;
    return f;
}

void fl_offload_free(fl_offload *f) {
    if (!f) return;
    wait_buffer(f, -1); // scratch: what is not written need not be
    pthread_mutex_lock(&f->lock);
    f->stop = 1;
    pthread_cond_broadcast(&f->work);
    pthread_cond_broadcast(&f->reads_queued);
    pthread_mutex_unlock(&f->lock);
    if (f->y.weights) pthread_join(f->reader, NULL);
    for (int i = 0; i < f->n_threads; i++) {
        pthread_join(f->threads[i].thread, NULL);
        io_uring_queue_exit(&f->threads[i].ring);
    }
    close(f->fd);
    close(f->fd_buffered);
    fl_free(f->reqs);
    fl_free(f->sums);
    if (f->o->pager == &f->pager) f->o->pager = NULL;
    pthread_mutex_destroy(&f->lock);
    pthread_cond_destroy(&f->work);
    pthread_cond_destroy(&f->done);
    pthread_cond_destroy(&f->reads_queued);
    fl_free(f->buf);
    fl_free(f->raw);
    fl_free(f);
}

void fl_offload_stats_get(const fl_offload *f, fl_offload_stats *s) {
    fl_offload *m = (fl_offload *)f;
    pthread_mutex_lock(&m->lock);
    *s = f->stats;
    pthread_mutex_unlock(&m->lock);
}

const char *fl_offload_path(const fl_offload *f) {
    return f->path;
}

int fl_offload_direct(const fl_offload *f) {
    return f->direct;
}
