// emu.cc: the CUDA emulator's runtime (tests/cuda_emu/). One emulated GPU
// whose memory is host memory: allocations are filled with 0xFF (NaN in
// every float dtype), as a real cudaMalloc's contents are garbage.
//
// Streams run as late as CUDA allows: work queued on a stream runs only
// when something waits for it (a stream or event synchronisation, a
// cudaStreamWaitEvent of another stream that runs, cudaFree, a synchronous
// copy, the legacy stream). So a missing event wait leaves its reader with
// the old bytes, and a host buffer reused before its asynchronous copy ran
// is read at its new contents, as on a GPU where the copy had not started.
// FITLM_CUDA_EMU_SCHEDULE=eager runs each piece of work when queued,
// =copies the copy streams' (cudaStreamNonBlocking) work when queued and
// the compute stream's as late as allowed (a copy that overwrites what the
// compute stream has yet to read then shows);
// FITLM_CUDA_EMU_TRACE=1 prints each kernel's grid and time.
//
// Kernels: each block in turn, one fiber per thread (a stack of its own and
// a switch of the callee-saved registers, x86-64's System V ABI); a thread
// runs until it returns or reaches a barrier (__syncthreads, a shuffle);
// the barrier opens when every thread it names has reached it (every
// other launch of a kernel takes the blocks, and the threads of a round, in
// reverse order, so order-dependent results differ between launches), and a
// barrier that can never open (threads at different barriers, a shuffle
// naming a lane that returned) stops the run naming the kernel. Checked at
// launch, as CUDA does: the block size, grid limits, dynamic shared memory
// against its attribute.
//
// cuBLASLt: column-major D = alpha op(A) op(B) + beta C (+ bias per row of
// D), fp32 sums in k order, operands and pointers checked against the
// layouts and the alignment the algorithm was chosen for.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda_runtime.h"
#include "emu.hpp"

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

using fl_emu::die;

namespace {

std::recursive_mutex &lock = fl_emu::lock;
cudaError_t last_error = cudaSuccess;

cudaError_t fail(cudaError_t e) {
    last_error = e;
    return e;
}

size_t env_size(const char *name, size_t fallback) {
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : fallback;
}

// ---- memory

size_t mem_total() {
    return env_size("FITLM_CUDA_EMU_MEM_GIB", 16) << 30;
}
// what the emulated context and cuBLASLt's handle hold, as a GPU's do
size_t context_bytes() {
    return env_size("FITLM_CUDA_EMU_CONTEXT_MIB", 64) << 20;
}
std::map<const char *, size_t> device_blocks, pinned_blocks; // start -> bytes
size_t device_used;

// the allocation of `blocks` holding [p, p + bytes), or NULL
const char *find(const std::map<const char *, size_t> &blocks, const void *p, size_t bytes) {
    const char *c = (const char *)p;
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return NULL;
    --it;
    return c >= it->first && c + bytes <= it->first + it->second ? it->first : NULL;
}

int touches_device(const void *p, size_t bytes) {
    const char *c = (const char *)p;
    auto it = device_blocks.lower_bound(c + bytes);
    if (it == device_blocks.begin()) return 0;
    --it;
    return it->first + it->second > c;
}

// ---- streams and events

// A piece of a stream's work: run(start) does it and returns the device
// time it ends, given the time it starts (the emulated GPU's clock: work
// starts when it is queued or when the stream's previous work ends,
// whichever is later, however late the emulator runs it).
struct op {
    std::function<double(double)> run;
    double queued_at;
};

struct stream_state {
    int early; // runs its work when queued (FITLM_CUDA_EMU_SCHEDULE)
    std::deque<op> queue;
    unsigned long long queued = 0, done = 0;
    double clock = 0; // when its last work ended, on the device's clock
};

// Whether a stream created with `flags` runs its work when queued:
// FITLM_CUDA_EMU_SCHEDULE=eager every stream; =copies the non-blocking
// streams (fitlm's copy streams), the compute stream staying as late as
// allowed, so a copy that overwrites a buffer the compute stream has yet to
// read, without waiting for it, shows; unset: none.
int runs_early(unsigned int flags) {
    const char *v = getenv("FITLM_CUDA_EMU_SCHEDULE");
    if (!v) return 0;
    return !strcmp(v, "eager") || (!strcmp(v, "copies") && (flags & cudaStreamNonBlocking));
}

std::vector<std::shared_ptr<stream_state>> streams; // live ones

// Runs s's work up to its first `until` items.
void force(const std::shared_ptr<stream_state> &s, unsigned long long until) {
    while (s->done < until) {
        op o = std::move(s->queue.front());
        s->queue.pop_front();
        s->done++;
        s->clock = o.run(o.queued_at > s->clock ? o.queued_at : s->clock);
    }
}

void flush_all() {
    for (size_t i = 0; i < streams.size(); i++) {
        std::shared_ptr<stream_state> s = streams[i];
        force(s, s->queued);
    }
}

} // namespace

