// matmul.c: out (N,OC) = inp (N,C) @ weight^T + bias, weight (OC,C) as in
// nn.Linear, and its gradients. Each GEMM is one parallel region whose output
// tiles are handed out to the threads as they free up, each tile one
// single-threaded GEMM. A thread that shares its core with another process
// then takes fewer tiles instead of holding the others back; and the tiles
// depend on the shape only, so the result does not depend on the thread
// count.
// The tiles' GEMM, by what the CPU has (capped by FITLM_ISA):
// - AVX2 or AVX-512: fitlm's (gemm.c) for every dtype, 16-bit operands
//   converted as they are packed; operands that several tiles of a call
//   read (inp; the input gradient's weight, and its dout where it has
//   several column tiles) are packed once per call.
// - otherwise OpenBLAS's sgemm, transposes expressed through its flags;
//   bf16/fp16 take the same tiles on fp32 copies: inp converted once, weight
//   and out (or dout) in panels of MM_PANEL output channels, each tile's
//   output rounded back as soon as it is done.
// 16-bit gradients are accumulated in fp32 and rounded once per element per
// call. A native bf16 GEMM (oneDNN with AMX, or AVX512_BF16 where its dot
// product outruns fp32 FMAs: matmul_dnnl.c) plugs in at the top of
// matmul_forward/matmul_backward (and matmul_workspace_bytes), before these
// paths; elsewhere bf16 takes fitlm's GEMM on fp32 FMAs like fp16 (on
// Intel's AVX512_BF16 without AMX oneDNN's bf16 step ran at 0.80x fp32).
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include <cblas.h>
#include <omp.h>
#include <string.h>

#include "gemm.h"
#include "matmul_dnnl.h"
#include "simd.h"

// output-channel block for the bias gradient (see column_sums)
#define MM_OCBLOCK 64
// Output channels per panel of weight on the 16-bit path: the panel's fp32
// copies (weight and dweight (MM_PANEL, C), out or dout (N, MM_PANEL)) are
// transient workspace.
#define MM_PANEL 2048
// The 16-bit input gradient sums dout @ weight over output channels in
// steps of MM_KSTEP (sgemm with beta = 1 on the fp32 accumulator): a fixed
// order, independent of MM_PANEL and of the tiles.
#define MM_KSTEP 256
// With AVX2 (gemm.c), the backward goes over OC in spans of MM_DINP_CHUNK
// output channels (a multiple of gemm's depth block), each span's weight
// gradient, bias gradient and input-gradient tiles in one loop: the bits
// do not depend on the span, and dout's columns of a span are packed once
// for all of its input-gradient tiles.
#define MM_DINP_CHUNK 2048
_Static_assert(MM_DINP_CHUNK % GEMM_DEPTH_BLOCK == 0, "chunks of whole depth blocks");
// With AVX2, GEMMs of at least 8 x MM_FULL_ROWS rows take tiles of
// MM_FULL_ROWS rows by every output column (gemm's one row block): each tile
// packs its own rows of the operand that differs between rows (dout for the
// input gradient, inp for the forward) once per depth block for all columns,
// where tiles of a few columns needed it packed ahead for all of them,
// written to memory and read back; the operand every tile reads whole (the
// weight) is packed ahead instead. The forward does so when OC <= N, so that
// the weight packed ahead takes no more workspace than inp did (not the LM
// head). Interleaved in one process against the column tiles (N = 2048, 2
// threads, Zen 5): the backward (weight, bias and input gradients together)
// 1-5% faster at GPT-2's 768-channel inputs with AVX-512 and 1.5-4% with
// AVX2, 4.5-7% at the LLaMA's 576-channel ones, fp16 up to 9%, level or 1.5%
// at 1536 and 3072 channels; the forward 6-14% faster at 1536 and 3072
// input channels (the down projections, AVX-512, AVX2 and fp16), level
// within -1..+2% at 576 and 768. Rows of 144 did better than 96 and 192
// (more tiles for the two threads to share at each barrier); above
// GEMM_ROW_BLOCK (240, 256) the gain was gone. At N = 1024 (7 tiles and a
// sliver) the full-width tiles were slower, up to 10%: too few to share.
#define MM_FULL_ROWS 144
_Static_assert(MM_FULL_ROWS <= GEMM_ROW_BLOCK && MM_FULL_ROWS % 24 == 0,
               "one row block of gemm's a, whole kernel rows");

// One tile's row-major sgemm, OpenBLAS's: inside a parallel region it runs
// on the calling thread, and an output row's bits do not depend on how many
// rows the call has, so evaluation gives the same bits at any batch size.
// (oneDNN's sgemm was a few percent faster on some gradient tiles with
// AVX-512, but corrupted the heap now and then when called from several
// threads at once; bench_train still times it whole beside OpenBLAS's.)
static void sgemm(int trans_a, int trans_b, int M, int N, int K, const float *A, int lda,
                  const float *B, int ldb, float beta, float *C, int ldc) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

static int min_int(int a, int b) {
    return a < b ? a : b;
}
static int ceil_div(int a, int b) {
    return (a + b - 1) / b;
}

