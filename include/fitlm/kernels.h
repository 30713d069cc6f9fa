// kernels.h: the transformer's ops, one family per file in src/kernels/.
//
// Contract shared by every kernel:
// - Pointers come destination first; shapes are given by the trailing ints.
//   Shape letters: B batch, T time, C channels, NH heads, HS head size,
//   V vocabulary, Vp padded vocabulary, N = B*T rows, OC output channels,
//   NKV key/value heads, IC the MLP's intermediate size (not I: <complex.h>,
//   which cblas.h includes, defines I as a macro).
// - Kernels own no memory; workspace they need is passed in.
// - Backward functions ACCUMULATE (+=) into every gradient they write, so a
//   gradient that receives contributions from several places (a residual
//   stream, a tied embedding) is simply summed; callers zero grads first.
//   Exceptions, marked where declared: softmax_xent_backward and
//   xent_shard_backward overwrite, and rope_forward/rope_backward,
//   position_forward and bias_forward work in place.
// - Forward functions overwrite their outputs.
// - Each fast kernel has a plain, single-threaded twin with the suffix _ref:
//   the test oracle and the portable fallback. Fast and _ref versions agree
//   to float rounding.
// - Multi-threaded with OpenMP; deterministic: the same inputs and thread
//   count give bitwise identical outputs (no atomics, fixed reduction order).
// - Precision: the first argument `dt` is the storage dtype (fp32, bf16 or
//   fp16) of every activation, weight and weight-gradient pointer (void *);
//   float * arguments (norm statistics, log-sum-exps, losses, the RoPE table)
//   are always fp32. Every kernel computes in fp32: it loads rows into fp32,
//   computes, and rounds once to nearest even on store (backward: dst =
//   round(dst + sum), the sum formed in fp32). The _ref twins are fp32 only:
//   the tests run a kernel in bf16/fp16 against its _ref on the same
//   (rounded) inputs.
#ifndef FITLM_KERNELS_H
#define FITLM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/dtype.h"

// ----------------------------------------------------------------------------
// embedding: out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]; wpe (and dwpe) may be
// NULL: no position embedding (LLaMA). A NULL weight gradient (dwte, dwpe;
// the norms' dweight, dbias) is a frozen weight: not computed.

void encoder_forward(fl_dtype dt, void *out, const int *inp, const void *wte, const void *wpe,
                     int B, int T, int C);
// dwte (Vp,C) and dwpe (maxT,C) accumulate; dout (B,T,C)
void encoder_backward(fl_dtype dt, void *dwte, void *dwpe, const void *dout, const int *inp, int B,
                      int T, int C);
void encoder_forward_ref(float *out, const int *inp, const float *wte, const float *wpe, int B,
                         int T, int C);
void encoder_backward_ref(float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T,
                          int C);

// Tensor parallelism's pieces of the same (Megatron's VocabParallelEmbedding).
// embedding_shard_forward: this rank holds rows [first, first + rows) of
// wte, as wte (rows,C); out (N,C) = wte[inp - first] for ids in the range
// and 0 for the others (another rank's rows: the all-reduce over the TP
// group sums them). position_forward then adds the position embeddings in
// place, out[b,t,:] += wpe[t,:] (GPT-2 adds them after that all-reduce).
// The sum over the shards plus position_forward is encoder_forward's result
// bit for bit, and embedding_shard_backward over the shards (dwte (rows,C),
// the rows of the ids in the range accumulate) with position_backward (dwpe
// (maxT,C) accumulates dout summed over b) are encoder_backward's.

void embedding_shard_forward(fl_dtype dt, void *out, const int *inp, const void *wte, int first,
                             int rows, int N, int C);
void embedding_shard_backward(fl_dtype dt, void *dwte, const void *dout, const int *inp, int first,
                              int rows, int N, int C);
void position_forward(fl_dtype dt, void *out, const void *wpe, int B, int T, int C);
void position_backward(fl_dtype dt, void *dwpe, const void *dout, int B, int T, int C);
void embedding_shard_forward_ref(float *out, const int *inp, const float *wte, int first, int rows,
                                 int N, int C);
void embedding_shard_backward_ref(float *dwte, const float *dout, const int *inp, int first,
                                  int rows, int N, int C);
void position_forward_ref(float *out, const float *wpe, int B, int T, int C);
void position_backward_ref(float *dwpe, const float *dout, int B, int T, int C);

