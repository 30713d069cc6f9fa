#!/usr/bin/python3
"""make_llama_reference.py: the PyTorch reference for fitlm's tiny-LLaMA test.

Run with Debian's interpreter, which has python3-torch (the `python3` on a
pyenv PATH may not):

    /usr/bin/python3 scripts/make_llama_reference.py [out]
        # default tests/fixtures/llama_tiny.bin; also writes, next to it,
        # llama_tiny_tied.bin and the directory llama_tiny_hf/

It builds a tiny LLaMA in plain PyTorch, written out here op by op after
Hugging Face transformers' src/transformers/models/llama/modeling_llama.py
(LlamaForCausalLM; transformers itself is not packaged in Debian): token
embedding embed_tokens, no position embedding; per layer an RMSNorm
input_layernorm, self-attention with q_proj/k_proj/v_proj/o_proj (no biases),
grouped-query attention (repeat_kv: query head h reads kv head
h // (NH // NKV)), rotary position embeddings in HF's rotate-half convention
on q and k, causal softmax with scale 1/sqrt(HS), a residual, an RMSNorm
post_attention_layernorm, the SwiGLU MLP down_proj(silu(gate_proj(x)) *
up_proj(x)) (no biases), a residual; then the final RMSNorm norm and lm_head.
It records a forward, a backward and `steps` AdamW training steps for the C
engine's LLaMA test to compare against, for two models:

    llama_tiny.bin       V 64, maxT 16, L 2, NH 4, NKV 2, C 16 (HS 4), I 24,
                         untied lm_head, 10 steps
    llama_tiny_tied.bin  the same but L 1, NKV 1 (multi-query), lm_head tied
                         to embed_tokens (no lm_head parameter), 3 steps

and writes the untied model's initial weights as a Hugging Face model
directory, llama_tiny_hf/ (config.json, model.safetensors, F32).

As in make_reference.py the weights are drawn in float32 (so the C engine
gets exactly the values the reference used) and then everything is computed
in float64, so the stored values are the exact truth rounded once to float32.
The hyperparameters (rms_norm_eps, rope_theta, the AdamW ones) are rounded to
float32 before use. Two details, following HF:

  - the rotary tables. As LlamaRotaryEmbedding does, inv_freq =
    1 / (theta ** (arange(0, HS, 2).float() / HS)) is computed in float32,
    the angles t * inv_freq in float32 (one rounding), and cos/sin of them in
    float32; only those cos/sin values are promoted to float64.
  - RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w, computed (as HF does in
    float32 for half inputs) in the model's dtype, float64 here.

Initialisation (one seeded torch.Generator, float32): embed_tokens, lm_head
and every projection N(0, W_STD); the RMSNorm weights are ones PLUS small
noise N(0, 0.1), not HF's plain ones, so that their use in the forward and
their gradients are really tested. W_STD is not HF's initializer_range 0.02
but, as in make_reference.py, 0.02 * sqrt(768 / C) = 0.139: at 0.02 this
narrow model is nearly linear and some wrong-rotary bugs pass the C test's
tolerances (see the comment at W_STD). config.json still says
initializer_range 0.02, the value LlamaConfig carries.

Tokens and targets are drawn from the same generator; targets are the labels
already shifted (the reference does not shift them as LlamaForCausalLM does
with `labels`). Some targets are -1 (position 7 of row 0 and the last three
positions of row 1) and the loss is the mean cross-entropy over the others
(ignore_index=-1), which is what the engine's token-weighted loss must give.

Fixture format: make_reference.py's (its docstring), written by its Writer.

Records (in this order; the last one is final/<last param>, i.e.
final/lm_head.weight untied, final/norm.weight tied, so truncation shows):

    config            int32 [maxT, V, L, NH, NKV, C, I, B, T, steps, tie]
    config_f          float32 [rms_norm_eps, rope_theta]
    adamw             float32 [lr, beta1, beta2, eps, weight_decay, max_grad_norm]
    tokens, targets   int32 (B, T); targets may be -1 (ignored)
    param/<name>      float32 initial weights, nn.Linear layout (out, in)
    logits            float32 (B, T, V)
    loss              float32 (1)  mean cross-entropy over targets != -1
    grad/<name>       float32 d loss / d param (tied: embed_tokens' gradient
                      includes the lm_head use)
    step_losses       float32 (steps)  loss of each step's forward (step 0 == loss)
    step_grad_norms   float32 (steps)  global L2 grad norm before clipping
    final/<name>      float32 weights after `steps` AdamW steps

Parameter names and order: embed_tokens.weight (V, C); then for each layer l
layers.l.input_layernorm.weight (C), layers.l.self_attn.q_proj.weight
(NH*HS, C), layers.l.self_attn.k_proj.weight (NKV*HS, C),
layers.l.self_attn.v_proj.weight (NKV*HS, C), layers.l.self_attn.o_proj.weight
(C, NH*HS), layers.l.post_attention_layernorm.weight (C),
layers.l.mlp.gate_proj.weight (I, C), layers.l.mlp.up_proj.weight (I, C),
layers.l.mlp.down_proj.weight (C, I); then norm.weight (C); then
lm_head.weight (V, C), absent when tied.

Training step (repeated `steps` times on the same batch): zero_grad, forward,
loss.backward, clip_grad_norm_(max_norm), torch.optim.AdamW step, with the
same hyperparameters as make_reference.py (lr 1e-2, betas 0.9/0.95, eps 1e-8,
weight decay 0.1, max grad norm 1.0). Weight decay applies to the 2-D tensors
(embed_tokens, the projections, lm_head), not to the RMSNorm weights (two
param groups).

Self-checks (assertions, run every time): the float64 loss matches a float32
autograd run of the same model within 1e-5 relative; central finite
differences agree with autograd on a few weight elements; in the tied model
embed_tokens' gradient equals the sum of the embedding and lm_head
gradients of the same model run with an untied copy of the matrix.

The output is deterministic: running the script twice gives byte-identical
files.
"""

