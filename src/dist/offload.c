// offload.c: the optimizer's master weights and state paged from a scratch
// file (offload.h). The file holds each tensor (master, then the rule's
// state tensors) in a region of its own, padded to whole 4 KiB pages;
// chunk c is the same element range of every tensor. Buffers cache chunks:
// acquiring a chunk already in a buffer costs no read. I/O runs on
// thread_count threads, each owning an io_uring ring: the step's thread
// queues requests (block_size bytes each) and waits only for the chunk it
// needs, so reads ahead and writes behind proceed while it computes.
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

enum { PAGE = 4096, PAGE_FLOATS = PAGE / 4, MAX_THREADS = 64 };

typedef struct request {
    struct request *next;
    int write, buffer;
    size_t offset, len; // in the file
    char *addr;
} request;

typedef struct {
    int chunk;      // held (valid once its read landed), or -1
    int pending;    // requests queued or in flight
    uint64_t stamp; // last use, for eviction
} buffer;

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
    size_t begin, numel, padded, chunk; // elements: the range, per tensor in the file, per chunk
    int ntensors, n_chunks;
    char *raw;      // FL_MEM_OFFLOAD: the buffers, page-aligned inside
    float *buffers; // buffer_count x ntensors x chunk floats
    buffer *buf;
    int active; // the buffer acquired, or -1
    uint64_t clock;
    void *map; // fl_optimizer_map's mapping, or NULL
    // the request queue and completions, under lock
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    request *head, *tail;
    request *reqs; // per buffer, requests_per_buffer of them
    size_t per_buffer;
    int stop;
    int error; // errno of the first failed request (EIO for a short one)
    char error_what[160];
    io_thread threads[MAX_THREADS];
    int n_threads;
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
    return c;
}

size_t fl_offload_chunk(const fl_offload_config *cfg, size_t numel) {
    double want = cfg->chunk < PAGE_FLOATS ? PAGE_FLOATS : cfg->chunk;
    size_t c = want >= (double)numel ? numel : (size_t)want;
    c = round_up(c ? c : 1, PAGE_FLOATS);
    return c;
}

static size_t buffers_bytes(const fl_offload_config *cfg, size_t chunk, int ntensors) {
    return (size_t)cfg->buffer_count * (size_t)ntensors * chunk * sizeof(float) + PAGE;
}

static size_t block_bytes(const fl_offload_config *cfg) {
    return round_up((size_t)cfg->block_size, PAGE);
}

// The requests one chunk's transfer takes.
static size_t requests_per_buffer(const fl_offload_config *cfg, size_t chunk, int ntensors) {
    size_t block = block_bytes(cfg);
    return (size_t)ntensors * ((chunk * sizeof(float) + block - 1) / block);
}

void fl_offload_memory(const fl_offload_config *cfg, size_t numel, int ntensors,
                       size_t bytes[FL_MEM_NTAGS], size_t *disk) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    size_t chunk = fl_offload_chunk(cfg, numel);
    bytes[FL_MEM_OFFLOAD] = buffers_bytes(cfg, chunk, ntensors);
    bytes[FL_MEM_OTHER] =
        sizeof(fl_offload) + (size_t)cfg->buffer_count * sizeof(buffer) +
        (size_t)cfg->buffer_count * requests_per_buffer(cfg, chunk, ntensors) * sizeof(request);
    *disk = (size_t)ntensors * round_up(numel, PAGE_FLOATS) * sizeof(float);
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
    double avail = (double)vs.f_bavail * (double)vs.f_frsize;
    if (avail < (double)disk)
        fl_die("%s %s: the offloaded optimizer needs %.2f GB of disk, only %.2f GB are free there",
               key, dir, disk / 1e9, avail / 1e9);
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
    snprintf(f->error_what, sizeof f->error_what, "%s of %zu bytes at offset %zu%s%ld%s",
             r->write ? "write" : "read", r->len, r->offset, got >= 0 ? " returned " : "",
             got >= 0 ? got : 0L, got >= 0 ? " bytes (a short transfer)" : "");
}

