// pipeline.c: the pipeline executor (pipeline.h). Each rank runs its list
// of forwards and backwards (src/parallel/schedule.c) on the chunks of its
// stage: a forward takes an activation set of its chunk, receives its input
// from the previous virtual stage unless it holds the embedding, and sends
// its output to the next unless it holds the head; a backward receives its
// output's gradient, runs, and sends its input's gradient back. Receives
// are waited for when their action starts; sends never are until their
// buffer is needed again (a forward's output lives in its set until the
// set's backward, by which time the next stage has taken it) or the step
// ends (the input gradients and the tied head's data have a buffer per
// micro-batch), so a list runs as the validator ran it.
#include "fitlm/pipeline.h"

#include <string.h>

#include "fitlm/dist.h"
#include "fitlm/profile.h"

// message kinds, for tags: a stream (kind, sending virtual stage) keeps
// its micro-batches in order
enum { MSG_ACT, MSG_GRAD, MSG_TIED_DOUT, MSG_TIED_INP, MSG_EVAL, MSG_WEIGHTS };
enum { NO_REQ = -1 };

struct fl_pipeline {
    fl_model *m;
    fl_optimizer *o;
    const fl_comm_group *g;
    int p, rank, v, n, m_micro, B, T, tied;
    fl_pp_action *acts;
    int n_acts;
    int *set_of;          // (v, m): the set micro-batch k's forward took on chunk c
    int *set_busy;        // (v, max_sets): per chunk, which sets are in use
    fl_comm_req *out_req; // (v, sets): the send of a set's output
    int max_sets;
    size_t act, logit; // elements of a chunk's input (B T C, this rank's positions) and logits
    void *grad_send;   // (v, m) of act: each micro-batch's input gradient
    fl_comm_req *grad_req;
    void *tied_send; // (m) of logit + act: the tied head's output gradient and input
    fl_comm_req *tied_req;
    struct fl_optim_pp opp;
};

static int tag(int kind, int vs) {
    return kind * FL_PP_MAX_VIRTUAL + vs;
}

void fl_pp_stage_of(fl_pp_stage *s, int kind, int p, int v, int m, int rank, const int *counts) {
    FL_ASSERT(p >= 1 && v >= 1 && v <= FL_PP_MAX_CHUNKS && rank >= 0 && rank < p);
    memset(s, 0, sizeof *s);
    s->size = p;
    s->rank = rank;
    s->chunks = v;
    for (int c = 0; c < v; c++) {
        int vs = c * p + rank;
        for (int i = 0; i < vs; i++) s->first[c] += counts[i];
        s->count[c] = counts[vs];
        s->sets[c] = p > 1 ? fl_pp_chunk_in_flight(kind, p, m, v, rank, c) : 1;
    }
}

static size_t dsize(const fl_model *m) {
    return fl_dtype_size(m->dtype);
}

// Elements of a chunk's input and of the logits for B x T.
static void sizes(const fl_model_config *c, int B, int T, size_t *act, size_t *logit) {
    size_t BT = (size_t)B * T;
    size_t local = c->tp_size > 1 && c->sequence_parallel ? BT / (size_t)c->tp_size : BT;
    *act = local * (size_t)c->n_embd;
    int t = c->tp_size > 1 ? c->tp_size : 1;
    *logit = BT * (t > 1 ? fl_params_vocab_rows((size_t)c->vocab_size, t)
                         : (size_t)c->padded_vocab_size);
}

static int tied_pipeline(const fl_model_config *c, const fl_pp_stage *s) {
    return c->tie_embeddings && s->size > 1;
}