// ----------------------------------------------------------------------------
// layernorm over the last dim C of N rows, eps = 1e-5 (GPT-2's).
// mean and rstd (N) are saved for the backward pass.

void layernorm_forward(fl_dtype dt, void *out, float *mean, float *rstd, const void *inp,
                       const void *weight, const void *bias, int N, int C);
void layernorm_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                        const void *inp, const void *weight, const float *mean, const float *rstd,
                        int N, int C);
// res (N,C) = res + skip, rounded, then layernorm_forward of res: the
// residual add fused with the norm after it (llm.c's fused residual
// forward; a device reads and writes the rows once); on the cpu the two
// kernels in turn, the same bits either way.
void residual_layernorm_forward(fl_dtype dt, void *res, void *out, float *mean, float *rstd,
                                const void *skip, const void *weight, const void *bias, int N,
                                int C);
void layernorm_forward_ref(float *out, float *mean, float *rstd, const float *inp,
                           const float *weight, const float *bias, int N, int C);
void layernorm_backward_ref(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, const float *mean,
                            const float *rstd, int N, int C);

// ----------------------------------------------------------------------------
// matmul with bias: out (N,OC) = inp (N,C) @ weight^T + bias, weight (OC,C)
// as in PyTorch's nn.Linear; bias may be NULL. bf16 where the CPU has
// AVX512_BF16 or AMX: oneDNN's bf16 GEMM (fp32 accumulation). Otherwise,
// with AVX2 or AVX-512: fitlm's GEMM (src/kernels/gemm.c) for fp32, bf16
// and fp16, converting 16-bit operands to fp32 as it packs them. Without
// AVX2: OpenBLAS's sgemm, on fp32 copies of 16-bit operands.
//
// workspace: matmul_workspace_bytes(dt, N, C, OC) bytes (0 for fp32 without
// AVX2, when workspace may be NULL); it also reserves the GEMM library's
// scratchpad, so every byte is counted by the tagged allocator.

size_t matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC);
// The GEMM that runs for dt on this CPU: "onednn", "fitlm", "openblas" or
// "openblas-converted" (16-bit operands converted to fp32 first).
const char *matmul_gemm_name(fl_dtype dt);
// 1 when dt's GEMMs run on native bf16 arithmetic (oneDNN on AMX, or on
// AVX512_BF16 where its dot product outruns fp32 FMAs), else 0: fp32 FMAs.
int matmul_native_bf16(fl_dtype dt);
void matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight, const void *bias,
                    void *workspace, int N, int C, int OC);
// dinp (N,C), dweight (OC,C), dbias (OC) accumulate; any of them may be NULL
// (e.g. the first layer's input needs no gradient).
void matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                     const void *inp, const void *weight, void *workspace, int N, int C, int OC);
void matmul_forward_ref(float *out, const float *inp, const float *weight, const float *bias, int N,
                        int C, int OC);
void matmul_backward_ref(float *dinp, float *dweight, float *dbias, const float *dout,
                         const float *inp, const float *weight, int N, int C, int OC);

// ----------------------------------------------------------------------------
// causal multi-head self-attention, flash style: no (T,T) matrix is kept
// between forward and backward, only the row log-sum-exp of the scores.
// Grouped-query attention (GQA): NH query heads share NKV key/value heads
// (NKV divides NH; query head h uses kv head h / (NH/NKV)); NKV == NH is
// ordinary multi-head attention (GPT-2), NKV == 1 multi-query attention.
//
// qkv (B,T,(NH+2*NKV)*HS): per position [q | k | v], the NH query heads of
// HS values (head h at columns h*HS), then the NKV key heads, then the NKV
// value heads. out (B,T,NH*HS) = softmax(q k^T / sqrt(HS), causal) v, heads
// concatenated. lse (B,NH,T) is saved for the backward pass.
// workspace: attention_workspace_floats(dt, T, HS, NH/NKV) floats per thread,
// times fl_threads() threads (the forward parallelises over (b, query head),
// the backward over (b, kv head): B*NKV work items); bf16 and fp16 need room
// for fp32 copies of a head's q, k, v (and their gradients). The size does
// not depend on the group today; pass NH/NKV all the same.

