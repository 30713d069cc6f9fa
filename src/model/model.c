// model.c: the model driver (see model.h). It allocates a model from its
// architecture's table and slot lists, runs the embedding, the blocks and the
// head forward, the loss, and the backward loop in reverse with the hooks,
// recomputing what the activation-checkpointing policy dropped.
#include "fitlm/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "arch.h"

// ----------------------------------------------------------------------------
// configuration

// indexed by fl_arch_kind
static const fl_arch *const ARCHS[] = {&fl_arch_gpt2, &fl_arch_llama};

static const fl_arch *arch_of(const fl_model_config *c) {
    FL_ASSERT((unsigned)c->arch < sizeof ARCHS / sizeof ARCHS[0]);
    return ARCHS[c->arch];
}

int fl_model_gemm_shapes(const fl_model_config *c, fl_gemm_shape *out) {
    fl_linear lins[FL_MAX_SLOTS];
    int nl = arch_of(c)->linears(c, lins), ns = 0;
    for (int i = 0; i < nl; i++) {
        int k = 0;
        while (k < ns && !(out[k].C == lins[i].in && out[k].OC == lins[i].out)) k++;
        if (k == ns) out[ns++] = (fl_gemm_shape){.C = lins[i].in, .OC = lins[i].out};
        size_t len = strlen(out[k].ops);
        snprintf(out[k].ops + len, sizeof out[k].ops - len, "%s%s", len ? "+" : "",
                 fl_op_name((fl_op)lins[i].op));
        out[k].calls += lins[i].op == FL_OP_MM_LMHEAD ? 1 : c->n_layer;
    }
    return ns;
}

void fl_model_config_finish(fl_model_config *cfg) {
    const struct {
        const char *name;
        int value;
    } fields[] = {{"n_layer", cfg->n_layer},
                  {"n_head", cfg->n_head},
                  {"n_embd", cfg->n_embd},
                  {"vocab_size", cfg->vocab_size},
                  {"max_seq_len", cfg->max_seq_len}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value <= 0)
            fl_die("model.%s must be positive (got %d)", fields[i].name, fields[i].value);
    if (cfg->n_embd % cfg->n_head != 0)
        fl_die("model.n_embd (%d) must be divisible by model.n_head (%d)", cfg->n_embd,
               cfg->n_head);
    if (cfg->vocab_size > (1 << 30) || cfg->n_embd > (1 << 16) || cfg->max_seq_len > (1 << 20) ||
        cfg->n_layer > 1024)
        fl_die("model shape out of range (vocab_size %d, n_embd %d, max_seq_len %d, n_layer %d)",
               cfg->vocab_size, cfg->n_embd, cfg->max_seq_len, cfg->n_layer);
    arch_of(cfg)->finish(cfg);
    if (cfg->n_kv_head <= 0 || cfg->n_head % cfg->n_kv_head != 0)
        fl_die("model.n_kv_head (%d) must be positive and divide model.n_head (%d)", cfg->n_kv_head,
               cfg->n_head);
    if (cfg->intermediate_size <= 0 || cfg->intermediate_size > (1 << 20))
        fl_die("model.intermediate_size must be in [1, %d] (got %d)", 1 << 20,
               cfg->intermediate_size);
    // A multiple of 128 keeps the LM-head GEMM on full SIMD tiles.
    cfg->padded_vocab_size = (cfg->vocab_size + 127) / 128 * 128;
    fl_model_tp_check(cfg, fl_tp_ways(cfg));
}

// t must divide `n` (model.<what>): each tensor-parallel rank takes 1/t of it.
static void check_divides(int t, int n, const char *key, const char *why) {
    if (n % t)
        fl_die("tensor_parallel.size %d does not divide %s %d (%d %% %d = %d): %s", t, key, n, n, t,
               n % t, why);
}

void fl_model_tp_check(const fl_model_config *c, int t) {
    if (t <= 1) return;
    FL_ASSERT(c->n_head > 0 && c->n_kv_head > 0); // a finished shape
    check_divides(t, c->n_head, "model.n_head", "each rank runs whole attention heads");
    int kv = c->n_kv_head;
    if (kv < t && t % kv == 0)
        fl_die("tensor_parallel.size %d is a multiple of model.n_kv_head %d, more ranks than "
               "key/value heads: Megatron's scheme for that (the QKV output gathered over the "
               "ranks, each keeping its group) is refused here, as torchtitan refuses it; use a "
               "tensor_parallel.size that divides %d",
               t, kv, kv);
    check_divides(t, kv, "model.n_kv_head",
                  "each rank runs whole key/value heads with their query heads");
    check_divides(t, c->intermediate_size, "model.intermediate_size",
                  "each rank takes an equal slice of the MLP");
}

int fl_vocab_cols(const fl_model_config *c) {
    int t = fl_tp_ways(c);
    return t > 1 ? (int)fl_params_vocab_rows((size_t)c->vocab_size, t) : c->padded_vocab_size;
}

size_t fl_model_num_params(const fl_model_config *cfg) {
    fl_model_config c = *cfg;
    fl_model_config_finish(&c);
    return arch_of(&c)->num_params(&c);
}

void fl_model_sizes(const fl_model_config *cfg, size_t *largest_row, size_t *block) {
    fl_model_config c = *cfg;
    fl_model_config_finish(&c);
    arch_of(&c)->sizes(&c, largest_row, block);
}

void fl_model_table(fl_param_table *t, const fl_model_config *cfg) {
    fl_model_config c = *cfg;
    fl_model_config_finish(&c);
    memset(t, 0, sizeof *t);
    fl_params_reserve(t, arch_of(&c)->table_rows(&c));
    arch_of(&c)->build_table(t, &c);
}

void fl_model_rank_table(fl_param_table *t, const fl_model_config *c, int rank) {
    fl_model_table(t, c);
    if (fl_tp_ways(c) == 1) return;
    fl_param_table whole = *t;
    fl_params_slice(t, &whole, fl_tp_ways(c), rank);
    fl_params_free(&whole);
}

int fl_arch_add_row(fl_param_table *t, int unit, unsigned flags, fl_init_rule init, float std,
                    size_t d0, size_t d1, const char *fmt, int l) {
    char name[FL_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, l);
    size_t shape[2] = {d0, d1};
    int r = fl_params_add(t, name, flags, d1 ? 2 : 1, shape);
    t->views[r].init = init;
    t->views[r].std = std;
    t->views[r].unit = unit;
    return r;
}

// ----------------------------------------------------------------------------
// allocation

// Bookkeeping beside the table: the row pointer arrays and the unit index.
static size_t bookkeeping_bytes(int rows, int L) {
    return 2 * (size_t)rows * sizeof(void *) + (size_t)(L + 3) * sizeof(int);
}

// Elements of the per-unit gradient buffers: the largest unit's, and the
// embedding's own when the LM head is tied to it (0 otherwise).
static void unit_grad_sizes(const fl_param_table *t, const fl_model_config *c, size_t *unit,
                            size_t *embed) {
    size_t per[1026] = {0};            // by unit + 1: embedding, blocks, head (n_layer <= 1024)
    for (int r = 0; r < t->count; r++) // (a pipeline's tied copy has no gradient)
        if (!(t->views[r].flags & FL_PARAM_TIED_COPY))
            per[t->views[r].unit + 1] += t->views[r].numel;
    *unit = 0;
    *embed = c->tie_embeddings ? per[0] : 0;
    for (int u = c->tie_embeddings ? 1 : 0; u <= c->n_layer + 1; u++)
        if (per[u] > *unit) *unit = per[u];
}