// Bytes of the send buffers: each micro-batch's input gradient of every
// chunk but virtual stage 0, and (the last stage of a tied model) each
// micro-batch's head output gradient and input.
static void send_bytes(const fl_model_config *c, fl_dtype dt, const fl_pp_stage *s, int m_micro,
                       int B, int T, size_t *grads, size_t *tied) {
    size_t act, logit, D = fl_dtype_size(dt);
    sizes(c, B, T, &act, &logit);
    int senders = 0;
    for (int ch = 0; ch < s->chunks; ch++) senders += ch * s->size + s->rank > 0;
    *grads = (size_t)senders * m_micro * act * D;
    *tied = tied_pipeline(c, s) && s->rank == s->size - 1 ? (size_t)m_micro * (logit + act) * D : 0;
}

void fl_pipeline_memory(const fl_model_config *c, fl_dtype dt, const fl_pp_stage *s, int m_micro,
                        int B, int T, size_t bytes[FL_MEM_NTAGS]) {
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    if (s->size <= 1) return;
    size_t grads, tied;
    send_bytes(c, dt, s, m_micro, B, T, &grads, &tied);
    bytes[FL_MEM_COMM] = grads + tied;
    // fl_pipeline_attach's: the executor, its list and its per-(chunk,
    // micro-batch) and per-(chunk, set) records
    int max_sets = 0;
    for (int ch = 0; ch < s->chunks; ch++)
        if (s->sets[ch] > max_sets) max_sets = s->sets[ch];
    size_t vm = (size_t)s->chunks * m_micro, vs = (size_t)s->chunks * max_sets;
    bytes[FL_MEM_OTHER] = sizeof(fl_pipeline) + 2 * vm * sizeof(fl_pp_action) +
                          vm * (sizeof(int) + sizeof(fl_comm_req)) +
                          vs * (sizeof(int) + sizeof(fl_comm_req)) +
                          2 * (size_t)m_micro * sizeof(fl_comm_req);
}

// Stage 0's token embedding rows into the last stage's copy.
static void refresh_copy(fl_pipeline *pl) {
    fl_model *m = pl->m;
    if (!pl->tied) return;
    size_t bytes = m->table.views[0].numel * dsize(m);
    if (pl->rank == 0) {
        fl_comm_wait(fl_comm_isend(pl->g, pl->p - 1, m->wp[0], bytes, tag(MSG_WEIGHTS, 0)));
    } else if (pl->rank == pl->p - 1) {
        FL_ASSERT(m->table.views[0].flags & FL_PARAM_TIED_COPY);
        fl_comm_wait(fl_comm_irecv(pl->g, 0, m->wp[0], bytes, tag(MSG_WEIGHTS, 0)));
    }
}

