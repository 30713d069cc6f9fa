#!/usr/bin/python3
"""make_lora_reference.py: the PyTorch reference for fitlm's LoRA test.

Run with Debian's interpreter, which has python3-torch (the `python3` on a
pyenv PATH may not):

    /usr/bin/python3 scripts/make_lora_reference.py [outdir]
        # default tests/fixtures: writes lora_llama_tiny.bin, lora_gpt2_tiny.bin

It adds LoRA adapters to the tiny models of make_llama_reference.py (the
untied LLaMA: L 2, NH 4, NKV 2, C 16, I 24) and make_reference.py (GPT-2:
L 2, NH 4, C 16), whose model code it imports, and records a forward, a
backward, the merged weights and `steps` AdamW steps of the adapters with
the base frozen, for tests/test_lora_ref.c.

PEFT is not packaged in Debian, so LoRA is written out here as PEFT defines
it (huggingface/peft, src/peft/tuners/lora/layer.py and config.py):

  - LoraLayer.update_layer: lora_A = nn.Linear(in, r, bias=False), weight
    (r, in); lora_B = nn.Linear(r, out, bias=False), weight (out, r);
    scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora;
    lora_dropout 0 makes the dropout nn.Identity.
  - Linear.forward: result = base_layer(x) + lora_B(lora_A(dropout(x))) *
    scaling.
  - Linear.get_delta_weight: transpose(B @ A, fan_in_fan_out) * scaling,
    added to the base layer's weight by merge. GPT-2's c_attn is a
    transformers Conv1D (weight (in, out)), for which PEFT forces
    fan_in_fan_out=True: the adapters are still lora_A (r, in) and lora_B
    (out, r) and the forward is the same; only the delta is transposed to
    the Conv1D layout. The fixture stores the merged weights in fitlm's
    table layout (out, in), i.e. W + scaling * B @ A for both models.
  - target_modules (config.py, model.py _check_target_module_exists): a
    module is adapted when its Hugging Face name ("model.layers.0.self_attn.
    q_proj", "transformer.h.0.attn.c_attn") equals an entry or ends with
    "." + entry.
  - saved names: "base_model.model." + module + ".lora_A.weight" (.lora_B).

The two cases:

    lora_llama_tiny.bin  q_proj, v_proj adapted; r 4, lora_alpha 8: scaling 2
    lora_gpt2_tiny.bin   c_attn adapted; r 2, lora_alpha 4: scaling 2

Both without use_rslora (its scaling, alpha / sqrt(r), is a scalar the C
test checks on its own). The base model's weights, tokens and targets are
drawn exactly as by its own script (same seed, same order), so they equal
that script's fixture's, except that GPT-2's targets here have some -1
(the positions LLaMA's has: 7 of row 0, the last three of row 1). The
adapters are drawn after them from the same generator, in table order (A
then B of each module), in float32: A and B both N(0, W_STD), the base's
weight scale, and not PEFT's init (B = 0 would make the adapter a no-op and
lora_A's gradient zero, hiding bugs). Everything is then computed in
float64 as in the other scripts, so the stored values are the exact truth
rounded once to float32.

Fixture format: make_reference.py's (its docstring), written by its Writer.

Records (in this order; the last one is final/<last adapter>):

    config            int32: the base script's (GPT-2 [maxT, V, L, NH, C, B,
                      T, steps], LLaMA [maxT, V, L, NH, NKV, C, I, B, T,
                      steps, tie]), steps being the adapter AdamW steps
    config_f          LLaMA only: float32 [rms_norm_eps, rope_theta]
    lora              int32 [r, use_rslora]
    lora_f            float32 [lora_alpha, scaling]
    adamw             float32 [lr, beta1, beta2, eps, weight_decay, max_grad_norm]
    tokens, targets   int32 (B, T); targets may be -1 (ignored)
    param/<name>      float32 base weights, fitlm's table names and layout
                      (out, in); the vocabulary rows are (V, C)
    param/<peft name> float32 initial adapters, e.g.
                      param/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
                      (r, in), ...lora_B.weight (out, r)
    logits            float32 (B, T, V)
    loss              float32 (1)  mean cross-entropy over targets != -1
    grad/<peft name>  float32 d loss / d adapter (the base has no gradient)
    merged/<name>     float32 (out, in) each adapted base weight with its
                      adapter merged in
    step_losses       float32 (steps)  loss of each step's forward (step 0 == loss)
    step_grad_norms   float32 (steps)  L2 norm of the adapters' gradient before clipping
    final/<peft name> float32 adapters after `steps` AdamW steps

Training step (repeated `steps` times on the same batch, the base frozen):
zero_grad, forward, loss.backward, clip_grad_norm_(max_norm) over the
adapters, torch.optim.AdamW step over the adapters, with the other scripts'
hyperparameters (lr 1e-2, betas 0.9/0.95, eps 1e-8, weight decay 0.1, max
grad norm 1.0). Weight decay applies to every adapter matrix, as the other
scripts decay the 2-D tensors and Hugging Face's Trainer decays every
parameter but biases and norms.

Self-checks (assertions, run every time): the float64 loss matches a float32
run within 1e-5 relative; central finite differences agree with autograd on
a lora_A and a lora_B element; the base model with the merged weights gives
the adapted model's logits (float64, 1e-12); the adapters change the loss.

The output is deterministic: running the script twice gives byte-identical
files.
"""