struct CUstream_st {
    std::shared_ptr<stream_state> s;
};

struct event_state {
    std::shared_ptr<stream_state> s; // NULL: recorded on the legacy stream
    unsigned long long at = 0;
    int recorded = 0, timing = 1;
    double seconds = 0;
};

struct CUevent_st {
    std::shared_ptr<event_state> e;
};

namespace {

double now() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

} // namespace

namespace fl_emu {

std::recursive_mutex lock;

void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda emulator: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

int is_device(const void *p, size_t bytes) {
    return find(device_blocks, p, bytes) != NULL;
}

// Queues timed work on s: run(start) returns when it ends on the device's
// clock. The legacy stream (NULL) waits for all work before it and runs at
// once.
void enqueue_timed(cudaStream_t s, std::function<double(double)> run) {
    if (!s) {
        flush_all();
        run(now());
        return;
    }
    s->s->queue.push_back(op{std::move(run), now()});
    s->s->queued++;
    if (s->s->early) force(s->s, s->s->queued);
}

// Work that takes on the device the time it takes the emulator.
void enqueue(cudaStream_t s, std::function<void()> run) {
    enqueue_timed(s, [run](double start) {
        double t = now();
        run();
        return start + (now() - t);
    });
}

} // namespace fl_emu

using fl_emu::enqueue;
using fl_emu::enqueue_timed;
using fl_emu::is_device;

extern "C" {

// each error's name and CUDA's text for it
static const struct {
    cudaError_t err;
    const char *name, *text;
} errors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
};

const char *cudaGetErrorString(cudaError_t err) {
    for (const auto &e : errors)
        if (e.err == err) return e.text;
    return "unknown error";
}

const char *cudaGetErrorName(cudaError_t err) {
    for (const auto &e : errors)
        if (e.err == err) return e.name;
    return "cudaErrorUnknown";
}

cudaError_t cudaGetLastError(void) {
    std::lock_guard<std::recursive_mutex> g(lock);
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    if (device != 0) return fail(cudaErrorInvalidValue);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "fitlm CUDA emulator (the CPU, tests/cuda_emu)");
    prop->totalGlobalMem = mem_total();
    prop->sharedMemPerBlock = 48 << 10;
    prop->sharedMemPerBlockOptin = 227 << 10; // an H100's
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxGridSize[0] = 0x7fffffff;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->major = 9;
    // few multiprocessors: grid-stride loops then run several rounds
    prop->multiProcessorCount = (int)env_size("FITLM_CUDA_EMU_SMS", 2);
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    std::lock_guard<std::recursive_mutex> g(lock);
    flush_all();
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    std::lock_guard<std::recursive_mutex> g(lock);
    *total_bytes = mem_total();
    *free_bytes = mem_total() - context_bytes() - device_used;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
    std::lock_guard<std::recursive_mutex> g(lock);
    *p = NULL;
    size_t rounded = (bytes + 255) & ~(size_t)255;
    if (!rounded || context_bytes() + device_used + rounded > mem_total())
        return fail(cudaErrorMemoryAllocation);
    // the exact size, so that a kernel's read past the end meets ASan's redzone
    void *q = NULL;
    if (posix_memalign(&q, 256, bytes)) return fail(cudaErrorMemoryAllocation);
    memset(q, 0xff, bytes);
    device_blocks[(const char *)q] = bytes;
    device_used += rounded;
    *p = q;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!p) return cudaSuccess;
    flush_all(); // cudaFree waits for the device
    auto it = device_blocks.find((const char *)p);
    if (it == device_blocks.end()) return fail(cudaErrorInvalidDevicePointer);
    device_used -= (it->second + 255) & ~(size_t)255;
    device_blocks.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags) {
    std::lock_guard<std::recursive_mutex> g(lock);
    (void)flags;
    *p = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
    if (!*p) return fail(cudaErrorMemoryAllocation);
    pinned_blocks[(const char *)*p] = bytes;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!p) return cudaSuccess;
    flush_all();
    auto it = pinned_blocks.find((const char *)p);
    if (it == pinned_blocks.end()) return fail(cudaErrorInvalidValue);
    pinned_blocks.erase(it);
    free(p);
    return cudaSuccess;
}