import json
import math
import os
import struct
import sys

import torch

# the fixture writer and float helpers are the GPT-2 reference's
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_reference import Writer, f32, f32_bytes  # noqa: E402

# ---------------------------------------------------------------------------
# configuration


class Cfg:
    def __init__(self, max_t, v, l, nh, nkv, c, i, b, t, steps, tie):
        assert c % nh == 0 and nh % nkv == 0
        self.MAX_T, self.V, self.L, self.NH, self.NKV = max_t, v, l, nh, nkv
        self.C, self.I, self.B, self.T, self.STEPS, self.TIE = c, i, b, t, steps, tie
        self.HS = c // nh


UNTIED = Cfg(max_t=16, v=64, l=2, nh=4, nkv=2, c=16, i=24, b=2, t=16, steps=10, tie=0)
TIED = Cfg(max_t=16, v=64, l=1, nh=4, nkv=1, c=16, i=24, b=2, t=16, steps=3, tie=1)
SEED = 1234
SEED_TIED = 4321

RMS_EPS = f32(1e-5)
ROPE_THETA = f32(10000.0)
# AdamW: the values make_reference.py uses (they are also the brief's)
LR = f32(1e-2)
BETA1, BETA2 = f32(0.9), f32(0.95)
EPS = f32(1e-8)
WEIGHT_DECAY = f32(0.1)
MAX_GRAD_NORM = f32(1.0)
# Weight scale: as in make_reference.py, HF's initializer_range 0.02 scaled
# by sqrt(768 / C) (GPT-2 124M's width), so each unit of this narrow model sees
# pre-activations of the size a 0.02-initialised 768-wide model's do (~0.5).
# With a plain 0.02 at C = 16 the attention scores are ~1e-2, the softmax
# almost uniform and SiLU almost linear. Measured when this script was
# written (effect of a deliberate bug on the untied model, in units of the C
# test's tolerances, LOGITS_ATOL 5e-6 + LOGITS_RTOL 1e-5 on the logits and
# 1e-6 + 1e-4 on the gradients): rope_theta 5e5 instead of 1e4 moves the
# logits by 2.9x the tolerance at 0.02 (1.6x tied) but 4500x here; dropping
# RoPE, interleaved instead of rotate-half pairs, GELU for SiLU, 1/HS for
# 1/sqrt(HS) go from 45..80x to 4e4..1e5x. Computing cos/sin in float64
# instead of HF's float32 moves them by 0.005x (it does not matter).
W_STD = 0.02 * math.sqrt(768 / 16)
assert UNTIED.C == TIED.C == 16
IGNORE = -1