// Elements of the largest GEMM over NF4 rows: every linear but the LM head.
static size_t dequant_numel(const fl_model_config *c) {
    fl_linear lins[FL_MAX_SLOTS];
    int n = arch_of(c)->linears(c, lins);
    size_t most = 0;
    for (int i = 0; i < n; i++)
        if (lins[i].op != FL_OP_MM_LMHEAD && (size_t)lins[i].in * lins[i].out > most)
            most = (size_t)lins[i].in * lins[i].out;
    return most;
}

static void store_sink(void *ctx, int row, size_t first, const float *values, size_t n) {
    fl_model_store_row(ctx, row, first, values, n);
}

void fl_pp_stage_whole(fl_pp_stage *s, int n_layer) {
    memset(s, 0, sizeof *s);
    s->size = s->chunks = 1;
    s->count[0] = n_layer;
    s->sets[0] = 1;
}

static void random_fill(fl_weight_source *s, fl_model *m) {
    fl_params_init_each(fl_model_whole_table(m), s->seed, store_sink, m);
}

void fl_weight_source_random(fl_weight_source *s, const fl_model_config *cfg, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->config = *cfg;
    s->seed = seed;
    s->fill = random_fill;
}

void fl_weight_source_close(fl_weight_source *s) {
    if (s->close) s->close(s);
    memset(s, 0, sizeof *s);
}

void fl_model_init(fl_model *m, const fl_model_config *cfg, fl_dtype dt, uint64_t seed) {
    fl_weight_source s;
    fl_weight_source_random(&s, cfg, seed);
    fl_model_init_whole(m, &s, dt, NULL);
}

void fl_model_init_whole(fl_model *m, fl_weight_source *src, fl_dtype dt,
                         const fl_quant_config *q) {
    fl_model_init_from(m, src, dt, q, 0, SIZE_MAX);
    fl_weight_source_close(src);
}

void fl_model_init_from(fl_model *m, fl_weight_source *src, fl_dtype dt, const fl_quant_config *q,
                        size_t begin, size_t end) {
    fl_model_init_tp(m, src, dt, q, begin, end, NULL, NULL);
}

// A pipeline stage's rows: its own table, and the maps between its rows
// and the whole table's.
static void stage_rows(fl_model *m) {
    fl_param_table rank = m->table;
    int *global = fl_alloc(FL_MEM_OTHER, (size_t)rank.count * sizeof(int));
    fl_model_stage_table(&m->table, &rank, &m->config, &m->pp, global);
    int n = m->table.count;
    m->row_offset = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof(size_t));
    for (int r = 0; r < n; r++) m->row_offset[r] = rank.views[global[r]].offset;
    fl_params_free(&rank);
    m->row_global = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof(int));
    memcpy(m->row_global, global, (size_t)n * sizeof(int));
    fl_free(global);
    m->row_local = fl_alloc(FL_MEM_OTHER, (size_t)m->whole.count * sizeof(int));
    for (int r = 0; r < m->whole.count; r++) m->row_local[r] = -1;
    // the tied copy is not stored from the source: the pipeline copies
    // stage 0's row into it
    for (int r = 0; r < n; r++)
        if (!(m->table.views[r].flags & FL_PARAM_TIED_COPY)) m->row_local[m->row_global[r]] = r;
}

void fl_model_init_tp(fl_model *m, fl_weight_source *src, fl_dtype dt, const fl_quant_config *q,
                      size_t begin, size_t end, const fl_tp *tp, const fl_pp_stage *pp) {
    memset(m, 0, sizeof *m);
    m->loss = -1.0f; // no forward with targets yet
    m->config = src->config;
    m->dtype = dt;
    m->dev = fl_device_default();
    m->tp = tp && tp->size > 1 ? *tp : (fl_tp){1, 0, 0, NULL};
    m->config.tp_size = m->tp.size;
    m->config.sequence_parallel = m->tp.size > 1 && m->tp.sequence_parallel;
    fl_model_config_finish(&m->config);
    const fl_model_config *c = &m->config;
    m->arch = arch_of(c);
    if (pp && pp->size > 1)
        m->pp = *pp;
    else
        fl_pp_stage_whole(&m->pp, c->n_layer);
    int quant = q && q->enabled;
    if (!m->dev->host && (m->tp.size > 1 || (pp && pp->size > 1)))
        fl_die("tensor and pipeline parallelism run on the cpu device only (not on '%s')",
               m->dev->name);
    if (m->tp.size > 1 && quant)
        fl_die("tensor parallelism with NF4 base weights (QLoRA) is not supported: drop "
               "--quantize or --tensor-parallel");
    FL_ASSERT(!(m->pp.size > 1 && (quant || begin > 0 || end != SIZE_MAX)));
    fl_model_rank_table(&m->table, c, m->tp.rank);
    if (m->tp.size > 1 || m->pp.size > 1) fl_model_table(&m->whole, c);
    if (m->pp.size > 1) stage_rows(m);
    const fl_param_table *whole = fl_model_whole_table(m);
    size_t n = m->table.numel;
    FL_ASSERT(whole->numel == m->arch->num_params(c) && whole->count == m->arch->table_rows(c));
    if (quant) fl_quant_check(q);
    if (src->check) src->check(src, whole, quant ? q : NULL); // before allocating
    m->params_begin = begin;
    m->params_end = end == SIZE_MAX ? n : end;
    FL_ASSERT(m->params_begin <= m->params_end && m->params_end <= n);
    FL_ASSERT(!(fl_model_sharded(m) && quant));
    if (quant) {
        fl_quant_alloc(m, q);
        m->quant.dequant = fl_model_mem(m, FL_MEM_WORKSPACE, dequant_numel(c) * fl_dtype_size(dt));
    } else {
        m->params =
            fl_model_mem(m, FL_MEM_PARAMS, (m->params_end - m->params_begin) * fl_dtype_size(dt));
    }
    int rows = m->table.count, L = c->n_layer;
    m->wp = fl_alloc(FL_MEM_OTHER, (size_t)rows * sizeof(void *));
    m->gp = fl_alloc(FL_MEM_OTHER, (size_t)rows * sizeof(void *));
    m->unit_row = fl_alloc(FL_MEM_OTHER, (size_t)(L + 3) * sizeof(int));
    // rows come unit by unit: embedding, blocks, head
    int u = FL_UNIT_EMBED;
    m->unit_row[0] = 0;
    for (int r = 0; r < rows; r++) {
        int ru = m->table.views[r].unit;
        FL_ASSERT(ru >= u && ru <= L);
        while (u < ru) m->unit_row[++u + 1] = r;
    }
    while (u <= L) m->unit_row[++u + 1] = rows;
    for (int unit = FL_UNIT_EMBED; unit <= L; unit++) {
        fl_model_bind_params(m, unit, NULL);
        fl_model_bind_grads(m, unit, NULL);
    }
    src->fill(src, m); // each row once: NF4 rows quantised from their real values
}

// LoRA without training the base: no base gradient at all.
static int base_frozen(const fl_model *m) {
    return m->lora.cfg.r && !m->lora.cfg.train_base;
}