// A copy's pointers must lie where its kind says: a device range inside one
// allocation, a host range outside every one.
static void check_copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
    int dev_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    int dev_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault)
        die("a copy of kind %d (src/cuda/ names the direction)", (int)kind);
    const char *what = kind == cudaMemcpyHostToDevice   ? "host-to-device"
                       : kind == cudaMemcpyDeviceToHost ? "device-to-host"
                                                        : "device-to-device";
    if (dev_dst ? !is_device(dst, bytes) : touches_device(dst, bytes))
        die("a %s copy of %zu bytes whose destination is not %s memory", what, bytes,
            dev_dst ? "device" : "host");
    if (dev_src ? !is_device(src, bytes) : touches_device(src, bytes))
        die("a %s copy of %zu bytes whose source is not %s memory", what, bytes,
            dev_src ? "device" : "host");
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
    std::lock_guard<std::recursive_mutex> g(lock);
    check_copy(dst, src, bytes, kind);
    flush_all();
    memcpy(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(lock);
    check_copy(dst, src, bytes, kind);
    // Pageable host memory: CUDA stages it, so the call returns only after
    // the source is read (host to device) or the data has arrived (device
    // to host); pinned memory is copied when the stream runs.
    const void *host = kind == cudaMemcpyHostToDevice ? src : dst;
    if (kind != cudaMemcpyDeviceToDevice && !find(pinned_blocks, host, bytes)) {
        if (s)
            force(s->s, s->s->queued);
        else
            flush_all();
        memcpy(dst, src, bytes);
        return cudaSuccess;
    }
    enqueue(s, [dst, src, bytes]() { memcpy(dst, src, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (bytes && !is_device(p, bytes)) die("a memset of %zu bytes outside device memory", bytes);
    enqueue(s, [p, value, bytes]() { memset(p, value, bytes); });
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    std::lock_guard<std::recursive_mutex> g(lock);
    // the legacy stream waits for all streams here, blocking or not (stricter)
    *s = new CUstream_st{std::make_shared<stream_state>()};
    (*s)->s->early = runs_early(flags);
    streams.push_back((*s)->s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!s) return fail(cudaErrorInvalidResourceHandle);
    force(s->s, s->s->queued); // its work still completes
    for (size_t i = 0; i < streams.size(); i++)
        if (streams[i] == s->s) streams.erase(streams.begin() + (long)i);
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (s)
        force(s->s, s->s->queued);
    else
        flush_all();
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
    std::lock_guard<std::recursive_mutex> g(lock);
    (void)flags;
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    if (!e->e->recorded || !e->e->s) return cudaSuccess; // nothing to wait for
    std::shared_ptr<event_state> ev = e->e;
    // s goes on when the event's work has run, and not before its time
    enqueue_timed(s, [ev](double start) {
        force(ev->s, ev->at);
        return ev->seconds > start ? ev->seconds : start;
    });
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    std::lock_guard<std::recursive_mutex> g(lock);
    *e = new CUevent_st{std::make_shared<event_state>()};
    (*e)->e->timing = !(flags & cudaEventDisableTiming);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    // a fresh state: waits queued on the old recording keep theirs
    std::shared_ptr<event_state> st = std::make_shared<event_state>();
    st->timing = e->e->timing;
    st->recorded = 1;
    e->e = st;
    enqueue_timed(s, [st](double start) {
        st->seconds = start;
        return start;
    });
    if (s) {
        st->s = s->s;
        st->at = s->s->queued;
    }
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    if (e->e->s) force(e->e->s, e->e->at);
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    return !e->e->s || e->e->s->done >= e->e->at ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!start || !end || !start->e->timing || !end->e->timing)
        return fail(cudaErrorInvalidResourceHandle);
    if (cudaEventQuery(start) != cudaSuccess || cudaEventQuery(end) != cudaSuccess)
        return fail(cudaErrorNotReady);
    *ms = (float)((end->e->seconds - start->e->seconds) * 1e3);
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    delete e; // queued waits keep its state
    return cudaSuccess;
}

cudaError_t fl_emu_memcpy_to_symbol(void *symbol, size_t symbol_bytes, const void *src,
                                    size_t bytes, size_t offset) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (offset + bytes > symbol_bytes) return fail(cudaErrorInvalidValue);
    flush_all(); // synchronous, on the legacy stream
    memcpy((char *)symbol + offset, src, bytes);
    return cudaSuccess;
}

} // extern "C"