def param_specs(cfg):
    """(name, shape, kind, decay) in the engine's table order."""
    C, I, HS = cfg.C, cfg.I, cfg.HS
    specs = [("embed_tokens.weight", (cfg.V, C), "w", True)]
    for l in range(cfg.L):
        p = "layers.%d." % l
        specs += [
            (p + "input_layernorm.weight", (C,), "norm", False),
            (p + "self_attn.q_proj.weight", (cfg.NH * HS, C), "w", True),
            (p + "self_attn.k_proj.weight", (cfg.NKV * HS, C), "w", True),
            (p + "self_attn.v_proj.weight", (cfg.NKV * HS, C), "w", True),
            (p + "self_attn.o_proj.weight", (C, cfg.NH * HS), "w", True),
            (p + "post_attention_layernorm.weight", (C,), "norm", False),
            (p + "mlp.gate_proj.weight", (I, C), "w", True),
            (p + "mlp.up_proj.weight", (I, C), "w", True),
            (p + "mlp.down_proj.weight", (C, I), "w", True),
        ]
    specs += [("norm.weight", (C,), "norm", False)]
    if not cfg.TIE:
        specs += [("lm_head.weight", (cfg.V, C), "w", True)]
    return specs


def init_params(cfg, gen):
    """Matrices N(0, W_STD), RMSNorm weights 1 + N(0, 0.1), drawn in float32,
    returned as float64 leaf tensors."""
    params = {}
    for name, shape, kind, _ in param_specs(cfg):
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        x = z * W_STD if kind == "w" else 1.0 + z * 0.1
        params[name] = x.to(torch.float64).requires_grad_(True)
    return params


def make_data(cfg, gen):
    tokens = torch.randint(0, cfg.V, (cfg.B, cfg.T), generator=gen)
    targets = torch.randint(0, cfg.V, (cfg.B, cfg.T), generator=gen)
    targets[0, cfg.T // 2 - 1] = IGNORE
    targets[1, cfg.T - 3:] = IGNORE
    return tokens, targets


# ---------------------------------------------------------------------------
# the model, after modeling_llama.py


def rope_cos_sin(cfg, Tn):
    """LlamaRotaryEmbedding (default rope type, attention_scaling 1): all in
    float32, as HF computes it whatever the model dtype. (T, HS) each."""
    HS = cfg.HS
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HS, 2, dtype=torch.int64).float() / HS))
    t = torch.arange(Tn, dtype=torch.int64).float()
    freqs = t[:, None] * inv_freq[None, :]  # float32, one rounding each
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rmsnorm(x, w):
    variance = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(variance + RMS_EPS))


def linear(x, w):
    return x @ w.t()  # nn.Linear layout, no bias


def repeat_kv(x, n_rep):
    """(B, NKV, T, HS) -> (B, NKV*n_rep, T, HS); head h = kv head h // n_rep."""
    if n_rep == 1:
        return x
    Bn, nkv, Tn, hs = x.shape
    return x[:, :, None, :, :].expand(Bn, nkv, n_rep, Tn, hs).reshape(Bn, nkv * n_rep, Tn, hs)


