// core.h: the engine's foundation: errors, the tagged allocator and its
// memory accounting, the RNG, CPU feature probing, threads and timing.
// Everything else in fitlm builds on these; nothing here knows about models.
#ifndef FITLM_CORE_H
#define FITLM_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// ----------------------------------------------------------------------------
// errors and logging

// Prints "fitlm: error: <message>" to stderr and ends the process with
// status 1 at once (_exit after flushing every stream: no exit handler runs,
// and what is still allocated goes with the process).
// Used for bad input (files, config, flags) and broken invariants alike:
// the engine never continues past an error it cannot recover from.
void fl_die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
void fl_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// Several ranks (src/parallel/comm.c): messages name `rank`, and fl_die calls
// on_die (which ends the whole job) before exiting.
void fl_log_set_rank(int rank, void (*on_die)(int code));
// For parsers that report instead of dying (so fuzzers can run them): writes
// the message into err and returns -1.
int fl_errorf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

// Sizes in messages (src/core/size_text.c): below 1 KiB "512 bytes", else
// KiB, MiB, GiB, ... to three significant digits ("1.50 MiB", "12.3 GiB",
// "118 KiB"); buf holds FL_SIZE_TEXT chars. A message that compares two
// sizes uses the pair, which gives both in exact bytes when their texts
// would read the same ("needs 4096 bytes, only 3072 bytes are free").
enum { FL_SIZE_TEXT = 32 };
const char *fl_size_text(size_t bytes, char *buf);
void fl_size_text_pair(size_t a, size_t b, char *text_a, char *text_b);
// The offset of the first NUL in a JSON text of n bytes (a raw NUL byte, or
// "\u0000" in a string, which cJSON would cut the string at), or n; with
// key_size > 0, key gets the key whose value holds it ("" when none, or
// when the NUL is in a key).
size_t fl_json_nul_at(const char *text, size_t n, char *key, size_t key_size);
// 0, or -1 with the reason in err when the JSON text holds a NUL: the line,
// the byte offset and the key. fl_json_check_nul dies with it, naming
// `where` (the file).
int fl_json_nul_error(const char *text, size_t n, char *err, size_t errlen);
void fl_json_check_nul(const char *text, size_t n, const char *where);

// Always-on assertion (also in release builds): names the source line.
#define FL_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fl_die("internal: assertion '%s' failed at %s:%d", #cond, __FILE__, __LINE__);         \
    } while (0)

// ----------------------------------------------------------------------------
// tagged allocator: every byte the engine allocates is counted under a tag,
// so the memory report is exact rather than estimated.

typedef enum {
    FL_MEM_PARAMS,    // model parameters (in their storage dtype)
    FL_MEM_GRADS,     // parameter gradients
    FL_MEM_MASTER,    // fp32 master weights (mixed precision)
    FL_MEM_OPTIM,     // optimizer state (AdamW m and v, SGD momentum)
    FL_MEM_ACTS,      // activations kept for the backward pass
    FL_MEM_WORKSPACE, // scratch reused within one op or step
    FL_MEM_COMM,      // communication buffers
    FL_MEM_OFFLOAD,   // offload staging buffers
    FL_MEM_OTHER,     // data loader, tokenizer and other bookkeeping
    FL_MEM_NTAGS
} fl_mem_tag;

const char *fl_mem_tag_name(fl_mem_tag tag);

