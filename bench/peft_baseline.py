#!/usr/bin/env python3
"""bench/peft_baseline.py: LoRA / QLoRA training speed and peak memory of
Hugging Face transformers + PEFT, the baseline beside `fitlm train --lora`
in bench/gpu_memory.sh.

A LLaMA shape from the flags with random weights (no downloads), bf16,
LoRA adapters (PEFT's LoraConfig) on --targets, AdamW on the adapters,
random tokens of the vocabulary; --quant nf4 stores the base's linears in
4 bits through bitsandbytes (the model is saved to a scratch directory
and reloaded with BitsAndBytesConfig, the one way transformers quantises
a model). --ckpt block recomputes each decoder layer in the backward pass
(gradient_checkpointing_enable), as fitlm's --activation-checkpointing
block.

Prints one line "RESULT tok_s=... ms_median=... peak_gpu_mib=... loss_first=...
loss_last=..." (peak: torch.cuda.max_memory_allocated; on the cpu 0), or
"SKIP reason" with exit 0 when a package it needs is missing.
"""
import argparse
import statistics
import sys
import tempfile
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--L", type=int, required=True, help="decoder layers")
    p.add_argument("--C", type=int, required=True, help="hidden size")
    p.add_argument("--NH", type=int, required=True, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (0: NH)")
    p.add_argument("--I", type=int, required=True, help="MLP intermediate size")
    p.add_argument("--V", type=int, default=32000, help="vocabulary")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--quant", choices=["none", "nf4"], default="none")
    p.add_argument("--ckpt", choices=["none", "block"], default="none")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()

    try:
        import torch
        import transformers
        import peft
    except ImportError as e:
        print(f"SKIP {e.name} is not installed")
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIP torch sees no CUDA device")
        return 0
    if a.quant == "nf4":
        try:
            import bitsandbytes  # noqa: F401 (transformers' 4-bit layers)
        except ImportError:
            print("SKIP bitsandbytes is not installed (QLoRA's 4-bit layers)")
            return 0

    dev = torch.device(a.device)
    config = transformers.LlamaConfig(
        vocab_size=a.V, hidden_size=a.C, intermediate_size=a.I, num_hidden_layers=a.L,
        num_attention_heads=a.NH, num_key_value_heads=a.kv_heads or a.NH,
        max_position_embeddings=max(a.T, 2048), rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with dev:  # the weights drawn where they live
        model = transformers.AutoModelForCausalLM.from_config(config)
    if a.quant == "nf4":
        bnb = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            model = transformers.AutoModelForCausalLM.from_pretrained(
                d, quantization_config=bnb, device_map={"": dev.index or 0})
    model.config.use_cache = False
    if a.ckpt == "block":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none",
                           target_modules=a.targets.split(","), task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    # fp32 adapters and state, as fitlm keeps them
    for q in params:
        q.data = q.data.float()
    opt = torch.optim.AdamW(params, lr=a.lr, fused=dev.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    times, losses = [], []
    for step in range(a.warmup + a.steps):
        x = torch.randint(0, a.V, (a.B, a.T), generator=gen).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss  # the model shifts the labels
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ms = statistics.median(times) * 1000
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0
    print(f"RESULT tok_s={a.B * a.T / (ms / 1000):.0f} ms_median={ms:.2f} peak_gpu_mib={peak:.0f} "
          f"loss_first={losses[0]:.4f} loss_last={losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