// One completion, under the lock.
static void complete(fl_offload *f, io_thread *t, struct io_uring_cqe *cqe) {
    request *r = io_uring_cqe_get_data(cqe);
    if (cqe->res < 0)
        fail(f, -cqe->res, r, -1);
    else if ((size_t)cqe->res != r->len)
        fail(f, EIO, r, cqe->res);
    else if (r->write)
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
        while (may && f->head && t->in_flight < f->cfg.queue_depth) {
            request *r = pop_request(f);
            struct io_uring_sqe *sqe = io_uring_get_sqe(&t->ring);
            FL_ASSERT(sqe); // the ring has queue_depth entries
            if (r->write)
                io_uring_prep_write(sqe, f->fd, r->addr, (unsigned)r->len, (off_t)r->offset);
            else
                io_uring_prep_read(sqe, f->fd, r->addr, (unsigned)r->len, (off_t)r->offset);
            io_uring_sqe_set_data(sqe, r);
            if (t->in_flight++ == 0) t->busy_since = now_s();
            prepared++;
            if (f->cfg.single_submit) io_uring_submit(&t->ring);
        }
        if (prepared && !f->cfg.single_submit) io_uring_submit(&t->ring);
        if (t->in_flight == 0) {
            if (f->stop) break;
            pthread_cond_wait(&f->work, &f->lock);
            continue;
        }
        pthread_mutex_unlock(&f->lock);
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&t->ring, &cqe);
        pthread_mutex_lock(&f->lock);
        if (rc == -EINTR) continue;
        FL_ASSERT(rc == 0);
        complete(f, t, cqe);
        io_uring_cqe_seen(&t->ring, cqe);
        while (io_uring_peek_cqe(&t->ring, &cqe) == 0) { // every other one ready
            complete(f, t, cqe);
            io_uring_cqe_seen(&t->ring, cqe);
        }
    }
    pthread_mutex_unlock(&f->lock);
    return NULL;
}