size_t attention_workspace_floats(fl_dtype dt, int T, int HS, int group);
void attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv, float *workspace, int B,
                       int T, int NH, int NKV, int HS);
// dqkv (B,T,(NH+2*NKV)*HS) accumulates; out and lse are the forward's
// results. The query heads of a group add into their kv head's dk and dv in
// a fixed order (deterministic).
void attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                        const float *lse, float *workspace, int B, int T, int NH, int NKV, int HS);
void attention_forward_ref(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                           int HS);
void attention_backward_ref(float *dqkv, const float *dout, const float *qkv, const float *out,
                            const float *lse, int B, int T, int NH, int NKV, int HS);

// ----------------------------------------------------------------------------
// RMSNorm over the last dim C of N rows, as Hugging Face's LlamaRMSNorm:
// y = x * rsqrt(mean(x^2) + eps) * weight, all in fp32 (HF rounds x * rsqrt
// to the activation dtype before the weight; here the product is rounded
// once). rstd (N) = rsqrt(mean(x^2) + eps) is saved for the backward pass.

void rmsnorm_forward(fl_dtype dt, void *out, float *rstd, const void *inp, const void *weight,
                     int N, int C, float eps);
// dinp (N,C) and dweight (C; NULL: frozen) accumulate; dweight sums the rows in a fixed
// order per block of channels (deterministic)
void rmsnorm_backward(fl_dtype dt, void *dinp, void *dweight, const void *dout, const void *inp,
                      const void *weight, const float *rstd, int N, int C);
// res = res + skip, rounded, then rmsnorm_forward of res (as residual_layernorm_forward)
void residual_rmsnorm_forward(fl_dtype dt, void *res, void *out, float *rstd, const void *skip,
                              const void *weight, int N, int C, float eps);
void rmsnorm_forward_ref(float *out, float *rstd, const float *inp, const float *weight, int N,
                         int C, float eps);
void rmsnorm_backward_ref(float *dinp, float *dweight, const float *dout, const float *inp,
                          const float *weight, const float *rstd, int N, int C);

// ----------------------------------------------------------------------------
// rotary position embedding (RoPE), Hugging Face's rotate-half convention,
// on the q and k heads of a fused qkv buffer laid out as for attention:
// (B,T,(NH+2*NKV)*HS), the NH query heads and NKV key heads rotated, the
// value heads untouched. HS must be even; with h = HS/2, for i < h, at
// position t (0..T-1 within each sequence):
//   out[i]   = x[i]   cos[t,i] - x[i+h] sin[t,i]
//   out[i+h] = x[i+h] cos[t,i] + x[i]   sin[t,i]
// angle[t,i] = t * inv_freq[i], inv_freq[i] = 1 / theta^(2i/HS), computed in
// float32 exactly as HF's LlamaRotaryEmbedding does (cos and sin of the
// float32 angle, correctly rounded). HF rounds the table to the activation
// dtype; here it stays fp32 and each output is rounded once.
//
// rope_table fills cos_sin (T, HS/2, 2) = {cos, sin}; the model keeps it
// (built for the longest T; forward and backward read its first T rows).
// rope_forward and rope_backward work IN PLACE (an exception to the
// accumulate rule, like softmax_xent_backward's overwrite): the forward
// rotates q and k; the backward replaces the q and k parts of dqkv, the
// gradient with respect to the rotated values, by the gradient with respect
// to the unrotated ones (the transpose rotation); the v part is untouched.

void rope_table(float *cos_sin, int T, int HS, float theta);
void rope_forward(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                  int HS);
void rope_backward(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T, int NH, int NKV,
                   int HS);
void rope_forward_ref(float *qkv, const float *cos_sin, int B, int T, int NH, int NKV, int HS);
void rope_backward_ref(float *dqkv, const float *cos_sin, int B, int T, int NH, int NKV, int HS);

// ----------------------------------------------------------------------------
// SwiGLU, LLaMA's MLP gate: inp (N,2*IC), each row [gate (IC) | up (IC)] (the
// gate_proj and up_proj outputs of one fused GEMM); out (N,IC) =
// silu(gate) * up, silu(x) = x * sigmoid(x).

void swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC);
// dinp (N,2*IC) accumulates, both halves
void swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N, int IC);
void swiglu_forward_ref(float *out, const float *inp, int N, int IC);
void swiglu_backward_ref(float *dinp, const float *inp, const float *dout, int N, int IC);