// ---- kernels

namespace {

std::map<const void *, int> max_dynamic_shared;      // per kernel: its attribute
std::map<const void *, unsigned long long> launches; // per kernel

const int stack_bytes = 128 << 10, guard_bytes = 4096, max_threads = 1024;

enum { RUNNABLE, AT_BLOCK, AT_WARP, DONE };

// a cp.async copy not yet made: 16 bytes from src, or zeros (!full)
struct async_copy {
    void *dst;
    const void *src;
    int full;
};

struct fiber {
    void *sp; // its saved stack pointer while another runs
    int state;
    unsigned mask; // at a warp barrier: the lanes it names
    int wmma;      // at a warp barrier: whether a WMMA call's or PTX instruction's
    uint3 tid;
    // its cp.async copies: committed groups, oldest first, then the open one
    std::deque<std::vector<async_copy>> groups;
    std::vector<async_copy> open;
};

// a lane's arguments to a WMMA call, compared across the warp
struct wmma_args {
    const char *call;
    const void *ptr;
    unsigned ldm;
    int layout;
};

// what free() releases: the block's shared memory, 256-byte aligned
struct free_delete {
    void operator()(char *p) const {
        free(p);
    }
};
typedef std::unique_ptr<char, free_delete> aligned_bytes;

aligned_bytes aligned(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1)) die("no memory for shared memory");
    memset(p, 0xff, bytes);
    return aligned_bytes((char *)p);
}

struct block_run {
    const char *name;
    const std::function<void()> *body;
    void *sched; // the scheduler's saved stack pointer
    std::vector<fiber> f;
    int n, current;
    int step; // 1 or -1: the threads' order in a round (and the blocks')
    // per thread, two sets used in turn: the bits a shuffle offers (a lane
    // reaches the shuffle after next only once all have read this one)
    std::vector<unsigned long long> slots[2];
    std::vector<unsigned char> turn; // per thread: its next set
    // the same for the WMMA calls' arguments, and per warp the staging
    // area through which mma_sync's lanes see each other's fragments
    std::vector<wmma_args> wmma_slots[2];
    std::vector<unsigned char> wmma_turn;
    // the same for the PTX instructions' operands (fl_emu_ptx.h)
    std::vector<fl_emu::ptx_slot> ptx_slots[2];
    std::vector<unsigned char> ptx_turn;
    std::vector<float> staging;
    aligned_bytes dynamic;
    size_t dynamic_bytes;
    struct shared_array {
        const void *site; // its declaration
        size_t bytes;
        aligned_bytes mem;
    };
    std::vector<shared_array> shared;
    size_t shared_bytes;
};

char *stacks; // max_threads stacks, each below a guard page
block_run *running;

} // namespace

// Saves the callee-saved registers on the stack, stores the stack pointer
// in *from and resumes the context whose stack pointer is `to` (saved the
// same way). MXCSR and the x87 control word are left alone: no kernel
// changes them.
extern "C" void fl_emu_switch(void **from, void *to);
asm(R"(
    .text
    .globl fl_emu_switch
    .type fl_emu_switch, @function
fl_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fl_emu_switch, .-fl_emu_switch
)");