// Tile sizes, measured on GPT-2 and LLaMA shapes (bench_train's GEMM table):
// a few tiles per thread for balance, each large enough that sgemm's packing
// stays a small part of it; wider forward tiles with a short inner dimension
// (the demo's C = 128). tile_len: a length near `base` along a dimension of
// n, a multiple of q, in an even number of tiles when there are few (3
// tiles on 2 threads would leave one idle a third of the time), and then
// of equal lengths where it can (a short last one idles a thread too).
static int tile_len(int n, int base, int q) {
    int panels = ceil_div(n, q), best = panels, best_err = -1;
    // past base, err only grows with per: stop once it exceeds the best
    for (int per = 1; per <= panels && (best_err < 0 || per * q - base <= best_err); per++) {
        int count = ceil_div(panels, per), err = per * q > base ? per * q - base : base - per * q;
        if (count > 1 && count < 8 && count % 2) continue;
        if (count < 8) err += (count * per - panels) * q;
        if (best_err < 0 || err < best_err) best = per, best_err = err;
    }
    return min_int(n, best * q);
}
// Output columns of a tile: whole panels of fitlm's GEMM kernel (48 columns
// with AVX-512), so that no tile ends in a narrower one.
static int col_quantum(void) {
    return fl_cpu_isa() >= FL_ISA_AVX2 ? gemm_panel_width() : 16;
}
static int fwd_tile_rows(int N) {
    return min_int(N, 1024);
}
static int fwd_tile_cols(int C, int OC) {
    return tile_len(OC, C <= 256 ? 512 : 192, col_quantum());
}
static int dinp_tile_rows(int N) {
    return tile_len(N, 256, 16);
}
static int dinp_tile_cols(int C) {
    return tile_len(C, C <= 1024 ? 192 : 384, col_quantum());
}
static int dw_tile_rows(int OC) {
    return tile_len(OC, 192, 16);
}

// dst (o1 - o0) += column sums of src rows [0, N) over columns [o0, o1)
// (row stride ld), rows in order: deterministic, no atomics. row: scratch of
// MM_OCBLOCK floats for 16-bit src (fp32 is read in place).
static void column_sums(float *dst, fl_dtype dt, const void *src, int N, int o0, int o1, int ld,
                        float *row) {
    for (int n = 0; n < N; n++) {
        const float *x = fl_load_f32(dt, fl_at_const(dt, src, (size_t)n * ld + o0), o1 - o0, row);
        for (int o = 0; o < o1 - o0; o++) dst[o] += x[o];
    }
}

// dst (rows,cols) contiguous fp32 = src (rows,cols) of dtype dt, row stride
// ld; called inside a parallel region, rows shared among its threads, which
// do not wait for each other (the caller's next barrier does)
static void load_rows_nowait(fl_dtype dt, float *dst, const void *src, int rows, int cols, int ld) {
#pragma omp for nowait
    for (int r = 0; r < rows; r++)
        fl_convert(FL_F32, dst + (size_t)r * cols, dt, fl_at_const(dt, src, (size_t)r * ld), cols);
}

static void store_rows_nowait(fl_dtype dt, void *dst, const float *src, int rows, int cols,
                              int ld) {
#pragma omp for nowait
    for (int r = 0; r < rows; r++)
        fl_store_f32(dt, fl_at(dt, dst, (size_t)r * ld), src + (size_t)r * cols, cols);
}

// the same, all rows done when it returns
static void load_rows(fl_dtype dt, float *dst, const void *src, int rows, int cols, int ld) {
    load_rows_nowait(dt, dst, src, rows, cols, ld);
#pragma omp barrier
}

static void store_rows(fl_dtype dt, void *dst, const float *src, int rows, int cols, int ld) {
    store_rows_nowait(dt, dst, src, rows, cols, ld);
#pragma omp barrier
}

// one thread's tile: dst (rows,cols) of dtype dt with row stride ld = src
// (rows,cols) with row stride lds
static void store_tile(fl_dtype dt, void *dst, const float *src, int rows, int cols, int ld,
                       int lds) {
    for (int r = 0; r < rows; r++)
        fl_store_f32(dt, fl_at(dt, dst, (size_t)r * ld), src + (size_t)r * lds, cols);
}

// ----------------------------------------------------------------------------
// forward

// out32 (N, ob) row stride ldo = inp32 (N,C) @ w32 (ob,C)^T + bias32, tiled;
// a 16-bit out (dt != FL_F32) gets each tile rounded into it at column o0.
// With w16 (the panel's 16-bit weight rows; only when the tiles span all N
// rows, so that each weight row belongs to one tile) each tile first
// converts its own rows into w32, which sgemm then reads from cache.
// Called inside a parallel region.
static void forward_tiles(fl_dtype dt, void *out, int OC, int o0, float *out32, int ldo,
                          const float *inp32, float *w32, const void *w16, const float *bias32,
                          int N, int C, int ob) {
    int rb = fwd_tile_rows(N), cb = fwd_tile_cols(C, ob);
    int nr = ceil_div(N, rb), nc = ceil_div(ob, cb);
    FL_ASSERT(!w16 || nr == 1);
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < nr * nc; t++) {
        int n0 = (t / nc) * rb, c0 = (t % nc) * cb;
        int rows = min_int(rb, N - n0), cols = min_int(cb, ob - c0);
        float *o = out32 + (size_t)n0 * ldo + c0;
        if (w16)
            fl_convert(FL_F32, w32 + (size_t)c0 * C, dt, fl_at_const(dt, w16, (size_t)c0 * C),
                       (size_t)cols * C);
        // with a bias, prefill the tile with it and let sgemm add the product
        if (bias32)
            for (int n = 0; n < rows; n++)
                for (int j = 0; j < cols; j++) o[(size_t)n * ldo + j] = bias32[c0 + j];
        sgemm(0, 1, rows, cols, C, inp32 + (size_t)n0 * C, C, w32 + (size_t)c0 * C, C,
              bias32 ? 1.0f : 0.0f, o, ldo);
        if (dt != FL_F32)
            store_tile(dt, fl_at(dt, out, (size_t)n0 * OC + o0 + c0), o, rows, cols, OC, ldo);
    }
}

