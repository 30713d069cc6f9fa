#!/usr/bin/python3
"""make_nf4_reference.py: the bitsandbytes reference for fitlm's NF4 kernels.

Run with Debian's interpreter (numpy; torch is only used for a side check):

    /usr/bin/python3 scripts/make_nf4_reference.py [out]   # default tests/fixtures/nf4_ref.bin
    /usr/bin/python3 scripts/make_nf4_reference.py --c-table   # dq8_map as C, for src/kernels/nf4.c

bitsandbytes is not installed here, so its NF4 quantisation and double
quantisation are written out in numpy from its sources, every step in
float32 as bitsandbytes computes it:

- the NF4 codebook: bitsandbytes/functional.py get_4bit_type("nf4") (the
  same floats as csrc/kernels.cu dDequantizeNF4);
- quantize_4bit: absmax = max |w| per block, s = w * (1 / absmax) in fp32
  (csrc/kernels.cu kQuantizeBlockwise: local_abs_max = 1.0f/local_abs_max),
  code = dQuantizeNF4(s): the number of its 15 fp32 thresholds strictly
  below s (the decision tree compares x > threshold, so a value on a
  threshold takes the lower code); two codes per byte, the first element in
  the high nibble (qvals[j] = q(vals[2j]) << 4 | q(vals[2j+1])), an odd tail
  padded with code 7 (0.0). An all-zero block has absmax 0: fitlm codes it 7
  (bitsandbytes' CUDA kernel computes 0 * inf = NaN there and stores code 0,
  -1.0; both dequantise to 0);
- dequantize_4bit: codebook[code] * absmax in fp32;
- compress_statistics (quantize_4bit's double quantisation): offset =
  mean(absmax) (here summed in double, then rounded to fp32), absmax - offset
  in fp32, quantize_blockwise with blocksize 256 and the map of
  create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
  nested = max |x| per block, x * (1 / nested) in fp32, the nearest map value
  (ties to the even index; bitsandbytes' kernels never meet one in practice);
  dequantize_blockwise: map[q] * nested, then + offset, each rounded to fp32.

create_dynamic_map builds its map in float32 torch.linspace arithmetic, so
the map depends on how PyTorch rounds linspace. PyTorch 2's CPU kernel
(aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp) computes start + step*i
(end - step*(steps-1-i) for the upper half) rounded once; linspace_f32 below
does that. The result equals the 256-value tables other projects print from
bitsandbytes. The torch 1.13 of Debian vectorises linspace and rounds twice:
its map differs in the last bit of some entries (printed below as a check).

Fixture format: that of scripts/make_reference.py (tests/testref.h). Records:

    config          int32 [n, block, dq_block]
    nf4_codebook    float32 (16)
    nf4_thresholds  float32 (15)  dQuantizeNF4's thresholds
    dq8_map         float32 (256)
    w               float32 (n)   N(0, 0.02), outliers, a zero block, a block
                                  of threshold values and their fp32 successors
    codes           int32 ((n+1)/2)  packed bytes
    absmax          float32 (ceil(n/block))
    dequant         float32 (n)
    dq_codes        int32 (ceil(n/block))  absmax double-quantised
    nested_absmax   float32 (ceil(ceil(n/block)/dq_block))
    offset          float32 (1)
    absmax_dq       float32 (ceil(n/block))  dequantised absmax
    dequant_dq      float32 (n)   dequantised through absmax_dq
    dq2/in, dq2/codes, dq2/nested_absmax, dq2/offset, dq2/out: double
                    quantisation alone of 600 absmax-like values (3 blocks of
                    256, the last partial), in, codes, nested, offset, decoded

The output is deterministic: running the script twice gives a byte-identical
file.
"""

import os
import struct
import sys
from fractions import Fraction

import numpy as np

f32 = np.float32

# bitsandbytes/functional.py get_4bit_type("nf4"), csrc/kernels.cu dDequantizeNF4
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]

# csrc/kernels.cu dQuantizeNF4, in increasing order (the literals, as written)
NF4_THRESHOLDS = ["-0.8480964004993439", "-0.6106329262256622", "-0.4599952697753906",
                  "-0.33967943489551544", "-0.23460740596055984", "-0.13791173323988914",
                  "-0.045525018125772476", "0.03979014977812767", "0.1202552504837513",
                  "0.2035212516784668", "0.2920137718319893", "0.3893125355243683",
                  "0.5016634166240692", "0.6427869200706482", "0.8614784181118011"]