// The gradients: one buffer for the model, or one unit's at a time.
static void alloc_grads(fl_model *m, int unit_grads) {
    size_t D = fl_dtype_size(m->dtype);
    if (m->lora.cfg.r) m->lora.grads = fl_model_mem(m, FL_MEM_GRADS, m->lora.table.numel * D);
    // the row pointers stay NULL: no gradient, or the hook binds them
    if (base_frozen(m) || unit_grads == FL_GRADS_HOOK) return;
    if (unit_grads) {
        size_t unit, embed;
        unit_grad_sizes(&m->table, &m->config, &unit, &embed);
        m->unit_grads = fl_model_mem(m, FL_MEM_GRADS, unit * D);
        if (embed) m->embed_grads = fl_model_mem(m, FL_MEM_GRADS, embed * D);
        return;
    }
    m->grads = fl_model_mem(m, FL_MEM_GRADS, m->table.numel * D);
    for (int unit = FL_UNIT_EMBED; unit <= m->config.n_layer; unit++)
        fl_model_bind_grads(m, unit, NULL);
}

void fl_model_unit_rows(const fl_model *m, int unit, int *first, int *count) {
    FL_ASSERT(unit >= FL_UNIT_EMBED && unit <= m->config.n_layer);
    *first = m->unit_row[unit + 1];
    *count = m->unit_row[unit + 2] - *first;
}

static void bind(const fl_model *m, void **ptrs, void *whole, int unit, void *buffer) {
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    const fl_param_view *v = m->table.views;
    for (int r = first; r < first + count; r++)
        ptrs[r] = buffer  ? fl_at(m->dtype, buffer, v[r].offset - v[first].offset)
                  : whole ? fl_at(m->dtype, whole, v[r].offset)
                          : NULL; // gradients per unit: bound when the unit runs
}

void fl_model_bind_grads(fl_model *m, int unit, void *buffer) {
    bind(m, m->gp, m->grads, unit, buffer);
}

void fl_model_bind_params(fl_model *m, int unit, void *buffer) {
    // a shard holds no whole rows: nothing to point back at
    if (buffer || !m->quant.cfg.enabled) {
        bind(m, m->wp, fl_model_sharded(m) ? NULL : m->params, unit, buffer);
        return;
    }
    // dense rows are packed in m->params; an NF4 row has no dense weights
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    for (int r = first; r < first + count; r++)
        m->wp[r] = fl_quant_row(&m->table.views[r])
                       ? NULL
                       : fl_at(m->dtype, m->params, m->quant.row_at[r]);
}

// One allocation of the activation set: where its pointer goes, how many
// elements of what size, under which tag. fl_model_alloc_acts walks this
// list to allocate and fl_model_memory to predict, so the two cannot disagree.
// Under pipeline parallelism what a micro-batch keeps from its forward to
// its backward is held once per activation set (PER_*): the residual
// stream per chunk (its blocks + 1 entries), the blocks' kept slots per
// chunk (its blocks), the head's (the last chunk's sets, on the last stage)
// and the tokens (the first chunk's, on the first stage). The rest is
// scratch, one copy (PER_STEP).
enum { PER_STEP, PER_RESID, PER_BLOCK, PER_HEAD, PER_EMBED };
typedef struct {
    void **slot; // NULL when only sizes are wanted
    size_t count, elem;
    fl_mem_tag tag;
    int per;     // PER_*
    size_t unit; // elements of one copy (PER_RESID, PER_BLOCK: of one entry or block)
} act_spec;

// Elements of set k of chunk c from the start of a PER_* buffer (k = the
// chunk's sets, c = 0: the buffer's size).
static size_t set_offset(const fl_pp_stage *s, int per, size_t unit, int c, int k) {
    if (per == PER_HEAD || per == PER_EMBED) return (size_t)k * unit;
    size_t at = 0;
    for (int i = 0; i <= c; i++) {
        size_t entries = (size_t)s->count[i] + (per == PER_RESID);
        at += (size_t)(i < c ? s->sets[i] : k) * entries * unit;
    }
    return at;
}

// Elements of a PER_* buffer on this stage (0: the stage does not hold it).
static size_t per_numel(const fl_pp_stage *s, int per, size_t unit) {
    if (per == PER_HEAD) return s->rank == s->size - 1 ? (size_t)s->sets[s->chunks - 1] * unit : 0;
    if (per == PER_EMBED) return s->rank == 0 ? (size_t)s->sets[0] * unit : 0;
    return set_offset(s, per, unit, s->chunks - 1, s->sets[s->chunks - 1]);
}

// The forward state a set keeps for its backward.
struct fl_set_state {
    int B, T, n_targets, dlogits_ready;
    float loss, dlogits_dloss;
};

// Set k of chunk c among all the stage's sets (k = 0 of c = chunks: how many).
static int set_index(const fl_pp_stage *s, int c, int k) {
    for (int i = 0; i < c; i++) k += s->sets[i];
    return k;
}

static int total_sets(const fl_pp_stage *s) {
    return set_index(s, s->chunks, 0);
}

enum { MAX_SPECS = 3 * FL_MAX_SLOTS + 16 };

static int recomputed(const fl_slot *s, fl_recompute r) {
    return r == FL_RECOMPUTE_BLOCK || (r == FL_RECOMPUTE_SELECTIVE && s->cheap);
}

// Positions whose logits exist at once: a chunk's (config.logits_chunk) or all
static size_t logits_rows(const fl_model_config *c, size_t BT) {
    return c->logits_chunk > 0 && (size_t)c->logits_chunk < BT ? (size_t)c->logits_chunk : BT;
}

// Elements of a slot for BT positions (a stream-side slot's 1/t of them
// under sequence parallelism).
static size_t slot_numel(const fl_model_config *c, const fl_slot *s, size_t BT) {
    return (s->seq ? (size_t)fl_seq_rows(c, (int)BT) : BT) * s->per_token;
}

// Under sequence parallelism: elements of the largest unit's rows (of the
// rank's table t: no table is built here, so nothing transient adds to the
// peak of tag other) whose gradients are sums over the positions of the
// rank's slice (FL_PARAM_TOKENWISE).
static size_t tokenwise_numel(const fl_model_config *c, const fl_param_table *t) {
    size_t per[1026] = {0}, most = 0; // by unit + 1
    for (int r = 0; r < t->count; r++)
        if (t->views[r].flags & FL_PARAM_TOKENWISE) per[t->views[r].unit + 1] += t->views[r].numel;
    for (int u = 0; u <= c->n_layer + 1; u++) most = per[u] > most ? per[u] : most;
    return most;
}

// The device's own scratch for the kernels of a step of BT positions
// (device.h's scratch_bytes): the widest column sum is a norm's weight
// gradient (C) or a bias's; the rank's query heads.
static size_t dev_scratch_bytes(const fl_device *dev, const fl_model_config *c, size_t BT) {
    fl_linear lins[FL_MAX_SLOTS];
    int nl = arch_of(c)->linears(c, lins), cols = c->n_embd;
    for (int i = 0; i < nl; i++)
        if (lins[i].b >= 0 && lins[i].out > cols) cols = lins[i].out;
    return dev->scratch_bytes((int)BT, cols, c->n_head / fl_tp_ways(c));
}