// Workspace in floats on the 16-bit path: inp and the dinp accumulator in
// fp32 (N,C), panels of weight and of dweight (ob,C), of out or dout (N,ob),
// and of bias or dbias (ob), with ob = min(OC, MM_PANEL).
static size_t portable_workspace_floats(int N, int C, int OC) {
    size_t ob = OC < MM_PANEL ? (size_t)OC : MM_PANEL;
    return 2 * (size_t)N * C + 2 * ob * C + (size_t)N * ob + ob;
}

typedef struct {
    float *inp32, *dinp32, *w32, *dw32, *dout32, *bias32;
} mm_workspace;

static mm_workspace workspace_split(float *ws, int N, int C, int OC) {
    size_t ob = OC < MM_PANEL ? (size_t)OC : MM_PANEL;
    mm_workspace w;
    w.inp32 = ws;
    w.dinp32 = w.inp32 + (size_t)N * C;
    w.w32 = w.dinp32 + (size_t)N * C;
    w.dw32 = w.w32 + ob * C;
    w.dout32 = w.dw32 + ob * C;
    w.bias32 = w.dout32 + (size_t)N * ob;
    return w;
}

static void portable_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                             const void *bias, float *ws, int N, int C, int OC) {
    mm_workspace w = workspace_split(ws, N, C, OC);
#pragma omp parallel
    {
        load_rows(dt, w.inp32, inp, N, C, C);
        // one block of rows: each tile converts its own weight rows
        int fused = fwd_tile_rows(N) >= N;
        for (int o0 = 0; o0 < OC; o0 += MM_PANEL) {
            int ob = min_int(MM_PANEL, OC - o0);
            const void *w16 = fl_at_const(dt, weight, (size_t)o0 * C);
            if (!fused) load_rows(dt, w.w32, w16, ob, C, C);
#pragma omp single
            if (bias) fl_convert(FL_F32, w.bias32, dt, fl_at_const(dt, bias, o0), ob);
            forward_tiles(dt, out, OC, o0, w.dout32, ob, w.inp32, w.w32, fused ? w16 : NULL,
                          bias ? w.bias32 : NULL, N, C, ob);
        }
    }
}

// ----------------------------------------------------------------------------
// backward

// The tiles of one backward panel (output channels [o0, o0+ob)), in one
// dynamic loop: dweight rows in blocks, dinp in (rows x cols)
// tiles, dbias in blocks of MM_OCBLOCK. dout32 is the panel's dout (N,ob)
// with row stride ldd, w32 its weight rows, dw32 its dweight rows (row
// stride C); on the 16-bit path (dt != FL_F32) each dweight tile converts its
// rows from dweight into dw32 and rounds them back as soon as it is done, and
// dinp is summed in MM_KSTEP steps.
// Called inside a parallel region.
typedef struct {
    fl_dtype dt;
    int N, C, o0, ob;
    const float *dout32, *w32, *inp32;
    int ldd;
    float *dinp32, *dw32, *dbias32;
    void *dweight;
} bwd_panel;

static void backward_tiles(const bwd_panel *p) {
    int N = p->N, C = p->C, ob = p->ob;
    int dwb = dw_tile_rows(ob), n_dw = p->dw32 ? ceil_div(ob, dwb) : 0;
    int rb = dinp_tile_rows(N), cb = dinp_tile_cols(C);
    int nc = ceil_div(C, cb), n_dinp = p->dinp32 ? ceil_div(N, rb) * nc : 0;
    int n_db = p->dbias32 ? ceil_div(ob, MM_OCBLOCK) : 0;
    int kstep = p->dt == FL_F32 ? ob : MM_KSTEP;
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < n_dw + n_dinp + n_db; t++) {
        if (t < n_dw) {
            // dweight rows += dout[:, rows]^T @ inp
            int r0 = t * dwb, rows = min_int(dwb, ob - r0);
            float *dw = p->dw32 + (size_t)r0 * C;
            void *dw16 =
                p->dt != FL_F32 ? fl_at(p->dt, p->dweight, (size_t)(p->o0 + r0) * C) : NULL;
            if (dw16) fl_convert(FL_F32, dw, p->dt, dw16, (size_t)rows * C);
            sgemm(1, 0, rows, C, N, p->dout32 + r0, p->ldd, p->inp32, C, 1.0f, dw, C);
            if (dw16) fl_store_f32(p->dt, dw16, dw, (size_t)rows * C);
        } else if (t < n_dw + n_dinp) {
            // dinp tile += dout (rows, ob) @ weight (ob, cols), in fixed K steps
            int i = t - n_dw, n0 = (i / nc) * rb, c0 = (i % nc) * cb;
            int rows = min_int(rb, N - n0), cols = min_int(cb, C - c0);
            for (int k0 = 0; k0 < ob; k0 += kstep)
                sgemm(0, 0, rows, cols, min_int(kstep, ob - k0),
                      p->dout32 + (size_t)n0 * p->ldd + k0, p->ldd, p->w32 + (size_t)k0 * C + c0, C,
                      1.0f, p->dinp32 + (size_t)n0 * C + c0, C);
        } else {
            int o = (t - n_dw - n_dinp) * MM_OCBLOCK;
            column_sums(p->dbias32 + o, FL_F32, p->dout32, N, o, min_int(o + MM_OCBLOCK, ob),
                        p->ldd, NULL);
        }
    }
}

