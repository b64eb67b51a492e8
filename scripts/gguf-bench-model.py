#!/usr/bin/env python3
"""Writes a GGUF file of random weights for `baton bench decode --device cpu`: a Llama of
hidden 1024, intermediate 2816 (K-quant rows need multiples of 256), 12 layers, 16 heads of 64,
4 KV heads, vocabulary 32000, tied embeddings (167M weights), every matrix of one type: f16,
q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl or iq4_xs. Scales are fixed and small, quants random: the values are noise,
only the sizes and types matter. No tokenizer is written: `baton bench decode` needs none; to serve it, give
`--tokenizer ../shared/models/llama2-tokenizer`.

    python3 scripts/gguf-bench-model.py q4_k /tmp/q4_k.gguf

Pure Python (no numpy or gguf package needed).
"""
import os, struct, sys
H, I, L, NH, NKV, V = 1024, 2816, 12, 16, 4, 32000
HD = H // NH
def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
def kv(k, t, v):
    out = s(k) + struct.pack('<I', t)
    if t == 4: out += struct.pack('<I', v)
    elif t == 6: out += struct.pack('<f', v)
    elif t == 8: out += s(v)
    return out
TYPES = {'f16': (1, 1, 2), 'q4_0': (2, 32, 18), 'q4_1': (3, 32, 20), 'q5_0': (6, 32, 22),
         'q5_1': (7, 32, 24), 'q8_0': (8, 32, 34), 'q2_k': (10, 256, 84),
         'q3_k': (11, 256, 110), 'q4_k': (12, 256, 144),
         'q5_k': (13, 256, 176), 'q6_k': (14, 256, 210), 'iq4_nl': (20, 32, 18),
         'iq4_xs': (23, 256, 136)}
def tensor_bytes(ty, n):
    tid, bs, ts = TYPES[ty]
    nb = n // bs
    buf = bytearray(os.urandom(nb * ts))
    if ty == 'f16':
        buf[1::2] = bytes([b & 0x23 for b in buf[1::2]])  # small exponents
    elif ty in ('q4_0', 'q8_0', 'q5_0', 'iq4_nl', 'iq4_xs'):  # d first (IQ4_XS: random 6-bit scales)
        buf[0::ts] = b'\x00' * nb; buf[1::ts] = b'\x14' * nb  # d ~ 0.001
    elif ty in ('q4_1', 'q5_1'):  # d and m first
        for off, hi in ((0, 0x14), (2, 0x90)):  # m ~ -0.001
            buf[off::ts] = b'\x00' * nb; buf[off + 1::ts] = bytes([hi]) * nb
    elif ty == 'q6_k':  # d after ql, qh and the 16 scales
        buf[208::ts] = b'\x00' * nb; buf[209::ts] = b'\x14' * nb
    elif ty == 'q3_k':  # d after hmask, qs and the 12 scale bytes
        buf[108::ts] = b'\x00' * nb; buf[109::ts] = b'\x14' * nb
    elif ty == 'q2_k':  # d and dmin after the 16 scales and qs
        for off, hi in ((80, 0x14), (82, 0x10)):
            buf[off::ts] = b'\x00' * nb; buf[off + 1::ts] = bytes([hi]) * nb
    else:  # d and dmin of a K-quant super-block
        for off, hi in ((0, 0x14), (2, 0x10)):
            buf[off::ts] = b'\x00' * nb; buf[off + 1::ts] = bytes([hi]) * nb
    return tid, bytes(buf)
def main(ty, path):
    if ty not in TYPES:
        sys.exit(f'type {ty!r}: one of {", ".join(TYPES)}')
    meta = [kv('general.architecture', 8, 'llama'), kv('general.name', 8, 'qbench'),
            kv('llama.context_length', 4, 2048), kv('llama.embedding_length', 4, H),
            kv('llama.feed_forward_length', 4, I), kv('llama.block_count', 4, L),
            kv('llama.attention.head_count', 4, NH), kv('llama.attention.head_count_kv', 4, NKV),
            kv('llama.attention.layer_norm_rms_epsilon', 6, 1e-5), kv('llama.rope.freq_base', 6, 10000.0),
            kv('llama.vocab_size', 4, V)]
    ts = [('token_embd.weight', [H, V], ty), ('output_norm.weight', [H], 'f32')]
    for i in range(L):
        b = f'blk.{i}.'
        ts += [(b+'attn_norm.weight', [H], 'f32'), (b+'ffn_norm.weight', [H], 'f32'),
               (b+'attn_q.weight', [H, H], ty), (b+'attn_k.weight', [H, NKV*HD], ty),
               (b+'attn_v.weight', [H, NKV*HD], ty), (b+'attn_output.weight', [H, H], ty),
               (b+'ffn_gate.weight', [H, I], ty), (b+'ffn_up.weight', [H, I], ty),
               (b+'ffn_down.weight', [I, H], ty)]
    infos, data = b'', bytearray()
    for name, dims, t in ts:
        while len(data) % 32: data.append(0)
        n = 1
        for d in dims: n *= d
        if t == 'f32':
            tid, raw = 0, struct.pack('<f', 1.0) * n
        else:
            tid, raw = tensor_bytes(t, n)
        infos += s(name) + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', d) for d in dims) + struct.pack('<IQ', tid, len(data))
        data += raw
    head = b'GGUF' + struct.pack('<IQQ', 3, len(ts), len(meta)) + b''.join(meta) + infos
    while len(head) % 32: head += b'\0'
    open(path, 'wb').write(head + data)
if len(sys.argv) != 3:
    sys.exit(__doc__)
main(sys.argv[1], sys.argv[2])