static int act_specs(fl_model *m, const fl_device *dev, const fl_model_config *c,
                     const fl_param_table *rows, fl_dtype dt, int B, int T, int threads,
                     fl_recompute r, const fl_lora_config *lc, const fl_param_table *lt,
                     const fl_pp_stage *pp, act_spec *out) {
    const fl_arch *arch = arch_of(c);
    size_t C = c->n_embd;
    size_t BT = (size_t)B * T, D = fl_dtype_size(dt), F = sizeof(float), I = sizeof(int);
    size_t BTs = (size_t)fl_seq_rows(c, (int)BT); // the residual stream's positions here
    int n = 0;
#define SPEC_PER(field, per, unit, size, tag)                                                      \
    do {                                                                                           \
        int per_ = (per);                                                                          \
        size_t unit_ = (unit), cnt_ = per_ == PER_STEP ? unit_ : per_numel(pp, per_, unit_);       \
        if (cnt_)                                                                                  \
            out[n++] = (act_spec){m ? (void **)&(field) : NULL, cnt_, size, tag, per_, unit_};     \
    } while (0)
#define SPEC(field, cnt, size, tag) SPEC_PER(field, PER_STEP, cnt, size, tag)
    fl_slot slots[FL_MAX_SLOTS];
    SPEC_PER(m->resid, PER_RESID, BTs * C, D, FL_MEM_ACTS);
    int ns = arch->block_slots(c, slots);
    for (int i = 0; i < ns; i++)
        SPEC_PER(m->block_act[i], recomputed(&slots[i], r) ? PER_STEP : PER_BLOCK,
                 slot_numel(c, &slots[i], BT), slots[i].f32 ? F : D, FL_MEM_ACTS);
    ns = arch->head_slots(c, slots);
    for (int i = 0; i < ns; i++)
        SPEC_PER(m->head_act[i], PER_HEAD, slot_numel(c, &slots[i], BT), slots[i].f32 ? F : D,
                 FL_MEM_ACTS);
    SPEC_PER(m->logits, PER_HEAD, logits_rows(c, BT) * (size_t)fl_vocab_cols(c), D, FL_MEM_ACTS);
    SPEC_PER(m->losses, PER_HEAD, BT, F, FL_MEM_ACTS);
    SPEC_PER(m->xent_lse, PER_HEAD, BT, F, FL_MEM_ACTS);
    SPEC_PER(m->inputs, PER_EMBED, BT, I, FL_MEM_ACTS);
    SPEC_PER(m->targets, PER_HEAD, BT, I, FL_MEM_ACTS);
    if (fl_tp_ways(c) > 1) { // the vocabulary-parallel loss's local targets and sums
        SPEC_PER(m->tp_targets, PER_HEAD, BT, I, FL_MEM_ACTS);
        SPEC(m->tp_sums, 2 * BT, F, FL_MEM_WORKSPACE);
    }
    if (pp->size > 1)
        SPEC(m->set_state, (size_t)total_sets(pp), sizeof(struct fl_set_state), FL_MEM_OTHER);
    if (pp->size > 1 && pp->rank == 0 && c->tie_embeddings) { // the last stage's head's
        SPEC(m->tied_dlogits, BT * (size_t)fl_vocab_cols(c), D, FL_MEM_WORKSPACE);
        SPEC(m->tied_x, BTs * C, D, FL_MEM_WORKSPACE);
    }
    size_t rope = arch->rope_floats(c, T);
    if (rope) SPEC(m->rope_table, rope, F, FL_MEM_ACTS);
    SPEC(m->dres, BTs * C, D, FL_MEM_WORKSPACE);
    ns = arch->work_slots(c, slots);
    for (int i = 0; i < ns; i++)
        SPEC(m->block_work[i], slot_numel(c, &slots[i], BT), slots[i].f32 ? F : D,
             FL_MEM_WORKSPACE);
    if (fl_seq_parallel(c)) {
        // every position's hidden states, gathered, and a partial sum before
        // its reduce-scatter (the linear unit, the embedding); the norms'
        // weight gradients of one unit before their sum over the TP group
        SPEC(m->tp_gather, BT * C, D, FL_MEM_WORKSPACE);
        SPEC(m->tp_partial, BT * C, D, FL_MEM_WORKSPACE);
        SPEC(m->tp_norm_grads, tokenwise_numel(c, rows), D, FL_MEM_WORKSPACE);
    }
    SPEC(m->dlosses, BT, F, FL_MEM_WORKSPACE);
    SPEC(m->att_workspace, arch->attention_floats(c, dev, dt, B, T, threads), F, FL_MEM_WORKSPACE);
    // the largest GEMM workspace of the step
    fl_linear lins[FL_MAX_SLOTS];
    int nl = arch->linears(c, lins);
    size_t mm = 0;
    for (int i = 0; i < nl; i++) {
        size_t b = fl_linear_workspace_bytes(dev, dt, &lins[i], (int)BT);
        if (b > mm) mm = b;
    }
    if (lt) { // the adapters: their GEMMs and scratch
        size_t h, dy, xd;
        fl_lora_workspace(lt, lc->r, lc->dropout, BT, &h, &dy, &xd);
        SPEC(m->lora.h, h, D, FL_MEM_WORKSPACE);
        SPEC(m->lora.dh, h, D, FL_MEM_WORKSPACE);
        SPEC(m->lora.dy, dy, D, FL_MEM_WORKSPACE);
        if (xd) SPEC(m->lora.xd, xd, D, FL_MEM_WORKSPACE);
        for (int a = 0; a < lt->count; a += 2) {
            int in = (int)lt->views[a].shape[1], out = (int)lt->views[a + 1].shape[0];
            size_t b1 = dev->matmul_workspace_bytes(dt, (int)BT, in, lc->r);
            size_t b2 = dev->matmul_workspace_bytes(dt, (int)BT, lc->r, out);
            if (b1 > mm) mm = b1;
            if (b2 > mm) mm = b2;
        }
    }
    SPEC(m->matmul_workspace, mm, 1, FL_MEM_WORKSPACE);
    SPEC(m->dev_scratch, dev_scratch_bytes(dev, c, BT), 1, FL_MEM_WORKSPACE);
#undef SPEC
#undef SPEC_PER
    FL_ASSERT(n <= MAX_SPECS);
    return n;
}

void fl_model_memory(const fl_device *dev, const fl_model_config *cfg, fl_dtype dt, int B, int T,
                     int threads, fl_recompute recompute, int unit_grads,
                     const fl_lora_config *lora, const fl_quant_config *quant,
                     const fl_pp_stage *pp, size_t bytes[FL_MEM_NTAGS]) {
    if (!dev) dev = fl_device_cpu();
    fl_model_config c = *cfg;
    fl_model_config_finish(&c);
    const fl_arch *arch = arch_of(&c);
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    size_t D = fl_dtype_size(dt);
    int whole_rows = arch->table_rows(&c), rows = whole_rows;
    fl_pp_stage one;
    if (!pp || pp->size <= 1) fl_pp_stage_whole(&one, c.n_layer), pp = &one;
    // the tables, built only to size what depends on their rows (under
    // tensor parallelism every rank's slices are the same size)
    fl_param_table t, lt = {0};
    fl_model_rank_table(&t, &c, 0);
    if (pp->size > 1) {
        fl_param_table rank = t;
        fl_model_stage_table(&t, &rank, &c, pp, NULL);
        fl_params_free(&rank);
        rows = t.count;
    }
    size_t numel = t.numel;
    if (lora && lora->r) fl_lora_table(&lt, &t, &c, lora, NULL);
    bytes[FL_MEM_PARAMS] = numel * D;
    bytes[FL_MEM_GRADS] = numel * D;
    int two = fl_tp_ways(&c) > 1 || pp->size > 1; // the whole table beside the rank's
    bytes[FL_MEM_OTHER] =
        (rows + (two ? whole_rows : 0)) * sizeof(fl_param_view) +
        bookkeeping_bytes(rows, c.n_layer) +
        (pp->size > 1 ? (size_t)(rows + whole_rows) * sizeof(int) + (size_t)rows * sizeof(size_t)
                      : 0);
    if (quant && quant->enabled) {
        size_t dense, store, absmax;
        fl_quant_sizes(&t, quant, &dense, &store, &absmax);
        bytes[FL_MEM_PARAMS] = dense * D + store;
        bytes[FL_MEM_OTHER] += rows * sizeof(size_t);
        bytes[FL_MEM_WORKSPACE] += absmax * sizeof(float) + dequant_numel(&c) * D;
        if (!dev->host) bytes[FL_MEM_OTHER] += fl_quant_host_floats(absmax) * sizeof(float);
    }
    if (unit_grads) {
        size_t unit, embed;
        unit_grad_sizes(&t, &c, &unit, &embed);
        bytes[FL_MEM_GRADS] = unit_grads == FL_GRADS_HOOK ? 0 : (unit + embed) * D;
    }
    if (lt.count) {
        bytes[FL_MEM_PARAMS] += lt.numel * D;
        bytes[FL_MEM_OTHER] += lt.count * sizeof(fl_param_view) + rows * sizeof(int);
        bytes[FL_MEM_GRADS] = (lora->train_base ? bytes[FL_MEM_GRADS] : 0) + lt.numel * D;
    }
    if (B > 0) {
        act_spec specs[MAX_SPECS];
        int n = act_specs(NULL, dev, &c, &t, dt, B, T, threads, recompute, lora,
                          lt.count ? &lt : NULL, pp, specs);
        for (int i = 0; i < n; i++) bytes[specs[i].tag] += specs[i].count * specs[i].elem;
    }
    fl_params_free(&lt);
    fl_params_free(&t);
}