static void portable_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                              const void *inp, const void *weight, float *ws, int N, int C,
                              int OC) {
    mm_workspace w = workspace_split(ws, N, C, OC);
#pragma omp parallel
    {
        if (dweight) load_rows(dt, w.inp32, inp, N, C, C);
        if (dinp) load_rows(dt, w.dinp32, dinp, N, C, C); // accumulates on top of dinp
        for (int o0 = 0; o0 < OC; o0 += MM_PANEL) {
            int ob = min_int(MM_PANEL, OC - o0);
            load_rows(dt, w.dout32, fl_at_const(dt, dout, o0), N, ob, OC);
            if (dinp) load_rows(dt, w.w32, fl_at_const(dt, weight, (size_t)o0 * C), ob, C, C);
#pragma omp single
            if (dbias) fl_convert(FL_F32, w.bias32, dt, fl_at(dt, dbias, o0), ob);
            bwd_panel p = {.dt = dt,
                           .N = N,
                           .C = C,
                           .o0 = o0,
                           .ob = ob,
                           .dout32 = w.dout32,
                           .ldd = ob,
                           .w32 = w.w32,
                           .inp32 = w.inp32,
                           .dinp32 = dinp ? w.dinp32 : NULL,
                           .dw32 = dweight ? w.dw32 : NULL,
                           .dbias32 = dbias ? w.bias32 : NULL,
                           .dweight = dweight};
            backward_tiles(&p);
#pragma omp single
            if (dbias) fl_store_f32(dt, fl_at(dt, dbias, o0), w.bias32, ob);
        }
        if (dinp) store_rows(dt, dinp, w.dinp32, N, C, C);
    }
}

// ----------------------------------------------------------------------------
// With AVX2 or AVX-512 (every dtype): the same tiles through gemm.c, which
// converts 16-bit operands while it packs them, so no conversion pass
// precedes the GEMMs. inp, which every tile of a GEMM reads (the forward's
// a, the weight gradient's b), is packed once per call by all threads
// instead of once per tile; that and gemm's own packing make these tiles
// faster than OpenBLAS's sgemm on the same tiles.
// Workspace: inp packed; on the 16-bit path also the fp32 dinp accumulator
// (N,C) and bias or dbias (OC); per thread, gemm's packing buffer and on
// the 16-bit path one fp32 tile (a forward output tile or dweight rows).

static int packed_path(void) {
    return fl_cpu_isa() >= FL_ISA_AVX2;
}

// Row blocks of a tiling whose a is packed ahead: rb rows rounded to the
// packing quantum (the blocks start where packed rows do).
static int packed_rows(int rb, int N) {
    if (rb >= N) return N;
    rb = (rb + GEMM_PACK_QUANTUM / 2) / GEMM_PACK_QUANTUM * GEMM_PACK_QUANTUM;
    return rb < N ? rb : N;
}

// Tiles of MM_FULL_ROWS rows by all columns (see MM_FULL_ROWS)
static int full_width(int N) {
    return N >= 8 * MM_FULL_ROWS;
}

// The input gradient's tiling: column tiles of cb, row tiles of rb. dout's
// columns of a span are packed ahead when several column tiles read them
// (then row tiles start on the packed rows' quantum), the span's weight rows
// when several row tiles read them.
typedef struct {
    int cb, nc, rb, nr, dout_ahead, weight_ahead;
} dinp_tiling;

static dinp_tiling dinp_tiles(int N, int C) {
    int full = full_width(N);
    dinp_tiling t = {.cb = full ? C : dinp_tile_cols(C)};
    t.nc = ceil_div(C, t.cb), t.dout_ahead = t.nc > 1;
    t.rb = full           ? MM_FULL_ROWS
           : t.dout_ahead ? packed_rows(dinp_tile_rows(N), N)
                          : dinp_tile_rows(N);
    t.nr = ceil_div(N, t.rb), t.weight_ahead = t.nr > 1;
    return t;
}

// The forward's tiling: row tiles of rb, column tiles of cb; full width:
// each tile packs its own rows of inp and the weight is packed ahead, else
// inp is packed ahead (row tiles on the packed rows' quantum) and each tile
// packs its columns of the weight.
typedef struct {
    int rb, cb, full_width;
} fwd_tiling;

static fwd_tiling fwd_tiles(int N, int C, int OC) {
    if (full_width(N) && OC <= N) return (fwd_tiling){MM_FULL_ROWS, OC, 1};
    return (fwd_tiling){packed_rows(fwd_tile_rows(N), N), fwd_tile_cols(C, OC), 0};
}