def forward(cfg, p, tokens, targets, lora=None):
    """Returns (logits, loss) in the parameters' dtype. lora: None, or
    lora(module, x, y) returning the output y of the linear layer `module`
    (e.g. "layers.0.self_attn.q_proj") on input x with the layer's adapter
    applied (make_lora_reference.py)."""
    Bn, Tn = tokens.shape

    def lin(x, module):
        y = linear(x, p[module + ".weight"])
        return y if lora is None else lora(module, x, y)

    HS, NH, NKV = cfg.HS, cfg.NH, cfg.NKV
    dtype = p["embed_tokens.weight"].dtype
    cos, sin = rope_cos_sin(cfg, Tn)
    cos, sin = cos.to(dtype), sin.to(dtype)  # promoted only now, as HF does
    mask = torch.ones(Tn, Tn, dtype=torch.bool).tril()
    x = p["embed_tokens.weight"][tokens]
    for l in range(cfg.L):
        q = "layers.%d." % l
        h = rmsnorm(x, p[q + "input_layernorm.weight"])
        qq = lin(h, q + "self_attn.q_proj").view(Bn, Tn, NH, HS).transpose(1, 2)
        kk = lin(h, q + "self_attn.k_proj").view(Bn, Tn, NKV, HS).transpose(1, 2)
        vv = lin(h, q + "self_attn.v_proj").view(Bn, Tn, NKV, HS).transpose(1, 2)
        qq = qq * cos + rotate_half(qq) * sin
        kk = kk * cos + rotate_half(kk) * sin
        kk = repeat_kv(kk, NH // NKV)
        vv = repeat_kv(vv, NH // NKV)
        att = (qq @ kk.transpose(-2, -1)) / math.sqrt(HS)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ vv).transpose(1, 2).reshape(Bn, Tn, NH * HS)
        x = x + lin(y, q + "self_attn.o_proj")
        h = rmsnorm(x, p[q + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(lin(h, q + "mlp.gate_proj"))
        h = gate * lin(h, q + "mlp.up_proj")
        x = x + lin(h, q + "mlp.down_proj")
    x = rmsnorm(x, p["norm.weight"])
    head = p["embed_tokens.weight"] if cfg.TIE else p["lm_head.weight"]
    logits = linear(x, head)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.V), targets.reshape(-1),
                                             ignore_index=IGNORE)
    return logits, loss


# ---------------------------------------------------------------------------
# self-checks


def check_float32(cfg, params, tokens, targets, loss64):
    p32 = {k: v.detach().to(torch.float32).requires_grad_(True) for k, v in params.items()}
    _, loss32 = forward(cfg, p32, tokens, targets)
    loss32.backward()
    rel = abs(loss32.item() - loss64.item()) / abs(loss64.item())
    assert rel < 1e-5, "float32 loss %.9g vs float64 %.9g (rel %.3g)" % (
        loss32.item(), loss64.item(), rel)
    return rel


def check_finite_diff(cfg, params, tokens, targets, names):
    """Central differences in float64 on the largest-gradient element of
    each named tensor."""
    worst = 0.0
    for name in names:
        g = params[name].grad
        idx = int(g.abs().reshape(-1).argmax())
        h = 1e-6
        vals = []
        for sgn in (1.0, -1.0):
            p = {k: v.detach().clone() for k, v in params.items()}
            p[name].view(-1)[idx] += sgn * h
            with torch.no_grad():
                vals.append(forward(cfg, p, tokens, targets)[1].item())
        fd = (vals[0] - vals[1]) / (2 * h)
        an = g.reshape(-1)[idx].item()
        err = abs(fd - an)
        assert err <= 1e-8 + 1e-6 * abs(an), "finite difference %s[%d]: fd %.10g autograd %.10g" % (
            name, idx, fd, an)
        worst = max(worst, err / abs(an))
    return worst


def check_tied_fold(cfg, params, tokens, targets):
    """The tied model's embed_tokens gradient must be the embedding-lookup
    gradient plus the lm_head gradient of the same weights used untied."""
    ucfg = Cfg(cfg.MAX_T, cfg.V, cfg.L, cfg.NH, cfg.NKV, cfg.C, cfg.I, cfg.B, cfg.T,
               cfg.STEPS, tie=0)
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    p["lm_head.weight"] = params["embed_tokens.weight"].detach().clone().requires_grad_(True)
    _, loss = forward(ucfg, p, tokens, targets)
    loss.backward()
    folded = p["embed_tokens.weight"].grad + p["lm_head.weight"].grad
    tied = params["embed_tokens.weight"].grad
    err = (folded - tied).abs().max().item()
    assert err <= 1e-12 * max(1.0, tied.abs().max().item()), "tied fold error %g" % err
    assert p["lm_head.weight"].grad.abs().max().item() > 1e-3  # the fold is not vacuous
    return err


# ---------------------------------------------------------------------------
# the fixture


def build(cfg, seed, out):
    """Writes the fixture `out`; returns (initial params, loss, step losses)."""
    specs = param_specs(cfg)
    gen = torch.Generator().manual_seed(seed)
    params = init_params(cfg, gen)
    tokens, targets = make_data(cfg, gen)

    w = Writer()
    w.record("config", torch.tensor([cfg.MAX_T, cfg.V, cfg.L, cfg.NH, cfg.NKV, cfg.C, cfg.I,
                                     cfg.B, cfg.T, cfg.STEPS, cfg.TIE], dtype=torch.int32))
    w.record("config_f", torch.tensor([RMS_EPS, ROPE_THETA], dtype=torch.float64))
    w.record("adamw", torch.tensor([LR, BETA1, BETA2, EPS, WEIGHT_DECAY, MAX_GRAD_NORM],
                                   dtype=torch.float64))
    w.record("tokens", tokens)
    w.record("targets", targets)
    for name, _, _, _ in specs:
        w.record("param/" + name, params[name])

    logits, loss = forward(cfg, params, tokens, targets)
    loss.backward()
    w.record("logits", logits)
    w.record("loss", loss.reshape(1))
    for name, _, _, _ in specs:
        w.record("grad/" + name, params[name].grad)

    # self-checks (they do not touch params' values or gradients)
    rel32 = check_float32(cfg, params, tokens, targets, loss)
    fd_names = ["layers.0.self_attn.k_proj.weight", "layers.0.input_layernorm.weight",
                "layers.%d.mlp.gate_proj.weight" % (cfg.L - 1), "norm.weight",
                "embed_tokens.weight"]
    fd_rel = check_finite_diff(cfg, params, tokens, targets, fd_names)
    msg = "float32 loss rel diff %.2g, finite differences rel %.2g" % (rel32, fd_rel)
    if cfg.TIE:
        msg += ", tied fold err %.2g" % check_tied_fold(cfg, params, tokens, targets)

    # training: fresh copies of the initial weights, AdamW with decay groups
    train = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    decay = [train[n] for n, _, _, d in specs if d]
    no_decay = [train[n] for n, _, _, d in specs if not d]
    assert all(t.dim() == 2 for t in decay) and all(t.dim() == 1 for t in no_decay)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS)
    step_losses, step_norms = [], []
    for _ in range(cfg.STEPS):
        opt.zero_grad(set_to_none=False)
        _, l = forward(cfg, train, tokens, targets)
        l.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(train.values()), max_norm=MAX_GRAD_NORM)
        opt.step()
        step_losses.append(l.item())
        step_norms.append(norm.item())
    assert step_losses[0] == loss.item()
    w.record("step_losses", torch.tensor(step_losses, dtype=torch.float64))
    w.record("step_grad_norms", torch.tensor(step_norms, dtype=torch.float64))
    for name, _, _, _ in specs:
        w.record("final/" + name, train[name])
    assert w.names[-1][0] == "final/" + specs[-1][0]

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as f:
        f.write(w.buf)
    print("wrote %s (%d bytes, %d records)" % (out, len(w.buf), len(w.names)))
    print("  %s" % msg)
    print("  loss %.6f; step losses %s" % (loss.item(), " ".join("%.4f" % x for x in step_losses)))
    print("  grad norms %s" % " ".join("%.4f" % x for x in step_norms))
    return params