void fl_model_alloc_acts(fl_model *m, int B, int T, fl_recompute recompute, int unit_grads) {
    const fl_model_config *c = &m->config;
    if (B <= 0 || T <= 0)
        fl_die("batch size and sequence length must be positive (B=%d, T=%d)", B, T);
    if (T > c->max_seq_len)
        fl_die("sequence length %d exceeds the model's max_seq_len %d", T, c->max_seq_len);
    FL_ASSERT(m->max_B == 0);                                  // allocated once, up front
    if (c->logits_chunk && (m->tp.size > 1 || m->pp.size > 1)) // (the config refuses it first)
        fl_die("logits_chunk: not with tensor or pipeline parallelism");
    alloc_grads(m, unit_grads);
    act_spec specs[MAX_SPECS];
    int n = act_specs(m, m->dev, c, &m->table, m->dtype, B, T, fl_threads(), recompute,
                      &m->lora.cfg, m->lora.cfg.r ? &m->lora.table : NULL, &m->pp, specs);
    for (int i = 0; i < n; i++) {
        *specs[i].slot = fl_model_mem(m, specs[i].tag, specs[i].count * specs[i].elem);
        m->set_base[i] = *specs[i].slot;
    }
    if (m->set_state) memset(m->set_state, 0, (size_t)total_sets(&m->pp) * sizeof *m->set_state);
    if (m->dev_scratch)
        m->dev->scratch_lend(m->dev, m->dev_scratch, dev_scratch_bytes(m->dev, c, (size_t)B * T));
    m->att_workspace_threads = fl_threads();
    m->max_B = B;
    m->max_T = T;
    m->recompute = recompute;
    if (m->rope_table) { // built on the host, then uploaded
        size_t bytes = m->arch->rope_floats(c, T) * sizeof(float);
        float *host = m->dev->host ? m->rope_table : fl_alloc(FL_MEM_OTHER, bytes);
        rope_table(host, T, c->n_embd / c->n_head, c->rope_theta);
        if (host != m->rope_table) {
            fl_dev_upload(m->dev, m->rope_table, host, bytes);
            fl_free(host);
        }
    }
}

void fl_model_use_set(fl_model *m, int chunk, int set) {
    fl_pp_stage *s = &m->pp;
    FL_ASSERT(chunk >= 0 && chunk < s->chunks && set >= 0 && set < s->sets[chunk] && m->max_B);
    if (m->set_state) { // keep the forward state of the set left, take the new one's
        m->set_state[set_index(s, m->chunk, m->set)] = (struct fl_set_state){
            m->B, m->T, m->n_targets, m->dlogits_ready, m->loss, m->dlogits_dloss};
        const struct fl_set_state *st = &m->set_state[set_index(s, chunk, set)];
        m->B = st->B, m->T = st->T, m->n_targets = st->n_targets;
        m->dlogits_ready = st->dlogits_ready, m->loss = st->loss;
        m->dlogits_dloss = st->dlogits_dloss;
    }
    m->chunk = chunk;
    m->set = set;
    act_spec specs[MAX_SPECS];
    int n = act_specs(m, m->dev, &m->config, &m->table, m->dtype, m->max_B, m->max_T,
                      m->att_workspace_threads, m->recompute, &m->lora.cfg,
                      m->lora.cfg.r ? &m->lora.table : NULL, s, specs);
    for (int i = 0; i < n; i++)
        if (specs[i].per != PER_STEP)
            *specs[i].slot = (char *)m->set_base[i] +
                             set_offset(s, specs[i].per, specs[i].unit, chunk, set) * specs[i].elem;
}

void *fl_model_chunk_input(fl_model *m) {
    return m->resid;
}

void *fl_model_chunk_output(fl_model *m) {
    size_t n = (size_t)fl_seq_rows(&m->config, m->B * m->T) * m->config.n_embd;
    return fl_at(m->dtype, m->resid, (size_t)m->pp.count[m->chunk] * n);
}

void fl_model_free(fl_model *m) {
    if (m->dev_scratch) m->dev->scratch_return(m->dev, m->dev_scratch);
    if (m->max_B) {
        act_spec specs[MAX_SPECS];
        int n = act_specs(m, m->dev, &m->config, &m->table, m->dtype, m->max_B, m->max_T,
                          m->att_workspace_threads, m->recompute, &m->lora.cfg,
                          m->lora.cfg.r ? &m->lora.table : NULL, &m->pp, specs);
        for (int i = 0; i < n; i++) fl_model_mem_free(m, specs[i].tag, m->set_base[i]);
    }
    fl_model_mem_free(m, FL_MEM_PARAMS, m->lora.params);
    fl_model_mem_free(m, FL_MEM_GRADS, m->lora.grads);
    fl_free(m->lora.a_row);
    fl_params_free(&m->lora.table);
    fl_model_mem_free(m, FL_MEM_PARAMS, m->quant.store);
    fl_free(m->quant.row_at);
    fl_model_mem_free(m, FL_MEM_WORKSPACE, m->quant.dequant);
    fl_model_mem_free(m, FL_MEM_WORKSPACE, m->quant.absmax);
    fl_free(m->quant.host);
    fl_model_mem_free(m, FL_MEM_PARAMS, m->params);
    fl_model_mem_free(m, FL_MEM_GRADS, m->grads);
    fl_model_mem_free(m, FL_MEM_GRADS, m->unit_grads);
    fl_model_mem_free(m, FL_MEM_GRADS, m->embed_grads);
    fl_free(m->wp);
    fl_free(m->gp);
    fl_free(m->unit_row);
    fl_free(m->row_local);
    fl_free(m->row_global);
    fl_free(m->row_offset);
    fl_params_free(&m->table);
    fl_params_free(&m->whole);
    memset(m, 0, sizeof *m);
}

// ----------------------------------------------------------------------------
// passes