// With AVX-512 and at most MM_DW_T_MAX_C input channels, a weight gradient
// tile is computed transposed: dweight rows^T (C, rows) += inp^T (C, N) @
// dout[:, rows], inp packed ahead as gemm's a and dout read in place as its
// b (gemm's AVX-512 kernel reads a row-major b where it lies), on a
// transposed fp32 copy of the rows. Untransposed, every tile packs its
// columns of dout, N x rows values for only 2 C FLOPs each: at C = 128 that
// packing took a third of the weight gradient's time. Each element sums the
// same products in the same order either way (FMA operands swap), so the
// bits are the same. Measured (N = 2048, 2 threads, Zen 5, both gradients in
// one call): the demo's LM head (C = 128, OC = 50304) 353 -> 394 GFLOP/s,
// C = 128 with OC = 384 356 -> 428, C = 256 +2-4%; C = 384 level, and C =
// 512 with OC = 128 13% slower (more than gemm's row block of a).
#define MM_DW_T_MAX_C 256
static int dw_transposed(int C) {
    return fl_cpu_isa() >= FL_ISA_AVX512 && C <= MM_DW_T_MAX_C;
}

// dst (cols, rows) fp32, row stride ldd = src (rows, cols) of dtype dt, row
// stride lds, transposed
static void load_transposed(float *dst, int ldd, fl_dtype dt, const void *src, int lds, int rows,
                            int cols) {
    float buf[MM_DW_T_MAX_C];
    for (int r = 0; r < rows; r++) {
        const float *x = fl_load_f32(dt, fl_at_const(dt, src, (size_t)r * lds), cols, buf);
        for (int c = 0; c < cols; c++) dst[(size_t)c * ldd + r] = x[c];
    }
}
// dst (rows, cols) of dtype dt, row stride ldd = src (cols, rows) fp32,
// row stride lds, transposed (rounded as fl_store_f32 rounds)
static void store_transposed(fl_dtype dt, void *dst, int ldd, const float *src, int lds, int rows,
                             int cols) {
    float buf[MM_DW_T_MAX_C];
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) buf[c] = src[(size_t)c * lds + r];
        fl_store_f32(dt, fl_at(dt, dst, (size_t)r * ldd), buf, cols);
    }
}

// gemm's packing buffer for the largest of the tiles below
static size_t pack_floats(int N, int C, int OC) {
    fwd_tiling ft = fwd_tiles(N, C, OC);
    size_t fwd = gemm_pack_floats(ft.rb, ft.cb, C);
    size_t dw = dw_transposed(C) ? gemm_pack_floats(C, dw_tile_rows(OC), N)
                                 : gemm_pack_floats(dw_tile_rows(OC), C, N);
    dinp_tiling t = dinp_tiles(N, C);
    size_t dinp = gemm_pack_floats(t.rb, t.cb, min_int(OC, MM_DINP_CHUNK));
    return fwd > dw ? (fwd > dinp ? fwd : dinp) : (dw > dinp ? dw : dinp);
}

// A thread's fp32 scratch after its packing buffer: on the 16-bit path a
// forward output tile, a weight gradient tile's rows (over more than one
// depth block of tokens; fewer accumulate in place) or a bias block's column
// sums; in any dtype, a transposed weight gradient tile (MM_DW_T_MAX_C).
static size_t packed_thread_floats(fl_dtype dt, int N, int C, int OC) {
    fwd_tiling ft = fwd_tiles(N, C, OC);
    int lp = dt != FL_F32;
    size_t fwd = lp ? (size_t)ft.rb * ft.cb : 0, col_sums = lp ? MM_OCBLOCK : 0;
    int dw_scratch = dw_transposed(C) || (lp && N > GEMM_DEPTH_BLOCK);
    size_t dw = dw_scratch ? (size_t)dw_tile_rows(OC) * C : 0;
    size_t scratch = fwd > dw ? fwd : dw;
    return pack_floats(N, C, OC) + (scratch > col_sums ? scratch : col_sums);
}

// inp packed (the forward's a, the weight gradient's b, or its a when
// transposed); a full-width forward packs its weight (OC <= N columns of C)
// there instead
static size_t inp_packed_floats(int N, int C) {
    size_t as_a = gemm_packed_floats(N, C), as_b = gemm_packed_floats(C, N);
    return as_a > as_b ? as_a : as_b;
}

static size_t dout_packed_floats(int N, int C, int OC) {
    return dinp_tiles(N, C).dout_ahead ? gemm_packed_floats(N, min_int(OC, MM_DINP_CHUNK)) : 0;
}

static size_t weight_packed_floats(int N, int C, int OC) {
    return dinp_tiles(N, C).weight_ahead ? gemm_packed_floats(C, min_int(OC, MM_DINP_CHUNK)) : 0;
}

static size_t packed_shared_floats(fl_dtype dt, int N, int C, int OC) {
    return inp_packed_floats(N, C) + dout_packed_floats(N, C, OC) + weight_packed_floats(N, C, OC) +
           (dt == FL_F32 ? 0 : (size_t)N * C + OC);
}

static size_t packed_workspace_floats(fl_dtype dt, int N, int C, int OC) {
    return packed_shared_floats(dt, N, C, OC) +
           (size_t)fl_threads() * packed_thread_floats(dt, N, C, OC);
}

typedef struct {
    float *inp_packed, *dout_packed, *weight_packed, *dinp32, *bias32;
} packed_shared;

static packed_shared shared_split(float *ws, fl_dtype dt, int N, int C, int OC) {
    packed_shared sh = {.inp_packed = ws};
    sh.dout_packed = sh.inp_packed + inp_packed_floats(N, C);
    sh.weight_packed = sh.dout_packed + dout_packed_floats(N, C, OC);
    if (dt != FL_F32) {
        sh.dinp32 = sh.weight_packed + weight_packed_floats(N, C, OC);
        sh.bias32 = sh.dinp32 + (size_t)N * C;
    }
    return sh;
}