// 64-byte aligned, zero-filled (so the pages are really resident and RSS
// matches the accounting). Dies with a clear message when memory runs out.
void *fl_alloc(fl_mem_tag tag, size_t bytes);
// Names what this thread is reading ("data.jsonl:3"; NULL: nothing) in the
// out-of-memory error, where the input decides how much is allocated. The
// string must live until the call with NULL.
void fl_mem_context(const char *what);
// The out-of-memory error for `bytes` more of tag, naming the context.
void fl_die_oom(size_t bytes, fl_mem_tag tag) __attribute__((noreturn));
void fl_free(void *ptr); // NULL is fine
// Grows the tagged array p (NULL: none yet; *cap elements of elem bytes) to
// hold at least `need` elements, doubling from 64, and keeps its first
// `used`; returns it, moved when it grew.
void *fl_reserve(fl_mem_tag tag, void *p, size_t *cap, size_t used, size_t need, size_t elem);
size_t fl_mem_current(fl_mem_tag tag);
size_t fl_mem_peak(fl_mem_tag tag);
size_t fl_mem_total_current(void);
size_t fl_mem_total_peak(void); // peak of the sum, not the sum of peaks
size_t fl_mem_peak_rss(void);   // the process's peak resident set (VmHWM)
// Device memory (device.h) is counted apart, per tag: a device's allocator
// adds its blocks with fl_mem_device_count (bytes > 0) and removes them
// (bytes < 0); it dies with fl_die_device_oom when the device is full.
// Under a cap (fl_mem_device_set_cap) a count that would take the device's
// total over it dies naming the cap, the tag and the size.
void fl_mem_device_count(fl_mem_tag tag, long long bytes);
// --mem-limit on a device: the most the device's blocks may total (0: no
// cap), with the bytes it holds outside them (fl_mem_device_set_reserved).
void fl_mem_device_set_cap(size_t bytes);
// What the device holds outside its counted blocks (the CUDA context,
// device.h's reserved), counted against the cap.
void fl_mem_device_set_reserved(size_t bytes);
void fl_die_device_oom(const char *device, size_t bytes, fl_mem_tag tag) __attribute__((noreturn));
size_t fl_mem_device_current(fl_mem_tag tag);
size_t fl_mem_device_peak(fl_mem_tag tag);
size_t fl_mem_device_total_peak(void); // peak of the sum
// Pinned host memory (a device's host_alloc) counts as host memory under its
// tag and, apart, as pinned: bytes > 0 adds a block, bytes < 0 removes one.
void fl_mem_pinned_count(fl_mem_tag tag, long long bytes);
size_t fl_mem_pinned_peak(fl_mem_tag tag);
size_t fl_mem_pinned_total_peak(void); // peak of the sum
// The tags' current and peak bytes, on the host and (when a device
// allocated any) on the device.
void fl_mem_report(FILE *out);
// Memory this process may still use: MemAvailable from /proc/meminfo, capped
// by a cgroup (v2 or v1) limit minus its usage when there is one. 0 when
// unknown.
size_t fl_mem_available(void);

// ----------------------------------------------------------------------------
// input files (src/core/input.c): every file the user names is read through
// these. The path (links followed) must be a regular file: a directory, FIFO,
// socket or device is refused, naming what it is, and never blocks or is
// opened.

struct stat;
// Reads a whole file (at most max_bytes; `what` names it in errors) into a
// tagged buffer with room for a terminating NUL; dies naming the file.
uint8_t *fl_file_read_all(const char *path, size_t max_bytes, size_t *size, const char *what);
// Dies unless path is a regular file: "cannot open <what> <path>: <reason>",
// "<what> <path> is a directory" or "... is not a regular file (it is a FIFO)".
void fl_require_regular_file(const char *path, const char *what);
// The same check of what fstat or lstat found at path.
void fl_check_regular(const struct stat *st, const char *path, const char *what);
// Opens a regular file for reading (O_RDONLY | O_CLOEXEC), with the errors
// of fl_require_regular_file.
int fl_open_regular(const char *path, const char *what);
// The same, never dying (for probes): the descriptor, or -1 with errno set
// (EISDIR, or EINVAL for another kind of file); *st receives its status.
int fl_try_open_regular(const char *path, struct stat *st);

// ----------------------------------------------------------------------------
// JSON from outside (src/core/json.c): every file, header or log line that
// fitlm did not just build is parsed here. The text must be one JSON value
// and nothing but white space after it; a NUL byte anywhere is refused (it
// would end a C string early). NULL when it is not: *why ("invalid JSON",
// "unexpected text after the top-level JSON value", "a NUL byte", "no JSON
// value") and *at, the byte offset, for the caller's message naming the file.

struct cJSON;
struct cJSON *fl_json_parse(const char *text, size_t n, const char **why, size_t *at);
// fl_json_parse, then no \u0000 in any string (fl_json_nul_error: a name or
// token cut short would be another): the tree, or NULL with the reason in
// err ("not valid JSON: <why> at line L (byte B)", or the NUL's place).
struct cJSON *fl_json_read(const char *text, size_t n, char *err, size_t errlen);
// The same for a reader that dies: what ("tokenizer file F") names the file.
struct cJSON *fl_json_load(const char *text, size_t n, const char *what);
// The 1-based line of byte off in text, for messages.
int fl_text_line_of(const char *text, size_t off);

// ----------------------------------------------------------------------------
// random numbers: a small, fast, fully reproducible generator (xoshiro256**
// seeded through splitmix64). Its whole state is this struct, so a checkpoint
// can save and restore it.

typedef struct {
    uint64_t s[4];
} fl_rng;

void fl_rng_seed(fl_rng *rng, uint64_t seed);
uint64_t fl_rng_u64(fl_rng *rng);
float fl_rng_uniform(fl_rng *rng);              // [0, 1)
float fl_rng_normal(fl_rng *rng);               // N(0, 1), Box-Muller
uint64_t fl_rng_below(fl_rng *rng, uint64_t n); // uniform in [0, n), n > 0
// The state n fl_rng_u64 draws later, in O(log n) (the state's update is
// linear over GF(2)): streams split at known points can be drawn in parallel.
void fl_rng_jump(fl_rng *rng, uint64_t n);

// ----------------------------------------------------------------------------
// CPU features, threads and time