import os
import sys

import torch

# the tiny models and the fixture writer of the other scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_llama_reference as llama  # noqa: E402
import make_reference as gpt2  # noqa: E402
from make_reference import Writer  # noqa: E402

STEPS = 5
IGNORE = -1
LLAMA_LORA = dict(r=4, alpha=8.0, targets=("q_proj", "v_proj"))
GPT2_LORA = dict(r=2, alpha=4.0, targets=("c_attn",))


class Case:
    """One base model of the other scripts, seen the way PEFT sees it."""

    def __init__(self, specs, prefix, fan_in_fan_out, w_std, forward, lora):
        self.specs, self.prefix, self.w_std = specs, prefix, w_std
        self.fan_in_fan_out = fan_in_fan_out  # PEFT's, for the adapted layers
        self.forward = forward  # forward(params, tokens, targets, lora_fn)
        self.r, self.alpha, self.targets = lora["r"], lora["alpha"], lora["targets"]
        self.scaling = self.alpha / self.r  # LoraLayer.update_layer, no use_rslora

    def module(self, row):
        """The Hugging Face module name of a base row, without ".weight"."""
        return self.prefix + row[: -len(".weight")]

    def adapted(self):
        """The adapted base rows, in table order: the blocks' linear layers
        whose module name equals a target or ends with "." + target."""
        rows = []
        for name, shape, _, _ in self.specs:
            if len(shape) != 2 or not name.startswith(("h.", "layers.")):
                continue
            m = self.module(name)
            if any(m == t or m.endswith("." + t) for t in self.targets):
                rows.append(name)
        return rows

    def peft_name(self, row, ab):
        return "base_model.model.%s.%s.weight" % (self.module(row), ab)


def lora_fn(case, adapters):
    """Linear.forward of every adapted layer: adapters maps a base row to
    its (A, B)."""
    def apply(module, x, y):
        ab = adapters.get(module + ".weight")
        if ab is None:
            return y
        a, b = ab
        return y + ((x @ a.t()) @ b.t()) * case.scaling  # lora_B(lora_A(x)) * scaling
    return apply


def merged_weight(case, w, a, b):
    """Linear.merge with get_delta_weight, returned in the table layout
    (out, in): the base weight is held in Hugging Face's layout, (in, out)
    for GPT-2's Conv1D (fan_in_fan_out), and the delta transposed to it."""
    hf = w.t() if case.fan_in_fan_out else w
    delta = b @ a
    delta = (delta.t() if case.fan_in_fan_out else delta) * case.scaling
    hf = hf + delta
    return hf.t() if case.fan_in_fan_out else hf


def init_adapters(case, base, gen):
    """A (r, in) and B (out, r), both N(0, the base's W_STD) drawn in
    float32, float64 leaf tensors, in table order."""
    adapters = {}
    for row in case.adapted():
        out_f, in_f = base[row].shape
        a = torch.randn((case.r, in_f), generator=gen, dtype=torch.float32) * case.w_std
        b = torch.randn((out_f, case.r), generator=gen, dtype=torch.float32) * case.w_std
        adapters[row] = tuple(t.to(torch.float64).requires_grad_(True) for t in (a, b))
    return adapters