fl_pipeline *fl_pipeline_attach(fl_model *m, fl_optimizer *o, const fl_comm_group *g, int kind,
                                int m_micro, int B, int T) {
    const fl_pp_stage *s = &m->pp;
    FL_ASSERT(s->size == fl_comm_group_size(g) && s->rank == fl_comm_group_rank(g));
    // the whole stage's gradients summed over the step, or (an optimizer
    // fused into the backward pass) one unit's at a time over one micro-batch
    FL_ASSERT(m->grads ? !m->unit_grads : m->unit_grads && m_micro == 1);
    fl_pipeline *pl = fl_alloc(FL_MEM_OTHER, sizeof *pl);
    memset(pl, 0, sizeof *pl);
    pl->m = m;
    pl->o = o;
    pl->g = g;
    pl->p = s->size;
    pl->rank = s->rank;
    pl->v = s->chunks;
    pl->n = s->size * s->chunks;
    pl->m_micro = m_micro;
    pl->B = B;
    pl->T = T;
    pl->tied = tied_pipeline(&m->config, s);
    pl->n_acts = 2 * m_micro * pl->v;
    pl->acts = fl_alloc(FL_MEM_OTHER, (size_t)pl->n_acts * sizeof *pl->acts);
    FL_ASSERT(fl_pp_schedule(kind, pl->p, m_micro, pl->v, pl->rank, pl->acts) == pl->n_acts);
    for (int c = 0; c < pl->v; c++)
        if (s->sets[c] > pl->max_sets) pl->max_sets = s->sets[c];
    size_t vm = (size_t)pl->v * m_micro, vs = (size_t)pl->v * pl->max_sets;
    pl->set_of = fl_alloc(FL_MEM_OTHER, vm * sizeof(int));
    pl->grad_req = fl_alloc(FL_MEM_OTHER, vm * sizeof(fl_comm_req));
    pl->set_busy = fl_alloc(FL_MEM_OTHER, vs * sizeof(int));
    pl->out_req = fl_alloc(FL_MEM_OTHER, vs * sizeof(fl_comm_req));
    pl->tied_req = fl_alloc(FL_MEM_OTHER, 2 * (size_t)m_micro * sizeof(fl_comm_req));
    for (size_t i = 0; i < vs; i++) pl->set_busy[i] = 0, pl->out_req[i] = NO_REQ;
    for (size_t i = 0; i < vm; i++) pl->grad_req[i] = NO_REQ;
    for (int i = 0; i < 2 * m_micro; i++) pl->tied_req[i] = NO_REQ;
    sizes(&m->config, B, T, &pl->act, &pl->logit);
    size_t grads, tied;
    send_bytes(&m->config, m->dtype, s, m_micro, B, T, &grads, &tied);
    if (grads) pl->grad_send = fl_alloc(FL_MEM_COMM, grads);
    if (tied) pl->tied_send = fl_alloc(FL_MEM_COMM, tied);
    size_t other[FL_MEM_NTAGS];
    fl_pipeline_memory(&m->config, m->dtype, s, m_micro, B, T, other);
    FL_ASSERT(other[FL_MEM_OTHER] == sizeof *pl + (size_t)pl->n_acts * sizeof *pl->acts +
                                         vm * (sizeof *pl->set_of + sizeof *pl->grad_req) +
                                         vs * (sizeof *pl->set_busy + sizeof *pl->out_req) +
                                         2 * (size_t)m_micro * sizeof *pl->tied_req);
    // the gradient norm and fp16's overflow over every stage, in the whole
    // table's order
    pl->opp = (struct fl_optim_pp){fl_tp_ops_group(g), fl_model_whole_table(m)->count,
                                   m->row_global, m->row_offset};
    o->pp = &pl->opp;
    refresh_copy(pl);
    return pl;
}

void fl_pipeline_free(fl_pipeline *pl) {
    if (!pl) return;
    fl_free(pl->acts);
    fl_free(pl->set_of);
    fl_free(pl->grad_req);
    fl_free(pl->set_busy);
    fl_free(pl->out_req);
    fl_free(pl->tied_req);
    fl_free(pl->grad_send);
    fl_free(pl->tied_send);
    fl_free(pl);
}

static void wait_req(fl_comm_req *r) {
    if (*r == NO_REQ) return;
    fl_comm_wait(*r);
    *r = NO_REQ;
}

// Lets finished sends go: their requests are few (a completed one is still
// waited on, which returns at once and frees its slot).
static void poll(fl_comm_req *r, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (r[i] != NO_REQ && fl_comm_test(r[i])) wait_req(&r[i]);
}

static void recv_wait(fl_pipeline *pl, int peer, void *buf, size_t n, int t) {
    FL_PROFILE(FL_OP_COMM, FL_STEP, 0.0,
               fl_comm_wait(fl_comm_irecv(pl->g, peer, buf, n * dsize(pl->m), t)));
}

// This rank's chunks that send an input gradient, in order: chunk c's index
// among them.
static int sender_index(const fl_pipeline *pl, int c) {
    int k = 0;
    for (int i = 0; i < c; i++) k += i * pl->p + pl->rank > 0;
    return k;
}

