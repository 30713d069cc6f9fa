#!/usr/bin/python3
"""make_reference.py: the PyTorch reference for fitlm's whole-model test.

Run with Debian's interpreter, which has python3-torch (the `python3` on a
pyenv PATH may not):

    /usr/bin/python3 scripts/make_reference.py [out]   # default tests/fixtures/gpt2_tiny.bin

It builds a tiny GPT-2 in plain PyTorch, written out here op by op as in
karpathy/llm.c's train_gpt2.c (learned token + position embeddings, pre-LN
blocks, causal multi-head attention with a fused QKV projection, GELU tanh
approximation, MLP 4C, final LayerNorm, LM head tied to wte, LayerNorm eps
1e-5 everywhere), and records a forward, a backward and 10 AdamW training
steps for tests/test_gpt2_ref.c to compare the C engine against.

The weights are drawn in float32 (so the C engine gets exactly the values the
reference used) and then everything is computed in float64, so the stored
values are the exact truth rounded once to float32. The AdamW
hyperparameters are likewise rounded to float32 before use.

Fixture format (all little-endian):

    8 bytes   magic "FITLMREF"
    uint32    version = 1
    then records until end of file, each:
      uint32  name_len
      bytes   name (name_len bytes, no NUL)
      uint32  dtype (0 = float32, 1 = int32)
      uint32  ndim
      uint64  shape[ndim]
      bytes   data: prod(shape) elements of 4 bytes, row-major

Records (in this order; the last one is final/ln_f.bias):

    config            int32 [maxT, V, L, NH, C, B, T, steps]
    adamw             float32 [lr, beta1, beta2, eps, weight_decay, max_grad_norm]
    tokens, targets   int32 (B, T)
    param/<name>      float32 initial weights, nn.Linear layout (out, in);
                      wte.weight is (V, C) (the engine pads it to Vp rows)
    logits            float32 (B, T, V)
    loss              float32 (1)  mean cross-entropy over all B*T positions
    grad/<name>       float32 d loss / d param
    step_losses       float32 (steps)  loss of each step's forward (step 0 == loss)
    step_grad_norms   float32 (steps)  global L2 grad norm before clipping
    final/<name>      float32 weights after `steps` AdamW steps

Parameter names and order: wte.weight, wpe.weight, then for each layer l
h.l.ln_1.{weight,bias}, h.l.attn.c_attn.{weight,bias},
h.l.attn.c_proj.{weight,bias}, h.l.ln_2.{weight,bias},
h.l.mlp.c_fc.{weight,bias}, h.l.mlp.c_proj.{weight,bias}; then
ln_f.{weight,bias}.

Training step (repeated `steps` times on the same batch): zero_grad, forward,
loss.backward, clip_grad_norm_(max_norm), AdamW step. Weight decay applies to
wte.weight and the attn/mlp ".weight" matrices only (two param groups).

The output is deterministic: running the script twice gives a byte-identical
file.
"""

import json
import math
import os
import struct
import sys

import torch

# ---------------------------------------------------------------------------
# configuration. C is 16 rather than 32 so that three full copies of the
# weights (initial, gradients, final) stay well under 200 KB.

MAX_T, V, L, NH, C = 16, 64, 2, 4, 16
B, T = 2, 16
STEPS = 10
SEED = 1234

def f32(x):
    """x rounded to float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]

LR = f32(1e-2)
BETA1, BETA2 = f32(0.9), f32(0.95)
EPS = f32(1e-8)
WEIGHT_DECAY = f32(0.1)
MAX_GRAD_NORM = f32(1.0)
LN_EPS = 1e-5
# Weight scale: GPT-2's N(0, 0.02) scaled by sqrt(768 / C), so each unit of
# this narrow model sees pre-activations of the size GPT-2 124M's do (~0.5).
# With a plain 0.02 at C = 16 the attention would be almost uniform and GELU
# almost linear, and e.g. a wrong GELU constant would pass the forward and
# gradient checks (it was caught only by the 10-step trajectory).
W_STD = 0.02 * math.sqrt(768 / C)


def param_specs():
    """(name, shape, kind, decay) in the engine's table order."""
    specs = [("wte.weight", (V, C), "w", True), ("wpe.weight", (MAX_T, C), "w", False)]
    for l in range(L):
        p = "h.%d." % l
        specs += [
            (p + "ln_1.weight", (C,), "lnw", False),
            (p + "ln_1.bias", (C,), "b", False),
            (p + "attn.c_attn.weight", (3 * C, C), "w", True),
            (p + "attn.c_attn.bias", (3 * C,), "b", False),
            (p + "attn.c_proj.weight", (C, C), "wproj", True),
            (p + "attn.c_proj.bias", (C,), "b", False),
            (p + "ln_2.weight", (C,), "lnw", False),
            (p + "ln_2.bias", (C,), "b", False),
            (p + "mlp.c_fc.weight", (4 * C, C), "w", True),
            (p + "mlp.c_fc.bias", (4 * C,), "b", False),
            (p + "mlp.c_proj.weight", (C, 4 * C), "wproj", True),
            (p + "mlp.c_proj.bias", (C,), "b", False),
        ]
    specs += [("ln_f.weight", (C,), "lnw", False), ("ln_f.bias", (C,), "b", False)]
    return specs