static float *thread_share(float *ws, fl_dtype dt, int N, int C, int OC) {
    FL_ASSERT(omp_get_thread_num() < fl_threads());
    size_t per = packed_thread_floats(dt, N, C, OC);
    return ws + packed_shared_floats(dt, N, C, OC) + (size_t)omp_get_thread_num() * per;
}

// An operand that several tiles read, packed ahead by all threads: x (rows,
// cols) with row stride ld, as gemm's a (rows by depth cols) or b (cols by
// depth rows), into dst; trans swaps the roles of x's rows and columns (the
// forward's weight, (OC, C), is its b of OC columns by depth C).
typedef struct {
    float *dst;
    fl_dtype dt;
    const void *x;
    int ld, as_b, rows, cols, trans;
} pack_job;

static int job_count(const pack_job *j) {
    return j->as_b != j->trans ? j->cols : j->rows;
}
static int job_depth(const pack_job *j) {
    return j->as_b != j->trans ? j->rows : j->cols;
}
static int job_tasks(const pack_job *j) {
    return ceil_div(job_depth(j), GEMM_DEPTH_BLOCK) * ceil_div(job_count(j), GEMM_PACK_QUANTUM);
}
static void job_task(const pack_job *j, int t) {
    int blocks = ceil_div(job_depth(j), GEMM_DEPTH_BLOCK), i = t / blocks * GEMM_PACK_QUANTUM;
    gemm_mat m = {.dt = j->dt, .p = j->x, .ld = j->ld, .trans = j->trans};
    gemm_pack(j->dst, m, j->as_b, job_count(j), job_depth(j), i,
              min_int(GEMM_PACK_QUANTUM, job_count(j) - i), t % blocks * GEMM_DEPTH_BLOCK);
}
static gemm_mat job_packed(const pack_job *j) {
    return (gemm_mat){.packed = j->dst, .count = job_count(j)};
}

// The jobs' pieces in one loop of the threads of a parallel region, then its
// barrier: one wait for all of them. With OMP_WAIT_POLICY=PASSIVE each wait
// can cost a thread's wake-up (tens of microseconds on a VM), against GEMMs
// of a millisecond or two at 256 tokens: a phase per operand, or a barrier
// that guards nothing, showed in the step.
static void pack_jobs(const pack_job *jobs, int n) {
    int total = 0;
    for (int j = 0; j < n; j++) total += job_tasks(&jobs[j]);
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < total; t++) {
        int j = 0, u = t;
        while (u >= job_tasks(&jobs[j])) u -= job_tasks(&jobs[j++]);
        job_task(&jobs[j], u);
    }
}

static gemm_mat mat(fl_dtype dt, const void *p, size_t offset, int ld, int trans) {
    return (gemm_mat){.dt = dt, .p = fl_at_const(dt, p, offset), .ld = ld, .trans = trans};
}

// Each GEMM below waits for the other threads once per phase that needs it:
// after its shared packing (and, in the backward, after each span of output
// channels but the last); the last loop runs into the region's end
// (nowait), and work only the 16-bit path has is skipped, not a barrier
// round an empty block.

static void packed_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                           const void *bias, float *ws, int N, int C, int OC) {
    packed_shared sh = shared_split(ws, dt, N, C, OC);
    fwd_tiling ft = fwd_tiles(N, C, OC);
    int rb = ft.rb, cb = ft.cb;
    int nr = ceil_div(N, rb), nc = ceil_div(OC, cb);
    // what every tile reads, packed ahead: the weight as b (full width), or inp as a
    pack_job ahead = ft.full_width ? (pack_job){sh.inp_packed, dt, weight, C, 1, OC, C, 1}
                                   : (pack_job){sh.inp_packed, dt, inp, C, 0, N, C, 0};
    FL_ASSERT(!ft.full_width || gemm_packed_floats(OC, C) <= inp_packed_floats(N, C));
    gemm_mat packed = job_packed(&ahead);
#pragma omp parallel
    {
        float *pack = thread_share(ws, dt, N, C, OC);
        const float *bias32 = dt == FL_F32 ? bias : sh.bias32;
        if (bias && dt != FL_F32) {
#pragma omp single nowait
            fl_convert(FL_F32, sh.bias32, dt, bias, OC);
        }
        pack_jobs(&ahead, 1);
#pragma omp for schedule(dynamic, 1) nowait
        for (int t = 0; t < nr * nc; t++) {
            int n0 = (t / nc) * rb, c0 = (t % nc) * cb;
            int rows = min_int(rb, N - n0), cols = min_int(cb, OC - c0);
            // fp32 straight into out; 16-bit on an fp32 tile, rounded after
            float *tile =
                dt == FL_F32 ? (float *)out + (size_t)n0 * OC + c0 : pack + pack_floats(N, C, OC);
            int ldt = dt == FL_F32 ? OC : cols;
            // full width: inp's rows in place, the weight packed; else inp
            // packed, the tile's rows of the weight in place
            gemm_mat a = packed, b = packed;
            if (ft.full_width)
                a = mat(dt, inp, (size_t)n0 * C, C, 0);
            else
                a.first = n0, b = mat(dt, weight, (size_t)c0 * C, C, 1);
            // the bias starts the sums in the kernel's registers
            gemm_tile(rows, cols, C, a, b, 0.0f, bias ? bias32 + c0 : NULL, FL_F32, tile, ldt,
                      pack);
            if (dt != FL_F32)
                store_tile(dt, fl_at(dt, out, (size_t)n0 * OC + c0), tile, rows, cols, OC, cols);
        }
    }
}