# ---------------------------------------------------------------------------
# the untied model's initial weights as a Hugging Face model directory,
# written byte by byte (no safetensors or transformers package needed)


def write_hf(cfg, out_dir, params):
    """config.json and model.safetensors as transformers' save_pretrained
    writes LlamaForCausalLM: "model." names, lm_head.weight unprefixed,
    nn.Linear layout, keys sorted, F32."""
    tensors = {}
    for name, _, _, _ in param_specs(cfg):
        hf = name if name == "lm_head.weight" else "model." + name
        tensors[hf] = params[name]
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name in sorted(tensors):
        t = tensors[name]
        b = f32_bytes(t)
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    config = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "head_dim": cfg.HS, "hidden_act": "silu", "hidden_size": cfg.C,
        "initializer_range": 0.02, "intermediate_size": cfg.I,
        "max_position_embeddings": cfg.MAX_T, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": cfg.NH, "num_hidden_layers": cfg.L,
        "num_key_value_heads": cfg.NKV, "pretraining_tp": 1, "rms_norm_eps": 1e-05,  # LlamaConfig's spelling; f32 of it is RMS_EPS
        "rope_scaling": None, "rope_theta": ROPE_THETA, "tie_word_embeddings": bool(cfg.TIE),
        "torch_dtype": "float32", "use_cache": True, "vocab_size": cfg.V,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    print("wrote %s (%d bytes of weights)" % (out_dir, len(data)))


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests/fixtures/llama_tiny.bin")
    torch.set_num_threads(1)  # fixed reduction order: byte-identical output
    stem, ext = os.path.splitext(out)
    params = build(UNTIED, SEED, out)
    build(TIED, SEED_TIED, stem + "_tied" + ext)
    write_hf(UNTIED, os.path.join(os.path.dirname(os.path.abspath(out)), "llama_tiny_hf"), params)


if __name__ == "__main__":
    main()