namespace {

// The current thread, now in `state` (at a barrier, or done), hands over
// to the next runnable thread of the round, or to the scheduler after the
// last.
void pass_on(int state, unsigned mask) {
    block_run &r = *running;
    fiber &me = r.f[r.current];
    me.state = state;
    me.mask = mask;
    int next = r.current + r.step;
    while (next >= 0 && next < r.n && r.f[next].state != RUNNABLE) next += r.step;
    if (next < 0 || next == r.n) {
        fl_emu_switch(&me.sp, r.sched);
        return;
    }
    r.current = next;
    threadIdx = r.f[next].tid;
    fl_emu_switch(&me.sp, r.f[next].sp);
}

// A thread's first frame: the kernel, then on to the next thread for good.
// A returning thread must have waited for all its cp.async copies. (Its
// own function, not fl_emu_thread_main's code: that frame never returns,
// and under ASan a frame with locals would leave poisoned bytes at the top
// of the fiber's stack for the next launch.)
__attribute__((noinline)) void check_copies_waited() {
    const fiber &me = running->f[running->current];
    if (!me.groups.empty() || !me.open.empty())
        die("kernel %s: thread %d returns with cp.async copies it never waited for", running->name,
            running->current);
}

extern "C" [[noreturn]] void fl_emu_thread_main() {
    (*running->body)();
    check_copies_waited();
    pass_on(DONE, 0);
    abort(); // a finished thread is never resumed
}

// A fresh thread's saved context at the top of its stack: the zeroed
// registers fl_emu_switch pops, then fl_emu_thread_main's address for its
// ret, placed so that the function starts with the stack aligned as after
// a call.
void *fresh_context(char *stack_top) {
    uint64_t *top = (uint64_t *)((uintptr_t)stack_top & ~(uintptr_t)15);
    uint64_t *sp = top - 8;
    memset(sp, 0, 8 * sizeof *sp);
    sp[6] = (uint64_t)(uintptr_t)&fl_emu_thread_main;
    return sp;
}

// Opens the barriers that every thread they name has reached; 0 when none.
int open_barriers(block_run &r) {
    int opened = 0, live = 0, at_block = 0;
    for (int w = 0; w * 32 < r.n; w++) {
        int lanes = r.n - w * 32 < 32 ? r.n - w * 32 : 32;
        unsigned mask = 0, waiting = 0;
        for (int l = 0; l < lanes; l++) {
            const fiber &t = r.f[w * 32 + l];
            if (t.state != AT_WARP) continue;
            if (waiting && t.mask != mask)
                die("kernel %s: lanes of warp %d shuffle with different masks", r.name, w);
            if (waiting && t.wmma != r.f[w * 32 + __builtin_ctz(waiting)].wmma)
                die("kernel %s: lanes of warp %d meet at a WMMA call and at a shuffle or "
                    "__syncwarp: a WMMA call inside a branch",
                    r.name, w);
            mask = t.mask;
            waiting |= 1u << l;
        }
        if (!waiting) continue;
        for (int l = 0; l < 32; l++) {
            if (!(mask >> l & 1)) continue;
            if (l >= lanes)
                die("kernel %s: a warp barrier's mask names lane %d of a block without it (a "
                    "shuffle, __syncwarp or WMMA call)",
                    r.name, l);
            if (r.f[w * 32 + l].state == DONE)
                die("kernel %s: a warp barrier's mask names lane %d, which has returned (a "
                    "shuffle, __syncwarp or WMMA call)",
                    r.name, l);
        }
        if ((waiting & mask) != mask) continue; // some named lane is still on its way
        if (!(waiting & mask))
            die("kernel %s: warp %d shuffles with a mask without the lanes that call it", r.name,
                w);
        for (int l = 0; l < lanes; l++)
            if (waiting >> l & 1) r.f[w * 32 + l].state = RUNNABLE;
        opened = 1;
    }
    if (opened) return 1;
    for (const fiber &t : r.f)
        if (t.state != DONE) live++, at_block += t.state == AT_BLOCK;
    if (live && at_block == live) {
        for (fiber &t : r.f)
            if (t.state == AT_BLOCK) t.state = RUNNABLE;
        return 1;
    }
    return 0;
}

void run_block(block_run &r) {
    for (int i = 0; i < r.n; i++) {
        fiber &t = r.f[i];
        // the tops staggered by cache lines: tops a page multiple apart would
        // share the cache's sets and evict each other at every switch
        t.sp = fresh_context(stacks + (size_t)(i + 1) * (stack_bytes + guard_bytes) -
                             (size_t)(i % 61) * 64);
        t.state = RUNNABLE;
        t.groups.clear();
        t.open.clear();
        r.turn[(size_t)i] = 0;
        r.wmma_turn[(size_t)i] = 0;
        r.ptx_turn[(size_t)i] = 0;
    }
    memset(r.dynamic.get(), 0xff, r.dynamic_bytes);
    r.shared.clear();
    r.shared_bytes = 0;
    for (;;) {
        // a round: each runnable thread in turn, handing over directly
        int first = r.step > 0 ? 0 : r.n - 1;
        while (first >= 0 && first < r.n && r.f[first].state != RUNNABLE) first += r.step;
        if (first >= 0 && first < r.n) {
            r.current = first;
            threadIdx = r.f[first].tid;
            fl_emu_switch(&r.sched, r.f[first].sp);
        }
        int done = 1;
        for (const fiber &t : r.f) done &= t.state == DONE;
        if (done) return;
        if (!open_barriers(r)) {
            int at_block = 0, at_warp = 0;
            for (const fiber &t : r.f)
                at_block += t.state == AT_BLOCK, at_warp += t.state == AT_WARP;
            die("kernel %s: its threads wait at barriers that cannot open (%d at __syncthreads, "
                "%d at a warp barrier, the rest returned): a barrier inside a branch",
                r.name, at_block, at_warp);
        }
    }
}

} // namespace