// Per-unit gradients: the unit's rows into its buffer, zeroed.
static void bind_unit_grads(fl_model *m, int unit, void *buffer) {
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    if (!count) return;
    const fl_param_view *a = &m->table.views[first], *z = &m->table.views[first + count - 1];
    m->dev->zero(m->dev, buffer, (z->offset + z->numel - a->offset) * fl_dtype_size(m->dtype));
    fl_model_bind_grads(m, unit, buffer);
}

static void pre_unit(fl_model *m, int unit, int pass) {
    if (m->unit_grads && pass == FL_PASS_BWD) {
        int L = m->config.n_layer, head_here = fl_pp_has_head(&m->pp, m->pp.chunks - 1);
        // the tied LM head writes into the embedding's gradient first (under
        // pipeline parallelism, stage 0 from the last stage's head's data)
        if (unit == FL_UNIT_HEAD(L) && m->embed_grads)
            bind_unit_grads(m, FL_UNIT_EMBED, m->embed_grads);
        if (unit == FL_UNIT_EMBED && m->embed_grads && !head_here)
            bind_unit_grads(m, FL_UNIT_EMBED, m->embed_grads);
        else if (unit != FL_UNIT_EMBED || !m->embed_grads)
            bind_unit_grads(m, unit, m->unit_grads);
    }
    if (m->hooks.pre_unit) m->hooks.pre_unit(m->hooks.ctx, m, unit, pass);
}

static void grad_ready(fl_model *m, int unit) {
    if (!m->hooks.grad_ready) return;
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    if (count) m->hooks.grad_ready(m->hooks.ctx, m, first, count);
}

// Block l's view of the activations: its copy of each slot, or the one
// shared copy of a slot the policy recomputes.
static fl_block block_at(fl_model *m, int l, void **act) {
    const fl_model_config *c = &m->config;
    size_t BT = (size_t)m->B * m->T, C = c->n_embd, BTs = (size_t)fl_seq_rows(c, (int)BT);
    fl_slot slots[FL_MAX_SLOTS];
    int ns = m->arch->block_slots(c, slots);
    size_t j = (size_t)(l - m->pp.first[m->chunk]); // the block's place in its chunk
    for (int i = 0; i < ns; i++) {
        size_t copy = recomputed(&slots[i], m->recompute) ? 0 : j;
        fl_dtype dt = slots[i].f32 ? FL_F32 : m->dtype;
        act[i] = fl_at(dt, m->block_act[i], copy * slot_numel(c, &slots[i], BT));
    }
    return (fl_block){m,
                      l,
                      m->B,
                      m->T,
                      fl_at(m->dtype, m->resid, j * BTs * C),
                      fl_at(m->dtype, m->resid, (j + 1) * BTs * C),
                      act,
                      m->block_work};
}

// The head reads the last block's output: the chunk's output.
static fl_block head_at(fl_model *m) {
    return (fl_block){m,    m->config.n_layer, m->B,         m->T, fl_model_chunk_output(m),
                      NULL, m->head_act,       m->block_work};
}

static float loss(fl_model *m, const float *dloss);
static float sum_losses(fl_model *m, const float *dloss);
static void set_dlosses(fl_model *m, float dloss);

// The head over positions [r0, r0 + n) of the batch, as a batch of n: its
// input and slots from position r0 on (no sequence parallelism: chunks are
// refused with tensor parallelism).
static fl_block head_rows_at(fl_model *m, size_t r0, int n, void **act) {
    fl_slot slots[FL_MAX_SLOTS];
    int ns = m->arch->head_slots(&m->config, slots);
    size_t D = fl_dtype_size(m->dtype);
    for (int i = 0; i < ns; i++)
        act[i] =
            (char *)m->head_act[i] + r0 * slots[i].per_token * (slots[i].f32 ? sizeof(float) : D);
    const char *in = fl_model_chunk_output(m);
    return (fl_block){m,   m->config.n_layer, n, 1, in + r0 * (size_t)m->config.n_embd * D, NULL,
                      act, m->block_work};
}

// The LM head and the loss over chunks of config.logits_chunk positions,
// one chunk's logits at a time (as Liger's fused linear cross-entropy):
// with dloss each chunk's gradient is written in place and taken through
// the head's backward at once, its input's gradient left in m->dres and the
// head's weight gradients added chunk by chunk (bound by the head's
// backward pre_unit here; the backward pass reports them, grad_ready, so
// every strategy sees the units in their order); with targets alone, the
// losses; without targets, the last chunk's logits (sampling reads the last
// position's).
static void head_chunks(fl_model *m, int with_targets, const float *dloss) {
    const fl_model_config *c = &m->config;
    int L = c->n_layer, V = c->vocab_size, Vp = c->padded_vocab_size;
    size_t BT = (size_t)m->B * m->T, rows = logits_rows(c, BT), D = fl_dtype_size(m->dtype);
    void *act[FL_MAX_SLOTS];
    if (!with_targets) {
        m->logits_first = BT - rows;
        fl_block h = head_rows_at(m, m->logits_first, (int)rows, act);
        m->arch->head_forward(&h, m->logits);
        return;
    }
    if (dloss) {
        set_dlosses(m, *dloss);
        pre_unit(m, FL_UNIT_HEAD(L), FL_PASS_BWD);
    }
    for (size_t r0 = 0; r0 < BT; r0 += rows) {
        int n = (int)(BT - r0 < rows ? BT - r0 : rows);
        fl_block h = head_rows_at(m, r0, n, act);
        m->arch->head_forward(&h, m->logits);
        if (!dloss) {
            FL_FWD_IO(FL_OP_XENT, fl_io((size_t)n * Vp, m->dtype, 1),
                      m->dev->softmax_xent_forward(m->dtype, m->losses + r0, m->xent_lse + r0,
                                                   m->logits, m->targets + r0, n, V, Vp));
            continue;
        }
        FL_FWD_IO(FL_OP_XENT, fl_io((size_t)n * Vp, m->dtype, 2),
                  m->dev->softmax_xent_forward_backward(m->dtype, m->losses + r0, m->xent_lse + r0,
                                                        m->logits, m->targets + r0, m->dlosses + r0,
                                                        n, V, Vp));
        m->arch->head_backward(&h, (char *)m->dres + r0 * (size_t)c->n_embd * D, m->logits);
    }
    if (dloss) m->dlogits_ready = 1, m->dlogits_dloss = *dloss;
}

// The head's forward after its pre_unit and, with targets, the mean loss
// (or the training step's sum into its sink), in chunks under logits_chunk
static float head_loss(fl_model *m, int with_targets, const float *dloss) {
    size_t BT = (size_t)m->B * m->T;
    if (logits_rows(&m->config, BT) < BT) {
        head_chunks(m, with_targets, dloss);
        return with_targets ? sum_losses(m, dloss) : m->loss;
    }
    fl_block head = head_at(m);
    m->arch->head_forward(&head, m->logits);
    return with_targets ? loss(m, dloss) : m->loss;
}

// Sequence parallelism: a unit's norm weights (FL_PARAM_TOKENWISE) take
// their gradient for this rank's positions in scratch while the unit runs
// backward; the scratch is then summed over the TP group and added, so every
// micro-batch adds each position's share once, whatever the strategy binds
// the gradients to (Megatron sums them once per step, after the data-parallel
// reduction, which ZeRO-2's per-micro-batch reduction would have passed).
enum { TOKENWISE_MAX = 32 };
typedef struct {
    void *grads[TOKENWISE_MAX]; // the rows' own gradients, or NULL
    size_t numel;               // of the scratch used
} tokenwise;