typedef struct {
    int avx2, fma, avx512f, avx512bw, avx512vl, avx512_bf16, amx_bf16;
    // AVX512_BF16's dot product outruns fp32 FMAs: on AMD (Zen 4: twice the
    // fp32 rate), not on Intel (an Emerald Rapids VM with AMX hidden: half
    // the fp32 rate)
    int bf16_dot_fast;
} fl_cpu_features;

// Probed once with CPUID/XGETBV, capped by the environment so that one
// machine can run every path it has: FITLM_ISA=avx2 turns AVX-512 and what
// builds on it (avx512_bf16, AMX) off, FITLM_ISA=portable (or
// FITLM_NO_SIMD=1) every feature; another FITLM_ISA value is an error.
const fl_cpu_features *fl_cpu(void);

// The kernels' vector paths: AVX-512 (F, BW, VL), AVX2 + FMA, or plain C.
typedef enum { FL_ISA_PORTABLE, FL_ISA_AVX2, FL_ISA_AVX512 } fl_isa;
// The widest of them fl_cpu() allows.
// This build: the commit it was configured from (git describe; "unknown"
// outside a git checkout) and the compiler (src/core/build.c).
const char *fl_build_id(void);
fl_isa fl_cpu_isa(void);
const char *fl_isa_name(fl_isa isa); // "portable", "avx2", "avx512"

// One thread pool for the whole engine: OpenMP's. OpenBLAS is linked in its
// OpenMP flavour so it shares that pool instead of spinning its own threads.
void fl_set_threads(int n);
int fl_threads(void);

// The runtime libraries read their settings from the environment when they
// load, before main. A program calls this first thing in main: where the
// user set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT it asks for passive
// waits (idle threads sleep instead of spinning, which costs nothing
// measurable alone and keeps a busy machine from slowing the step twice
// over), and where OPENBLAS_CORETYPE is unset, OpenBLAS's AVX2 (Haswell)
// kernels under FITLM_ISA=avx2 or portable on a CPU with AVX2, or, where
// OpenBLAS did not recognise the CPU and fell back to SSE3, the widest
// kernels the CPU has (SkylakeX or Haswell); then the program starts over
// with that environment (execv of /proc/self/exe, argv unchanged). When
// nothing is to change, or the exec fails, it returns and the run goes on.
void fl_runtime_env(char **argv);
// The OPENBLAS_CORETYPE fl_runtime_env sets, or NULL where it leaves
// OpenBLAS's own choice (set by the user, or no kernels the CPU can run to
// name: AVX2's only where the CPU has AVX2, whatever FITLM_ISA says).
const char *fl_openblas_coretype(void);

double fl_now(void); // monotonic seconds

// AVX2 and AVX-512 copies of a plain-C loop, picked at run time by
// fl_cpu_isa() (so FITLM_ISA caps them too). GCC vectorises each copy for its
// ISA; contraction into FMA stays off (baseline x86-64 has none), so
// elementwise loops give the same bits on every path; an FMA the arithmetic
// needs is written as fmaf. A reduction must write out its order: under
// `omp simd` the lane count sets the order of the sum.
#if defined(__x86_64__)
#define FL_AVX2_FN __attribute__((target("avx2,fma"), optimize("fp-contract=off")))
#define FL_AVX512_FN                                                                               \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"), optimize("fp-contract=off")))
#else
#define FL_AVX2_FN
#define FL_AVX512_FN
#endif

// Defines name_portable, name_avx2 and name_avx512, each returning `type`
// from the always_inline name_body, and name_for(isa) to pick one.
#define FL_ISA_COPIES_OF(type, name, params, args)                                                 \
    static type name##_portable params {                                                           \
        return name##_body args;                                                                   \
    }                                                                                              \
    FL_AVX2_FN static type name##_avx2 params {                                                    \
        return name##_body args;                                                                   \
    }                                                                                              \
    FL_AVX512_FN static type name##_avx512 params {                                                \
        return name##_body args;                                                                   \
    }                                                                                              \
    FL_ISA_PICK(name)

// The same for a body that returns nothing.
#define FL_ISA_COPIES(name, params, args)                                                          \
    static void name##_portable params {                                                           \
        name##_body args;                                                                          \
    }                                                                                              \
    FL_AVX2_FN static void name##_avx2 params {                                                    \
        name##_body args;                                                                          \
    }                                                                                              \
    FL_AVX512_FN static void name##_avx512 params {                                                \
        name##_body args;                                                                          \
    }                                                                                              \
    FL_ISA_PICK(name)

#define FL_ISA_PICK(name)                                                                          \
    static __typeof__(name##_portable) *name##_for(fl_isa isa) {                                   \
        return isa == FL_ISA_AVX512 ? name##_avx512                                                \
               : isa == FL_ISA_AVX2 ? name##_avx2                                                  \
                                    : name##_portable;                                             \
    }

#endif
