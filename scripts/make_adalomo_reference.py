#!/usr/bin/python3
"""make_adalomo_reference.py: the PyTorch reference for fitlm's AdaLomo rule.

Run with Debian's interpreter, which has python3-torch:

    /usr/bin/python3 scripts/make_adalomo_reference.py [out]
        # default tests/fixtures/adalomo_ref.bin

It applies AdaLomo's update, written out here after AdaLomo.fuse_update in
OpenLMLab/LOMO's lomo_optim/adalomo.py (loss_scale and clipping aside, which
fitlm folds into the gradient it hands the rule), to two tensors for STEPS
steps with known gradients:

    w  a 7x5 matrix, weight decay on (fitlm: an FL_PARAM_DECAY row)
    b  a vector of 6, no weight decay (fitlm: a row without FL_PARAM_DECAY;
       the reference decays every tensor when weight_decay > 0)

Per tensor at step t: beta2t = 1 - t^decay_rate; u = g^2 + eps1; a matrix
keeps exp_avg_sq_row (mean of u over the last dim) and exp_avg_sq_col (mean
over the first), v = rsqrt(row / mean(row)) (x) rsqrt(col); a vector keeps
exp_avg_sq; u = g * v (rsqrt form); u /= max(1, RMS(u) / clip_threshold);
lr_t = lr * max(eps2, RMS(p)); p = p * (1 - lr_t*wd) - lr_t*u.

The weights and gradients are drawn in float32 (exact in the fixture) and
everything is computed in float64, so the stored weights are the exact truth
rounded once to float32. The hyperparameters are rounded to float32 first.

Records (FITLMREF, the format of make_reference.py): "hyper" float32 [lr,
eps1, eps2, clip_threshold, decay_rate, weight_decay]; "param/w" (7,5),
"param/b" (6) the initial weights; "grad/<step>/w", "grad/<step>/b" the
gradients of steps 1..STEPS; "after/<step>/w", "after/<step>/b" the weights
after each step; "state/<STEPS>/exp_avg_sq_row" (7), ".../exp_avg_sq_col"
(5), ".../exp_avg_sq" (6) the state after the last step.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_reference import Writer, f32  # noqa: E402

STEPS = 5
LR, EPS1, EPS2 = f32(1e-2), f32(1e-30), f32(1e-3)
CLIP_THRESHOLD, DECAY_RATE, WD = f32(1.0), f32(-0.8), f32(0.1)


def approx_sq_grad(row, col):
    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor)


def rms(t):
    return t.norm(2) / (t.numel() ** 0.5)


def adalomo_step(p, g, state, step, decay):
    """One AdaLomo update of tensor p (float64) in place."""
    beta2t = 1.0 - step ** DECAY_RATE
    update = g**2 + EPS1
    if p.dim() > 1:
        state["row"].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
        state["col"].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
        update = approx_sq_grad(state["row"], state["col"])
        update.mul_(g)
    else:
        state["sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
        update = state["sq"].rsqrt().mul_(g)
    update.div_((rms(update) / CLIP_THRESHOLD).clamp_(min=1.0))
    lr = LR * max(EPS2, rms(p).item())
    if decay:
        p.mul_(1.0 - lr * WD)
    p.add_(update, alpha=-lr)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "adalomo_ref.bin")
    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(7, 5, generator=gen, dtype=torch.float32)
    b = 1.0 + 0.1 * torch.randn(6, generator=gen, dtype=torch.float32)
    b[3] = 0.0  # an exact zero weight
    wr = Writer()
    wr.record("hyper", torch.tensor([LR, EPS1, EPS2, CLIP_THRESHOLD, DECAY_RATE, WD],
                                    dtype=torch.float64))
    wr.record("param/w", w)
    wr.record("param/b", b)
    pw, pb = w.double(), b.double()
    sw = {"row": torch.zeros(7, dtype=torch.float64), "col": torch.zeros(5, dtype=torch.float64)}
    sb = {"sq": torch.zeros(6, dtype=torch.float64)}
    for step in range(1, STEPS + 1):
        # gradients of different scales per step; one large enough to clip
        scale = [0.5, 3.0, 0.01, 1.0, 20.0][step - 1]
        gw = (scale * torch.randn(7, 5, generator=gen)).to(torch.float32)
        gb = (scale * torch.randn(6, generator=gen)).to(torch.float32)
        gw[2, 1] = 0.0  # an exact zero gradient
        wr.record("grad/%d/w" % step, gw)
        wr.record("grad/%d/b" % step, gb)
        adalomo_step(pw, gw.double(), sw, step, True)
        adalomo_step(pb, gb.double(), sb, step, False)
        wr.record("after/%d/w" % step, pw)
        wr.record("after/%d/b" % step, pb)
    wr.record("state/%d/exp_avg_sq_row" % STEPS, sw["row"])
    wr.record("state/%d/exp_avg_sq_col" % STEPS, sw["col"])
    wr.record("state/%d/exp_avg_sq" % STEPS, sb["sq"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "wb") as f:
        f.write(wr.buf)
    print("wrote %s (%d bytes, %d records)" % (out, len(wr.buf), len(wr.names)))
    print("  w moved by %.3g, b by %.3g (max abs)" % ((pw - w.double()).abs().max().item(),
                                                      (pb - b.double()).abs().max().item()))


if __name__ == "__main__":
    main()