BLOCK = 64
DQ_BLOCK = 256
N = 3 * 64 * 5 + 17  # 977: 16 blocks, the last one partial, an odd tail
SEED = 20240523


def f32_of_decimal(s):
    """A decimal literal rounded once to float32, as a C compiler reads "...f".
    (np.float32(float(s)) would round twice, through double.)"""
    q = Fraction(s)
    x = f32(float(s))
    cands = [np.nextafter(x, f32(-np.inf)), x, np.nextafter(x, f32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))


def linspace_f32(start, end, steps):
    """torch.linspace(start, end, steps) in float32 as PyTorch 2's CPU kernel
    computes it: step = (end - start) / (steps - 1) in fp32, each element one
    rounding of start + step*i (lower half) or end - step*(steps-1-i)."""
    start, end = f32(start), f32(end)
    step = f32(f32(end - start) / f32(steps - 1))
    out = []
    for i in range(steps):
        if i < steps // 2:
            v = float(start) + float(step) * i  # exact in double, then one rounding
        else:
            v = float(end) - float(step) * (steps - 1 - i)
        out.append(f32(v))
    return np.array(out, dtype=f32)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8, linspace=linspace_f32):
    """bitsandbytes/functional.py create_dynamic_map, line for line (its tensors
    are float32; a Python scalar times a float32 tensor is rounded to fp32)."""
    data = []
    non_sign_bits = total_bits - (1 if signed else 1)
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = linspace(0.1, 1, fraction_items)
        means = ((boundaries[:-1] + boundaries[1:]) / f32(2.0)).astype(f32)
        scale = f32(10 ** (-(max_exponent_bits - 1) + i))
        data += list((scale * means).astype(f32))
        if signed:
            data += list((-scale * means).astype(f32))
    assert additional_items == 0  # signed, 7 exponent bits, 8 bits: none
    data.append(f32(0))
    data.append(f32(1.0))
    assert len(data) == 2 ** total_bits
    data.sort()
    return np.array(data, dtype=f32)


CODEBOOK = np.array(NF4, dtype=f32)
THRESHOLDS = np.array([f32_of_decimal(s) for s in NF4_THRESHOLDS], dtype=f32)
DQ8_MAP = create_dynamic_map()
# exact midpoints of the map (sums of two floats are exact in double)
DQ8_MID = (DQ8_MAP[:-1].astype(np.float64) + DQ8_MAP[1:].astype(np.float64)) / 2


def inv(a):
    """1 / a in fp32; 0 for a zero scale (no 0 * inf)."""
    return f32(1.0) / a if a > 0 else f32(0.0)