// Chunk c's gradient rows: its units' (the embedding on stage 0, the head
// on the last; never the tied copy), one range of the flat buffer.
static void chunk_range(const fl_model *m, int c, size_t *a, size_t *b) {
    const fl_pp_stage *s = &m->pp;
    int u0 = fl_pp_has_embed(s, c) ? FL_UNIT_EMBED : s->first[c];
    int u1 = fl_pp_has_head(s, c) ? FL_UNIT_HEAD(m->config.n_layer) : s->first[c] + s->count[c] - 1;
    int f0, n0, f1, n1;
    fl_model_unit_rows(m, u0, &f0, &n0);
    fl_model_unit_rows(m, u1, &f1, &n1);
    const fl_param_view *v = m->table.views;
    *a = v[f0].offset;
    *b = v[f1 + n1 - 1].offset + v[f1 + n1 - 1].numel;
}

static void forward_action(fl_pipeline *pl, const fl_pp_action *x, const int *inputs,
                           const int *targets, float dloss, double *loss_sum) {
    fl_model *m = pl->m;
    int c = x->chunk, k = x->micro, vs = c * pl->p + pl->rank;
    size_t BT = (size_t)pl->B * pl->T;
    int set = 0;
    while (pl->set_busy[c * pl->max_sets + set]) set++;
    FL_ASSERT(set < m->pp.sets[c]); // the validator's bound
    pl->set_busy[c * pl->max_sets + set] = 1;
    pl->set_of[c * pl->m_micro + k] = set;
    fl_comm_req *out = &pl->out_req[c * pl->max_sets + set];
    wait_req(out); // the set's last output: taken before its backward ran
    fl_model_use_set(m, c, set);
    if (vs > 0)
        recv_wait(pl, (vs - 1) % pl->p, fl_model_chunk_input(m), pl->act, tag(MSG_ACT, vs - 1));
    fl_model_forward_train(m, inputs + k * BT, targets + k * BT, pl->B, pl->T, dloss);
    if (vs == pl->n - 1) {
        if (loss_sum) *loss_sum += (double)m->loss * m->n_targets;
    } else {
        *out = fl_comm_isend(pl->g, (vs + 1) % pl->p, fl_model_chunk_output(m), pl->act * dsize(m),
                             tag(MSG_ACT, vs));
    }
}

static void backward_action(fl_pipeline *pl, const fl_pp_action *x, float dloss) {
    fl_model *m = pl->m;
    fl_optimizer *o = pl->o;
    int c = x->chunk, k = x->micro, vs = c * pl->p + pl->rank;
    size_t D = dsize(m);
    int set = pl->set_of[c * pl->m_micro + k];
    fl_model_use_set(m, c, set);
    if (vs < pl->n - 1) recv_wait(pl, (vs + 1) % pl->p, m->dres, pl->act, tag(MSG_GRAD, vs + 1));
    if (vs == 0 && pl->tied) {
        recv_wait(pl, pl->p - 1, m->tied_dlogits, pl->logit, tag(MSG_TIED_DOUT, 0));
        recv_wait(pl, pl->p - 1, m->tied_x, pl->act, tag(MSG_TIED_INP, 0));
    }
    // 16-bit gradients are one micro-batch's, summed in fp32: per chunk here
    size_t a = 0, b = 0;
    if (o->grad_accum) chunk_range(m, c, &a, &b);
    if (o->grad_accum) o->dev->zero(o->dev, fl_at(m->dtype, o->grads, a), (b - a) * D);
    fl_model_backward(m, dloss);
    if (o->grad_accum) fl_optimizer_accum_range(o, a, b);
    if (vs == pl->n - 1 && pl->tied) { // the head's output gradient and input, for stage 0
        char *at = (char *)pl->tied_send + (size_t)k * (pl->logit + pl->act) * D;
        fl_dev_download(m->dev, at, m->tied_dout, pl->logit * D);
        fl_dev_download(m->dev, at + pl->logit * D, m->tied_inp, pl->act * D);
        pl->tied_req[2 * k] = fl_comm_isend(pl->g, 0, at, pl->logit * D, tag(MSG_TIED_DOUT, 0));
        pl->tied_req[2 * k + 1] =
            fl_comm_isend(pl->g, 0, at + pl->logit * D, pl->act * D, tag(MSG_TIED_INP, 0));
    }
    if (vs > 0) {
        char *at =
            (char *)pl->grad_send + ((size_t)sender_index(pl, c) * pl->m_micro + k) * pl->act * D;
        fl_dev_download(m->dev, at, m->dres, pl->act * D);
        pl->grad_req[c * pl->m_micro + k] =
            fl_comm_isend(pl->g, (vs - 1) % pl->p, at, pl->act * D, tag(MSG_GRAD, vs));
    }
    pl->set_busy[c * pl->max_sets + set] = 0;
}

