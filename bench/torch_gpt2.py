#!/usr/bin/python3
"""torch_gpt2.py: the PyTorch side of bench/train.sh.

The same GPT-2 as fitlm's (fused qkv Linear, causal self-attention as masked
softmax, GELU tanh, pre-LayerNorm blocks, LM head tied to wte), random
weights and the batch bench_train uses (the first B windows of T+1 GPT-2
tokens of fitlm's Brown shards) on the CPU, and the same training step:
zero_grad, forward, backward, clip_grad_norm_(1.0), AdamW step (lr 1e-4,
betas 0.9/0.95, eps 1e-8, weight decay 0.1 on wte and the four matrices of
each block, as fitlm). ms/step is the median of --steps timed steps after
--warmup untimed ones.

--precision fp32 (default) runs everything in fp32. --precision bf16 is
PyTorch's CPU mixed precision: torch.autocast("cpu", dtype=torch.bfloat16)
around forward + loss (autocast runs the Linear/matmul ops in bf16 and keeps
LayerNorm, softmax and the loss in fp32), backward outside it, fp32
parameters, gradients and AdamW state (no loss scaling: bf16 has fp32's
range).

--arch llama (with --kv-heads, --I, --tie) is fitlm's LLaMA instead
(src/model/llama.c, Hugging Face's LlamaForCausalLM): no biases, RMSNorm
(eps 1e-5, fitlm's default), rotary embeddings (theta 1e4, rotate-half),
grouped-query attention, a SwiGLU MLP of hidden size --I (fitlm's default
4C), an LM head untied unless --tie 1 (fitlm's default), N(0, 0.02) for every
matrix and embedding; AdamW's weight decay on the embedding, the LM head and
every block matrix, none on the norms (fitlm's FL_PARAM_DECAY rows). The
vocabulary is GPT-2's (--V 50257), so both engines read the same batch.

MFU is against --peak (fp32 FMA) for fp32 and --peak-bf16 (vdpbf16ps) for
bf16, as bench_train; both, and --peak-amx's, are in the RESULT line.

--device cuda runs the same model and step on an NVIDIA GPU, the baseline
a GPU engine is measured against (PyTorch's fast path there, as a user
would write it): autocast("cuda", bf16) under --precision bf16, AdamW with
fused=True, --compile wraps the model in torch.compile; every timestamp
waits for the GPU (torch.cuda.synchronize), and the peak is
torch.cuda.max_memory_allocated. --data random draws the batch's tokens
(seeded) instead of reading fitlm's shards, for a machine without them.

    OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 bench/torch_gpt2.py --B 8 --T 256 \
        --steps 7 --warmup 2 --threads 2 --precision bf16 --peak 410 --peak-bf16 213

Run it with /usr/bin/python3 (Debian's python3-torch). OMP_WAIT_POLICY must
be in the environment before torch loads; this script sets it to PASSIVE
(PyTorch's fastest setting on this 2-core machine) when it is unset.

The last line is machine-readable: "RESULT engine=pytorch key=value ...";
cpus= is the CPUs the timed steps kept busy (CPU seconds of all the
process's threads per wall second), as in bench_train's.
"""
import argparse
import math
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before libgomp loads with torch

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def first_windows(data, B, T):
    """The first B windows of T+1 tokens of DIR/train_000000.bin (a fitlm shard:
    64-byte header, then little-endian tokens of the width at bytes 16-19),
    windows starting every T tokens, as fitlm's loader cuts them."""
    path = os.path.join(data, "train_000000.bin") if os.path.isdir(data) else data
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:8] != b"FITLMTOK":
            sys.exit(f"torch_gpt2: {path} is not a fitlm token shard")
        width = int.from_bytes(head[16:20], "little")
        raw = f.read((B * T + 1) * width)
    if len(raw) < (B * T + 1) * width:
        sys.exit(f"torch_gpt2: {path} holds fewer than {B * T + 1} tokens")
    ids = [int.from_bytes(raw[i:i + width], "little") for i in range(0, len(raw), width)]
    return torch.tensor([ids[b * T:b * T + T + 1] for b in range(B)], dtype=torch.long)