def init_params(gen):
    """GPT-2 style init (N(0, W_STD), residual projections N(0, W_STD/sqrt(2L)))
    drawn in float32, returned as float64 leaf tensors. Biases and LayerNorm
    parameters get small random values (not 0 and 1) so that their use in the
    forward and their gradients are really tested."""
    params = {}
    for name, shape, kind, _ in param_specs():
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "w":
            x = z * W_STD
        elif kind == "wproj":
            x = z * (W_STD / math.sqrt(2 * L))
        elif kind == "lnw":
            x = 1.0 + z * 0.1
        else:  # biases, LayerNorm biases
            x = z * 0.02
        params[name] = x.to(torch.float64).requires_grad_(True)
    return params


def layernorm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased, as LayerNorm
    return (x - mean) / torch.sqrt(var + LN_EPS) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def linear(x, w, b):
    return x @ w.t() + b  # nn.Linear layout: w is (out, in)


def forward(p, tokens, targets, lora=None):
    """lora: None, or lora(module, x, y) returning the output y of the linear
    layer `module` (e.g. "h.0.attn.c_attn") on input x with the layer's
    adapter applied (make_lora_reference.py)."""
    Bn, Tn = tokens.shape
    hs = C // NH

    def lin(x, module):
        y = linear(x, p[module + ".weight"], p[module + ".bias"])
        return y if lora is None else lora(module, x, y)

    x = p["wte.weight"][tokens] + p["wpe.weight"][:Tn]
    mask = torch.ones(Tn, Tn, dtype=torch.bool).tril()
    for l in range(L):
        q = "h.%d." % l
        h = layernorm(x, p[q + "ln_1.weight"], p[q + "ln_1.bias"])
        qkv = lin(h, q + "attn.c_attn")
        qq, kk, vv = qkv.split(C, dim=-1)
        qq = qq.view(Bn, Tn, NH, hs).transpose(1, 2)  # (B, NH, T, hs)
        kk = kk.view(Bn, Tn, NH, hs).transpose(1, 2)
        vv = vv.view(Bn, Tn, NH, hs).transpose(1, 2)
        att = (qq @ kk.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ vv).transpose(1, 2).reshape(Bn, Tn, C)
        x = x + lin(y, q + "attn.c_proj")
        h = layernorm(x, p[q + "ln_2.weight"], p[q + "ln_2.bias"])
        h = gelu_tanh(lin(h, q + "mlp.c_fc"))
        x = x + lin(h, q + "mlp.c_proj")
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    logits = x @ p["wte.weight"].t()  # tied LM head, no bias
    # a target -1 has no loss (this fixture has none; make_lora_reference.py's has)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1),
                                             ignore_index=-1)
    return logits, loss


class Writer:
    def __init__(self):
        self.buf = bytearray(b"FITLMREF" + struct.pack("<I", 1))
        self.names = []  # (name, shape) of each record, in order

    def record(self, name, t):
        t = t.detach().contiguous()
        if t.dtype in (torch.float64, torch.float32):
            t, dtype, fmt = t.to(torch.float32), 0, "<%df"
        elif t.dtype in (torch.int64, torch.int32):
            t, dtype, fmt = t.to(torch.int32), 1, "<%di"
        else:
            raise TypeError(t.dtype)
        nb = name.encode("ascii")
        self.buf += struct.pack("<I", len(nb)) + nb
        self.buf += struct.pack("<II", dtype, t.dim())
        self.buf += b"".join(struct.pack("<Q", s) for s in t.shape)
        vals = t.reshape(-1).tolist()
        self.buf += struct.pack(fmt % len(vals), *vals)
        self.names.append((name, tuple(t.shape)))


# ---------------------------------------------------------------------------
# the same initial weights in the model-file formats fitlm imports, written
# here byte by byte (no safetensors or transformers package needed)

LLMC_VP = 80  # llm.c's padded vocab, deliberately not fitlm's (128)


def f32_bytes(t):
    vals = t.detach().to(torch.float32).contiguous().reshape(-1).tolist()
    return struct.pack("<%df" % len(vals), *vals)