static void packed_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                            const void *inp, const void *weight, float *ws, int N, int C, int OC) {
    packed_shared sh = shared_split(ws, dt, N, C, OC);
    // fp32 input and bias gradients accumulate in place, 16-bit ones in fp32 copies
    float *dinp32 = dt == FL_F32 ? dinp : sh.dinp32, *dbias32 = dt == FL_F32 ? dbias : sh.bias32;
    int dwb = dw_tile_rows(OC);
    dinp_tiling tiles = dinp_tiles(N, C);
    int cb = tiles.cb, nc = tiles.nc, rb = tiles.rb, n_dinp = dinp ? tiles.nr * nc : 0;
    // The weight gradient accumulates in place when fp32, or when 16-bit over
    // one depth block of tokens (gemm rounds its one sum: the bits of an fp32
    // copy of its rows rounded after); otherwise in an fp32 copy, rounded once.
    int dw_in_place = dt == FL_F32 || N <= GEMM_DEPTH_BLOCK;
    // inp packed as the weight gradient's b, or as its a when transposed
    int dw_t = dw_transposed(C);
    pack_job inp_b = {sh.inp_packed, dt, inp, C, !dw_t, N, C, dw_t};
    // Output channels span by span (MM_DINP_CHUNK of them): a span's
    // dweight rows, dbias sums and dinp tiles share one dynamic loop, so
    // the span of dout that the weight gradient has just read is still
    // in cache when the input gradient reads it again; spans in order,
    // as the input gradient's sums over output channels need.
    // dweight rows += dout[:, rows]^T @ inp, a 16-bit one rounded once;
    // dinp tiles += dout (rows, span) @ weight (span, cols). dout's
    // columns of a span are packed once for all the column tiles that
    // read them; with one column tile, each tile packs its own rows as
    // it goes (packing ahead would only add a write and a re-read).
    // Without an input gradient there is one span: spans would only add
    // barriers, each leaving a thread idle behind the span's last tile
    // (a weight gradient alone over 2048 x 768 x 2304 took 0.91x the
    // time in one span, the LM head's 0.94x, 10 pairs in turn; the same
    // bits).
    int span = dinp ? MM_DINP_CHUNK : OC;
#pragma omp parallel
    {
        // scratch: only 16-bit data is converted into it
        float *pack = thread_share(ws, dt, N, C, OC), *scratch = pack + pack_floats(N, C, OC);
        if (dt != FL_F32) {
            if (dinp) load_rows_nowait(dt, dinp32, dinp, N, C, C);
            if (dbias) {
#pragma omp single nowait
                fl_convert(FL_F32, dbias32, dt, dbias, OC);
            }
        }
        for (int k0 = 0; k0 < OC; k0 += span) {
            int kn = min_int(span, OC - k0), k1 = k0 + kn;
            int n_dw = dweight ? ceil_div(kn, dwb) : 0, n_db = dbias ? ceil_div(kn, MM_OCBLOCK) : 0;
            // The span's packing in one wait, inp's with the first span's:
            // what the input-gradient tiles read ahead, dout's columns when
            // several column tiles read them, the weight's rows when several
            // row tiles do.
            gemm_mat a = mat(dt, dout, k0, OC, 0), w = mat(dt, weight, (size_t)k0 * C, C, 0);
            pack_job jobs[3];
            const pack_job *dout_job = NULL, *weight_job = NULL;
            int n_jobs = 0;
            if (k0 == 0 && dweight) jobs[n_jobs++] = inp_b;
            if (n_dinp && tiles.dout_ahead) {
                jobs[n_jobs] = (pack_job){sh.dout_packed, dt, a.p, OC, 0, N, kn, 0};
                dout_job = &jobs[n_jobs++];
            }
            if (n_dinp && tiles.weight_ahead) {
                jobs[n_jobs] = (pack_job){sh.weight_packed, dt, w.p, C, 1, kn, C, 0};
                weight_job = &jobs[n_jobs++];
            }
            // the 16-bit copies above are read from here on
            if (n_jobs || (k0 == 0 && dt != FL_F32)) pack_jobs(jobs, n_jobs);
            if (dout_job) a = job_packed(dout_job);
            if (weight_job) w = job_packed(weight_job);
            gemm_mat inp_packed = job_packed(&inp_b);
#pragma omp for schedule(dynamic, 1) nowait
            for (int t = 0; t < n_dw + n_db + n_dinp; t++) {
                if (t < n_dw) {
                    int r0 = k0 + t * dwb, rows = min_int(dwb, k1 - r0);
                    void *dw = fl_at(dt, dweight, (size_t)r0 * C);
                    gemm_mat dout_t = mat(dt, dout, r0, OC, 1);
                    if (dw_t) { // see MM_DW_T_MAX_C
                        load_transposed(scratch, rows, dt, dw, C, rows, C);
                        gemm_tile(C, rows, N, inp_packed, mat(dt, dout, r0, OC, 0), 1.0f, NULL,
                                  FL_F32, scratch, rows, pack);
                        store_transposed(dt, dw, C, scratch, rows, rows, C);
                        continue;
                    }
                    if (dw_in_place) {
                        gemm_tile(rows, C, N, dout_t, inp_packed, 1.0f, NULL, dt, dw, C, pack);
                        continue;
                    }
                    fl_convert(FL_F32, scratch, dt, dw, (size_t)rows * C);
                    gemm_tile(rows, C, N, dout_t, inp_packed, 1.0f, NULL, FL_F32, scratch, C, pack);
                    fl_store_f32(dt, dw, scratch, (size_t)rows * C);
                } else if (t < n_dw + n_db) {
                    int o = k0 + (t - n_dw) * MM_OCBLOCK;
                    column_sums(dbias32 + o, dt, dout, N, o, min_int(o + MM_OCBLOCK, k1), OC,
                                scratch);
                } else {
                    int i = t - n_dw - n_db, n0 = (i / nc) * rb, c0 = (i % nc) * cb;
                    gemm_mat ai = a, wi = w;
                    if (tiles.dout_ahead)
                        ai.first = n0;
                    else
                        ai = mat(dt, dout, (size_t)n0 * OC + k0, OC, 0);
                    if (tiles.weight_ahead)
                        wi.first = c0;
                    else
                        wi = mat(dt, weight, (size_t)k0 * C + c0, C, 0);
                    gemm_tile(min_int(rb, N - n0), min_int(cb, C - c0), kn, ai, wi, 1.0f, NULL,
                              FL_F32, dinp32 + (size_t)n0 * C + c0, C, pack);
                }
            }
            // the next span packs over this one's operands and adds to the
            // same dinp tiles; the 16-bit copies below are read whole
            if (k1 < OC || dt != FL_F32) {
#pragma omp barrier
            }
        }
        if (dt != FL_F32) {
            if (dinp) store_rows_nowait(dt, dinp, dinp32, N, C, C);
            if (dbias) {
#pragma omp single nowait
                fl_store_f32(dt, dbias, dbias32, OC);
            }
        }
    }
}