// The rank's actions of one kind (forwards or backwards) in list order, the
// finished sends let go as it goes.
static void run_actions(fl_pipeline *pl, int kind, const int *inputs, const int *targets,
                        float dloss, double *loss_sum) {
    for (int i = 0; i < pl->n_acts; i++) {
        const fl_pp_action *x = &pl->acts[i];
        if (kind >= 0 && x->kind != kind) continue;
        if (x->kind == FL_PP_FORWARD)
            forward_action(pl, x, inputs, targets, dloss, loss_sum);
        else
            backward_action(pl, x, dloss);
        poll(pl->grad_req, (size_t)pl->v * pl->m_micro);
        poll(pl->tied_req, 2 * (size_t)pl->m_micro);
    }
}

static void wait_sends(fl_pipeline *pl) {
    FL_PROFILE(FL_OP_COMM, FL_STEP, 0.0, {
        for (int i = 0; i < pl->v * pl->m_micro; i++) wait_req(&pl->grad_req[i]);
        for (int i = 0; i < 2 * pl->m_micro; i++) wait_req(&pl->tied_req[i]);
        for (int i = 0; i < pl->v * pl->max_sets; i++) wait_req(&pl->out_req[i]);
    });
}

// An optimizer fused into the backward pass (LOMO, AdaLomo) over the stages:
// one micro-batch, its forwards, then its backwards, each stage updating its
// units as their gradients complete (step.c's fused step over these passes).
static void fused_forward(void *ctx, const int *inputs, const int *targets, int B, int T,
                          float dloss, int head_only) {
    fl_pipeline *pl = ctx;
    fl_model *m = pl->m;
    (void)B, (void)T;
    double r[2] = {0.0, 0.0}; // the loss and its targets, the last stage's
    if (!head_only) {
        double sum = 0.0;
        run_actions(pl, FL_PP_FORWARD, inputs, targets, dloss, &sum);
    } else if (pl->rank == pl->p - 1) { // the kept activations serve: the head again
        fl_model_use_set(m, pl->v - 1, pl->set_of[(pl->v - 1) * pl->m_micro]);
        fl_model_forward_head_train(m, dloss);
    }
    if (pl->rank == pl->p - 1) r[0] = m->loss, r[1] = m->n_targets;
    fl_comm_bcast(pl->g, r, sizeof r, pl->p - 1);
    if (pl->rank != pl->p - 1) m->loss = (float)r[0], m->n_targets = (int)r[1];
}

static void fused_backward(void *ctx, float dloss) {
    fl_pipeline *pl = ctx;
    run_actions(pl, FL_PP_BACKWARD, NULL, NULL, dloss, NULL);
    wait_sends(pl);
}