def bf16_bytes(t):
    """Round to nearest even, as llm.c's exporter (and fitlm) do."""
    bits = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).reshape(-1).tolist()
    return struct.pack("<%dh" % len(bits), *bits)


def write_hf(out_dir, params):
    """config.json and model.safetensors as transformers' save_pretrained
    writes GPT2LMHeadModel: "transformer." names, Conv1D weights (in, out),
    the attention-mask buffers, no lm_head (tied). F32, so the reference
    logits apply unchanged."""
    tensors = []
    for name, _, _, _ in param_specs():
        t = params[name]
        if name.startswith("h.") and t.dim() == 2:
            t = t.t()  # Conv1D layout
        tensors.append(("transformer." + name, t))
    for l in range(L):
        mask = torch.ones(MAX_T, MAX_T).tril().view(1, 1, MAX_T, MAX_T)
        tensors.append(("transformer.h.%d.attn.bias" % l, mask))
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name, t in tensors:
        b = f32_bytes(t)
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    config = {
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1, "bos_token_id": None, "embd_pdrop": 0.1, "eos_token_id": None,
        "initializer_range": 0.02, "layer_norm_epsilon": LN_EPS, "model_type": "gpt2",
        "n_embd": C, "n_head": NH, "n_inner": None, "n_layer": L, "n_positions": MAX_T,
        "resid_pdrop": 0.1, "tie_word_embeddings": True, "torch_dtype": "float32",
        "vocab_size": V,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    print("wrote %s (%d bytes of weights)" % (out_dir, len(data)))


def write_llmc(path, params, version):
    """llm.c's model file: 256 int32 header, then each parameter kind
    stacked over the layers, wte padded to LLMC_VP rows with zeros."""
    header = [20240326, version, MAX_T, V, L, NH, C, LLMC_VP] + [0] * 248
    wte = torch.cat([params["wte.weight"], torch.zeros(LLMC_VP - V, C, dtype=torch.float64)])
    kinds = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
             "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
             "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    ts = [wte, params["wpe.weight"]]
    ts += [params["h.%d.%s" % (l, k)] for k in kinds for l in range(L)]
    ts += [params["ln_f.weight"], params["ln_f.bias"]]
    pack = f32_bytes if version == 3 else bf16_bytes
    data = struct.pack("<256i", *header) + b"".join(pack(t) for t in ts)
    with open(path, "wb") as f:
        f.write(data)
    print("wrote %s (%d bytes)" % (path, len(data)))


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests/fixtures/gpt2_tiny.bin")
    torch.set_num_threads(1)  # fixed reduction order: byte-identical output
    gen = torch.Generator().manual_seed(SEED)
    params = init_params(gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)

    w = Writer()
    w.record("config", torch.tensor([MAX_T, V, L, NH, C, B, T, STEPS], dtype=torch.int32))
    w.record("adamw", torch.tensor([LR, BETA1, BETA2, EPS, WEIGHT_DECAY, MAX_GRAD_NORM],
                                   dtype=torch.float64))
    w.record("tokens", tokens)
    w.record("targets", targets)
    for name, _, _, _ in param_specs():
        w.record("param/" + name, params[name])

    logits, loss = forward(params, tokens, targets)
    loss.backward()
    w.record("logits", logits)
    w.record("loss", loss.reshape(1))
    for name, _, _, _ in param_specs():
        w.record("grad/" + name, params[name].grad)

    # training: fresh copies of the initial weights, AdamW with decay groups
    train = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    decay = [train[n] for n, _, _, d in param_specs() if d]
    no_decay = [train[n] for n, _, _, d in param_specs() if not d]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS)
    step_losses, step_norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        _, l = forward(train, tokens, targets)
        l.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(train.values()), max_norm=MAX_GRAD_NORM)
        opt.step()
        step_losses.append(l.item())
        step_norms.append(norm.item())
    w.record("step_losses", torch.tensor(step_losses, dtype=torch.float64))
    w.record("step_grad_norms", torch.tensor(step_norms, dtype=torch.float64))
    for name, _, _, _ in param_specs():
        w.record("final/" + name, train[name])

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as f:
        f.write(w.buf)
    print("wrote %s (%d bytes)" % (out, len(w.buf)))
    fixtures = os.path.dirname(os.path.abspath(out))
    write_hf(os.path.join(fixtures, "gpt2_tiny_hf"), params)
    write_llmc(os.path.join(fixtures, "gpt2_tiny_llmc_v3.bin"), params, 3)
    write_llmc(os.path.join(fixtures, "gpt2_tiny_llmc_v5.bin"), params, 5)
    print("loss %.6f; step losses %s" % (loss.item(), " ".join("%.4f" % x for x in step_losses)))
    print("grad norms %s" % " ".join("%.4f" % x for x in step_norms))


if __name__ == "__main__":
    main()
