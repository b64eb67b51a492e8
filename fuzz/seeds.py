#!/usr/bin/env python3
"""Writes small seed inputs for the `gguf_load` fuzz target into DIR (see README.md here).

Each seed keeps the metadata of ../shared/models/stories260K-gguf (its tokenizer of 512 pieces,
its chat-template-free llama keys) but replaces the model with one layer of small random
tensors in a mix of ggml types, so that the fuzzer's mutations fall on the header, the
metadata and the quantized blocks rather than on a megabyte of f32 weights:

    python3 fuzz/seeds.py ../shared/models/stories260K-gguf/stories260K-f32.gguf /tmp/corpus

Pure Python (no numpy or gguf package needed).
"""
import os, struct, sys

def read_kvs(path):
    """The raw metadata entries (key, raw bytes of the whole entry) of a GGUF v2/v3 file."""
    b = open(path, 'rb').read()
    assert b[:4] == b'GGUF'
    _, n_t, n_kv = struct.unpack_from('<IQQ', b, 4)
    at = 24
    def string(at):
        n, = struct.unpack_from('<Q', b, at)
        return b[at + 8:at + 8 + n].decode(), at + 8 + n
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    def value(t, at):
        if t in sizes: return at + sizes[t]
        if t == 8: return string(at)[1]
        if t == 9:
            et, n = struct.unpack_from('<IQ', b, at)
            at += 12
            for _ in range(n): at = value(et, at)
            return at
        raise ValueError(f'value type {t}')
    out = []
    for _ in range(n_kv):
        start = at
        key, at = string(at)
        t, = struct.unpack_from('<I', b, at)
        at = value(t, at + 4)
        out.append((key, b[start:at]))
    return out

def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
def u32(k, v): return s(k) + struct.pack('<II', 4, v)

# ggml type: (id, values per block, bytes per block, byte offsets of f16 scales)
TYPES = {'f32': (0, 1, 4, []), 'f16': (1, 1, 2, []), 'q4_0': (2, 32, 18, [0]),
         'q4_1': (3, 32, 20, [0, 2]), 'q5_0': (6, 32, 22, [0]), 'q5_1': (7, 32, 24, [0, 2]),
         'q8_0': (8, 32, 34, [0]), 'q2_k': (10, 256, 84, [80, 82]), 'q3_k': (11, 256, 110, [108]),
         'q4_k': (12, 256, 144, [0, 2]), 'q5_k': (13, 256, 176, [0, 2]),
         'q6_k': (14, 256, 210, [208]), 'iq4_nl': (20, 32, 18, [0]), 'iq4_xs': (23, 256, 136, [0])}

def tensor(ty, n, rng):
    tid, bs, ts, scales = TYPES[ty]
    if ty == 'f32':
        return tid, b''.join(struct.pack('<f', rng.uniform(-0.1, 0.1)) for _ in range(n))
    buf = bytearray(rng.randbytes(n // bs * ts))
    if ty == 'f16':
        buf[1::2] = bytes(x & 0x23 for x in buf[1::2])
    for off in scales:  # small finite f16 scales
        buf[off::ts] = b'\x00' * (n // bs); buf[off + 1::ts] = b'\x14' * (n // bs)
    return tid, bytes(buf)

def write(path, kvs, hidden, inter, heads, kv_heads, mats, vocab=512):
    import random
    rng = random.Random(hidden)
    keep = [raw for k, raw in kvs if not k.startswith('llama.')]
    meta = keep + [u32('llama.embedding_length', hidden), u32('llama.feed_forward_length', inter),
                   u32('llama.block_count', 1), u32('llama.attention.head_count', heads),
                   u32('llama.attention.head_count_kv', kv_heads), u32('llama.context_length', 64),
                   s('llama.attention.layer_norm_rms_epsilon') + struct.pack('<If', 6, 1e-5),
                   s('llama.rope.freq_base') + struct.pack('<If', 6, 10000.0)]
    hd = hidden // heads
    ts = [('token_embd.weight', [hidden, vocab], mats[0]), ('output_norm.weight', [hidden], 'f32'),
          ('blk.0.attn_norm.weight', [hidden], 'f32'), ('blk.0.ffn_norm.weight', [hidden], 'f32'),
          ('blk.0.attn_q.weight', [hidden, hidden], mats[1]),
          ('blk.0.attn_k.weight', [hidden, kv_heads * hd], mats[2]),
          ('blk.0.attn_v.weight', [hidden, kv_heads * hd], mats[3]),
          ('blk.0.attn_output.weight', [hidden, hidden], mats[4]),
          ('blk.0.ffn_gate.weight', [hidden, inter], mats[5]),
          ('blk.0.ffn_up.weight', [hidden, inter], mats[6]),
          ('blk.0.ffn_down.weight', [inter, hidden], mats[7])]
    infos, data = b'', bytearray()
    for name, dims, ty in ts:
        while len(data) % 32: data.append(0)
        n = 1
        for d in dims: n *= d
        tid, raw = tensor(ty, n, rng)
        infos += s(name) + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', d) for d in dims)
        infos += struct.pack('<IQ', tid, len(data))
        data += raw
    head = b'GGUF' + struct.pack('<IQQ', 3, len(ts), len(meta)) + b''.join(meta) + infos
    while len(head) % 32: head += b'\0'
    open(path, 'wb').write(head + data)

if len(sys.argv) != 3:
    sys.exit(__doc__)
kvs = read_kvs(sys.argv[1])
os.makedirs(sys.argv[2], exist_ok=True)
out = lambda name: os.path.join(sys.argv[2], name)
write(out('blocks32.gguf'), kvs, 64, 96, 4, 2,
      ['q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'iq4_nl', 'f16', 'q8_0'])
write(out('kquants.gguf'), kvs, 256, 256, 4, 2,
      ['q4_k', 'q2_k', 'q3_k', 'q6_k', 'q5_k', 'iq4_xs', 'q4_k', 'q6_k'])
