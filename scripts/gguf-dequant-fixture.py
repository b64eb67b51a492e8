#!/usr/bin/env python3
"""Writes crates/model/tests/fixtures/gguf-dequant.json, the reference for tests/gguf_dequant.rs.

Regenerate (from the repository root):

    python3 -m venv /tmp/gguf-venv
    /tmp/gguf-venv/bin/pip install gguf==0.17.1 numpy
    /tmp/gguf-venv/bin/python scripts/gguf-dequant-fixture.py

For each ggml type Baton reads, builds a few blocks of seeded random bytes and dequantizes them
with llama.cpp's own Python package, gguf-py (`gguf.quants.dequantize`, numpy ports of ggml's
`dequantize_row_*`), an implementation independent of Baton's. Every f16 scale field (`d`, `m`,
`dmin`) is overwritten with a random finite value in [-0.05, 0.05], so no NaN or infinity appears;
the last block of each quantized type has every quant byte 0xFF (the largest codes). The float
types get random finite values. Output: {type name: {"bytes_hex": the blocks' bytes as hex,
"values": the dequantized f32 values}}, each value written as the exact f32 (Python's float repr
of it, which reads back into an f64 that converts to that f32 without rounding).
"""
import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Byte offsets of each quantized type's f16 scale fields, per ggml-common.h's block structs.
F16_FIELDS = {
    "Q4_0": [0],  # d, qs[16]
    "Q4_1": [0, 2],  # d, m, qs[16]
    "Q5_0": [0],  # d, qh[4], qs[16]
    "Q5_1": [0, 2],  # d, m, qh[4], qs[16]
    "Q8_0": [0],  # d, qs[32]
    "Q2_K": [80, 82],  # scales[16], qs[64], d, dmin
    "Q3_K": [108],  # hmask[32], qs[64], scales[12], d
    "Q4_K": [0, 2],  # d, dmin, scales[12], qs[128]
    "Q5_K": [0, 2],  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": [208],  # ql[128], qh[64], scales[16], d
    "IQ4_NL": [0],  # d, qs[16]
    "IQ4_XS": [0],  # d, scales_h, scales_l[4], qs[128]
}
# Byte ranges of each quantized type's scale bytes (left random in the 0xFF block).
SCALES = {"Q2_K": (0, 16), "Q3_K": (96, 108), "Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208),
          "IQ4_XS": (2, 8)}

BLOCKS_32 = 4  # blocks per 32-element type: 3 random, 1 all-0xFF quants
BLOCKS_256 = 3  # super-blocks per K type: 2 random, 1 all-0xFF quants
N_FLOAT = 64  # elements per float type


def quantized(name, rng):
    qtype = T[name]
    block, size = GGML_QUANT_SIZES[qtype]
    n = BLOCKS_32 if block == 32 else BLOCKS_256
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    keep = np.zeros(size, dtype=bool)
    for off in F16_FIELDS[name]:
        keep[off : off + 2] = True
    if name in SCALES:
        lo, hi = SCALES[name]
        keep[lo:hi] = True
    data[-1, ~keep] = 0xFF
    for off in F16_FIELDS[name]:
        scale = rng.uniform(-0.05, 0.05, size=n).astype(np.float16)
        data[:, off : off + 2] = scale.view(np.uint8).reshape(n, 2)
    values = dequantize(data.reshape(-1), qtype)
    assert values.dtype == np.float32 and values.size == n * block
    return data.tobytes(), values


def floats(name, rng):
    x = rng.uniform(-4.0, 4.0, size=N_FLOAT).astype(np.float32)
    x[0], x[1] = 0.0, -0.0
    if name == "F32":
        data = x.tobytes()
    elif name == "F16":
        data = x.astype(np.float16).tobytes()
    else:  # BF16: truncate the f32 bits (any 16 high bits of a finite f32 are a valid bf16)
        data = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    values = dequantize(np.frombuffer(data, dtype=np.uint8), T[name]).astype(np.float32)
    return data, values


def main():
    rng = np.random.default_rng(20240607)
    out = {}
    for name in ["F32", "F16", "BF16"]:
        data, values = floats(name, rng)
        out[name] = (data, values)
    for name in F16_FIELDS:
        out[name] = quantized(name, rng)
    fixture = {}
    for name, (data, values) in out.items():
        values = values.reshape(-1)
        assert np.isfinite(values).all(), name
        fixture[name] = {"bytes_hex": data.hex(), "values": [float(v) for v in values]}
    path = os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..", "crates", "model", "tests", "fixtures", "gguf-dequant.json",
    )
    with open(path, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.normpath(path)}: {os.path.getsize(path)} bytes, {len(fixture)} types")


if __name__ == "__main__":
    main()