namespace fl_emu {

void launch(const char *name, const void *func, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
            std::function<void()> body) {
    std::lock_guard<std::recursive_mutex> g(lock);
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!threads || threads > max_threads || block.z > 64 || !grid.x || !grid.y || !grid.z ||
        grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    auto attr = max_dynamic_shared.find(func);
    size_t limit = attr != max_dynamic_shared.end() ? (size_t)attr->second : 48 << 10;
    if (smem > limit) {
        fail(cudaErrorInvalidValue);
        return;
    }
    if (!stacks) {
        size_t bytes = (size_t)max_threads * (stack_bytes + guard_bytes);
        stacks = (char *)mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stacks == MAP_FAILED) die("no memory for the fibers' stacks");
        for (int i = 0; i < max_threads; i++)
            mprotect(stacks + (size_t)i * (stack_bytes + guard_bytes), guard_bytes, PROT_NONE);
    }
    // Every other launch of a kernel runs its blocks, and its threads in
    // each round, in reverse order (FITLM_CUDA_EMU_ORDER=forward or
    // reverse: all): a result that depends on the order (a race between
    // threads or blocks) differs between two launches of the same work.
    const char *order = getenv("FITLM_CUDA_EMU_ORDER");
    int step = order && !strcmp(order, "reverse")   ? -1
               : order && !strcmp(order, "forward") ? 1
               : launches[func]++ % 2               ? -1
                                                    : 1;
    enqueue(s, [name, grid, block, smem, body, step]() {
        block_run r;
        r.name = name;
        r.step = step;
        r.body = &body;
        r.n = (int)(block.x * block.y * block.z);
        r.f.resize((size_t)r.n);
        r.slots[0].resize((size_t)r.n);
        r.slots[1].resize((size_t)r.n);
        r.turn.resize((size_t)r.n);
        r.wmma_turn.resize((size_t)r.n);
        r.ptx_turn.resize((size_t)r.n);
        // at least 128-byte aligned, as CUDA's dynamic shared memory is in practice
        r.dynamic = aligned(smem);
        r.dynamic_bytes = smem;
        for (int i = 0; i < r.n; i++)
            r.f[i].tid = uint3{(unsigned)i % block.x, (unsigned)i / block.x % block.y,
                               (unsigned)i / (block.x * block.y)};
        running = &r;
        double t0 = now();
        blockDim = block;
        gridDim = grid;
        unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
        for (unsigned long long i = 0; i < blocks; i++) {
            unsigned long long b = step > 0 ? i : blocks - 1 - i;
            blockIdx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                             (unsigned)(b / ((unsigned long long)grid.x * grid.y))};
            run_block(r);
        }
        running = NULL;
        if (getenv("FITLM_CUDA_EMU_TRACE"))
            fprintf(stderr, "emu: %s grid %u,%u,%u block %u,%u,%u smem %zu: %.1f ms\n", name,
                    grid.x, grid.y, grid.z, block.x, block.y, block.z, smem, (now() - t0) * 1e3);
    });
}

