// bench_disk: the sequential bandwidth of the disk under a directory, the
// way NVMe offload uses it: O_DIRECT, io_uring, `depth` requests of `block`
// bytes in flight. Writes a file of `mib` MiB, fsyncs, reads it back, then
// reads and writes two halves at once (the offload's read-ahead beside its
// write-back), and deletes it.
//
//   bench_disk DIR [MiB=4096] [block KiB=1024] [depth=8]
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Moves `bytes` in `block` requests, `depth` in flight: reads (write 0),
// writes, or (write -1) reads of the first half and writes of the second,
// interleaved. Returns the seconds taken.
static double transfer(struct io_uring *ring, int fd, char *buf, size_t bytes, size_t block,
                       int depth, int write) {
    size_t next = 0, n = bytes / block, done = 0;
    int in_flight = 0;
    double t0 = now_s();
    while (done < n) {
        while (in_flight < depth && next < n) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            // interleaved: even requests read the first half, odd ones write the second
            size_t i = write >= 0 ? next : (next % 2 ? n / 2 + next / 2 : next / 2);
            int w = write >= 0 ? write : (int)(next % 2);
            char *at = buf + (size_t)(in_flight % depth) * block;
            if (w)
                io_uring_prep_write(sqe, fd, at, (unsigned)block, (off_t)(i * block));
            else
                io_uring_prep_read(sqe, fd, at, (unsigned)block, (off_t)(i * block));
            next++;
            in_flight++;
        }
        io_uring_submit(ring);
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(ring, &cqe) != 0) {
            fprintf(stderr, "bench_disk: io_uring_wait_cqe failed\n");
            exit(1);
        }
        if (cqe->res != (int)block) {
            fprintf(stderr, "bench_disk: a request moved %d of %zu bytes: %s\n", cqe->res, block,
                    cqe->res < 0 ? strerror(-cqe->res) : "short");
            exit(1);
        }
        io_uring_cqe_seen(ring, cqe);
        in_flight--;
        done++;
    }
    if (write != 0 && fdatasync(fd) != 0) {
        fprintf(stderr, "bench_disk: fdatasync: %s\n", strerror(errno));
        exit(1);
    }
    return now_s() - t0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_disk DIR [MiB=4096] [block KiB=1024] [depth=8]\n");
        return 2;
    }
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 4096;
    size_t block = (argc > 3 ? (size_t)atol(argv[3]) : 1024) * 1024;
    int depth = argc > 4 ? atoi(argv[4]) : 8;
    size_t bytes = mib << 20;
    if (!mib || !block || depth < 1 || bytes % (2 * block)) {
        fprintf(stderr, "bench_disk: MiB, block and depth must be positive, the size a multiple "
                        "of two blocks\n");
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/bench_disk.%ld.tmp", argv[1], (long)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (fd < 0) {
        fprintf(stderr, "bench_disk: cannot create %s with O_DIRECT: %s\n", path, strerror(errno));
        return 1;
    }
    unlink(path);
    char *buf;
    if (posix_memalign((void **)&buf, 4096, block * (size_t)depth)) return 1;
    memset(buf, 0x5a, block * (size_t)depth);
    struct io_uring ring;
    if (io_uring_queue_init((unsigned)depth, &ring, 0) < 0) {
        fprintf(stderr, "bench_disk: io_uring is not available\n");
        return 1;
    }
    double w = transfer(&ring, fd, buf, bytes, block, depth, 1);
    double r = transfer(&ring, fd, buf, bytes, block, depth, 0);
    double rw = transfer(&ring, fd, buf, bytes, block, depth, -1);
    printf("disk %s: %zu MiB, O_DIRECT, io_uring, %zu KiB x %d in flight: write %.2f GB/s, read "
           "%.2f GB/s, read and write at once %.2f GB/s\n",
           argv[1], mib, block >> 10, depth, bytes / w / 1e9, bytes / r / 1e9, bytes / rw / 1e9);
    io_uring_queue_exit(&ring);
    close(fd);
    free(buf);
    return 0;
}