class CausalSelfAttention(nn.Module):
    def __init__(self, C, NH, maxT):
        super().__init__()
        self.NH = NH
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.has_sdpa = hasattr(F, "scaled_dot_product_attention")
        if not self.has_sdpa:  # torch < 2.0: manual masked softmax
            mask = torch.tril(torch.ones(maxT, maxT, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, maxT, maxT), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        HS = C // self.NH
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.NH, HS).transpose(1, 2)  # (B, NH, T, HS)
        k = k.view(B, T, self.NH, HS).transpose(1, 2)
        v = v.view(B, T, self.NH, HS).transpose(1, 2)
        if self.has_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, NH, maxT):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C)
        self.attn = CausalSelfAttention(C, NH, maxT)
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, L, C, NH, V, maxT):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(maxT, C)
        self.h = nn.ModuleList([Block(C, NH, maxT) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # GPT-2 init, as fitlm's GPT-2 table (src/model/gpt2.c): N(0, 0.02), residual projections
        # N(0, 0.02/sqrt(2L)), biases 0, LayerNorm 1/0
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L))
            elif name.endswith(".weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.startswith("ln") or ".ln_" in name:
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# LLaMA, after scripts/make_llama_reference.py's functional definition
# (rope_cos_sin, rotate_half, rmsnorm, repeat_kv, forward), as modules.


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    """(B, NKV, T, HS) -> (B, NKV*n_rep, T, HS); head h = kv head h // n_rep."""
    if n_rep == 1:
        return x
    B, nkv, T, hs = x.shape
    return x[:, :, None, :, :].expand(B, nkv, n_rep, T, hs).reshape(B, nkv * n_rep, T, hs)


class LlamaAttention(nn.Module):
    def __init__(self, C, NH, NKV, maxT):
        super().__init__()
        self.NH, self.NKV, self.HS = NH, NKV, C // NH
        self.q_proj = nn.Linear(C, NH * self.HS, bias=False)
        self.k_proj = nn.Linear(C, NKV * self.HS, bias=False)
        self.v_proj = nn.Linear(C, NKV * self.HS, bias=False)
        self.o_proj = nn.Linear(NH * self.HS, C, bias=False)
        self.has_sdpa = hasattr(F, "scaled_dot_product_attention")
        if not self.has_sdpa:
            mask = torch.tril(torch.ones(maxT, maxT, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, maxT, maxT), persistent=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        NH, NKV, HS = self.NH, self.NKV, self.HS
        q = self.q_proj(x).view(B, T, NH, HS).transpose(1, 2)
        k = self.k_proj(x).view(B, T, NKV, HS).transpose(1, 2)
        v = self.v_proj(x).view(B, T, NKV, HS).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV)
        if self.has_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, NH * HS))