// Queues the transfer of chunk c between the file and buffer b, tensor by
// tensor, in block_size requests.
static void start_io(fl_offload *f, int b, int c, int write) {
    size_t lo = (size_t)c * f->chunk, n = f->numel - lo < f->chunk ? f->numel - lo : f->chunk;
    size_t bytes = round_up(n, PAGE_FLOATS) * sizeof(float), block = block_bytes(&f->cfg);
    request *next = f->reqs + (size_t)b * f->per_buffer;
    pthread_mutex_lock(&f->lock);
    FL_ASSERT(f->buf[b].pending == 0);
    f->buf[b].chunk = c;
    for (int k = 0; k < f->ntensors; k++) {
        char *addr = (char *)(f->buffers + ((size_t)b * f->ntensors + k) * f->chunk);
        size_t at = ((size_t)k * f->padded + lo) * sizeof(float);
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

// Waits for buffer b's transfers (every buffer's with b = -1).
static void wait_buffer(fl_offload *f, int b) {
    double t0 = now_s();
    pthread_mutex_lock(&f->lock);
    for (;;) {
        int busy = 0;
        for (int i = 0; i < f->cfg.buffer_count; i++)
            if ((b < 0 || i == b) && f->buf[i].pending) busy = 1;
        if (!busy || f->error) break;
        pthread_cond_wait(&f->done, &f->lock);
    }
    int err = f->error;
    pthread_mutex_unlock(&f->lock);
    if (err)
        fl_die("NVMe offload file %s: %s failed: %s", f->path, f->error_what,
               err == EIO ? "I/O error or end of file (was the file truncated?)" : strerror(err));
    f->stats.wait_s += now_s() - t0;
}

static int idle(fl_offload *f, int b) {
    pthread_mutex_lock(&f->lock);
    int p = f->buf[b].pending;
    pthread_mutex_unlock(&f->lock);
    return p == 0;
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

static void tensors_of(fl_offload *f, int b, float **t) {
    for (int k = 0; k < f->ntensors; k++)
        t[k] = f->buffers + ((size_t)b * f->ntensors + k) * f->chunk;
}

static void pager_acquire(void *ctx, int c, size_t *lo, size_t *hi, float **tensors) {
    fl_offload *f = ctx;
    FL_ASSERT(f->active < 0 && c >= 0 && c < f->n_chunks);
    int b = holding(f, c);
    if (b < 0) {
        b = victim(f, 0);
        wait_buffer(f, b); // its write-back
        start_io(f, b, c, 0);
    }
    wait_buffer(f, b);
    f->active = b;
    f->buf[b].stamp = ++f->clock;
    // read ahead into buffers with nothing in flight, keeping one for the
    // write-back of this chunk; past the last chunk, the next step's first
    // ones, read while the forward and backward passes run
    int ahead = f->cfg.buffer_count - 1 - (f->cfg.pipeline_write ? 1 : 0);
    for (int i = 1; f->cfg.pipeline_read && i <= ahead && i < f->n_chunks; i++) {
        int n = (c + i) % f->n_chunks;
        if (holding(f, n) >= 0) continue;
        int v = victim(f, 1);
        if (v < 0 || f->buf[v].stamp == f->clock) break;
        f->buf[v].stamp = f->clock;
        start_io(f, v, n, 0);
    }
    *lo = f->begin + (size_t)c * f->chunk;
    *hi = f->begin +
          (f->numel - (size_t)c * f->chunk < f->chunk ? f->numel : (size_t)(c + 1) * f->chunk);
    tensors_of(f, b, tensors);
}

static void pager_release(void *ctx, int c) {
    fl_offload *f = ctx;
    int b = f->active;
    FL_ASSERT(b >= 0 && f->buf[b].chunk == c);
    f->active = -1;
    start_io(f, b, c, 1);
    if (!f->cfg.pipeline_write) wait_buffer(f, b);
}

static void pager_map(void *ctx, float **tensors) {
    fl_offload *f = ctx;
    FL_ASSERT(!f->map && f->active < 0);
    wait_buffer(f, -1);
    size_t bytes = (size_t)f->ntensors * f->padded * sizeof(float);
    f->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        fl_die("NVMe offload file %s: cannot map its %zu bytes: %s", f->path, bytes,
               strerror(errno));
    }
    madvise(f->map, bytes, MADV_SEQUENTIAL);
    for (int k = 0; k < f->ntensors; k++) tensors[k] = (float *)f->map + (size_t)k * f->padded;
}

static void pager_unmap(void *ctx) {
    fl_offload *f = ctx;
    size_t bytes = (size_t)f->ntensors * f->padded * sizeof(float);
    if (msync(f->map, bytes, MS_SYNC) != 0)
        fl_die("NVMe offload file %s: writing back the mapped state failed: %s", f->path,
               strerror(errno));
    munmap(f->map, bytes);
    f->map = NULL;
    // what the mapping wrote is newer than what the buffers hold
    for (int b = 0; b < f->cfg.buffer_count; b++) f->buf[b] = (buffer){-1, 0, 0};
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
    unlink(f->path); // scratch: gone with the process, however it ends
    size_t bytes = (size_t)f->ntensors * f->padded * sizeof(float);
    int rc = posix_fallocate(f->fd, 0, (off_t)bytes);
    if (rc != 0)
        fl_die("zero_optimization.offload_optimizer.nvme_path: cannot reserve %.2f GB for %s: %s",
               bytes / 1e9, f->path, strerror(rc));
}

// The file's first contents: the master from the weights, the state zeros.
static void fill_file(fl_offload *f, int has_master) {
    fl_optimizer *o = f->o;
    for (int c = 0; c < f->n_chunks; c++) {
        int b = c % f->cfg.buffer_count;
        wait_buffer(f, b);
        float *t[FL_OPTIM_MAX_TENSORS];
        tensors_of(f, b, t);
        size_t lo = (size_t)c * f->chunk, n = f->numel - lo < f->chunk ? f->numel - lo : f->chunk;
        for (int k = 0; k < f->ntensors; k++) memset(t[k], 0, f->chunk * sizeof(float));
        if (has_master)
            fl_convert(FL_F32, t[0], o->dtype,
                       fl_at(o->dtype, o->params, f->begin + lo - o->params_first), n);
        start_io(f, b, c, 1);
    }
    wait_buffer(f, -1);
    for (int b = 0; b < f->cfg.buffer_count; b++) f->buf[b] = (buffer){-1, 0, 0};
}

fl_offload *fl_offload_optimizer(fl_optimizer *o, const fl_offload_config *cfg) {
    FL_ASSERT(o->cfg.paged && !o->pager);
    FL_ASSERT(cfg->buffer_count >= 1 && cfg->queue_depth >= 1 && cfg->block_size >= 1);
    FL_ASSERT(cfg->thread_count >= 1 && cfg->thread_count <= MAX_THREADS);
    fl_offload *f = fl_alloc(FL_MEM_OTHER, sizeof *f);
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    f->o = o;
    f->begin = o->rule->state_begin;
    f->numel = o->rule->state_end - f->begin;
    f->ntensors = fl_optimizer_paged_tensors(&o->cfg, o->dtype);
    FL_ASSERT(f->ntensors >= 1 && f->ntensors <= FL_OPTIM_MAX_TENSORS);
    f->padded = round_up(f->numel ? f->numel : 1, PAGE_FLOATS);
    f->chunk = fl_offload_chunk(cfg, f->numel ? f->numel : 1);
    f->n_chunks = f->numel ? (int)((f->numel + f->chunk - 1) / f->chunk) : 0;
    f->active = -1;
    f->raw = fl_alloc(FL_MEM_OFFLOAD, buffers_bytes(cfg, f->chunk, f->ntensors));
    f->buffers = (float *)(f->raw + (PAGE - (uintptr_t)f->raw % PAGE) % PAGE);
    f->buf = fl_alloc(FL_MEM_OTHER, (size_t)cfg->buffer_count * sizeof(buffer));
    f->per_buffer = requests_per_buffer(cfg, f->chunk, f->ntensors);
    f->reqs = fl_alloc(FL_MEM_OTHER, (size_t)cfg->buffer_count * f->per_buffer * sizeof(request));
    for (int b = 0; b < cfg->buffer_count; b++) f->buf[b] = (buffer){-1, 0, 0};
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->work, NULL);
    pthread_cond_init(&f->done, NULL);
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
    pthread_mutex_unlock(&f->lock);
    fill_file(f, o->dtype != FL_F32); // mixed precision: a master first
    memset(&f->stats, 0, sizeof f->stats);
    f->pager =
        (fl_optim_pager){f, f->n_chunks, pager_acquire, pager_release, pager_map, pager_unmap};
    o->pager = &f->pager;
    return f;
}

void fl_offload_free(fl_offload *f) {
    if (!f) return;
    wait_buffer(f, -1);
    pthread_mutex_lock(&f->lock);
    f->stop = 1;
    pthread_cond_broadcast(&f->work);
    pthread_mutex_unlock(&f->lock);
    for (int i = 0; i < f->n_threads; i++) {
        pthread_join(f->threads[i].thread, NULL);
        io_uring_queue_exit(&f->threads[i].ring);
    }
    close(f->fd);
    fl_free(f->reqs);
    if (f->o->pager == &f->pager) f->o->pager = NULL;
    pthread_mutex_destroy(&f->lock);
    pthread_cond_destroy(&f->work);
    pthread_cond_destroy(&f->done);
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