void *dynamic_shared() {
    return running->dynamic.get();
}

void *shared_array(const void *site, size_t bytes) {
    block_run &r = *running;
    for (auto &a : r.shared)
        if (a.site == site) return a.mem.get();
    r.shared_bytes += bytes;
    if (r.shared_bytes + r.dynamic_bytes > (227u << 10))
        die("kernel %s: %zu bytes of shared memory, more than a block has", r.name,
            r.shared_bytes + r.dynamic_bytes);
    r.shared.push_back(block_run::shared_array{site, bytes, aligned(bytes)});
    return r.shared.back().mem.get();
}

void block_barrier() {
    pass_on(AT_BLOCK, 0);
}

unsigned long long exchange(unsigned mask, unsigned long long bits, int mode, int arg, int width) {
    block_run &r = *running;
    int me = r.current, lane = me % 32, base = me - lane;
    if (!(mask >> lane & 1))
        die("kernel %s: lane %d shuffles with a mask without itself", r.name, lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        die("kernel %s: a shuffle of width %d", r.name, width);
    std::vector<unsigned long long> &slots = r.slots[r.turn[(size_t)me]];
    r.turn[(size_t)me] ^= 1;
    slots[(size_t)me] = bits;
    r.f[me].wmma = 0;
    pass_on(AT_WARP, mask);
    int seg = lane & ~(width - 1), src = lane;
    switch (mode) {
    case SHFL_IDX:
        src = seg + (arg & (width - 1));
        break;
    case SHFL_DOWN:
        src = (lane - seg) + arg < width ? lane + arg : lane;
        break;
    case SHFL_UP:
        src = (lane - seg) >= arg ? lane - arg : lane;
        break;
    case SHFL_XOR:
        src = (lane ^ arg) < seg + width ? lane ^ arg : lane;
        break;
    }
    if (!(mask >> src & 1))
        die("kernel %s: lane %d reads a lane outside the shuffle's mask", r.name, lane);
    return slots[(size_t)(base + src)];
}

void kernel_die(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    die("kernel %s: %s", running->name, msg);
}

void warp_barrier(unsigned mask, int wmma) {
    block_run &r = *running;
    int lane = r.current % 32;
    if (!(mask >> lane & 1))
        die("kernel %s: lane %d calls __syncwarp with a mask without itself", r.name, lane);
    r.f[r.current].wmma = wmma;
    pass_on(AT_WARP, mask);
}

// whether [p, p + bytes) lies inside the running block's dynamic shared
// memory or one of its shared arrays
int in_shared(const block_run &r, const void *p, size_t bytes) {
    const char *c = (const char *)p, *d = r.dynamic.get();
    if (c >= d && c + bytes <= d + r.dynamic_bytes) return 1;
    for (const auto &a : r.shared)
        if (c >= a.mem.get() && c + bytes <= a.mem.get() + a.bytes) return 1;
    return 0;
}

float *wmma_enter(const char *call, const void *ptr, unsigned ldm, int layout, size_t elem_bytes,
                  size_t span) {
    block_run &r = *running;
    int me = r.current, lane = me % 32, base = me - lane;
    // the CUDA Programming Guide's rules (Warp Matrix Functions), and the
    // matrix where a GPU's memory is (global or shared)
    if (elem_bytes && (uintptr_t)ptr % 32)
        die("kernel %s: wmma::%s at %p, not 256-bit (32-byte) aligned", r.name, call, ptr);
    if (elem_bytes && ldm * elem_bytes % 16)
        die("kernel %s: wmma::%s with ldm %u, not a multiple of %zu elements (16 bytes)", r.name,
            call, ldm, 16 / elem_bytes);
    if (elem_bytes && !is_device(ptr, span * elem_bytes) && !in_shared(r, ptr, span * elem_bytes))
        die("kernel %s: wmma::%s of [%p, +%zu bytes) (ldm %u), outside every device allocation "
            "and shared array",
            r.name, call, ptr, span * elem_bytes, ldm);
    std::vector<wmma_args> &slots = r.wmma_slots[r.wmma_turn[(size_t)me]];
    r.wmma_turn[(size_t)me] ^= 1;
    if (slots.empty()) slots.resize((size_t)r.n);
    slots[(size_t)me] = wmma_args{call, ptr, ldm, layout};
    warp_barrier(0xffffffffu, 1);
    const wmma_args &a = slots[(size_t)me], &b = slots[(size_t)base];
    if (a.call != b.call && strcmp(a.call, b.call))
        die("kernel %s: lane %d of warp %d calls wmma::%s, lane 0 wmma::%s: a WMMA call inside a "
            "branch",
            r.name, lane, me / 32, a.call, b.call);
    if (a.ptr != b.ptr || a.ldm != b.ldm || a.layout != b.layout)
        die("kernel %s: wmma::%s with arguments that differ across warp %d (lane %d: %p, ldm %u, "
            "%s; lane 0: %p, ldm %u, %s)",
            r.name, a.call, me / 32, lane, a.ptr, a.ldm, a.layout ? "col-major" : "row-major",
            b.ptr, b.ldm, b.layout ? "col-major" : "row-major");
    size_t warps = (size_t)(r.n + 31) / 32;
    if (r.staging.size() < warps * wmma_staging) r.staging.resize(warps * wmma_staging);
    return &r.staging[(size_t)(me / 32) * wmma_staging];
}

void cp_async(void *dst, const void *src, int full) {
    block_run &r = *running;
    if ((uintptr_t)dst % 16 || !in_shared(r, dst, 16))
        die("kernel %s: cp.async to %p: not 16 bytes, 16-byte aligned, of the block's shared "
            "memory",
            r.name, dst);
    if ((uintptr_t)src % 16 || !is_device(src, full ? 16 : 1))
        die("kernel %s: cp.async from %p: not 16 bytes, 16-byte aligned, of a device allocation",
            r.name, src);
    r.f[r.current].open.push_back(async_copy{dst, src, full});
}

void cp_async_commit() {
    fiber &me = running->f[running->current];
    me.groups.push_back(std::move(me.open));
    me.open.clear();
}

void cp_async_wait(int pending) {
    fiber &me = running->f[running->current];
    while ((int)me.groups.size() > pending) {
        for (const async_copy &c : me.groups.front()) {
            if (c.full)
                memcpy(c.dst, c.src, 16);
            else
                memset(c.dst, 0, 16);
        }
        me.groups.pop_front();
    }
}

int in_shared_memory(const void *p, size_t bytes) {
    return in_shared(*running, p, bytes);
}

const ptx_slot *ptx_enter(const char *call, const void *mine, size_t bytes) {
    block_run &r = *running;
    int me = r.current, lane = me % 32, base = me - lane;
    if (bytes > sizeof(ptx_slot::bytes))
        die("kernel %s: %s with %zu bytes a lane", r.name, call, bytes);
    std::vector<ptx_slot> &slots = r.ptx_slots[r.ptx_turn[(size_t)me]];
    r.ptx_turn[(size_t)me] ^= 1;
    if (slots.size() < (size_t)r.n) slots.resize((size_t)r.n);
    slots[(size_t)me].call = call;
    memcpy(slots[(size_t)me].bytes, mine, bytes);
    // every lane's operands in place before any reads them; the other set
    // of slots takes the next instruction's, so these stay until all lanes
    // have passed that one's barrier
    warp_barrier(0xffffffffu, 1);
    if (slots[(size_t)me].call != slots[(size_t)base].call &&
        strcmp(slots[(size_t)me].call, slots[(size_t)base].call))
        die("kernel %s: lane %d of warp %d is at %s, lane 0 at %s: a warp-collective PTX "
            "instruction inside a branch",
            r.name, lane, me / 32, slots[(size_t)me].call, slots[(size_t)base].call);
    return &slots[(size_t)base];
}

} // namespace fl_emu

extern "C" cudaError_t fl_emu_func_set_attribute(const void *func, int attr, int value) {
    std::lock_guard<std::recursive_mutex> g(lock);
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > (227 << 10))
        return fail(cudaErrorInvalidValue);
    max_dynamic_shared[func] = value;
    return cudaSuccess;
}
