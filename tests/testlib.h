// testlib.h: the few helpers every test program uses. A failed check prints
// what was expected and what came, and makes the program exit non-zero.
#ifndef FITLM_TESTLIB_H
#define FITLM_TESTLIB_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/dist.h"
#include "fitlm/run.h"
#include "fitlm/safetensors.h"

// Records one check; prints a line on failure (and on success when verbose).
int t_check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// Compares got against want elementwise with |got-want| <= atol + rtol*|want|.
// Prints the tensor's name, max abs diff and, on failure, the first bad index.
int t_close(const char *name, const float *got, const float *want, size_t n, double atol,
            double rtol);
int t_close_d(const char *name, const double *got, const double *want, size_t n, double atol,
              double rtol);

// Runs fn(arg) in a child process and checks that it exits with status 1
// and that its stderr contains `expect` (an fl_die error path). Call it
// before the program's first OpenMP parallel region if fn uses OpenMP:
// libgomp's thread pool does not survive fork().
int t_dies(const char *name, void (*fn)(void *), void *arg, const char *expect);

// A model's whole weights as fp32 (malloc'd, table order): under a
// data-parallel strategy d (a collective: every rank calls it) gathered row
// by row, which ZeRO-3 needs; else the model's own buffer.
float *t_weights_f32(fl_model *m, fl_dist *d);
// n positions of a learnable rule over ids [0, V) drawn from `seed` (xorshift):
// target = (7 x input + 3) mod V, about one in 11 masked (-1), so ranks hold
// different numbers of target tokens. The training tests' batches.
void t_rule_batch(uint64_t seed, size_t n, int V, int *inputs, int *targets);
// ||a - b|| / ||b|| over n values, in double.
double t_rel_diff(const float *a, const float *b, size_t n);
// Row `row` of a tensor-parallel rank's table lt, taken from the whole
// row's fp32 values (whole_row) into out_row (its numel values; padding
// rows left as they are): fl_params_blocks' mapping.
void t_slice_row(const fl_param_table *lt, int row, const float *whole_row, float *out_row);

// Opens a run (run.h) as `fitlm train` would with a config file holding
// `json` (NULL: none) and these flags (space-separated, unquoted; "--out="
// for none), on the test's own batches (fl_run_step_batch: no data is
// opened); alone: the one-process reference under mpirun (no strategy).
void t_run_open(fl_run *run, const char *json, const char *flags, int alone);

// A test program's main under every ISA cap the CPU allows. fl_cpu() reads
// FITLM_ISA once per process, so each narrower cap's run_all(name) is in a
// child forked first thing, before any OpenMP thread exists (portable, then
// AVX2 where the CPU has AVX-512); the parent runs the CPU's own paths. First
// across(avx2, avx512) compares the paths in one process (NULL: none).
// FITLM_ISA or FITLM_NO_SIMD set from outside: that run only (and
// t_check_expected_isa first).
int t_main_under_isa_caps(int (*run_all)(const char *isa), void (*across)(int avx2, int avx512));
// AVX2 and FMA, as the compiler's own probe sees the CPU
int t_cpu_avx2(void);
// With FITLM_TEST_EXPECT_ISA (an emulated CPU's run, CMakeLists.txt): a
// check that fl_cpu_isa() is that ISA.
void t_check_expected_isa(void);

// FITLM_TEST_QUICK=1 (CMakeLists.txt: the emulated CPUs' runs and the
// sanitizer build): the reduced case lists, fewer and smaller shapes that
// still run every ISA path; the release build runs the full lists natively.
int t_quick(void);

// Prints "<program>: N passed, N failed" and returns the exit status.
int t_report(void);

// Deterministic test data: uniform in [-scale, scale).
void t_fill(float *x, size_t n, unsigned seed, float scale);

// One fp32 AdamW step with global-norm clipping (max_norm 0: none), the
// way the engine's optimizer does it; returns the gradient norm.
float t_adamw_step_fp32(void *adamw, const void *table, float *params, const float *grads, float lr,
                        float max_norm);

// A deterministic random mutation of in[0, n) for parser robustness tests:
// 1-4 edits drawn from seed (bit flips, bytes set to 0x00/0xff/'9'/'"'/...,
// truncation, insertion, deletion, a duplicated range, the 8-byte length
// prefix or a 32-bit field set to extreme values). Writes at most cap bytes
// to out and returns the new length.
size_t t_mutate(const unsigned char *in, size_t n, unsigned long long seed, unsigned char *out,
                size_t cap);

// Runs `parse` (0: ok; -1 with a message in err: refused; anything else:
// broken) on `count` seeded mutations (t_mutate) of the file at path, each
// in an exact-size copy so that ASan sees any overread; checks that none is
// broken and that more than half are refused, and prints the counts.
void t_mutations(const char *what, const char *path, int count, unsigned long long seed,
                 int (*parse)(const unsigned char *b, size_t n, char *err, size_t errlen));

// The whole file, NUL-terminated (free() it); NULL with *n = 0 when it
// cannot be read.
unsigned char *t_read_file(const char *path, size_t *n);
void t_write_file(const char *path, const void *data, size_t n);
void t_write_text(const char *path, const char *text);
// Makes the directory path (if missing) a temporary of the writer process
// pid, as that writer marks it (fitlm/io.h: a killed writer's leftover when
// no process has the pid).
void t_mark_temporary(const char *path, long pid);
// Removes a scratch directory and everything in it; 0 on success.
int t_remove_dir(const char *dir);

// Path of a file in the source tree (FITLM_SOURCE_DIR, set by CTest).
const char *t_source_path(const char *rel);

// Runs `fitlm ARGS` (the binary FITLM_BINARY, set by CTest; else fitlm on
// the PATH) in directory dir, its stdout and (with_stderr) stderr captured
// into out (size bytes, NUL-terminated, the rest dropped); stderr is
// discarded otherwise. Returns the exit status, -1 when it did not exit.
int t_fitlm(const char *dir, const char *args, int with_stderr, char *out, size_t size);
// Checks that `fitlm ARGS` exits with status 1 saying "fitlm: error:" and
// `what`, and no LeakSanitizer report (the sanitizer build); out receives its
// output.
int t_fitlm_fails(const char *dir, const char *args, const char *what, char *out, size_t size);
// The same within `seconds` (a run still going then is ended: status 124),
// for inputs that could block it (a FIFO).
int t_fitlm_fails_within(const char *dir, const char *args, int seconds, const char *what,
                         char *out, size_t size);

// Safetensors test files. t_write_st: a file with this header and `data`
// zero bytes of data. t_st_rewrite: a copy of a safetensors file with edits,
// to test the layers above the format.
typedef struct {
    const char *drop;           // a tensor left out
    const char *from, *to;      // a tensor renamed
    const char *transpose;      // a 2-D tensor with its shape transposed
    const char *copy, *copy_as; // a copy of tensor `copy` added as copy_as
    int flip;                   // a bit of the last tensor's data flipped
} t_st_edit;
void t_write_st(const char *path, const char *header, size_t data);
void t_st_rewrite(const char *src_path, const char *out, const t_st_edit *e);
// Checks that the stored tensor `name` has this shape (ndim 0: is not stored).
void t_st_stored(const fl_safetensors *st, const char *what, const char *name, int ndim,
                 uint64_t d0, uint64_t d1);

#endif