// ----------------------------------------------------------------------------

// bf16 on oneDNN's native kernels where they beat fp32 FMAs
int matmul_native_bf16(fl_dtype dt) {
    return (fl_cpu()->amx_bf16 || fl_cpu()->bf16_dot_fast) && dnnl_matmul_supported(dt);
}

const char *matmul_gemm_name(fl_dtype dt) {
    if (matmul_native_bf16(dt)) return "onednn";
    if (packed_path()) return "fitlm";
    return dt == FL_F32 ? "openblas" : "openblas-converted";
}

size_t matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC) {
    if (matmul_native_bf16(dt)) return dnnl_matmul_workspace_bytes(dt, N, C, OC);
    if (packed_path()) return packed_workspace_floats(dt, N, C, OC) * sizeof(float);
    return dt == FL_F32 ? 0 : portable_workspace_floats(N, C, OC) * sizeof(float);
}

void matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight, const void *bias,
                    void *workspace, int N, int C, int OC) {
    if (matmul_native_bf16(dt)) {
        dnnl_matmul_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
        return;
    }
    if (packed_path()) {
        FL_ASSERT(workspace);
        packed_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
        return;
    }
    if (dt != FL_F32) {
        FL_ASSERT(workspace);
        portable_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
        return;
    }
#pragma omp parallel
    forward_tiles(FL_F32, out, OC, 0, out, OC, inp, (float *)weight, NULL, bias, N, C, OC);
}

void matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                     const void *inp, const void *weight, void *workspace, int N, int C, int OC) {
    if (matmul_native_bf16(dt)) {
        dnnl_matmul_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
        return;
    }
    if (packed_path()) {
        FL_ASSERT(workspace);
        packed_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
        return;
    }
    if (dt != FL_F32) {
        FL_ASSERT(workspace);
        portable_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
        return;
    }
    // fp32: the whole of dout is one panel, summed over all OC in one sgemm per tile
    bwd_panel p = {.dt = FL_F32,
                   .N = N,
                   .C = C,
                   .o0 = 0,
                   .ob = OC,
                   .dout32 = dout,
                   .ldd = OC,
                   .w32 = weight,
                   .inp32 = inp,
                   .dinp32 = dinp,
                   .dw32 = dweight,
                   .dbias32 = dbias};
#pragma omp parallel
    backward_tiles(&p);
}

void matmul_forward_ref(float *out, const float *inp, const float *weight, const float *bias, int N,
                        int C, int OC) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        for (int o = 0; o < OC; o++) {
            const float *w = weight + (size_t)o * C;
            float val = bias ? bias[o] : 0.0f;
            for (int i = 0; i < C; i++) val += x[i] * w[i];
            out[(size_t)n * OC + o] = val;
        }
    }
}

void matmul_backward_ref(float *dinp, float *dweight, float *dbias, const float *dout,
                         const float *inp, const float *weight, int N, int C, int OC) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * OC;
        for (int o = 0; o < OC; o++) {
            const float *w = weight + (size_t)o * C;
            if (dinp)
                for (int i = 0; i < C; i++) dinp[(size_t)n * C + i] += dy[o] * w[i];
            if (dweight)
                for (int i = 0; i < C; i++) dweight[(size_t)o * C + i] += dy[o] * x[i];
            if (dbias) dbias[o] += dy[o];
        }
    }
}
