// quant.c: base rows stored in NF4 (lora.h), as bitsandbytes' Linear4bit
// holds them: the linear layers of the blocks, 4-bit codes with a
// blockwise absmax (optionally itself quantised to 8 bits: double
// quantisation); embeddings, norms and the LM head stay in the model's
// dtype. A row is quantised as it is stored (from a loader or the
// initialiser, piece by piece) and dequantised into workspace, one GEMM's
// weights at a time, whenever the linear unit needs it.
#include <math.h>
#include <string.h>

#include "arch.h"

int fl_quant_row(const fl_param_view *v) {
    return (v->flags & FL_PARAM_LINEAR) != 0;
}

// Where one row's pieces sit in its storage: codes ((n + 1) / 2 bytes), then
// the absmax as fp32, or as 8-bit codes, the nested fp32 absmax and the
// offset. Rows start 64-byte aligned.
typedef struct {
    size_t nblocks, absmax, q, nested, offset, total;
} row_layout;

static size_t align(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

static row_layout layout_of(const fl_quant_config *q, size_t numel) {
    row_layout l = {0};
    l.nblocks = (numel + (size_t)q->blocksize - 1) / (size_t)q->blocksize;
    size_t at = align((numel + 1) / 2, 4);
    if (!q->double_quant) {
        l.absmax = at;
        at += l.nblocks * sizeof(float);
    } else {
        l.q = at;
        l.nested = align(at + l.nblocks, 4);
        l.offset = l.nested + (l.nblocks + FL_DQ_BLOCK - 1) / FL_DQ_BLOCK * sizeof(float);
        at = l.offset + sizeof(float);
    }
    l.total = align(at, 64);
    return l;
}

size_t fl_quant_row_bytes(const fl_quant_config *q, size_t numel) {
    return layout_of(q, numel).total;
}

double fl_quant_bytes_per_param(const fl_param_table *t, const fl_quant_config *q,
                                size_t *quantised) {
    size_t bytes = 0, n = 0;
    for (int r = 0; r < t->count; r++)
        if (fl_quant_row(&t->views[r])) {
            bytes += fl_quant_row_bytes(q, t->views[r].numel);
            n += t->views[r].numel;
        }
    if (quantised) *quantised = n;
    return n ? (double)bytes / (double)n : 0.0;
}

void fl_quant_check(const fl_quant_config *q) {
    int b = q->blocksize;
    if (b < 32 || b > 4096 || (b & (b - 1)))
        fl_die("quantization: the NF4 block size must be a power of two in [32, 4096] (got %d)", b);
}

void fl_quant_sizes(const fl_param_table *t, const fl_quant_config *q, size_t *dense, size_t *store,
                    size_t *absmax) {
    *dense = *store = *absmax = 0;
    for (int r = 0; r < t->count; r++) {
        const fl_param_view *v = &t->views[r];
        if (!fl_quant_row(v)) {
            *dense += v->numel;
            continue;
        }
        row_layout l = layout_of(q, v->numel);
        *store += l.total;
        if (l.nblocks > *absmax) *absmax = l.nblocks;
    }
}

void fl_quant_alloc(fl_model *m, const fl_quant_config *q) {
    fl_quant_set *s = &m->quant;
    s->cfg = *q;
    size_t dense, store, absmax;
    fl_quant_sizes(&m->table, q, &dense, &store, &absmax);
    m->params = fl_model_mem(m, FL_MEM_PARAMS, dense * fl_dtype_size(m->dtype));
    s->store = fl_model_mem(m, FL_MEM_PARAMS, store);
    s->absmax = fl_model_mem(m, FL_MEM_WORKSPACE, absmax * sizeof(float));
    if (!m->dev->host)
        s->host = fl_alloc(FL_MEM_OTHER, fl_quant_host_floats(absmax) * sizeof(float));
    s->row_at = fl_alloc(FL_MEM_OTHER, (size_t)m->table.count * sizeof(size_t));
    size_t at_dense = 0, at_store = 0;
    for (int r = 0; r < m->table.count; r++) {
        const fl_param_view *v = &m->table.views[r];
        if (fl_quant_row(v)) {
            s->row_at[r] = at_store;
            at_store += layout_of(q, v->numel).total;
        } else {
            s->row_at[r] = at_dense;
            at_dense += v->numel;
        }
    }
}

size_t fl_quant_host_floats(size_t absmax) {
    // the absmax, then the statistics' bytes (fewer than 4 per block + 64)
    return 2 * absmax + 16;
}

// fp32 statistics inside a row's bytes (4-byte aligned by the layout)
static float *floats_at(const uint8_t *p, size_t offset) {
    return (float *)(void *)(uintptr_t)(p + offset);
}

// a row's storage and layout
static uint8_t *row_store(const fl_model *m, int row, row_layout *l) {
    *l = layout_of(&m->quant.cfg, m->table.views[row].numel);
    return m->quant.store + m->quant.row_at[row];
}

// The row's double-quantised statistics ([l.q, l.offset + 4) of its
// storage) as the host sees them: the storage itself on the cpu, a copy
// in quant.host past the absmax on a device.
static const uint8_t *host_stats(const fl_model *m, const uint8_t *p, const row_layout *l) {
    if (m->dev->host) return p + l->q;
    uint8_t *h = (uint8_t *)(m->quant.host + l->nblocks);
    fl_dev_download(m->dev, h, p + l->q, l->offset + sizeof(float) - l->q);
    return h;
}

// Double quantisation: the row's absmax undone on the host (a row read
// whole, fl_model_row_f32), into quant.absmax on the cpu, quant.host on a
// device.
static const float *host_absmax(const fl_model *m, int row) {
    row_layout l;
    const uint8_t *p = row_store(m, row, &l), *st = host_stats(m, p, &l);
    float *absmax = m->dev->host ? m->quant.absmax : m->quant.host, offset;
    memcpy(&offset, st + (l.offset - l.q), sizeof offset);
    dq8_dequantize(absmax, st, floats_at(st, l.nested - l.q), offset, l.nblocks, FL_DQ_BLOCK);
    return absmax;
}

// The row's absmax where the GEMM dequantises: double quantisation undone
// into quant.absmax by the table (on a device only its offset, 4 bytes,
// comes to the host).
static const float *row_absmax(const fl_model *m, int row) {
    row_layout l;
    const uint8_t *p = row_store(m, row, &l);
    if (!m->quant.cfg.double_quant) return floats_at(p, l.absmax);
    float offset;
    fl_dev_download(m->dev, &offset, p + l.offset, sizeof offset);
    m->dev->dq8_dequantize(m->quant.absmax, p + l.q, floats_at(p, l.nested), offset, l.nblocks,
                           FL_DQ_BLOCK);
    return m->quant.absmax;
}

static int is_nf4(const fl_model *m, int row) {
    return m->quant.cfg.enabled && fl_quant_row(&m->table.views[row]);
}

// a dense row's values (NULL for an NF4 row)
static void *dense_row(const fl_model *m, int row) {
    size_t at = m->quant.cfg.enabled ? m->quant.row_at[row] : m->table.views[row].offset;
    return fl_at(m->dtype, m->params, at);
}

// What the codes of w[0, n) lose, into the running sums (e: the absolute
// error's sum and max, the weights' sum of squares).
static void add_error(double e[3], const uint8_t *codes, const float *absmax, const float *w,
                      size_t n, int block) {
    for (size_t i = 0; i < n; i++) {
        int q = (codes[i / 2] >> (i % 2 ? 0 : 4)) & 15; // the first element is the high nibble
        double err = fabs((double)(nf4_codebook[q] * absmax[i / (size_t)block]) - w[i]);
        e[0] += err;
        e[2] += (double)w[i] * w[i];
        if (err > e[1]) e[1] = err;
    }
}

// A piece of a row is quantised on the host a chunk at a time (whole
// blocks: FL_PARAMS_INIT_CHUNK is a multiple of every block size) and its
// codes uploaded; a store takes pieces of up to QUANT_PIECE values at once
// (nf4_quantize shares those among the threads, and a device's copies are
// 32 KiB).
enum { CHUNK = FL_PARAMS_INIT_CHUNK, QUANT_PIECE = 16 * CHUNK };

void fl_model_quant_error(const fl_model *m, double *mean_abs, double *max_abs, double *rms) {
    const fl_quant_set *s = &m->quant;
    size_t n = s->err_n ? s->err_n : 1;
    *mean_abs = s->err_sum / n;
    *max_abs = s->err_max;
    *rms = sqrt(s->w_sumsq / n);
}

void fl_model_store_local(fl_model *m, int row, size_t first, const float *w, size_t n) {
    const fl_param_view *v = &m->table.views[row];
    FL_ASSERT(first + n <= v->numel);
    if (!is_nf4(m, row) && fl_model_sharded(m)) {
        // a shard (fl_model_init_from): the part of the piece inside it
        size_t a = v->offset + first, lo = a > m->params_begin ? a : m->params_begin;
        size_t hi = a + n < m->params_end ? a + n : m->params_end;
        if (lo < hi)
            fl_model_upload_f32(m, fl_at(m->dtype, m->params, lo - m->params_begin), w + (lo - a),
                                hi - lo);
        return;
    }
    if (!is_nf4(m, row)) {
        fl_model_upload_f32(m, fl_at(m->dtype, dense_row(m, row), first), w, n);
        return;
    }
    const fl_quant_config *q = &m->quant.cfg;
    FL_ASSERT(first % CHUNK == 0);
    row_layout l;
    uint8_t *p = row_store(m, row, &l);
    size_t B = (size_t)q->blocksize;
    // double quantisation: the row's absmax gathers on the host until its end
    float *dq = !q->double_quant ? NULL : m->dev->host ? m->quant.absmax : m->quant.host;
    uint8_t codes[QUANT_PIECE / 2];
    float absmax[QUANT_PIECE / 32] = {0}; // (filled by nf4_quantize)
    double e[3] = {0.0, m->quant.err_max, 0.0};
    for (size_t i = 0; i < n; i += QUANT_PIECE) {
        size_t k = n - i < QUANT_PIECE ? n - i : QUANT_PIECE, at = first + i;
        size_t blocks = (k + B - 1) / B;
        float *am = dq ? dq + at / B : absmax;
        nf4_quantize(codes, am, w + i, k, (int)B);
        add_error(e, codes, am, w + i, k, (int)B);
        fl_dev_upload(m->dev, p + at / 2, codes, (k + 1) / 2);
        if (!dq) fl_dev_upload(m->dev, floats_at(p, l.absmax) + at / B, am, blocks * sizeof(float));
    }
    m->quant.err_sum += e[0];
    m->quant.err_max = e[1];
    m->quant.w_sumsq += e[2];
    m->quant.err_n += n;
    if (dq && first + n == v->numel) { // the statistics, written once the row is complete
        uint8_t *st = m->dev->host ? p + l.q : (uint8_t *)(m->quant.host + l.nblocks);
        float offset;
        dq8_quantize(st, floats_at(st, l.nested - l.q), &offset, dq, l.nblocks, FL_DQ_BLOCK);
        memcpy(st + (l.offset - l.q), &offset, sizeof offset);
        if (st != p + l.q) fl_dev_upload(m->dev, p + l.q, st, l.offset + sizeof offset - l.q);
    }
}

void fl_model_row_f32(const fl_model *m, int row, float *out) {
    const fl_param_view *v = &m->table.views[row];
    if (!is_nf4(m, row)) {
        if (fl_model_sharded(m)) fl_die("internal: a row of a model sharded for ZeRO-3 read whole");
        fl_model_download_f32(m, out, dense_row(m, row), v->numel);
        return;
    }
    // dequantised on the host a chunk at a time from the downloaded codes
    row_layout l;
    const uint8_t *p = row_store(m, row, &l);
    size_t B = (size_t)m->quant.cfg.blocksize;
    const float *dq = m->quant.cfg.double_quant ? host_absmax(m, row) : NULL;
    uint8_t codes[CHUNK / 2];
    float absmax[CHUNK / 32];
    for (size_t i = 0; i < v->numel; i += CHUNK) {
        size_t k = v->numel - i < CHUNK ? v->numel - i : CHUNK, blocks = (k + B - 1) / B;
        fl_dev_download(m->dev, codes, p + i / 2, (k + 1) / 2);
        if (!dq)
            fl_dev_download(m->dev, absmax, floats_at(p, l.absmax) + i / B, blocks * sizeof(float));
        nf4_dequantize(FL_F32, out + i, codes, dq ? dq + i / B : absmax, k, (int)B);
    }
}

static void dequantize_rows(fl_model *m, int first, int out_rows) {
    const fl_param_view *v = m->table.views;
    size_t at = 0;
    for (int r = first, col = 0; col < out_rows; col += (int)v[r].shape[0], r++) {
        row_layout l;
        const uint8_t *p = row_store(m, r, &l);
        m->dev->nf4_dequantize(m->dtype, fl_at(m->dtype, m->quant.dequant, at), p, row_absmax(m, r),
                               v[r].numel, m->quant.cfg.blocksize);
        at += v[r].numel;
    }
}

const void *fl_quant_weights(fl_model *m, int unit, const fl_linear *lin, int phase) {
    int first = m->unit_row[unit + 1] + lin->w;
    if (!is_nf4(m, first)) return fl_unit_w(m, unit, lin->w);
    FL_PROFILE(FL_OP_DEQUANT, phase, 0.0, dequantize_rows(m, first, lin->out));
    return m->quant.dequant;
}