def nf4_quantize(w, block):
    n = len(w)
    nb = (n + block - 1) // block
    absmax = np.array([np.max(np.abs(w[b * block:(b + 1) * block])) for b in range(nb)], dtype=f32)
    q = np.empty(n + (n & 1), dtype=np.int64)
    for i in range(n):
        s = f32(w[i] * inv(absmax[i // block]))
        q[i] = int(np.sum(s > THRESHOLDS))
    if n & 1:
        q[n] = 7
    return q[0::2] << 4 | q[1::2], absmax


def nf4_dequantize(codes, absmax, n, block):
    q = np.stack([codes >> 4, codes & 15], axis=1).reshape(-1)[:n]
    return np.array([f32(CODEBOOK[q[i]] * absmax[i // block]) for i in range(n)], dtype=f32)


def dq8_code(x):
    """Nearest map value, ties to the even index."""
    k = int(np.searchsorted(DQ8_MID, float(x), side="left"))  # midpoints < x
    if k < 255 and DQ8_MID[k] == float(x) and k & 1:
        k += 1
    return k


def dq8_quantize(a, block):
    s = 0.0
    for v in a:  # summed in order, in double
        s += float(v)
    offset = f32(s / len(a))
    x = (a - offset).astype(f32)
    nb = (len(a) + block - 1) // block
    nested = np.array([np.max(np.abs(x[b * block:(b + 1) * block])) for b in range(nb)], dtype=f32)
    q = np.array([dq8_code(f32(x[i] * inv(nested[i // block]))) for i in range(len(a))])
    return q, nested, offset


def dq8_dequantize(q, nested, offset, block):
    return np.array([f32(f32(DQ8_MAP[q[i]] * nested[i // block]) + offset) for i in range(len(q))],
                    dtype=f32)


def make_weights():
    rng = np.random.default_rng(SEED)
    w = (rng.standard_normal(N) * 0.02).astype(f32)
    for i, v in [(5, 0.31), (200, -0.45), (701, 0.12), (960, -0.2)]:  # outliers
        w[i] = f32(v)
    w[3 * BLOCK:4 * BLOCK] = 0  # an all-zero block
    # block 5: absmax 1, so s = w exactly: each threshold (lower code) and
    # the next float up (upper code)
    b = 5 * BLOCK
    w[b:b + BLOCK] = 0
    w[b] = 1.0
    for j, t in enumerate(THRESHOLDS):
        w[b + 1 + 2 * j] = t
        w[b + 2 + 2 * j] = np.nextafter(t, f32(np.inf))
    return w


class Writer:
    """The fixture format of scripts/make_reference.py."""

    def __init__(self):
        self.buf = bytearray(b"FITLMREF" + struct.pack("<I", 1))

    def record(self, name, a):
        a = np.asarray(a)
        if a.dtype.kind == "f":
            a, dtype, fmt = a.astype("<f4"), 0, "f4"
        else:
            a, dtype, fmt = a.astype("<i4"), 1, "i4"
        nb = name.encode("ascii")
        self.buf += struct.pack("<I", len(nb)) + nb
        self.buf += struct.pack("<II", dtype, a.ndim)
        self.buf += b"".join(struct.pack("<Q", s) for s in a.shape)
        self.buf += a.astype("<" + fmt).tobytes()


def c_literal(v):
    s = "%.9g" % v  # 9 digits: reads back as the same float
    return s + ("f" if "." in s or "e" in s else ".0f")


def c_table():
    rows = []
    for i in range(0, 256, 4):
        rows.append("    " + ", ".join(c_literal(v) for v in DQ8_MAP[i:i + 4]) + ",")
    return "\n".join(rows)


def check_local_torch():
    try:
        import torch
    except ImportError:
        return
    m = create_dynamic_map(linspace=lambda a, b, k: torch.linspace(a, b, k).numpy())
    print("torch %s's own linspace gives a map differing in %d of 256 entries (last bit)"
          % (torch.__version__, int(np.sum(m != DQ8_MAP))))


def main():
    if sys.argv[1:] == ["--c-table"]:
        print(c_table())
        return
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "nf4_ref.bin")
    assert np.all(np.diff(DQ8_MAP) > 0) and np.all(np.diff(THRESHOLDS) > 0)
    check_local_torch()

    w = make_weights()
    codes, absmax = nf4_quantize(w, BLOCK)
    deq = nf4_dequantize(codes, absmax, N, BLOCK)
    dq, nested, offset = dq8_quantize(absmax, DQ_BLOCK)
    absmax_dq = dq8_dequantize(dq, nested, offset, DQ_BLOCK)
    deq_dq = nf4_dequantize(codes, absmax_dq, N, BLOCK)

    rng = np.random.default_rng(SEED + 1)
    a2 = (0.05 + 0.02 * rng.standard_normal(600)).astype(f32)
    a2[300:310] = 0.5  # outliers in the second block
    dq2, nested2, offset2 = dq8_quantize(a2, DQ_BLOCK)
    out2 = dq8_dequantize(dq2, nested2, offset2, DQ_BLOCK)

    wr = Writer()
    wr.record("config", np.array([N, BLOCK, DQ_BLOCK]))
    wr.record("nf4_codebook", CODEBOOK)
    wr.record("nf4_thresholds", THRESHOLDS)
    wr.record("dq8_map", DQ8_MAP)
    wr.record("w", w)
    wr.record("codes", codes)
    wr.record("absmax", absmax)
    wr.record("dequant", deq)
    wr.record("dq_codes", dq)
    wr.record("nested_absmax", nested)
    wr.record("offset", np.array([offset], dtype=f32))
    wr.record("absmax_dq", absmax_dq)
    wr.record("dequant_dq", deq_dq)
    wr.record("dq2/in", a2)
    wr.record("dq2/codes", dq2)
    wr.record("dq2/nested_absmax", nested2)
    wr.record("dq2/offset", np.array([offset2], dtype=f32))
    wr.record("dq2/out", out2)
    with open(out, "wb") as fh:
        fh.write(wr.buf)
    err = np.abs(deq - w)
    print("wrote %s (%d bytes): n %d, block %d, mean |err| %.3g, max %.3g, offset %.6g"
          % (out, len(wr.buf), N, BLOCK, err.mean(), err.max(), offset))


if __name__ == "__main__":
    main()