static void tokenwise_begin(fl_model *m, int unit, tokenwise *tw) {
    tw->numel = 0;
    if (!fl_seq_parallel(&m->config)) return;
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    FL_ASSERT(count <= TOKENWISE_MAX);
    size_t D = fl_dtype_size(m->dtype);
    for (int i = 0; i < count; i++) {
        const fl_param_view *v = &m->table.views[first + i];
        tw->grads[i] = v->flags & FL_PARAM_TOKENWISE ? m->gp[first + i] : NULL;
        if (!tw->grads[i]) continue;
        m->gp[first + i] = fl_at(m->dtype, m->tp_norm_grads, tw->numel);
        m->dev->zero(m->dev, m->gp[first + i], v->numel * D);
        tw->numel += v->numel;
    }
}

static void tokenwise_end(fl_model *m, int unit, const tokenwise *tw) {
    if (!tw->numel) return;
    fl_tp_all_reduce(m, m->tp_norm_grads, tw->numel, FL_BWD);
    int first, count;
    fl_model_unit_rows(m, unit, &first, &count);
    for (int i = 0; i < count; i++) {
        if (!tw->grads[i]) continue;
        size_t n = m->table.views[first + i].numel;
        m->dev->residual_forward(m->dtype, tw->grads[i], tw->grads[i], m->gp[first + i], n);
        m->gp[first + i] = tw->grads[i];
    }
}

// In a step the host's tokens outlive it: the device may keep reading the
// inputs' (ids_known: the embedding backward's); otherwise it forgets them.
static void upload_tokens(fl_model *m, int *dst, const int *tokens, size_t n) {
    const fl_device *d = m->dev;
    if (m->async_tokens)
        d->copy_async(d, dst, tokens, n * sizeof(int), FL_COPY_H2D, NULL);
    else
        fl_dev_upload(d, dst, tokens, n * sizeof(int));
    if (d->ids_known && dst == m->inputs) d->ids_known(d, dst, m->async_tokens ? tokens : NULL, n);
}

// dloss: NULL, or the backward's, for the loss pass to write the logits'
// gradient too
static float forward(fl_model *m, const int *tokens, const int *targets, int B, int T,
                     const float *dloss) {
    const fl_model_config *c = &m->config;
    if (m->max_B == 0) fl_die("internal: fl_model_forward before fl_model_alloc_acts");
    if (B > m->max_B || T > m->max_T)
        fl_die("internal: batch %dx%d exceeds the allocated %dx%d", B, T, m->max_B, m->max_T);
    int L = c->n_layer, V = c->vocab_size;
    const fl_pp_stage *s = &m->pp;
    int embed = fl_pp_has_embed(s, m->chunk), head = fl_pp_has_head(s, m->chunk);
    size_t BT = (size_t)B * T;
    if (fl_seq_parallel(c) && BT % (size_t)c->tp_size)
        fl_die("sequence parallelism: a batch of %d x %d positions does not split over %d "
               "tensor-parallel ranks",
               B, T, c->tp_size);
    for (size_t i = 0; i < BT; i++) {
        if (embed && (tokens[i] < 0 || tokens[i] >= V))
            fl_die("token id %d at position %zu is outside the vocabulary [0, %d)", tokens[i], i,
                   V);
        if (head && targets && (targets[i] < -1 || targets[i] >= V))
            fl_die("target id %d at position %zu is outside the vocabulary [0, %d)", targets[i], i,
                   V);
    }
    // attention takes one workspace slice per thread
    if (fl_threads() > m->att_workspace_threads)
        fl_die("internal: %d threads, but activations were allocated for %d", fl_threads(),
               m->att_workspace_threads);
    m->B = B;
    m->T = T;
    m->loss = -1.0f;
    m->n_targets = 0;
    m->dlogits_ready = 0;
    m->logits_first = 0;

    // the tokens go up first, before the device has work to wait behind
    if (embed) upload_tokens(m, m->inputs, tokens, BT);
    if (head && targets) {
        upload_tokens(m, m->targets, targets, BT);
        for (size_t i = 0; i < BT; i++) m->n_targets += targets[i] != -1; // counted on the host
    }
    if (embed) { // else the chunk's input was received into fl_model_chunk_input
        pre_unit(m, FL_UNIT_EMBED, FL_PASS_FWD);
        m->arch->embed_forward(m, m->resid, m->inputs, B, T);
    }
    void *act[FL_MAX_SLOTS];
    for (int l = s->first[m->chunk]; l < s->first[m->chunk] + s->count[m->chunk]; l++) {
        pre_unit(m, l, FL_PASS_FWD);
        fl_block b = block_at(m, l, act);
        m->arch->block_forward(&b, 0);
    }
    if (!head) return m->loss; // the output goes to the next stage (fl_model_chunk_output)
    pre_unit(m, FL_UNIT_HEAD(L), FL_PASS_FWD);
    return head_loss(m, targets != NULL, dloss);
}

float fl_model_forward(fl_model *m, const int *tokens, const int *targets, int B, int T) {
    return forward(m, tokens, targets, B, T, NULL);
}

float fl_model_forward_train(fl_model *m, const int *tokens, const int *targets, int B, int T,
                             float dloss) {
    if (!targets) fl_die("internal: fl_model_forward_train needs targets");
    return forward(m, tokens, targets, B, T, &dloss);
}

// every target token's loss weighs dloss in the softmax's backward
static void set_dlosses(fl_model *m, float dloss) {
    m->dev->fill(m->dlosses, dloss, (size_t)m->B * m->T);
}

// The mean loss of the logits against m->targets, kept for the backward;
// with dloss, the logits become their gradient for it.
static float loss(fl_model *m, const float *dloss) {
    const fl_model_config *c = &m->config;
    size_t BT = (size_t)m->B * m->T;
    const int *targets = m->targets;
    int V = c->vocab_size, Vp = c->padded_vocab_size;
    m->dlogits_ready = 0;
    if (m->tp.size > 1) {
        fl_vocab_xent(m, dloss);
        if (dloss) m->dlogits_ready = 1, m->dlogits_dloss = *dloss;
    } else if (dloss) {
        set_dlosses(m, *dloss);
        // the logits read, their gradient written in place
        FL_FWD_IO(FL_OP_XENT, fl_io(BT * Vp, m->dtype, 2),
                  m->dev->softmax_xent_forward_backward(m->dtype, m->losses, m->xent_lse, m->logits,
                                                        targets, m->dlosses, BT, V, Vp));
        m->dlogits_ready = 1, m->dlogits_dloss = *dloss;
    } else {
        FL_FWD_IO(FL_OP_XENT, fl_io(BT * Vp, m->dtype, 1),
                  m->dev->softmax_xent_forward(m->dtype, m->losses, m->xent_lse, m->logits, targets,
                                               BT, V, Vp));
    }
    return sum_losses(m, dloss);
}

// The batch's token losses summed in index order: deterministic; a
// position without a target has loss 0, which adds nothing (m->n_targets
// was counted from the host's targets). A training step's stays on the
// device (its gate takes the mean).
static float sum_losses(fl_model *m, const float *dloss) {
    size_t BT = (size_t)m->B * m->T;
    if (m->loss_sink && dloss) {
        m->dev->sum_to(m->loss_sink, m->losses, BT);
        m->loss = NAN;
        return m->loss;
    }
    double sum = m->dev->sum(m->losses, BT);
    m->loss = m->n_targets ? (float)(sum / m->n_targets) : 0.0f;
    return m->loss;
}

