#!/usr/bin/env python3
"""bench/torch_attention.py: PyTorch's causal scaled_dot_product_attention on
the GPU at the shapes bench_gpu_attention times fitlm's kernels on (called
by bench/gpu.sh): the forward, and the backward alone (autograd.grad of a
kept graph), the mean of --rounds calls after one between CUDA events.
Grouped-query heads are expanded to the query heads first (not timed), so
that every backend takes them; the FLOPs counted are FlashAttention's
causal ones, as bench_gpu_attention counts them. The backend is
FlashAttention where PyTorch has it for the shape, else its choice.

Prints one line: RESULT engine=torch-sdpa backend=B fwd_ms=.. bwd_ms=..
fwd_tflops=.. bwd_tflops=..
"""
import argparse
import sys


def main():
    p = argparse.ArgumentParser()
    for name in ("B", "T", "NH", "HS"):
        p.add_argument("--" + name, type=int, required=True)
    p.add_argument("--NKV", type=int, default=0)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    nkv = a.NKV or a.NH
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("torch_attention.py: no GPU", file=sys.stderr)
        return 1
    dt = torch.bfloat16 if a.precision == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(1234)

    def rand(heads):
        return torch.rand(a.B, heads, a.T, a.HS, device="cuda", dtype=dt, generator=g) * 2 - 1

    q = rand(a.NH).requires_grad_()
    k = rand(nkv).repeat_interleave(a.NH // nkv, dim=1).requires_grad_()
    v = rand(nkv).repeat_interleave(a.NH // nkv, dim=1).requires_grad_()
    dout = rand(a.NH)

    backend = "default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        backend = "flash"
    except Exception:  # no FlashAttention for this shape or build: PyTorch's choice
        pass

    def attend():
        if backend == "flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def timed(call):
        call()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.rounds):
            call()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / a.rounds

    with torch.no_grad():
        fwd = timed(attend)
    out = attend()
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    flops = 2.0 * a.B * a.NH * a.T * a.T * a.HS
    print(f"RESULT engine=torch-sdpa backend={backend} fwd_ms={fwd:.4f} bwd_ms={bwd:.4f} "
          f"fwd_tflops={flops / fwd / 1e9:.1f} bwd_tflops={2.5 * flops / bwd / 1e9:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