# ---------------------------------------------------------------------------
# self-checks


def check_float32(case, base, adapters, tokens, targets, loss64):
    p32 = {k: v.detach().to(torch.float32) for k, v in base.items()}
    a32 = {k: tuple(t.detach().to(torch.float32) for t in ab) for k, ab in adapters.items()}
    with torch.no_grad():
        _, loss32 = case.forward(p32, tokens, targets, lora_fn(case, a32))
    rel = abs(loss32.item() - loss64.item()) / abs(loss64.item())
    assert rel < 1e-5, "float32 loss %.9g vs float64 %.9g" % (loss32.item(), loss64.item())
    return rel


def check_finite_diff(case, base, adapters, tokens, targets):
    """Central differences in float64 on the largest-gradient element of the
    first module's lora_A and the last module's lora_B."""
    rows = case.adapted()
    worst = 0.0
    for row, k in ((rows[0], 0), (rows[-1], 1)):
        g = adapters[row][k].grad
        idx = int(g.abs().reshape(-1).argmax())
        h = 1e-6
        vals = []
        for sgn in (1.0, -1.0):
            ad = {r: tuple(t.detach().clone() for t in ab) for r, ab in adapters.items()}
            ad[row][k].view(-1)[idx] += sgn * h
            with torch.no_grad():
                vals.append(case.forward(base, tokens, targets, lora_fn(case, ad))[1].item())
        fd = (vals[0] - vals[1]) / (2 * h)
        an = g.reshape(-1)[idx].item()
        assert abs(fd - an) <= 1e-8 + 1e-6 * abs(an), (
            "finite difference %s lora_%s[%d]: %.10g vs autograd %.10g" % (row, "AB"[k], idx, fd, an))
        worst = max(worst, abs(fd - an) / abs(an))
    return worst


def check_merged(case, base, merged, tokens, targets, logits):
    """The base model with the merged weights gives the adapted logits."""
    p = {k: v.detach() for k, v in base.items()}
    p.update(merged)
    with torch.no_grad():
        got, _ = case.forward(p, tokens, targets, None)
    err = (got - logits.detach()).abs().max().item()
    assert err < 1e-12, "merged model's logits differ by %g" % err
    return err


# ---------------------------------------------------------------------------
# the fixture