static float forward_head(fl_model *m, const float *dloss) {
    if (m->loss < 0.0f) fl_die("internal: fl_model_forward_head needs a forward with targets");
    pre_unit(m, FL_UNIT_HEAD(m->config.n_layer), FL_PASS_FWD);
    return head_loss(m, 1, dloss);
}

float fl_model_forward_head(fl_model *m) {
    return forward_head(m, NULL);
}

float fl_model_forward_head_train(fl_model *m, float dloss) {
    return forward_head(m, &dloss);
}

void fl_model_zero_grad(fl_model *m) {
    size_t D = fl_dtype_size(m->dtype);
    if (m->grads) m->dev->zero(m->dev, m->grads, m->table.numel * D);
    if (m->lora.grads) m->dev->zero(m->dev, m->lora.grads, m->lora.table.numel * D);
}

// The LM head's backward (the chunk's first part on the last stage): the
// loss's gradient into the logits, then the head.
static void head_backward(fl_model *m, float dloss) {
    const fl_model_config *c = &m->config;
    int L = c->n_layer, V = c->vocab_size, Vp = c->padded_vocab_size;
    size_t BT = (size_t)m->B * m->T;
    void *dlogits = m->logits;     // overwritten in place by its own gradient
    if (logits_rows(c, BT) < BT) { // in chunks: the forward took them through the head
        if (!m->dlogits_ready)     // (not a training forward's: its chunks again)
            head_chunks(m, 1, &dloss);
        else if (memcmp(&dloss, &m->dlogits_dloss, sizeof dloss))
            fl_die("internal: a backward with dloss %g after a training forward for %g", dloss,
                   m->dlogits_dloss);
        m->dlogits_ready = 0;
        grad_ready(m, FL_UNIT_HEAD(L));
        return;
    }
    if (!m->dlogits_ready && m->tp.size > 1) {
        fl_vocab_xent_backward(m, dloss);
    } else if (!m->dlogits_ready) {
        set_dlosses(m, dloss);
        FL_BWD_IO(FL_OP_XENT, fl_io(BT * Vp, m->dtype, 2),
                  m->dev->softmax_xent_backward(m->dtype, dlogits, m->logits, m->xent_lse,
                                                m->targets, m->dlosses, BT, V, Vp));
    } else if (memcmp(&dloss, &m->dlogits_dloss, sizeof dloss)) {
        fl_die("internal: a backward with dloss %g after a training forward for %g", dloss,
               m->dlogits_dloss);
    }
    m->dlogits_ready = 0; // the logits hold a gradient now either way
    pre_unit(m, FL_UNIT_HEAD(L), FL_PASS_BWD);
    fl_block head = head_at(m);
    tokenwise tw;
    tokenwise_begin(m, FL_UNIT_HEAD(L), &tw);
    m->arch->head_backward(&head, m->dres, dlogits);
    tokenwise_end(m, FL_UNIT_HEAD(L), &tw);
    grad_ready(m, FL_UNIT_HEAD(L));
}

// Pipeline stage 0 of a tied model: the LM head's weight gradient, from the
// last stage's output gradient and input (received into tied_dlogits and
// tied_x), added to the embedding's as one process adds it, before the
// embedding's own.
static void tied_head_grad(fl_model *m) {
    fl_linear lins[FL_MAX_SLOTS];
    int n = m->arch->linears(&m->config, lins);
    for (int i = 0; i < n; i++)
        if (lins[i].op == FL_OP_MM_LMHEAD)
            fl_linear_backward(m, FL_UNIT_EMBED, &lins[i], NULL, m->tied_dlogits, m->tied_x,
                               m->B * m->T);
}

void fl_model_backward(fl_model *m, float dloss) {
    const fl_pp_stage *s = &m->pp;
    int c = m->chunk, head = fl_pp_has_head(s, c);
    if (head && m->loss < 0.0f) fl_die("internal: fl_model_backward needs a forward with targets");
    if (head) head_backward(m, dloss); // else m->dres holds the next stage's gradient

    // dres holds the gradient of the residual stream, walking back through
    // the blocks.
    void *act[FL_MAX_SLOTS];
    tokenwise tw;
    for (int l = s->first[c] + s->count[c] - 1; l >= s->first[c]; l--) {
        pre_unit(m, l, FL_PASS_BWD);
        fl_block b = block_at(m, l, act);
        // recomputation is deterministic: the same values as the forward's
        if (m->recompute != FL_RECOMPUTE_NONE)
            m->arch->block_forward(&b, m->recompute == FL_RECOMPUTE_SELECTIVE);
        tokenwise_begin(m, l, &tw);
        m->arch->block_backward(&b, m->dres);
        tokenwise_end(m, l, &tw);
        grad_ready(m, l);
    }
    if (!fl_pp_has_embed(s, c)) return; // m->dres goes to the previous stage
    // the token embedding is complete only now when the LM head is tied to it
    pre_unit(m, FL_UNIT_EMBED, FL_PASS_BWD);
    if (m->tied_dlogits) tied_head_grad(m);
    m->arch->embed_backward(m, m->dres, m->inputs, m->B, m->T);
    grad_ready(m, FL_UNIT_EMBED);
}

int fl_model_weight_spans(const fl_model *m, const void *data[3], size_t bytes[3]) {
    size_t D = fl_dtype_size(m->dtype), dense = m->params_end - m->params_begin, store = 0;
    if (!m->params_end) dense = m->table.numel;
    if (m->quant.cfg.enabled) {
        size_t absmax;
        fl_quant_sizes(&m->table, &m->quant.cfg, &dense, &store, &absmax);
    }
    int n = 0;
    data[n] = m->params, bytes[n++] = dense * D;
    if (store) data[n] = m->quant.store, bytes[n++] = store;
    if (m->lora.cfg.r > 0) data[n] = m->lora.params, bytes[n++] = m->lora.table.numel * D;
    return n;
}

// ----------------------------------------------------------------------------
// host values in and out

enum { STAGE_BYTES = 65536 }; // a staging buffer on the stack (a device copy each)

void fl_model_upload_f32(const fl_model *m, void *dst, const float *w, size_t n) {
    fl_dtype dt = m->dtype;
    if (m->dev->host) {
        fl_store_f32(dt, dst, w, n);
        return;
    }
    _Alignas(64) unsigned char stage[STAGE_BYTES];
    size_t D = fl_dtype_size(dt), step = STAGE_BYTES / D;
    for (size_t i = 0; i < n; i += step) {
        size_t k = n - i < step ? n - i : step;
        fl_store_f32(dt, stage, w + i, k); // elementwise: the same bits as in place
        m->dev->copy_h2d(m->dev, fl_at(dt, dst, i), stage, k * D);
    }
}

void fl_model_download_f32(const fl_model *m, float *out, const void *src, size_t n) {
    fl_dtype dt = m->dtype;
    if (m->dev->host) {
        fl_convert(FL_F32, out, dt, src, n);
        return;
    }
    _Alignas(64) unsigned char stage[STAGE_BYTES];
    size_t D = fl_dtype_size(dt), step = STAGE_BYTES / D;
    for (size_t i = 0; i < n; i += step) {
        size_t k = n - i < step ? n - i : step;
        m->dev->copy_d2h(m->dev, stage, fl_at_const(dt, src, i), k * D);
        fl_convert(FL_F32, out + i, dt, stage, k);
    }
}
