#!/usr/bin/env python3
"""bench/make_hf_gpt2.py: writes a GPT-2-shaped Hugging Face directory
(config.json + model.safetensors, bf16), as save_pretrained lays it out, for
timing how long a model takes to open (bench/init_from.sh). The weights are
one block of N(0, 0.02) values repeated: what is timed is reading and
converting them, not what they are. Standard library only.

    python3 bench/make_hf_gpt2.py DIR [n_layer n_head n_embd vocab n_ctx]
    (default: GPT-2 XL, 48 1600 25 50257 1024: 1.56 B parameters, 3.1 GB)
"""
import array
import json
import os
import random
import struct
import sys

BLOCK = 1 << 20  # values in the repeated block


def tensors(n_layer, n_embd, vocab, n_ctx):
    """(name, shape) in save_pretrained's order; Conv1D weights are (in, out)."""
    C = n_embd
    out = [("transformer.wte.weight", [vocab, C]), ("transformer.wpe.weight", [n_ctx, C])]
    for l in range(n_layer):
        h = f"transformer.h.{l}."
        out += [(h + "ln_1.weight", [C]), (h + "ln_1.bias", [C]),
                (h + "attn.c_attn.weight", [C, 3 * C]), (h + "attn.c_attn.bias", [3 * C]),
                (h + "attn.c_proj.weight", [C, C]), (h + "attn.c_proj.bias", [C]),
                (h + "ln_2.weight", [C]), (h + "ln_2.bias", [C]),
                (h + "mlp.c_fc.weight", [C, 4 * C]), (h + "mlp.c_fc.bias", [4 * C]),
                (h + "mlp.c_proj.weight", [4 * C, C]), (h + "mlp.c_proj.bias", [C])]
    return out + [("transformer.ln_f.weight", [C]), ("transformer.ln_f.bias", [C])]


def bf16_block():
    rng = random.Random(1)
    f = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(BLOCK)))
    bits = array.array("I")
    bits.frombytes(f.tobytes())
    return array.array("H", (b >> 16 for b in bits)).tobytes()  # bf16: the top half


def main():
    d = sys.argv[1]
    n_layer, n_head, n_embd, vocab, n_ctx = (int(x) for x in sys.argv[2:7]) if len(
        sys.argv) > 2 else (48, 25, 1600, 50257, 1024)
    os.makedirs(d, exist_ok=True)
    config = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
              "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": n_ctx,
              "n_embd": n_embd, "n_head": n_head, "n_inner": None, "n_layer": n_layer,
              "n_positions": n_ctx, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "vocab_size": vocab}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    header, at = {}, 0
    ts = tensors(n_layer, n_embd, vocab, n_ctx)
    for name, shape in ts:
        n = 1
        for s in shape:
            n *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + 2 * n]}
        at += 2 * n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    block = bf16_block()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left = at
        while left:
            piece = block if left >= len(block) else block[:left]
            f.write(piece)
            left -= len(piece)
    print(f"{d}: {at // 2} parameters ({at / 1e9:.2f} GB bf16), {len(ts)} tensors")


main()