// ----------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2's "gelu_new"), elementwise over N values

void gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N);
void gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N);
void gelu_forward_ref(float *out, const float *inp, size_t N);
void gelu_backward_ref(float *dinp, const float *inp, const float *dout, size_t N);

// ----------------------------------------------------------------------------
// residual add: out = a + b, elementwise over N values

void residual_forward(fl_dtype dt, void *out, const void *a, const void *b, size_t N);
void residual_backward(fl_dtype dt, void *da, void *db, const void *dout, size_t N);
void residual_forward_ref(float *out, const float *a, const float *b, size_t N);
void residual_backward_ref(float *da, float *db, const float *dout, size_t N);

// A row-parallel linear's bias (tensor parallelism), added once after the
// all-reduce of the partial products: out (N,OC) += bias (OC) per row, in
// place. Its gradient is matmul_backward's dbias.
void bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC);
void bias_forward_ref(float *out, const float *bias, int N, int OC);

// ----------------------------------------------------------------------------
// fused softmax + cross-entropy over the first V of Vp logits per row
// (columns V..Vp-1 are vocabulary padding and never take part).
//
// forward: losses[i] = lse_i - logits[i, targets[i]], lse (N) saved.
// A target of -1 marks a position without loss: its loss and gradient are 0.
// backward: dlogits[i,j] = dlosses[i] * (softmax_ij - [j == target_i]) for
// j < V, and 0 for the padding. It OVERWRITES dlogits (it is the first
// gradient of the backward pass), and dlogits may alias logits, so the
// (N,Vp) logits buffer is reused for its own gradient.

void softmax_xent_forward(fl_dtype dt, float *losses, float *lse, const void *logits,
                          const int *targets, int N, int V, int Vp);
void softmax_xent_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                           const int *targets, const float *dlosses, int N, int V, int Vp);
// Both in one pass over the rows, for a training step whose dlosses are
// known before the forward (llm.c's fused classifier): losses and lse as
// the forward's, then the logits OVERWRITTEN by their gradient as the
// backward's with dlogits = logits, the same bits as the two calls. Each
// row is read from memory once instead of twice.
void softmax_xent_forward_backward(fl_dtype dt, float *losses, float *lse, void *logits,
                                   const int *targets, const float *dlosses, int N, int V, int Vp);
void softmax_xent_forward_ref(float *losses, float *lse, const float *logits, const int *targets,
                              int N, int V, int Vp);
void softmax_xent_backward_ref(float *dlogits, const float *logits, const float *lse,
                               const int *targets, const float *dlosses, int N, int V, int Vp);

// Vocabulary-parallel cross-entropy (Megatron's cross_entropy.py), the logits
// never gathered: this rank's logits (N,Vp) hold its V columns of the
// vocabulary (the rest is padding and never takes part; V may be 0).
// targets are LOCAL column ids: -1 when the target is not in this shard or
// the position has no loss. The model combines the ranks' results over the
// TP group: the global max = max of mx; S = sum of sums[2i]; the target
// logit = sum of sums[2i+1]; lse = max + log S; loss = lse - target logit.
// xent_shard_max: mx[i] = max over j < V of logits[i,j] (-INFINITY when V
// is 0).
// xent_shard_sums: sums (N,2), sums[2i] = sum over j < V of exp(logits[i,j] -
// mx[i]) (mx the global max; summed in double, stored in fp32), sums[2i+1] =
// logits[i, targets[i]] when targets[i] >= 0, else 0.
// xent_shard_backward: dlogits[i,j] = dlosses[i] * (exp(logits[i,j] - lse[i])
// - [j == targets[i]]) for j < V, 0 for the padding; lse is the global one.
// A row whose position has no loss has dlosses[i] == 0 (all zero). It
// OVERWRITES dlogits, which may alias logits, as softmax_xent_backward.

void xent_shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp);
void xent_shard_sums(fl_dtype dt, float *sums, const void *logits, const float *mx,
                     const int *targets, int N, int V, int Vp);
void xent_shard_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                         const int *targets, const float *dlosses, int N, int V, int Vp);
void xent_shard_max_ref(float *mx, const float *logits, int N, int V, int Vp);
void xent_shard_sums_ref(float *sums, const float *logits, const float *mx, const int *targets,
                         int N, int V, int Vp);