fl_train_result fl_pipeline_step(fl_pipeline *pl, const int *inputs, const int *targets, float lr) {
    fl_optimizer *o = pl->o;
    if (pl->m->unit_grads) { // the sets of the forward stay taken until the backward
        fl_step_passes passes = {pl, fused_forward, fused_backward};
        fl_train_result r =
            fl_fused_step_passes(pl->m, o, &passes, inputs, targets, pl->B, pl->T, lr);
        refresh_copy(pl);
        return r;
    }
    size_t BT = (size_t)pl->B * pl->T;
    long total = fl_batch_targets(o, targets, (size_t)pl->m_micro * BT); // over data parallelism
    float dloss = total ? fl_optimizer_scale(o) / (float)total : 0.0f;
    FL_ASSERT(o->micro == 0);
    size_t cleared = 0; // bytes, for the profile
    FL_PROFILE_IO(FL_OP_ZERO_GRAD, FL_STEP, 0.0, cleared, cleared = fl_optimizer_zero_grad(o));
    double loss_sum = 0.0;
    run_actions(pl, -1, inputs, targets, dloss, &loss_sum);
    wait_sends(pl);
    o->micro = pl->m_micro; // every micro-batch's gradient is in
    // the loss is the last stage's, summed over the data-parallel ranks
    fl_comm_bcast(pl->g, &loss_sum, sizeof loss_sum, pl->p - 1);
    if (o->sync) o->sync->sum(o->sync->ctx, &loss_sum, 1);
    float loss = total ? (float)(loss_sum / total) : 0.0f;
    fl_step_result s;
    FL_PROFILE(FL_OP_OPTIMIZER, FL_STEP, 0.0, s = fl_optimizer_step_loss(o, lr, loss));
    refresh_copy(pl);
    return (fl_train_result){loss,         total,   s.grad_norm,     s.skipped,
                             s.loss_scale, s.spike, o->spike.in_row, o->spike.skipped};
}

// A forward of B x T through the stages, one after the other (the last
// stage's chunk 0 set 0 then holds the logits and the loss).
static void forward_through(fl_pipeline *pl, const int *tokens, const int *targets, int B, int T) {
    fl_model *m = pl->m;
    size_t act, logit;
    sizes(&m->config, B, T, &act, &logit);
    for (int c = 0; c < pl->v; c++) {
        int vs = c * pl->p + pl->rank;
        fl_model_use_set(m, c, 0);
        if (vs > 0)
            recv_wait(pl, (vs - 1) % pl->p, fl_model_chunk_input(m), act, tag(MSG_EVAL, vs - 1));
        fl_model_forward(m, tokens, targets, B, T);
        if (vs < pl->n - 1)
            fl_comm_wait(fl_comm_isend(pl->g, (vs + 1) % pl->p, fl_model_chunk_output(m),
                                       act * dsize(m), tag(MSG_EVAL, vs)));
    }
}

float fl_pipeline_forward(fl_pipeline *pl, const int *tokens, const int *targets, int *n_targets) {
    double r[2] = {0.0, 0.0}; // loss, targets
    forward_through(pl, tokens, targets, pl->B, pl->T);
    if (pl->rank == pl->p - 1) r[0] = pl->m->loss, r[1] = pl->m->n_targets;
    fl_comm_bcast(pl->g, r, sizeof r, pl->p - 1);
    *n_targets = (int)r[1];
    return (float)r[0];
}

// Generation's forward: the last stage's logits, sent to every stage.
static const float *pipeline_next(void *ctx, const int *context, int T, int last, float *row,
                                  float *mine) {
    fl_pipeline *pl = ctx;
    fl_model *m = pl->m;
    forward_through(pl, context, NULL, 1, T);
    int V = m->config.vocab_size;
    if (pl->rank == pl->p - 1) {
        const float *x = fl_model_last_logits(m, last, row, mine);
        if (x != row) memcpy(row, x, (size_t)V * sizeof(float));
    }
    fl_comm_bcast(pl->g, row, (size_t)V * sizeof(float), pl->p - 1);
    return row;
}

void fl_pipeline_generate(fl_pipeline *pl, int *tokens, int n_prompt, int n_new, float temperature,
                          int top_k, fl_rng *rng, void (*on_token)(int token, void *ctx),
                          void *ctx) {
    fl_model_generate_with(pl->m, pipeline_next, pl, tokens, n_prompt, n_new, temperature, top_k,
                           rng, on_token, ctx);
}