class LlamaMLP(nn.Module):
    def __init__(self, C, I):
        super().__init__()
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, C, NH, NKV, I, maxT, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = LlamaAttention(C, NH, NKV, maxT)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.mlp = LlamaMLP(C, I)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, L, C, NH, NKV, I, V, maxT, tie, eps=1e-5, theta=10000.0):
        super().__init__()
        self.HS, self.theta = C // NH, theta
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList([LlamaBlock(C, NH, NKV, I, maxT, eps) for _ in range(L)])
        self.norm = RMSNorm(C, eps)
        self.lm_head = nn.Linear(C, V, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight
        # fitlm's LLaMA table (src/model/llama.c): N(0, 0.02) for every matrix and the
        # embedding, RMSNorm weights 1
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        # LlamaRotaryEmbedding (default rope type), in fp32: (T, HS) each
        HS = self.HS
        dev = idx.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, HS, 2, dtype=torch.int64, device=dev).float() / HS))
        freqs = torch.arange(T, dtype=torch.int64, device=dev).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: torch.autocast('cpu', dtype=torch.bfloat16) around forward+loss")
    ap.add_argument("--peak", type=float, default=0.0, help="fp32 peak GFLOP/s for MFU (peak_fma)")
    ap.add_argument("--peak-bf16", type=float, default=0.0,
                    help="bf16 dot-product peak GFLOP/s, the MFU denominator under bf16")
    ap.add_argument("--peak-amx", type=float, default=0.0, help="AMX-BF16 peak GFLOP/s")
    ap.add_argument("--L", type=int, default=12)
    ap.add_argument("--C", type=int, default=768)
    ap.add_argument("--NH", type=int, default=12)
    ap.add_argument("--V", type=int, default=50257)
    ap.add_argument("--maxT", type=int, default=1024)
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="LLaMA: key/value heads (GQA); 0 = --NH, fitlm's default")
    ap.add_argument("--I", type=int, default=0,
                    help="LLaMA: SwiGLU hidden size; 0 = 4*C, fitlm's default")
    ap.add_argument("--tie", type=int, choices=(0, 1), default=0,
                    help="LLaMA: LM head tied to the embedding (fitlm's default: 0)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True)")
    ap.add_argument("--data", default="data/brown_gpt2",
                    help="fitlm token shards; the batch is their first B windows; random: drawn")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model)")
    a = ap.parse_args()
    if min(a.B, a.T, a.steps, a.threads) < 1 or a.warmup < 0 or a.T > a.maxT:
        sys.exit("torch_gpt2: bad shape or step counts")
    llama = a.arch == "llama"
    if not llama and (a.kv_heads or a.I or a.tie):
        sys.exit("torch_gpt2: --kv-heads, --I and --tie are LLaMA's (--arch llama)")
    NKV = a.kv_heads or a.NH
    I = a.I or 4 * a.C
    if llama and (a.NH % NKV or (a.C // a.NH) % 2):
        sys.exit("torch_gpt2: --kv-heads must divide --NH, and C/NH must be even (RoPE)")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    L, C, V, T = a.L, a.C, a.V, a.T
    KV = NKV * (C // a.NH)  # k's (and v's) width
    if llama:
        flops_formula = (f"6*(L*(2*C^2 + 2*C*KV + 3*C*I) + V*C) + 12*L*T*C with KV = {KV}, "
                         f"I = {I}")
        flops_per_token = 6 * (L * (2 * C * C + 2 * C * KV + 3 * C * I) + V * C) + 12 * L * T * C
    else:
        flops_formula = "6*(12*L*C^2 + V*C) + 12*L*T*C"
        flops_per_token = 6 * (12 * L * C * C + V * C) + 12 * L * T * C
    tokens_per_step = a.B * a.T

    if llama:
        model = Llama(a.L, a.C, a.NH, NKV, I, a.V, a.maxT, a.tie)
        # fitlm's FL_PARAM_DECAY rows: every matrix and the embedding, not the norms
        decay_names = {n for n, p in model.named_parameters() if p.dim() == 2}
    else:
        model = GPT2(a.L, a.C, a.NH, a.V, a.maxT)
        decay_names = {"wte.weight"} | {
            f"h.{i}.{m}.weight"
            for i in range(a.L)
            for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        }
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
    groups = [
        {"params": [p for n, p in params.items() if n in decay_names], "weight_decay": 0.1},
        {"params": [p for n, p in params.items() if n not in decay_names], "weight_decay": 0.0},
    ]
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("torch_gpt2: --device cuda, but PyTorch finds no CUDA GPU")
    if a.compile and not hasattr(torch, "compile"):
        sys.exit(f"torch_gpt2: --compile needs PyTorch 2 (this is {torch.__version__})")
    model = model.to(a.device)
    opt_kw = {"foreach": True} if a.foreach else {"fused": True} if cuda else {}
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **opt_kw)
    nparams = sum(p.numel() for p in params.values())

    if a.data == "random":
        tok = torch.randint(0, a.V, (a.B, a.T + 1), generator=torch.Generator().manual_seed(a.seed))
    else:
        tok = first_windows(a.data, a.B, a.T)
    inputs, targets = tok[:, :-1].contiguous().to(a.device), tok[:, 1:].contiguous().to(a.device)
    step_model = torch.compile(model) if a.compile else model

    def sync():  # a timestamp means the GPU's work so far is done
        if cuda:
            torch.cuda.synchronize()

    shape = (f"LLaMA L={a.L} C={a.C} NH={a.NH} KV heads={NKV} SwiGLU I={I} V={a.V} (GPT-2's "
             f"vocabulary) LM head {'tied' if a.tie else 'untied'}, RMSNorm eps 1e-05, RoPE theta "
             f"10000" if llama else f"GPT-2 L={a.L} C={a.C} NH={a.NH} V={a.V}")
    print(
        f"pytorch {torch.__version__} train bench: {shape} "
        f"maxT={a.maxT} | B={a.B} T={a.T} | "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}{', torch.compile' if a.compile else ''}"
        f" | {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | "
        f"{a.warmup} warm-up + {a.steps} timed steps | "
        f"attention {'sdpa' if hasattr(F, 'scaled_dot_product_attention') else 'masked softmax'}"
    )
    bf16 = a.precision == "bf16"
    peak_kind = "bf16" if bf16 else "fp32"
    peak = a.peak_bf16 if bf16 else a.peak
    print(
        "step = zero_grad(set_to_none) + "
        f"{f'autocast({a.device}, bf16)[forward + loss]' if bf16 else 'forward'} + backward + "
        "clip_grad_norm_(1.0) + "
        f"AdamW(lr 1e-4, betas 0.9/0.95, eps 1e-8, wd 0.1{''.join(f', {k}' for k in opt_kw)})"
    )
    print(f"FLOPs/token = {flops_formula}: {flops_per_token:.4g}; "
          f"peaks (given, GFLOP/s): fp32 {a.peak:.1f}, bf16 {a.peak_bf16:.1f}, "
          f"AMX {a.peak_amx:.1f}; MFU against the {peak_kind} peak")
    print(f"{nparams} parameters ({nparams / 1e6:.2f} M)", flush=True)

    ms, ms_fwd, ms_bwd, ms_opt = [], [], [], []
    first_loss = last_loss = float("nan")
    total = a.warmup + a.steps
    cpu_timed = wall_timed = 0.0  # CPU seconds of all threads, wall seconds
    for s in range(total):
        sync()
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = step_model(inputs, targets)
        else:
            loss = step_model(inputs, targets)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        t3, c3 = time.perf_counter(), time.process_time()
        lv = loss.item()
        if s == 0:
            first_loss = lv
        last_loss = lv
        timed = s >= a.warmup
        print(
            f"step {s + 1:2d}/{total} {'' if timed else 'warm-up':7s} | loss {lv:.4f} | "
            f"norm {norm.item():.3f} | {(t3 - t0) * 1e3:.1f} ms (fwd {(t1 - t0) * 1e3:.1f}, "
            f"bwd {(t2 - t1) * 1e3:.1f}, clip+adamw {(t3 - t2) * 1e3:.1f})",
            flush=True,
        )
        if timed:
            cpu_timed += c3 - c0
            wall_timed += t3 - t0
            ms.append((t3 - t0) * 1e3)
            ms_fwd.append((t1 - t0) * 1e3)
            ms_bwd.append((t2 - t1) * 1e3)
            ms_opt.append((t3 - t2) * 1e3)

    med, lo, hi = statistics.median(ms), min(ms), max(ms)
    tok_s = tokens_per_step / (med / 1e3)
    gflops = flops_per_token * tok_s / 1e9
    def mfu_of(p):
        return gflops / p if p > 0 else 0.0

    mfu = mfu_of(peak)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    mf, mb, mo = statistics.median(ms_fwd), statistics.median(ms_bwd), statistics.median(ms_opt)
    print(
        f"median {med:.1f} ms/step (min {lo:.1f}, max {hi:.1f}; fwd {mf:.1f}, bwd {mb:.1f}, "
        f"clip+adamw {mo:.1f}) | {tok_s:.1f} tok/s | {gflops:.1f} GFLOP/s | "
        f"MFU {100 * mfu:.1f}% of the {peak_kind} peak {peak:.1f} (fp32 "
        f"{100 * mfu_of(a.peak):.1f}%, bf16 {100 * mfu_of(a.peak_bf16):.1f}%, AMX "
        f"{100 * mfu_of(a.peak_amx):.1f}%) | peak RSS {rss_mib:.0f} MiB"
        + (f" | peak GPU memory {gpu_mib:.0f} MiB" if cuda else "")
    )
    print(
        f"RESULT engine=pytorch arch={a.arch} precision={a.precision} B={a.B} T={a.T} threads={a.threads} "
        f"steps={a.steps} "
        f"warmup={a.warmup} ms_median={med:.2f} ms_min={lo:.2f} ms_max={hi:.2f} "
        f"ms_fwd={mf:.2f} ms_bwd={mb:.2f} ms_opt={mo:.2f} tok_s={tok_s:.2f} "
        f"flops_per_token={flops_per_token} gflops={gflops:.2f} peak={peak_kind} "
        f"peak_gflops={peak:.1f} mfu={mfu:.4f} peak_fp32_gflops={a.peak:.1f} "
        f"peak_bf16_gflops={a.peak_bf16:.1f} peak_amx_gflops={a.peak_amx:.1f} "
        f"mfu_fp32={mfu_of(a.peak):.4f} mfu_bf16={mfu_of(a.peak_bf16):.4f} "
        f"mfu_amx={mfu_of(a.peak_amx):.4f} peak_rss_mib={rss_mib:.0f} loss_first={first_loss:.4f} "
        f"loss_last={last_loss:.4f} torch={torch.__version__} "
        f"omp_wait_policy={os.environ.get('OMP_WAIT_POLICY')} cpus={cpu_timed / wall_timed:.2f}"
        f" device={a.device} compile={int(a.compile)} peak_gpu_mib={gpu_mib:.0f}"
        + (f" L={a.L} C={a.C} NH={a.NH} kv_heads={NKV} I={I} V={a.V} tie={a.tie}" if llama else "")
    )


if __name__ == "__main__":
    main()