def build(case, base, tokens, targets, gen, config_records, out):
    adapters = init_adapters(case, base, gen)
    frozen = {k: v.detach() for k, v in base.items()}

    w = Writer()
    for name, t in config_records:
        w.record(name, t)
    w.record("lora", torch.tensor([case.r, 0], dtype=torch.int32))
    w.record("lora_f", torch.tensor([case.alpha, case.scaling], dtype=torch.float64))
    w.record("adamw", torch.tensor([llama.LR, llama.BETA1, llama.BETA2, llama.EPS,
                                    llama.WEIGHT_DECAY, llama.MAX_GRAD_NORM], dtype=torch.float64))
    w.record("tokens", tokens)
    w.record("targets", targets)
    for name, _, _, _ in case.specs:
        w.record("param/" + name, base[name])
    for row in case.adapted():
        for ab, t in zip(("lora_A", "lora_B"), adapters[row]):
            w.record("param/" + case.peft_name(row, ab), t)

    logits, loss = case.forward(frozen, tokens, targets, lora_fn(case, adapters))
    loss.backward()
    w.record("logits", logits)
    w.record("loss", loss.reshape(1))
    for row in case.adapted():
        for ab, t in zip(("lora_A", "lora_B"), adapters[row]):
            assert t.grad.abs().max().item() > 1e-3  # B != 0: lora_A's gradient is not zero
            w.record("grad/" + case.peft_name(row, ab), t.grad)
    merged = {}
    with torch.no_grad():
        for row in case.adapted():
            merged[row] = merged_weight(case, frozen[row], *adapters[row])
            w.record("merged/" + row, merged[row])

    # self-checks (they do not touch the values or gradients)
    with torch.no_grad():
        _, base_loss = case.forward(frozen, tokens, targets, None)
    assert abs(base_loss.item() - loss.item()) > 1e-2  # the adapters matter
    msg = "float32 loss rel diff %.2g, finite differences rel %.2g, merged logits err %.2g" % (
        check_float32(case, base, adapters, tokens, targets, loss),
        check_finite_diff(case, frozen, adapters, tokens, targets),
        check_merged(case, frozen, merged, tokens, targets, logits))

    # training: fresh copies of the initial adapters, the base frozen
    train = {r: tuple(t.detach().clone().requires_grad_(True) for t in ab)
             for r, ab in adapters.items()}
    params = [t for row in case.adapted() for t in train[row]]
    opt = torch.optim.AdamW(params, lr=llama.LR, betas=(llama.BETA1, llama.BETA2),
                            eps=llama.EPS, weight_decay=llama.WEIGHT_DECAY)
    step_losses, step_norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        _, l = case.forward(frozen, tokens, targets, lora_fn(case, train))
        l.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=llama.MAX_GRAD_NORM)
        opt.step()
        step_losses.append(l.item())
        step_norms.append(norm.item())
    assert step_losses[0] == loss.item()
    assert all(t.grad is None for t in frozen.values())
    w.record("step_losses", torch.tensor(step_losses, dtype=torch.float64))
    w.record("step_grad_norms", torch.tensor(step_norms, dtype=torch.float64))
    for row in case.adapted():
        for ab, t in zip(("lora_A", "lora_B"), train[row]):
            w.record("final/" + case.peft_name(row, ab), t)

    with open(out, "wb") as f:
        f.write(w.buf)
    print("wrote %s (%d bytes, %d records, %d adapted modules, scaling %g)" % (
        out, len(w.buf), len(w.names), len(case.adapted()), case.scaling))
    print("  %s" % msg)
    print("  loss %.6f (base alone %.6f); step losses %s" % (
        loss.item(), base_loss.item(), " ".join("%.4f" % x for x in step_losses)))
    print("  grad norms %s" % " ".join("%.4f" % x for x in step_norms))


def build_llama(out):
    cfg = llama.Cfg(max_t=16, v=64, l=2, nh=4, nkv=2, c=16, i=24, b=2, t=16, steps=STEPS, tie=0)
    gen = torch.Generator().manual_seed(llama.SEED)
    base = llama.init_params(cfg, gen)
    tokens, targets = llama.make_data(cfg, gen)
    case = Case(llama.param_specs(cfg), "model.", False, llama.W_STD,
                lambda p, x, y, f: llama.forward(cfg, p, x, y, f), LLAMA_LORA)
    config = [
        ("config", torch.tensor([cfg.MAX_T, cfg.V, cfg.L, cfg.NH, cfg.NKV, cfg.C, cfg.I, cfg.B,
                                 cfg.T, cfg.STEPS, cfg.TIE], dtype=torch.int32)),
        ("config_f", torch.tensor([llama.RMS_EPS, llama.ROPE_THETA], dtype=torch.float64)),
    ]
    build(case, base, tokens, targets, gen, config, out)


def build_gpt2(out):
    gen = torch.Generator().manual_seed(gpt2.SEED)
    base = gpt2.init_params(gen)
    tokens = torch.randint(0, gpt2.V, (gpt2.B, gpt2.T), generator=gen)
    targets = torch.randint(0, gpt2.V, (gpt2.B, gpt2.T), generator=gen)
    targets[0, gpt2.T // 2 - 1] = IGNORE
    targets[1, gpt2.T - 3:] = IGNORE
    case = Case(gpt2.param_specs(), "transformer.", True, gpt2.W_STD, gpt2.forward, GPT2_LORA)
    config = [("config", torch.tensor([gpt2.MAX_T, gpt2.V, gpt2.L, gpt2.NH, gpt2.C, gpt2.B,
                                       gpt2.T, STEPS], dtype=torch.int32))]
    build(case, base, tokens, targets, gen, config, out)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests/fixtures")
    torch.set_num_threads(1)  # fixed reduction order: byte-identical output
    os.makedirs(out_dir, exist_ok=True)
    build_llama(os.path.join(out_dir, "lora_llama_tiny.bin"))
    build_gpt2(os.path.join(out_dir, "lora_gpt2_tiny.bin"))


if __name__ == "__main__":
    main()