void xent_shard_backward_ref(float *dlogits, const float *logits, const float *lse,
                             const int *targets, const float *dlosses, int N, int V, int Vp);

// ----------------------------------------------------------------------------
// LoRA's pieces around its two GEMMs (the linear unit, src/model/lora.c):
// columns [0, cols) of a wider row-major matrix (row stride ld) and dropout.
//
// lora_add_columns: out[n, 0:cols] += scale * x[n, :] (x is (N, cols)),
// rounded once; lora_gather_columns: x[n, :] = scale * src[n, 0:cols].
// dropout_apply: out = inp * mask / (1 - p), element i dropped when the top
// 24 bits of fl_sr_bits(key, i), as a fraction of 2^24, fall below p: the
// same key gives the same mask, so the backward applies it to the gradient
// (out may alias inp).

void lora_add_columns(fl_dtype dt, void *out, int ld, const void *x, float scale, int N, int cols);
void lora_gather_columns(fl_dtype dt, void *x, const void *src, int ld, float scale, int N,
                         int cols);
void dropout_apply(fl_dtype dt, void *out, const void *inp, size_t n, float p, uint64_t key);
void lora_add_columns_ref(float *out, int ld, const float *x, float scale, int N, int cols);
void dropout_apply_ref(float *out, const float *inp, size_t n, float p, uint64_t key);

// ----------------------------------------------------------------------------
// NF4 (bitsandbytes' 4-bit NormalFloat, QLoRA) and its double quantisation
// (src/kernels/nf4.c; scripts/make_nf4_reference.py is its numpy twin).
//
// nf4_quantize: w (n fp32) in blocks of `block` values; absmax[b] = max |w|
// of block b; code = the number of NF4 midpoints strictly below
// w * (1 / absmax) computed in fp32 (a value exactly on a midpoint takes the
// lower code). The midpoints are bitsandbytes' fp32 thresholds (dQuantizeNF4
// in csrc/kernels.cu). An all-zero block has absmax 0 and codes 7, the 0.0
// entry. Two codes per byte, the FIRST element in the HIGH nibble, an odd
// tail padded with code 7. codes: (n + 1) / 2 bytes; absmax: ceil(n / block)
// floats.
// nf4_dequantize: out[i] = codebook[code_i] * absmax[i / block], in fp32,
// rounded once to dt (by fl_store_f32). Fast paths (AVX2, AVX-512) are chosen
// at run time and match the _ref twin bitwise, on any thread count.
//
// dq8_quantize (double quantisation, bitsandbytes' compress_statistics): the
// n absmax values minus their mean (*offset = mean, summed in double, then
// fp32; the subtraction in fp32) are quantised in blocks of `block`
// (FL_DQ_BLOCK) with bitsandbytes' signed 8-bit dynamic map (dq8_map, 256
// sorted values in [-1, 1]: 0 and 1 are in it, -1 is not): nested[b] = max |x|
// of block b, code = index of the nearest map value of x * (1 / nested[b])
// in fp32 (ties to the even index; an all-zero block has nested 0 and the
// code of 0.0). dq8_dequantize: absmax[i] = map[q[i]] * nested[i / block]
// + offset, each operation rounded to fp32.

extern const float nf4_codebook[16];
extern const float dq8_map[256];
void nf4_quantize(uint8_t *codes, float *absmax, const float *w, size_t n, int block);
void nf4_dequantize(fl_dtype dt, void *out, const uint8_t *codes, const float *absmax, size_t n,
                    int block);
void nf4_dequantize_ref(float *out, const uint8_t *codes, const float *absmax, size_t n, int block);
void dq8_quantize(uint8_t *q, float *nested, float *offset, const float *absmax, size_t n,
                  int block);
void dq8_dequantize(float *absmax, const uint8_t *q, const float *nested, float offset, size_t n,
                    int block);

// For the tests and benchmarks: nf4_dequantize through one code path. Dies
// if the CPU lacks it (check fl_cpu()->avx2 / ->avx512f first).
enum { NF4_ISA_PORTABLE, NF4_ISA_AVX2, NF4_ISA_AVX512 };
void nf4_dequantize_isa(int isa, fl_dtype dt, void *out, const uint8_t *codes, const float *absmax,
                        size_t n, int block);

#endif
