//! The CUDA kernels of `kernels/*.cu`, run by the emulator against naive Rust references.
//!
//! Every launch passes the argument list, grid and block that `crates/cuda/src/executor.rs`
//! passes (the C signature is repeated above each launch). Device buffers are host vectors;
//! element buffers are 16-byte aligned so the kernels' vectorized paths run, and odd sizes
//! exercise the scalar fallbacks. f32 is compared tightly; bf16 (and f16 where cheap) within a
//! couple of units in the last place of the element type.

use baton_cuda::staging::{pack_penalties, DevicePenaltyEntry, PenaltyRow};
use baton_cuda_emu::{launch_with, Dtype, Params, Schedule};
use baton_proto::SamplingParams;
use baton_worker::penalty::{build_penalty_list, PenaltyEntry};
use baton_worker::sampling::Sampler;
use half::{bf16, f16};
use std::cell::Cell;

// ---- Harness -----------------------------------------------------------------------------------

thread_local! {
    /// The schedule this test thread's launches use (see [`every_schedule`]).
    static SCHEDULE: Cell<Schedule> = const { Cell::new(Schedule::InOrder) };
}

/// Runs a test body once per [`Schedule`]: a kernel with a race between its threads would
/// compute a different (poisoned or stale) result under one of them and fail the comparison.
fn every_schedule(body: impl Fn()) {
    for s in Schedule::ALL {
        SCHEDULE.with(|c| c.set(s));
        body();
    }
}

/// Launches `name` of the `dtype` module, panicking with the emulator's message on failure.
fn run(dtype: Dtype, name: &str, grid: (u32, u32, u32), block: u32, p: &mut Params) {
    let args = p.as_args();
    let schedule = SCHEDULE.with(Cell::get);
    // SAFETY: each call site passes the argument list of `name`'s C signature (comment above
    // it), with buffers sized for the grid and shapes it passes.
    unsafe { launch_with(dtype, name, grid, (block, 1, 1), &args, schedule) }
        .unwrap_or_else(|e| panic!("{} {name} ({schedule:?}): {e}", dtype.name()));
}

/// Rounds `x` to the element type and back.
fn round(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        Dtype::F32 => x,
    }
}

/// Relative tolerance of one rounding to the element type (half an ulp is 2^-9 / 2^-12).
fn ulp(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bf16 => 1.0 / 128.0,
        Dtype::F16 => 1.0 / 1024.0,
        Dtype::F32 => 1.0e-6,
    }
}

/// A device buffer of `elem_t`, 16-byte aligned.
struct Elems {
    dtype: Dtype,
    words: Vec<u128>,
    len: usize,
}

impl Elems {
    fn new(dtype: Dtype, values: &[f32]) -> Self {
        let mut e = Elems {
            dtype,
            words: vec![0; (values.len() * dtype.size()).div_ceil(16)],
            len: values.len(),
        };
        e.write(values);
        e
    }

    fn filled(dtype: Dtype, len: usize, v: f32) -> Self {
        Self::new(dtype, &vec![v; len])
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        // SAFETY: `words` holds at least n bytes; u8 has no alignment or validity requirements.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), n) }
    }

    fn write(&mut self, values: &[f32]) {
        let dtype = self.dtype;
        let b = self.bytes_mut();
        for (i, &v) in values.iter().enumerate() {
            match dtype {
                Dtype::Bf16 => {
                    b[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes())
                }
                Dtype::F16 => b[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                Dtype::F32 => b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            }
        }
    }

    fn read(&mut self) -> Vec<f32> {
        let dtype = self.dtype;
        let b = self.bytes_mut();
        match dtype {
            Dtype::Bf16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }

    /// Device pointer to element `i`.
    fn at(&mut self, i: usize) -> *mut u8 {
        assert!(i <= self.len);
        let size = self.dtype.size();
        // SAFETY: i <= len, so the offset stays inside (or one past) the allocation.
        unsafe { self.bytes_mut().as_mut_ptr().add(i * size) }
    }

    fn ptr(&mut self) -> *mut u8 {
        self.at(0)
    }
}

/// Deterministic values in [-1, 1) (an LCG; no rand dependency in the hot loop).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Values already representable in `dtype`.
fn rounded_values(dtype: Dtype, seed: u64, n: usize, scale: f32) -> Vec<f32> {
    values(seed, n)
        .into_iter()
        .map(|v| round(dtype, v * scale))
        .collect()
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = abs + rel * w.abs();
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (diff {}, tolerance {tol})",
            (g - w).abs()
        );
    }
}

// ---- RMSNorm -----------------------------------------------------------------------------------

/// HF LlamaRMSNorm on stored values: round(w * round(x * inv)), statistics in f64.
fn rmsnorm_ref(dtype: Dtype, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()) as f32;
    x.iter()
        .zip(w)
        .map(|(&v, &w)| round(dtype, w * round(dtype, v * inv)))
        .collect()
}

#[test]
fn rmsnorm_matches_the_reference_per_token_for_both_executor_block_sizes() {
    every_schedule(|| {
        let (t, h, eps) = (3usize, 300usize, 1e-5f32);
        for dtype in Dtype::ALL {
            for block in [256u32, 1024] {
                let x = rounded_values(dtype, 1, t * h, 3.0);
                let w = rounded_values(dtype, 2, h, 1.0);
                let (mut xin, mut win) = (Elems::new(dtype, &x), Elems::new(dtype, &w));
                let mut out = Elems::filled(dtype, t * h, f32::NAN);
                // rmsnorm(out, in, weight, num_tokens, hidden, eps)
                run(
                    dtype,
                    "baton_rmsnorm",
                    (t as u32, 1, 1),
                    block,
                    Params::new()
                        .ptr_mut(out.ptr())
                        .ptr(xin.ptr())
                        .ptr(win.ptr())
                        .int(t as i32)
                        .int(h as i32)
                        .float(eps),
                );
                let got = out.read();
                for r in 0..t {
                    let want = rmsnorm_ref(dtype, &x[r * h..(r + 1) * h], &w, eps);
                    // One rounding of x * inv may flip with inv's last bit: two ulps of the output.
                    assert_close(
                        &format!("{} block {block} token {r}", dtype.name()),
                        &got[r * h..(r + 1) * h],
                        &want,
                        2.0 * ulp(dtype),
                        1e-6,
                    );
                }
            }
        }
    });
}

#[test]
fn add_rmsnorm_updates_the_residual_and_normalizes_it_even_when_out_aliases_x() {
    every_schedule(|| {
        let (t, h, eps) = (2usize, 200usize, 1e-6f32);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for alias in [false, true] {
                let r0 = rounded_values(dtype, 3, t * h, 2.0);
                let x = rounded_values(dtype, 4, t * h, 2.0);
                let w = rounded_values(dtype, 5, h, 1.0);
                let (mut resid, mut xin, mut win) = (
                    Elems::new(dtype, &r0),
                    Elems::new(dtype, &x),
                    Elems::new(dtype, &w),
                );
                let mut out = Elems::filled(dtype, t * h, f32::NAN);
                let out_ptr = if alias { xin.ptr() } else { out.ptr() };
                // add_rmsnorm(out, residual, x, weight, num_tokens, hidden, eps)
                run(
                    dtype,
                    "baton_add_rmsnorm",
                    (t as u32, 1, 1),
                    256,
                    Params::new()
                        .ptr_mut(out_ptr)
                        .ptr_mut(resid.ptr())
                        .ptr(xin.ptr())
                        .ptr(win.ptr())
                        .int(t as i32)
                        .int(h as i32)
                        .float(eps),
                );
                let want_resid: Vec<f32> = r0
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| round(dtype, a + b))
                    .collect();
                assert_eq!(resid.read(), want_resid, "{} residual", dtype.name());
                let got = if alias { xin.read() } else { out.read() };
                for r in 0..t {
                    let want = rmsnorm_ref(dtype, &want_resid[r * h..(r + 1) * h], &w, eps);
                    assert_close(
                        &format!("{} alias {alias} token {r}", dtype.name()),
                        &got[r * h..(r + 1) * h],
                        &want,
                        2.0 * ulp(dtype),
                        1e-6,
                    );
                }
            }
        }
    });
}

// ---- Embedding, row gather, pending ids -----------------------------------------------------------

/// The rows `baton_embedding_gather` writes for `ids`: each id's table row, zeros for an id
/// past `vocab`.
fn embedded_rows(table: &[f32], ids: &[u32], vocab: usize, hidden: usize) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            let id = id as usize;
            if id < vocab {
                table[id * hidden..(id + 1) * hidden].to_vec()
            } else {
                vec![0.0; hidden]
            }
        })
        .collect()
}

/// Rows copied (scale 1) or scaled once in f32 and rounded to the dtype (Gemma 3's
/// `embed_scale`), out-of-range ids zeroed.
#[test]
fn embedding_gather_copies_rows_and_zeroes_out_of_range_ids() {
    every_schedule(|| {
        let vocab = 10usize;
        let ids: Vec<u32> = vec![3, 0, 12, 9, 3];
        // 64: the 16-byte vector path; 7: rows not 16-byte aligned, the scalar path.
        for (hidden, scale) in [(64usize, 1.0f32), (7, 1.0), (64, 34.0)] {
            for dtype in Dtype::ALL {
                let table = rounded_values(dtype, 6, vocab * hidden, 1.0);
                let mut tab = Elems::new(dtype, &table);
                let mut out = Elems::filled(dtype, ids.len() * hidden, f32::NAN);
                let mut staged = ids.clone();
                let ring = [0u32; 4];
                // embedding(out, table, ids, sampled_ring, num_tokens, hidden, vocab, scale)
                run(
                    dtype,
                    "baton_embedding_gather",
                    (ids.len() as u32, 1, 1),
                    256,
                    Params::new()
                        .ptr_mut(out.ptr())
                        .ptr(tab.ptr())
                        .ptr_mut(staged.as_mut_ptr())
                        .ptr(ring.as_ptr())
                        .int(ids.len() as i32)
                        .int(hidden as i32)
                        .int(vocab as i32)
                        .float(scale),
                );
                let want: Vec<f32> = embedded_rows(&table, &ids, vocab, hidden)
                    .iter()
                    .map(|&x| dtype.round(x * scale))
                    .collect();
                assert_eq!(
                    out.read(),
                    want,
                    "{} hidden {hidden} scale {scale}",
                    dtype.name()
                );
            }
        }
    });
}

#[test]
fn gather_rows_picks_the_indexed_rows_and_zeroes_negative_indices() {
    every_schedule(|| {
        let (rows_in, width) = (5usize, 33usize);
        let index: Vec<i32> = vec![4, -1, 0, 2];
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let src = rounded_values(dtype, 7, rows_in * width, 1.0);
            let mut inp = Elems::new(dtype, &src);
            let mut out = Elems::filled(dtype, index.len() * width, f32::NAN);
            // gather_rows(out, in, index, num_rows, width)
            run(
                dtype,
                "baton_gather_rows",
                (index.len() as u32, 1, 1),
                256,
                Params::new()
                    .ptr_mut(out.ptr())
                    .ptr(inp.ptr())
                    .ptr(index.as_ptr())
                    .int(index.len() as i32)
                    .int(width as i32),
            );
            let want: Vec<f32> = index
                .iter()
                .flat_map(|&r| {
                    if r < 0 {
                        vec![0.0; width]
                    } else {
                        src[r as usize * width..(r as usize + 1) * width].to_vec()
                    }
                })
                .collect();
            assert_eq!(out.read(), want);
        }
    });
}

/// Tagged ids (`PENDING_TAG | ring index`) take their id from the ring of sampled ids, embed
/// it and write it back in place; untagged ids are left as they are.
#[test]
fn embedding_gather_resolves_pending_ids_from_the_ring_and_writes_them_back() {
    const TAG: u32 = 0x8000_0000; // baton_cuda::staging::PENDING_TAG
    every_schedule(|| {
        let (vocab, hidden) = (50usize, 64usize);
        let ring: Vec<u32> = (0..40u32).map(|i| (i * 7 + 3) % vocab as u32).collect();
        // Plain, pending, plain, pending (ring entry 39), an out-of-range plain id.
        let staged_in: Vec<u32> = vec![4, TAG | 10, 4, TAG | 39, 77];
        let resolved: Vec<u32> = vec![4, ring[10], 4, ring[39], 77];
        let table = rounded_values(Dtype::F32, 6, vocab * hidden, 1.0);
        let mut tab = Elems::new(Dtype::F32, &table);
        let mut out = Elems::filled(Dtype::F32, staged_in.len() * hidden, f32::NAN);
        let mut staged = staged_in.clone();
        run(
            Dtype::F32,
            "baton_embedding_gather",
            (staged.len() as u32, 1, 1),
            256,
            Params::new()
                .ptr_mut(out.ptr())
                .ptr(tab.ptr())
                .ptr_mut(staged.as_mut_ptr())
                .ptr(ring.as_ptr())
                .int(staged.len() as i32)
                .int(hidden as i32)
                .int(vocab as i32)
                .float(1.0),
        );
        assert_eq!(
            staged, resolved,
            "pending ids written back, the others untouched"
        );
        assert_eq!(out.read(), embedded_rows(&table, &resolved, vocab, hidden));
    });
}

// ---- RoPE and the KV cache write -----------------------------------------------------------------

/// Rotate-half RoPE of one head vector: angle formed in f32 (as HF and the kernel), sin/cos and
/// the rotation in f64.
fn rope_ref(v: &mut [f32], pos: i32, inv_freq: &[f32]) {
    let half = v.len() / 2;
    for i in 0..half {
        let a = f64::from(pos as f32 * inv_freq[i]);
        let (s, c) = a.sin_cos();
        let (x1, x2) = (f64::from(v[i]), f64::from(v[i + half]));
        v[i] = (x1 * c - x2 * s) as f32;
        v[i + half] = (x2 * c + x1 * s) as f32;
    }
}

#[test]
fn rope_and_cache_rotates_q_and_k_and_writes_the_rotated_k_and_v_to_their_slots() {
    every_schedule(|| {
        let (nh, bs, pages) = (4usize, 8usize, 3usize);
        // Positions up to 131000 (llama3 contexts); slot -1 is graph padding.
        let positions: Vec<i32> = vec![0, 1, 7, 4099, 131_000];
        let slots: Vec<i32> = vec![5, -1, 0, 17, 23];
        let t = positions.len();
        for (kvh, hd) in [(2usize, 16usize), (1, 6)] {
            let n = kvh * hd;
            let qkv_w = (nh + 2 * kvh) * hd;
            let inv_freq: Vec<f32> = (0..hd / 2)
                .map(|i| 500_000f64.powf(-(2.0 * i as f64) / hd as f64) as f32)
                .collect();
            // One block per token, and three sharing each token's pairs and v elements.
            for (dtype, gy) in Dtype::ALL.into_iter().flat_map(|d| [(d, 1u32), (d, 3)]) {
                let qkv = rounded_values(dtype, 8, t * qkv_w, 1.0);
                let mut buf = Elems::new(dtype, &qkv);
                let (q, k, v) = (buf.at(0), buf.at(nh * hd), buf.at(nh * hd + n));
                let sentinel = -7.0;
                let mut kc = Elems::filled(dtype, pages * bs * n, sentinel);
                let mut vc = Elems::filled(dtype, pages * bs * n, sentinel);
                // rope_and_cache(q, k, v, k_cache, v_cache, positions, slots, inv_freq,
                //                num_tokens, nq, nkv, head_dim, q_stride, kv_stride)
                run(
                    dtype,
                    "baton_rope_and_cache",
                    (t as u32, gy, 1),
                    32,
                    Params::new()
                        .ptr_mut(q)
                        .ptr_mut(k)
                        .ptr(v)
                        .ptr_mut(kc.ptr())
                        .ptr_mut(vc.ptr())
                        .ptr(positions.as_ptr())
                        .ptr(slots.as_ptr())
                        .ptr(inv_freq.as_ptr())
                        .int(t as i32)
                        .int(nh as i32)
                        .int(kvh as i32)
                        .int(hd as i32)
                        .int(qkv_w as i32)
                        .int(qkv_w as i32),
                );
                // q and k heads rotated in place, v untouched.
                let mut want = qkv.clone();
                for (ti, &pos) in positions.iter().enumerate() {
                    for head in 0..nh + kvh {
                        let o = ti * qkv_w + head * hd;
                        rope_ref(&mut want[o..o + hd], pos, &inv_freq);
                    }
                }
                // f32: sincosf and the f32 products against f64; angles up to ~1.3e5 rad.
                let (rel, abs) = match dtype {
                    Dtype::F32 => (1e-5, 2e-6),
                    d => (ulp(d), 1e-3),
                };
                let got = buf.read();
                assert_close(dtype.name(), &got, &want, rel, abs);
                // The cache holds exactly the rotated k (the same rounded values) and v, at
                // each token's slot; padding and untouched slots keep the sentinel.
                let mut want_k = vec![sentinel; pages * bs * n];
                let mut want_v = want_k.clone();
                for (ti, &s) in slots.iter().enumerate() {
                    if s < 0 {
                        continue;
                    }
                    let (s, row) = (s as usize, ti * qkv_w + nh * hd);
                    want_k[s * n..(s + 1) * n].copy_from_slice(&got[row..row + n]);
                    want_v[s * n..(s + 1) * n].copy_from_slice(&qkv[row + n..row + 2 * n]);
                }
                assert_eq!(kc.read(), want_k, "{} k cache, {kvh}x{hd}", dtype.name());
                assert_eq!(vc.read(), want_v, "{} v cache, {kvh}x{hd}", dtype.name());
            }
        }
    });
}

// ---- QKV post-processing (Qwen2 biases, Qwen3 q/k norms) ----------------------------------------

/// What `baton_qkv_post` must leave in `qkv` (rows of `stride` elements, heads of `hd`): each
/// head of q, k and v gets its bias, rounded once; then each q and k head is RMSNorm'd with
/// its kind's weight (Qwen3RMSNorm: `round(w * round(y * inv))`, statistics in f64 here).
/// Elements past the heads (row padding) are left as they are.
#[allow(clippy::too_many_arguments)]
fn qkv_post_ref(
    dtype: Dtype,
    qkv: &[f32],
    bias: Option<&[f32]>,
    norm: Option<&[f32]>,
    (nq, nkv, hd): (usize, usize, usize),
    stride: usize,
    eps: f32,
) -> Vec<f32> {
    let mut out = qkv.to_vec();
    let heads = nq + 2 * nkv;
    for row in out.chunks_exact_mut(stride) {
        if let Some(b) = bias {
            for (x, &b) in row[..heads * hd].iter_mut().zip(b) {
                *x = round(dtype, *x + b);
            }
        }
        if let Some(w) = norm {
            for head in 0..nq + nkv {
                let wk = if head < nq { &w[..hd] } else { &w[hd..] };
                let x = &mut row[head * hd..(head + 1) * hd];
                let y = rmsnorm_ref(dtype, x, wk, eps);
                x.copy_from_slice(&y);
            }
        }
    }
    out
}

#[test]
fn qkv_post_adds_biases_and_normalizes_q_and_k_heads_as_the_reference() {
    every_schedule(|| {
        let (t, eps) = (3usize, 1e-6f32);
        // (q heads, kv heads, head_dim, extra row padding, block): one and several warps per
        // block, heads not a multiple of the warps per block, a head_dim not a multiple of 32.
        let shapes = [
            (4usize, 2usize, 64usize, 0usize, 128u32),
            (2, 1, 128, 0, 128),
            (6, 2, 128, 8, 64),
            (3, 3, 40, 0, 32),
        ];
        for (nq, nkv, hd, pad, block) in shapes {
            let heads = nq + 2 * nkv;
            let stride = heads * hd + pad;
            for dtype in Dtype::ALL {
                for (with_bias, with_norm) in [(true, false), (false, true), (true, true)] {
                    let what = format!(
                        "{} {nq}/{nkv}x{hd} pad {pad} block {block} bias {with_bias} \
                         norm {with_norm}",
                        dtype.name()
                    );
                    let qkv = rounded_values(dtype, 11, t * stride, 3.0);
                    let bias = rounded_values(dtype, 12, heads * hd, 0.5);
                    // Around 1, different for q and k: a kind mix-up shows.
                    let norm: Vec<f32> = values(13, 2 * hd)
                        .into_iter()
                        .map(|v| round(dtype, 1.0 + 0.4 * v))
                        .collect();
                    let mut buf = Elems::new(dtype, &qkv);
                    let mut b = Elems::new(dtype, &bias);
                    let mut w = Elems::new(dtype, &norm);
                    let bias_ptr = if with_bias {
                        b.ptr()
                    } else {
                        std::ptr::null_mut()
                    };
                    let norm_ptr = if with_norm {
                        w.ptr()
                    } else {
                        std::ptr::null_mut()
                    };
                    let launched = nq + nkv + if with_bias { nkv } else { 0 };
                    let gy = launched.div_ceil(block as usize / 32) as u32;
                    // qkv_post(qkv, bias, norm, num_tokens, nq, nkv, head_dim, stride, eps)
                    run(
                        dtype,
                        "baton_qkv_post",
                        (t as u32, gy, 1),
                        block,
                        Params::new()
                            .ptr_mut(buf.ptr())
                            .ptr(bias_ptr)
                            .ptr(norm_ptr)
                            .int(t as i32)
                            .int(nq as i32)
                            .int(nkv as i32)
                            .int(hd as i32)
                            .int(stride as i32)
                            .float(eps),
                    );
                    let want = qkv_post_ref(
                        dtype,
                        &qkv,
                        with_bias.then_some(&bias[..]),
                        with_norm.then_some(&norm[..]),
                        (nq, nkv, hd),
                        stride,
                        eps,
                    );
                    let got = buf.read();
                    if with_norm {
                        // One rounding of y * inv may flip with inv's last bit: two ulps.
                        assert_close(&what, &got, &want, 2.0 * ulp(dtype), 1e-6);
                    } else {
                        assert_eq!(got, want, "{what}");
                    }
                    // v heads are never normalized, and padding is never written.
                    for r in 0..t {
                        let v = r * stride + (nq + nkv) * hd;
                        assert_eq!(
                            got[v..(r + 1) * stride],
                            want[v..(r + 1) * stride],
                            "{what}"
                        );
                    }
                }
            }
        }
    });
}

// ---- SiLU-and-mul ------------------------------------------------------------------------------------

/// `name` (an act-and-mul kernel: out = act(gate) * up) against `want(gate, up)` rounded to
/// the dtype, over the vector (inter 40) and scalar (inter 13) paths in every dtype, within
/// one ulp and `abs`.
fn act_and_mul_case(name: &str, seed: u64, want: impl Fn(f32, f32) -> f32, abs: f32) {
    every_schedule(|| {
        let t = 3usize;
        for inter in [40usize, 13] {
            for dtype in Dtype::ALL {
                let x = rounded_values(dtype, seed, t * 2 * inter, 6.0);
                let mut inp = Elems::new(dtype, &x);
                let mut out = Elems::filled(dtype, t * inter, f32::NAN);
                // act_and_mul(out, in, num_tokens, inter)
                run(
                    dtype,
                    name,
                    (t as u32, 1, 1),
                    256,
                    Params::new()
                        .ptr_mut(out.ptr())
                        .ptr(inp.ptr())
                        .int(t as i32)
                        .int(inter as i32),
                );
                let want: Vec<f32> = (0..t * inter)
                    .map(|i| {
                        let (r, j) = (i / inter, i % inter);
                        round(
                            dtype,
                            want(x[r * 2 * inter + j], x[r * 2 * inter + inter + j]),
                        )
                    })
                    .collect();
                assert_close(
                    &format!("{name} {} inter {inter}", dtype.name()),
                    &out.read(),
                    &want,
                    ulp(dtype),
                    abs,
                );
            }
        }
    });
}

#[test]
fn silu_and_mul_matches_the_reference_on_the_vector_and_scalar_paths() {
    act_and_mul_case(
        "baton_silu_and_mul",
        10,
        |g, u| g / (1.0 + (-g).exp()) * u,
        1e-7,
    );
}

/// Gemma's GELU(tanh)-and-mul against an f64 evaluation of PyTorch's tanh formula.
#[test]
fn gelu_tanh_and_mul_matches_the_reference() {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let gelu = move |g: f32, u: f32| {
        let (g, u) = (g as f64, u as f64);
        (0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u) as f32
    };
    act_and_mul_case("baton_gelu_tanh_and_mul", 11, gelu, 1e-6);
}

// ---- Small-batch GEMV -----------------------------------------------------------------------------

/// `baton_gemv` against an f64 reference in every mode, dtype and path (vectorized K 64 and
/// 1000, the latter with a partial last group of in-flight vectors; scalar K 37), for 1, 3 and
/// 8 tokens and a row count that leaves the last block partial.
#[test]
fn gemv_matches_the_reference_in_every_mode_with_and_without_the_norm_prologue() {
    every_schedule(|| {
        let n = 20usize;
        let eps = 1e-5f32;
        for dtype in Dtype::ALL {
            for k in [64usize, 1000, 37] {
                for t in [1usize, 3, 8] {
                    for mode in 0..4 {
                        for norm in [false, true] {
                            // The general entry, and for one token the one the executor
                            // launches for the mode.
                            let mut entries = vec![("baton_gemv", 8usize), ("baton_gemv", 16)];
                            if t == 1 {
                                entries.push((t1_entry(mode), 8));
                            }
                            gemv_case(dtype, t, n, k, mode, norm, eps, &entries);
                        }
                    }
                }
            }
        }
    });
}

/// The batch-of-one streaming path of `baton_gemv_t1` / `baton_gemv_silu_t1`: rows of several
/// chunks with a partial last one (K 4104 is 513 bf16 or 1026 f32 vectors; a chunk is 256),
/// several rows per warp (24 rows per block: the pipeline crosses rows), a partial last block,
/// and K past the shared staging buffer (the generic fallback; 8200 > 8192 f32 elements).
#[test]
fn gemv_batch_of_one_streams_rows_of_several_chunks_and_several_rows_per_warp() {
    let eps = 1e-5f32;
    for dtype in Dtype::ALL {
        for mode in 0..4 {
            for norm in [false, true] {
                let entries = [(t1_entry(mode), 8usize), (t1_entry(mode), 24)];
                gemv_case(dtype, 1, 30, 4104, mode, norm, eps, &entries);
            }
        }
    }
    for mode in [2, 3] {
        gemv_case(
            Dtype::F32,
            1,
            9,
            8200,
            mode,
            true,
            eps,
            &[(t1_entry(mode), 8)],
        );
    }
}

/// The shared-memory ring entries (`baton_gemv_t1_async`, `baton_gemv_silu_t1_async`, what
/// `BATON_GEMV_ASYNC=1` launches) give the register entries' outputs bit for bit, every thread
/// order: rows of one partial chunk (K 64, 1000), of several chunks with a partial last one and
/// several rows per warp (K 4000, 24 rows a block: the ring crosses rows), a row that exactly
/// fills the activation buffer (K 4096 16-bit, 2048 f32), and one past it without the norm
/// (the fallback, which the worker never launches: with the norm its statistic is summed in
/// another order than the staged path's), each with a partial last block. They also meet the
/// f64 reference (`gemv_case`), the fallback with the norm included.
#[test]
fn gemv_ring_entries_give_the_register_entries_bits() {
    let eps = 1e-5f32;
    let (n, t) = (30usize, 1usize);
    every_schedule(|| {
        for dtype in Dtype::ALL {
            let cap = 8192 / dtype.size();
            for k in [64usize, 1000, 4000, cap, cap + 8] {
                for mode in 0..4 {
                    for norm in [false, true] {
                        if norm && k > cap {
                            continue;
                        }
                        let mut case = Gemv::new(dtype, t, n, k, mode, norm, eps);
                        let mut outputs = |entry: &str, rows_per_block: usize| {
                            let v = case.run(entry, rows_per_block);
                            v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                        };
                        for rows_per_block in [8usize, 24] {
                            let reg = outputs(t1_entry(mode), rows_per_block);
                            let ring =
                                outputs(&format!("{}_async", t1_entry(mode)), rows_per_block);
                            assert!(
                                reg == ring,
                                "{} mode {mode} norm {norm} K {k} rows/block {rows_per_block}",
                                dtype.name()
                            );
                        }
                    }
                }
            }
        }
    });
    for mode in 0..4 {
        let entry = format!("{}_async", t1_entry(mode));
        gemv_case(Dtype::Bf16, 1, 30, 4000, mode, true, eps, &[(&entry, 24)]);
        gemv_case(Dtype::F32, 1, 30, 2056, mode, true, eps, &[(&entry, 8)]);
    }
}

/// The batch-of-one entry the executor launches for `mode`.
fn t1_entry(mode: i32) -> &'static str {
    if mode == 3 {
        "baton_gemv_silu_t1"
    } else {
        "baton_gemv_t1"
    }
}

/// A GEMV case: its scalar arguments and its inputs (x `[t, k]`, the weight `[rows, k]` with
/// `rows` = 2n in SiLU mode, the norm weight `[k]`, the residual `[t, n]` that mode 2 adds to),
/// random values rounded to `dtype`, also kept as f32 for a reference.
struct Gemv {
    dtype: Dtype,
    t: usize,
    n: usize,
    k: usize,
    mode: i32,
    norm: bool,
    eps: f32,
    x: Vec<f32>,
    w: Vec<f32>,
    g: Vec<f32>,
    resid: Vec<f32>,
    bufs: [Elems; 3],
}

impl Gemv {
    #[allow(clippy::too_many_arguments)]
    fn new(dtype: Dtype, t: usize, n: usize, k: usize, mode: i32, norm: bool, eps: f32) -> Self {
        let rows = if mode == 3 { 2 * n } else { n };
        let x = rounded_values(dtype, 20 + t as u64, t * k, 2.0);
        let w = rounded_values(dtype, 30 + k as u64, rows * k, 0.5);
        let g = rounded_values(dtype, 40, k, 1.5);
        let resid = rounded_values(dtype, 50, t * n, 3.0);
        let bufs = [
            Elems::new(dtype, &x),
            Elems::new(dtype, &w),
            Elems::new(dtype, &g),
        ];
        Gemv {
            dtype,
            t,
            n,
            k,
            mode,
            norm,
            eps,
            x,
            w,
            g,
            resid,
            bufs,
        }
    }

    /// The output of GEMV entry `entry` over `ceil(n / rows_per_block)` blocks of 256 threads:
    /// gemv(out, x, w, norm_w, T, N, K, eps, mode, rows_per_block); f32 logits in mode 1, else
    /// the `dtype` output (mode 2: starting from the residual) widened.
    fn run(&mut self, entry: &str, rows_per_block: usize) -> Vec<f32> {
        let (dtype, t, n) = (self.dtype, self.t, self.n);
        let mut out_e = Elems::new(dtype, &self.resid);
        let mut out_f = vec![f32::NAN; t * n];
        let out: *mut u8 = if self.mode == 1 {
            out_f.as_mut_ptr().cast()
        } else {
            out_e.ptr()
        };
        let [x, w, g] = &mut self.bufs;
        let norm_w: *const u8 = if self.norm { g.ptr() } else { std::ptr::null() };
        run(
            dtype,
            entry,
            (n.div_ceil(rows_per_block) as u32, 1, 1),
            256,
            Params::new()
                .ptr_mut(out)
                .ptr(x.ptr())
                .ptr(w.ptr())
                .ptr(norm_w)
                .int(t as i32)
                .int(n as i32)
                .int(self.k as i32)
                .float(self.eps)
                .int(self.mode)
                .int(rows_per_block as i32),
        );
        if self.mode == 1 {
            out_f
        } else {
            out_e.read()
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv_case(
    dtype: Dtype,
    t: usize,
    n: usize,
    k: usize,
    mode: i32,
    norm: bool,
    eps: f32,
    entries: &[(&str, usize)],
) {
    let mut case = Gemv::new(dtype, t, n, k, mode, norm, eps);
    let (x, w, g, resid) = (
        case.x.clone(),
        case.w.clone(),
        case.g.clone(),
        case.resid.clone(),
    );
    // The activations each row multiplies: x, or rmsnorm(x) * g with rmsnorm.cu's roundings.
    let xin: Vec<f32> = (0..t)
        .flat_map(|r| {
            let row = &x[r * k..(r + 1) * k];
            if norm {
                rmsnorm_ref(dtype, row, &g, eps)
            } else {
                row.to_vec()
            }
        })
        .collect();
    let dot = |r: usize, row: usize| -> f32 {
        (0..k)
            .map(|i| f64::from(xin[r * k + i]) * f64::from(w[row * k + i]))
            .sum::<f64>() as f32
    };
    let want: Vec<f32> = (0..t * n)
        .map(|i| {
            let (r, j) = (i / n, i % n);
            match mode {
                0 => round(dtype, dot(r, j)),
                1 => dot(r, j),
                2 => round(dtype, resid[i] + round(dtype, dot(r, j))),
                _ => {
                    let (a, b) = (round(dtype, dot(r, j)), round(dtype, dot(r, n + j)));
                    round(dtype, a / (1.0 + (-a).exp()) * b)
                }
            }
        })
        .collect();
    for &(entry, rows_per_block) in entries {
        let got = case.run(entry, rows_per_block);
        // One rounding of the result, plus the fp32 sum (its error grows with K) and, with the
        // norm, a last-bit difference of the fp32 statistics flipping a rounded activation.
        let sum_tol = 1e-5 * (k as f32 / 64.0).max(1.0);
        let (rel, abs) = match (mode, dtype) {
            (1, Dtype::F32) | (_, Dtype::F32) => (sum_tol, sum_tol),
            _ => (3.0 * ulp(dtype), 2e-2),
        };
        assert_close(
            &format!(
                "{} {entry} mode {mode} norm {norm} T {t} K {k} rows/block {rows_per_block}",
                dtype.name()
            ),
            &got,
            &want,
            rel,
            abs,
        );
    }
}

// ---- Paged attention -----------------------------------------------------------------------------

/// A paged KV cache for one layer, [pages][block_size][kvh][hd] for K and V, with each row's
/// pages scattered (not in order) over the pool.
struct Paged {
    bs: usize,
    kvh: usize,
    hd: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    /// [rows, max_blocks] page ids (unused entries -1).
    tables: Vec<i32>,
    max_blocks: usize,
}

impl Paged {
    /// Contexts of `ctx[r]` positions per row, random K/V rounded to `dtype`.
    fn new(dtype: Dtype, ctx: &[usize], max_len: usize, bs: usize, kvh: usize, hd: usize) -> Self {
        let max_blocks = max_len.div_ceil(bs);
        let used: usize = ctx.iter().map(|c| c.div_ceil(bs)).sum();
        let pages = used + 3;
        // Pages handed out from both ends of the pool alternately (0, last, 1, last - 1, ...),
        // so consecutive logical blocks are never neighbours.
        let perm: Vec<usize> = (0..pages)
            .map(|p| if p % 2 == 0 { p / 2 } else { pages - 1 - p / 2 })
            .collect();
        let mut tables = vec![-1i32; ctx.len() * max_blocks];
        let mut next = 0;
        for (r, &c) in ctx.iter().enumerate() {
            for b in 0..c.div_ceil(bs) {
                tables[r * max_blocks + b] = perm[next] as i32;
                next += 1;
            }
        }
        let n = pages * bs * kvh * hd;
        Paged {
            bs,
            kvh,
            hd,
            k: rounded_values(dtype, 11, n, 1.0),
            v: rounded_values(dtype, 12, n, 1.0),
            tables,
            max_blocks,
        }
    }

    /// Offset of (row, position, kv head) in the cache.
    fn off(&self, row: usize, pos: usize, kvh: usize) -> usize {
        let page = self.tables[row * self.max_blocks + pos / self.bs];
        assert!(page >= 0, "row {row} position {pos} has no page");
        ((page as usize * self.bs + pos % self.bs) * self.kvh + kvh) * self.hd
    }

    /// softmax(q . K[lo..ctx] * scale) V[lo..ctx] for query head `head` of `row`, in f64,
    /// where `lo` is 0, or `ctx - window` under a sliding window (`window > 0`).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        row: usize,
        ctx: usize,
        window: usize,
        q: &[f32],
        head: usize,
        nh: usize,
        scale: f32,
    ) -> Vec<f32> {
        let hd = self.hd;
        let kvh = head / (nh / self.kvh);
        let lo = if window > 0 {
            ctx.saturating_sub(window)
        } else {
            0
        };
        let scores: Vec<f64> = (lo..ctx)
            .map(|p| {
                let o = self.off(row, p, kvh);
                let dot: f64 = (0..hd)
                    .map(|d| f64::from(q[d]) * f64::from(self.k[o + d]))
                    .sum();
                dot * f64::from(scale)
            })
            .collect();
        if ctx == 0 {
            return vec![0.0; hd];
        }
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                let a: f64 = (lo..ctx)
                    .map(|p| e[p - lo] * f64::from(self.v[self.off(row, p, kvh) + d]))
                    .sum();
                (a / z) as f32
            })
            .collect()
    }
}

/// Tolerance of an attention output: f32 accumulation order, or one rounding of the output
/// (plus the q scaling the fast kernels do in f32) for 16-bit types.
fn attn_tol(dtype: Dtype) -> (f32, f32) {
    match dtype {
        Dtype::F32 => (2e-5, 2e-6),
        d => (2.0 * ulp(d), 2.0 * ulp(d) * 0.05),
    }
}

/// The fused decode kernel as the executor launches it, against the unfused pipeline it
/// replaces (baton_rope_and_cache, then attention over the cache, in f64): `qkv` is the QKV
/// projection before RoPE and the step's token sits at position `seq_len - 1`, whose cache slot
/// starts as NaN (so a kernel that read it back from the cache would show). The kernel must
/// write the same cache bytes as baton_rope_and_cache and the same attention output.
///
/// `z` partitions per sequence (grid.z; the kernel sizes each sequence's partitions from its
/// length and `min_part`, the fewest keys per partition, and the last block of a split sequence
/// combines them): long sequences (1100 keys),
/// exactly 512 and 513 keys, short ones and a padding row of length 0; GQA groups of 8 (one
/// head chunk) and 12 (two chunks, the second partial). Launched twice on the same buffers: the
/// arrival counters must come back to 0, or the second launch would combine too early (or
/// never).
fn decode_case(dtype: Dtype, hd: usize, nh: usize, kvh: usize, seq_lens: &[i32], z: usize) {
    decode_case_sized(dtype, hd, nh, kvh, seq_lens, z, Sizing::grid(z));
}

/// The decode kernel's partition-sizing arguments (`fill`, `min_part`, `long_part`; see
/// `baton_cuda::plan::decode_partition_size`), and the sliding window (0 for none) whose keys
/// are partitioned.
#[derive(Clone, Copy)]
struct Sizing {
    fill: usize,
    min_part: usize,
    long_part: usize,
    window: usize,
}

impl Sizing {
    /// Partitions sized by the grid alone: fill = z, 64-key minimum.
    fn grid(z: usize) -> Self {
        Sizing {
            fill: z,
            min_part: 64,
            long_part: baton_cuda::plan::ATTN_LONG_PARTITION,
            window: 0,
        }
    }
}

/// [`decode_case`] with explicit partition sizing.
fn decode_case_sized(
    dtype: Dtype,
    hd: usize,
    nh: usize,
    kvh: usize,
    seq_lens: &[i32],
    z: usize,
    sizing: Sizing,
) {
    let Sizing {
        fill,
        min_part,
        long_part,
        window,
    } = sizing;
    let bs = 16usize;
    let max_len = seq_lens
        .iter()
        .map(|&c| c as usize)
        .max()
        .unwrap_or(0)
        .max(1536);
    let max_parts = z;
    let r = seq_lens.len();
    let ctx: Vec<usize> = seq_lens.iter().map(|&c| c as usize).collect();
    let mut cache = Paged::new(dtype, &ctx, max_len, bs, kvh, hd);
    let n = kvh * hd;
    // The step's token of each row: its position and slot (-1 for the padding row).
    let positions: Vec<i32> = seq_lens.iter().map(|&c| (c - 1).max(0)).collect();
    let slots: Vec<i32> = (0..r)
        .map(|s| match ctx[s] {
            0 => -1,
            c => (cache.off(s, c - 1, 0) / n) as i32,
        })
        .collect();
    for &slot in slots.iter().filter(|&&x| x >= 0) {
        let o = slot as usize * n;
        cache.k[o..o + n].fill(f32::NAN);
        cache.v[o..o + n].fill(f32::NAN);
    }
    let qkv_w = (nh + 2 * kvh) * hd;
    let qkv = rounded_values(dtype, 13, r * qkv_w, 1.0);
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 500_000f64.powf(-(2.0 * i as f64) / hd as f64) as f32)
        .collect();
    let scale = (hd as f64).powf(-0.5) as f32;

    // The unfused reference: RoPE + cache write, in place on copies.
    let (mut q_ref, mut kc_ref, mut vc_ref) = (
        Elems::new(dtype, &qkv),
        Elems::new(dtype, &cache.k),
        Elems::new(dtype, &cache.v),
    );
    let (qp, kp, vp) = (q_ref.at(0), q_ref.at(nh * hd), q_ref.at(nh * hd + n));
    // rope_and_cache(q, k, v, k_cache, v_cache, positions, slots, inv_freq, num_tokens, nq,
    //                nkv, head_dim, q_stride, kv_stride)
    run(
        dtype,
        "baton_rope_and_cache",
        (r as u32, 1, 1),
        128,
        Params::new()
            .ptr_mut(qp)
            .ptr_mut(kp)
            .ptr(vp)
            .ptr_mut(kc_ref.ptr())
            .ptr_mut(vc_ref.ptr())
            .ptr(positions.as_ptr())
            .ptr(slots.as_ptr())
            .ptr(inv_freq.as_ptr())
            .int(r as i32)
            .int(nh as i32)
            .int(kvh as i32)
            .int(hd as i32)
            .int(qkv_w as i32)
            .int(qkv_w as i32),
    );

    let (mut q, mut kc, mut vc) = (
        Elems::new(dtype, &qkv),
        Elems::new(dtype, &cache.k),
        Elems::new(dtype, &cache.v),
    );
    let mut out = Elems::filled(dtype, r * nh * hd, f32::NAN);
    let mut part_acc = vec![f32::NAN; r * nh * max_parts * hd];
    let mut part_m = vec![f32::NAN; r * nh * max_parts];
    let mut part_l = vec![f32::NAN; r * nh * max_parts];
    let gy = (kvh * (nh / kvh).div_ceil(8)) as u32;
    let mut counters = vec![0i32; r * gy as usize];
    for launch in 0..2 {
        if launch == 1 {
            out = Elems::filled(dtype, r * nh * hd, f32::NAN);
        }
        // decode_hdD(out, part_acc, part_m, part_l, counters, qkv, qkv_stride, k_cache,
        //            v_cache, block_tables, max_blocks_per_row, seq_lens, slot_mapping,
        //            inv_freq, nh, nkv, block_size, scale, max_partitions, fill, min_part,
        //            long_part, window)
        run(
            dtype,
            &format!("baton_paged_attention_decode_hd{hd}"),
            (r as u32, gy, max_parts as u32),
            128,
            Params::new()
                .ptr_mut(out.ptr())
                .ptr_mut(part_acc.as_mut_ptr())
                .ptr_mut(part_m.as_mut_ptr())
                .ptr_mut(part_l.as_mut_ptr())
                .ptr_mut(counters.as_mut_ptr())
                .ptr(q.ptr())
                .int(qkv_w as i32)
                .ptr_mut(kc.ptr())
                .ptr_mut(vc.ptr())
                .ptr(cache.tables.as_ptr())
                .int(cache.max_blocks as i32)
                .ptr(seq_lens.as_ptr())
                .ptr(slots.as_ptr())
                .ptr(inv_freq.as_ptr())
                .int(nh as i32)
                .int(kvh as i32)
                .int(bs as i32)
                .float(scale)
                .int(max_parts as i32)
                .int(fill as i32)
                .int(min_part as i32)
                .int(long_part as i32)
                .int(window as i32),
        );
        assert!(
            counters.iter().all(|&c| c == 0),
            "launch {launch}: arrival counters left at {counters:?}"
        );
    }
    let what = format!(
        "{} decode hd {hd} nh {nh} kvh {kvh} z {z} fill {fill} min_part {min_part} long \
         {long_part} window {window}",
        dtype.name()
    );
    // Partitions as the kernel sizes them (attention.cu, baton_decode_part_size): a split
    // sequence writes a partial (m) for each of its partitions and no others, an unsplit one
    // none.
    for (s, &len) in ctx.iter().enumerate() {
        let span = if window > 0 { len.min(window) } else { len };
        let psize = baton_cuda::plan::decode_partition_size(span, z, fill, min_part, long_part);
        let parts = span.div_ceil(psize);
        assert!(parts <= z, "{what}: {parts} partitions");
        let written = if parts > 1 { parts } else { 0 };
        for h in 0..nh {
            let b = (s * nh + h) * max_parts;
            let got = part_m[b..b + max_parts]
                .iter()
                .filter(|m| !m.is_nan())
                .count();
            assert_eq!(
                got, written,
                "{what}: seq {s} (len {len}) head {h} partials"
            );
        }
    }
    assert!(kc.bytes_mut() == kc_ref.bytes_mut(), "{what}: k cache");
    assert!(vc.bytes_mut() == vc_ref.bytes_mut(), "{what}: v cache");
    assert_eq!(q.read(), qkv, "{what}: the QKV input is left as it was");
    cache.k = kc_ref.read();
    cache.v = vc_ref.read();
    let q_rot = q_ref.read();
    let got = out.read();
    let (rel, abs) = attn_tol(dtype);
    for s in 0..r {
        for h in 0..nh {
            let qh = &q_rot[s * qkv_w + h * hd..s * qkv_w + (h + 1) * hd];
            let want = cache.attend(s, ctx[s], window, qh, h, nh, scale);
            let o = (s * nh + h) * hd;
            assert_close(
                &format!("{what} seq {s} (len {}) head {h}", ctx[s]),
                &got[o..o + hd],
                &want,
                rel,
                abs,
            );
        }
    }
}

#[test]
fn decode_attention_split_k_and_combine_match_the_reference_f32() {
    every_schedule(|| {
        // z = 1: one partition per sequence, walked in tiles of 64 keys (f32, head dim 64:
        // 1100 = 17 x 64 + 12); 3: partitions of 384, 192 and 192 keys; 64: partitions of the
        // minimum 64 keys.
        for z in [1, 3, 64] {
            decode_case(Dtype::F32, 64, 16, 2, &[1100, 37, 0, 512, 513], z);
        }
        // 71 partitions of 64 keys: the combine's weights past the first 64.
        decode_case(Dtype::F32, 64, 8, 1, &[4500, 3], 72);
    });
}

#[test]
fn decode_attention_with_a_larger_minimum_partition_f32() {
    every_schedule(|| {
        // z = 64 with partitions of at least 256 keys: 1100 keys in 5 partitions (four of
        // 256, one of 76), 512 and 513 in 2 and 3, 37 in one (no combine); at least 1024:
        // 1100 in 2, the rest in one. Head dim 128: tiles of 64 keys, so one partition
        // walks several tiles.
        for (z, min_part) in [(64, 256), (64, 1024), (3, 512)] {
            let sizing = Sizing {
                min_part,
                ..Sizing::grid(z)
            };
            decode_case_sized(Dtype::F32, 128, 8, 2, &[1100, 37, 0, 512, 513], z, sizing);
        }
    });
}

#[test]
fn decode_attention_sized_by_fill_splits_only_long_sequences_f32() {
    every_schedule(|| {
        // A grid of 8 partitions, fill 1 (a batch that fills the GPU), partitions of at most
        // 512 keys: 1100 keys in 3 (512, 512, 76), 513 in 2, 512 and 37 in one; fill 2: 1100
        // in 3 (the 512 cap), 512 in 2 of 256, 37 in one. A 4500-key sequence would need 9 of
        // 512, so the grid's 8 sizes it (576 keys each).
        for fill in [1, 2] {
            let sizing = Sizing {
                fill,
                min_part: 64,
                long_part: 512,
                window: 0,
            };
            decode_case_sized(Dtype::F32, 64, 8, 2, &[1100, 37, 0, 512, 513], 8, sizing);
            decode_case_sized(Dtype::F32, 64, 8, 1, &[4500, 3], 8, sizing);
        }
    });
}

#[test]
fn decode_attention_with_more_than_eight_query_heads_per_kv_head_f32() {
    every_schedule(|| {
        decode_case(Dtype::F32, 64, 12, 1, &[700, 5], 2);
    });
}

#[test]
fn decode_attention_bf16() {
    every_schedule(|| {
        decode_case(Dtype::Bf16, 64, 8, 2, &[600, 20], 1);
        decode_case(Dtype::Bf16, 64, 8, 2, &[600, 20], 8);
    });
}

#[test]
fn decode_and_prefill_attention_hd128_and_hd256_in_every_dtype() {
    every_schedule(|| {
        for dtype in Dtype::ALL {
            for hd in [128, 256] {
                decode_case(dtype, hd, 4, 2, &[530, 9, 0], 4);
                prefill_case(
                    dtype,
                    &format!("baton_paged_attention_prefill_hd{hd}"),
                    2,
                    1,
                    hd,
                );
            }
        }
    });
}

/// Varlen causal prefill: rows continuing a cached prefix (start_pos > 0), the second one
/// crossing a 512-key chunk, plus graph-padding tokens past cu_seqlens[num_rows] that must be
/// left alone. Launched like the executor's prefill (fast kernel) or generic path.
fn prefill_case(dtype: Dtype, name: &str, nh: usize, kvh: usize, hd: usize) {
    prefill_case_windowed(dtype, name, (nh, kvh, hd), 0);
}

/// [`prefill_case`] under a sliding window of `window` keys (0 for none).
fn prefill_case_windowed(
    dtype: Dtype,
    name: &str,
    (nh, kvh, hd): (usize, usize, usize),
    window: usize,
) {
    let (bs, max_len) = (16usize, 1024usize);
    let start_pos = [5i32, 600, 40];
    let lens = [7usize, 3, 1]; // the last row is a decode inside a prefill launch
    let cu: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l as i32;
            Some(*acc)
        }))
        .collect();
    let rows = lens.len();
    let real = cu[rows] as usize;
    let t = real + 2; // padding tokens
    let ctx: Vec<usize> = (0..rows).map(|r| start_pos[r] as usize + lens[r]).collect();
    let cache = Paged::new(dtype, &ctx, max_len, bs, kvh, hd);
    let qkv_w = (nh + 2 * kvh) * hd;
    let qkv = rounded_values(dtype, 14, t * qkv_w, 1.0);
    let scale = (hd as f64).powf(-0.5) as f32;
    let (mut q, mut kc, mut vc) = (
        Elems::new(dtype, &qkv),
        Elems::new(dtype, &cache.k),
        Elems::new(dtype, &cache.v),
    );
    let sentinel = 3.0;
    let mut out = Elems::filled(dtype, t * nh * hd, sentinel);
    let mut p = Params::new();
    p.ptr_mut(out.ptr())
        .ptr(q.ptr())
        .int(qkv_w as i32)
        .ptr(kc.ptr())
        .ptr(vc.ptr())
        .ptr(cu.as_ptr())
        .ptr(start_pos.as_ptr())
        .int(rows as i32)
        .ptr(cache.tables.as_ptr())
        .int(cache.max_blocks as i32)
        .int(nh as i32)
        .int(kvh as i32);
    let grid = if name == "baton_paged_attention_generic" {
        // generic(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos, num_rows,
        //         block_tables, max_blocks_per_row, nh, nkv, head_dim, block_size, scale,
        //         window)
        p.int(hd as i32)
            .int(bs as i32)
            .float(scale)
            .int(window as i32);
        (t as u32, nh as u32, 1)
    } else {
        // prefill_hdD(out, q, q_stride, k_cache, v_cache, cu_seqlens, start_pos, num_rows,
        //             block_tables, max_blocks_per_row, nh, nkv, block_size, scale, window)
        p.int(bs as i32).float(scale).int(window as i32);
        (t as u32, (kvh * (nh / kvh).div_ceil(8)) as u32, 1)
    };
    run(dtype, name, grid, 128, &mut p);
    let got = out.read();
    let (rel, abs) = attn_tol(dtype);
    for tok in 0..t {
        for h in 0..nh {
            let o = (tok * nh + h) * hd;
            if tok >= real {
                assert!(
                    got[o..o + hd].iter().all(|&x| x == sentinel),
                    "padding token {tok} written"
                );
                continue;
            }
            let row = (0..rows).rev().find(|&r| cu[r] as usize <= tok).unwrap();
            let pos = start_pos[row] as usize + (tok - cu[row] as usize);
            let qh = &qkv[tok * qkv_w + h * hd..tok * qkv_w + (h + 1) * hd];
            let want = cache.attend(row, pos + 1, window, qh, h, nh, scale);
            assert_close(
                &format!(
                    "{} {name} window {window} token {tok} (row {row}, position {pos}) head {h}",
                    dtype.name()
                ),
                &got[o..o + hd],
                &want,
                rel,
                abs,
            );
        }
    }
}

#[test]
fn prefill_attention_hd64_is_causal_over_varlen_rows_with_cached_prefixes_f32() {
    every_schedule(|| {
        prefill_case(Dtype::F32, "baton_paged_attention_prefill_hd64", 8, 2, 64);
    });
}

#[test]
fn prefill_attention_hd64_bf16() {
    every_schedule(|| {
        prefill_case(Dtype::Bf16, "baton_paged_attention_prefill_hd64", 4, 4, 64);
    });
}

/// Sliding windows (`ModelConfig::sliding_window`): each query attends to its last `window`
/// keys. Windows of 1 key, of fewer keys than a prefill row continues from, and of more keys
/// than a 512-key chunk (the 603-key row's window starts mid-chunk); decode partitions counted
/// from the window's first key, split or not.
#[test]
fn every_attention_kernel_reads_only_its_sliding_window() {
    every_schedule(|| {
        for window in [1, 3, 520] {
            prefill_case_windowed(
                Dtype::F32,
                "baton_paged_attention_prefill_hd64",
                (8, 2, 64),
                window,
            );
            prefill_case_windowed(
                Dtype::F32,
                "baton_paged_attention_generic",
                (8, 4, 8),
                window,
            );
        }
        prefill_case_windowed(
            Dtype::Bf16,
            "baton_paged_attention_prefill_hd128",
            (2, 1, 128),
            100,
        );
        for (window, z) in [(1, 1), (100, 1), (100, 4), (700, 3), (1000, 64)] {
            let sizing = Sizing {
                window,
                ..Sizing::grid(z)
            };
            decode_case_sized(Dtype::F32, 64, 16, 2, &[1100, 37, 0, 512, 513], z, sizing);
        }
        let sizing = Sizing {
            window: 300,
            ..Sizing::grid(8)
        };
        decode_case_sized(Dtype::Bf16, 128, 4, 2, &[530, 9, 0], 8, sizing);
    });
}

#[test]
fn generic_attention_head_dim_8_matches_the_reference_like_stories260k() {
    every_schedule(|| {
        // stories260K: 8 query heads, 4 kv heads, head_dim 8.
        for dtype in [Dtype::F32, Dtype::Bf16] {
            prefill_case(dtype, "baton_paged_attention_generic", 8, 4, 8);
        }
    });
}

// ---- Sampling ------------------------------------------------------------------------------------

const TOP: usize = baton_cuda::kernels::SAMPLER_TOP_SLOTS;

struct SampleOut {
    tokens: Vec<u32>,
    logprob: Vec<f32>,
    top_ids: Vec<u32>,
    top_lp: Vec<f32>,
}

/// Runs baton_sample_f32 over `logits` [rows, vocab] with `logits_stride` = vocab, no row
/// penalized.
fn sample(
    logits: &[f32],
    vocab: usize,
    params: &[SamplingParams],
    output_index: &[u32],
) -> SampleOut {
    let none = vec![PenaltyRow::NONE; params.len()];
    sample_penalized(logits, vocab, params, output_index, &none, &mut [], &[])
}

/// Runs baton_sample_f32 with penalties: `rows` [num_rows] index into `entries`, pending inputs
/// are read from `input_ids`. Runs it twice, with one block per row and with the rows split
/// (the executor's `plan::sample_splits`, at least 3 so that small vocabularies split too), and
/// checks that both give the same tokens and top ids and log-probabilities within float
/// rounding; returns the split run (what the executor launches).
fn sample_penalized(
    logits: &[f32],
    vocab: usize,
    params: &[SamplingParams],
    output_index: &[u32],
    penalty_rows: &[PenaltyRow],
    entries: &mut [DevicePenaltyEntry],
    input_ids: &[u32],
) -> SampleOut {
    let splits = baton_cuda::plan::sample_splits(vocab).max(3);
    let one = sample_split(
        logits,
        vocab,
        params,
        output_index,
        penalty_rows,
        entries,
        input_ids,
        1,
    );
    let split = sample_split(
        logits,
        vocab,
        params,
        output_index,
        penalty_rows,
        entries,
        input_ids,
        splits,
    );
    assert_same_samples(&one, &split, &format!("1 vs {splits} slices"));
    split
}

/// Asserts that two sampler runs over the same rows agree: tokens and top ids exactly,
/// log-probabilities within float rounding (a split row sums exp() per slice).
#[track_caller]
fn assert_same_samples(a: &SampleOut, b: &SampleOut, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.top_ids, b.top_ids, "{what}: top ids");
    let close = |x: f32, y: f32| x == y || (x - y).abs() <= 1e-6 * (1.0 + y.abs());
    for (i, (x, y)) in a.logprob.iter().zip(&b.logprob).enumerate() {
        assert!(close(*x, *y), "{what}: row {i} logprob {x} vs {y}");
    }
    for (i, (x, y)) in a.top_lp.iter().zip(&b.top_lp).enumerate() {
        assert!(close(*x, *y), "{what}: top slot {i} logprob {x} vs {y}");
    }
}

/// One baton_sample_f32 launch with grid (rows, `splits`). Checks that the kernel leaves the
/// logits as it found them and every row's arrival counter at 0.
#[allow(clippy::too_many_arguments)]
fn sample_split(
    logits: &[f32],
    vocab: usize,
    params: &[SamplingParams],
    output_index: &[u32],
    penalty_rows: &[PenaltyRow],
    entries: &mut [DevicePenaltyEntry],
    input_ids: &[u32],
    splits: usize,
) -> SampleOut {
    let rows = params.len();
    // BatonSamplePartial {u64 key; float max; float sum}: poisoned, the kernel writes before
    // it reads.
    let mut partials = vec![u64::MAX; 2 * rows * splits];
    let mut counters = vec![0i32; rows];
    assert_eq!(penalty_rows.len(), rows);
    let mut dev_logits = logits.to_vec();
    let table: u64 = entries.as_mut_ptr() as u64;
    assert_eq!(logits.len(), rows * vocab);
    let mut o = SampleOut {
        tokens: vec![u32::MAX; rows],
        logprob: vec![f32::NAN; rows],
        top_ids: vec![0; rows * TOP],
        top_lp: vec![f32::NAN; rows * TOP],
    };
    // sample_f32(tokens, logprob, top_ids, top_lp, logits, logits_stride, params, output_index,
    //            penalty_table, penalty_rows, input_ids, partials, counters, vocab)
    run(
        Dtype::Bf16, // sampling reads f32 logits whatever the module's elem_t
        "baton_sample_f32",
        (rows as u32, splits as u32, 1),
        baton_cuda::plan::SAMPLE_BLOCK as u32,
        Params::new()
            .ptr_mut(o.tokens.as_mut_ptr())
            .ptr_mut(o.logprob.as_mut_ptr())
            .ptr_mut(o.top_ids.as_mut_ptr())
            .ptr_mut(o.top_lp.as_mut_ptr())
            .ptr_mut(dev_logits.as_mut_ptr())
            .int(vocab as i32)
            .ptr(params.as_ptr())
            .ptr(output_index.as_ptr())
            .ptr(&table)
            .ptr(penalty_rows.as_ptr())
            .ptr(input_ids.as_ptr())
            .ptr_mut(partials.as_mut_ptr())
            .ptr_mut(counters.as_mut_ptr())
            .int(vocab as i32),
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&dev_logits) == bits(logits),
        "the sampler did not restore the logits"
    );
    assert!(
        counters.iter().all(|&c| c == 0),
        "arrival counters left at {counters:?} ({splits} slices)"
    );
    o
}

/// Compares row `r` of a device result with the CPU reference sampler.
#[track_caller]
fn assert_matches_cpu(o: &SampleOut, r: usize, logits: &[f32], p: &SamplingParams, idx: u32) {
    assert_matches_cpu_penalized(o, r, logits, p, idx, &[]);
}

/// [`assert_matches_cpu`] for a row penalized by `penalties` (the full list, pending token
/// included): the token is that of the penalized logits, the log-probabilities the raw ones.
#[track_caller]
fn assert_matches_cpu_penalized(
    o: &SampleOut,
    r: usize,
    logits: &[f32],
    p: &SamplingParams,
    idx: u32,
    penalties: &[PenaltyEntry],
) {
    let cpu = Sampler::new().sample_penalized(logits, p, idx, penalties);
    assert_eq!(o.tokens[r], cpu.token, "row {r} token");
    let lp_close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
    assert!(
        lp_close(o.logprob[r], cpu.logprob),
        "row {r} logprob {} vs cpu {}",
        o.logprob[r],
        cpu.logprob
    );
    for (j, &(id, lp)) in cpu.top.iter().enumerate() {
        assert_eq!(o.top_ids[r * TOP + j], id, "row {r} top {j}");
        assert!(
            lp_close(o.top_lp[r * TOP + j], lp),
            "row {r} top {j}: {} vs {lp}",
            o.top_lp[r * TOP + j]
        );
    }
    for j in cpu.top.len()..TOP {
        assert_eq!(
            o.top_ids[r * TOP + j],
            u32::MAX,
            "row {r} unused top slot {j}"
        );
        assert_eq!(o.top_lp[r * TOP + j], f32::NEG_INFINITY);
    }
}

#[test]
fn split_rows_sample_as_one_block_whatever_the_slice_count() {
    every_schedule(|| {
        let vocab = 100usize;
        let rows = 6usize;
        let mut logits = values(31, rows * vocab);
        // Row 0: a tie for the maximum across slices (ids 95 and 5) -> 5.
        logits[95] = 4.0;
        logits[5] = 4.0;
        // Row 1: the maximum in the last slice; row 2 in the first.
        logits[vocab + 99] = 3.0;
        logits[2 * vocab] = 3.0;
        // Row 3: NaN and +inf in different slices; row 4: every logit -inf.
        logits[3 * vocab + 10] = f32::NAN;
        logits[3 * vocab + 60] = f32::INFINITY;
        logits[4 * vocab..5 * vocab].fill(f32::NEG_INFINITY);
        let with_lp = SamplingParams {
            top_logprobs: 4,
            want_logprob: 1,
            ..SamplingParams::greedy()
        };
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            seed: 11,
            want_logprob: 1,
            ..SamplingParams::greedy()
        };
        let params = [
            with_lp,
            SamplingParams::greedy(),
            with_lp,
            with_lp,
            with_lp,
            sampled,
        ];
        let idx: Vec<u32> = (0..rows as u32).collect();
        let none = vec![PenaltyRow::NONE; rows];
        let run_with = |splits: usize| {
            sample_split(&logits, vocab, &params, &idx, &none, &mut [], &[], splits)
        };
        let one = run_with(1);
        // Slices are rounded up to 32 logits: 7 and 64 slices leave the last ones empty.
        for splits in [2, 7, 64] {
            let split = run_with(splits);
            assert_same_samples(&one, &split, &format!("{splits} slices"));
            for r in 0..rows {
                let row = &logits[r * vocab..(r + 1) * vocab];
                assert_matches_cpu(&split, r, row, &params[r], idx[r]);
            }
        }
        assert_eq!(&one.tokens[..5], &[5, 99, 0, 60, 0]);
    });
}

#[test]
fn greedy_sampling_is_the_argmax_with_ties_to_the_lowest_id() {
    every_schedule(|| {
        let vocab = 1000usize;
        let mut logits = values(20, 3 * vocab);
        // Row 0: a tie for the maximum at ids 503 and 17 -> 17.
        logits[503] = 5.0;
        logits[17] = 5.0;
        // Row 1: NaN never wins; +inf (cleaned to f32::MAX) does.
        logits[vocab + 3] = f32::NAN;
        logits[vocab + 900] = f32::INFINITY;
        // Row 2: every logit -inf or NaN -> token 0.
        for (i, x) in logits[2 * vocab..].iter_mut().enumerate() {
            *x = if i % 3 == 0 {
                f32::NAN
            } else {
                f32::NEG_INFINITY
            };
        }
        let with_lp = SamplingParams {
            top_logprobs: 5,
            want_logprob: 1,
            ..SamplingParams::greedy()
        };
        let params = [with_lp, SamplingParams::greedy(), with_lp];
        let idx = [0u32, 1, 2];
        let o = sample(&logits, vocab, &params, &idx);
        assert_eq!(o.tokens, vec![17, 900, 0]);
        for r in 0..3 {
            assert_matches_cpu(
                &o,
                r,
                &logits[r * vocab..(r + 1) * vocab],
                &params[r],
                idx[r],
            );
        }
    });
}

#[test]
fn a_seeded_sample_is_the_same_alone_or_second_in_a_batch_and_matches_the_cpu() {
    every_schedule(|| {
        let vocab = 2000usize;
        let logits: Vec<f32> = values(21, vocab).iter().map(|x| x * 4.0).collect();
        let other: Vec<f32> = values(22, vocab).iter().map(|x| x * 4.0).collect();
        let seeded = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 50,
            min_p: 0.05,
            seed: 0xDEAD_BEEF_1234,
            top_logprobs: 3,
            want_logprob: 1,
            ..SamplingParams::greedy()
        };
        let first = SamplingParams {
            temperature: 1.3,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 99,
            top_logprobs: 0,
            want_logprob: 0,
            ..SamplingParams::greedy()
        };
        for idx in [0u32, 7, 12_345] {
            let alone = sample(&logits, vocab, &[seeded], &[idx]);
            let batch: Vec<f32> = other.iter().chain(&logits).copied().collect();
            let pair = sample(&batch, vocab, &[first, seeded], &[3, idx]);
            assert_eq!(alone.tokens[0], pair.tokens[1], "output index {idx}");
            assert_eq!(alone.logprob[0].to_bits(), pair.logprob[1].to_bits());
            assert_eq!(alone.top_ids[..TOP], pair.top_ids[TOP..]);
            assert_matches_cpu(&alone, 0, &logits, &seeded, idx);
            assert_matches_cpu(&pair, 0, &other, &first, 3);
        }
    });
}

#[test]
fn sampling_filters_agree_with_the_cpu_sampler_over_many_draws() {
    every_schedule(|| {
        let vocab = 300usize;
        let logits: Vec<f32> = values(23, vocab).iter().map(|x| x * 3.0).collect();
        let cases = [
            (1.0f32, 1.0f32, 0i32, 0.0f32), // plain temperature sampling
            (0.7, 1.0, 10, 0.0),            // top-k
            (1.0, 0.5, 0, 0.0),             // top-p
            (1.2, 1.0, 0, 0.2),             // min-p
            (0.9, 0.8, 40, 0.01),           // everything
            (1.0, f32::NAN, 400, 0.0),      // top-k >= vocab and a NaN top-p: both disabled
            (1e-39, 1.0, 0, 0.0),           // 1 / temperature overflows: greedy
            (-1.0, 0.5, 5, 0.0),            // negative temperature: greedy
            (1.0, 1e-6, 0, 0.0),            // top-p keeps only the top token
        ];
        let idx: Vec<u32> = (0..8).collect();
        for (temperature, top_p, top_k, min_p) in cases {
            let params: Vec<SamplingParams> = idx
                .iter()
                .map(|&i| SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    min_p,
                    seed: 1000 + u64::from(i),
                    top_logprobs: 0,
                    want_logprob: 1,
                    ..SamplingParams::greedy()
                })
                .collect();
            let batch: Vec<f32> = idx.iter().flat_map(|_| logits.iter().copied()).collect();
            let o = sample(&batch, vocab, &params, &idx);
            for (r, &i) in idx.iter().enumerate() {
                assert_matches_cpu(&o, r, &logits, &params[r], i);
            }
        }
    });
}

/// One row of the penalty test: its full history (prompt then outputs) and whether its last
/// output is still pending (resolved on the device, so the host list leaves it out).
struct PenaltyCase {
    history: Vec<u32>,
    prompt_len: usize,
    pending: bool,
    /// The row's logit bias.
    bias: Vec<(u32, f32)>,
}

impl PenaltyCase {
    /// The row's list as the CPU reference builds it: from the whole history when
    /// `with_pending`, else (as the host side of the CUDA worker) without the pending last
    /// token, which the device merges; from the bias alone when the row has no penalties.
    fn list(
        &self,
        p: &SamplingParams,
        with_pending: bool,
        scratch: &mut Vec<u64>,
    ) -> Vec<PenaltyEntry> {
        let mut list = Vec::new();
        if p.adjusts_logits() {
            let known = if !p.has_penalties() {
                &[][..]
            } else if with_pending {
                &self.history[..]
            } else {
                &self.history[..self.history.len() - usize::from(self.pending)]
            };
            build_penalty_list(
                known,
                self.prompt_len.min(known.len()),
                p.has_repetition_penalty(),
                &self.bias,
                scratch,
                &mut list,
            );
        }
        list
    }
}

#[test]
fn penalized_sampling_matches_the_cpu_sampler_on_the_penalized_logits() {
    let vocab = 400usize;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let rows = 12usize;
    let mut changed = 0;
    let mut pending_kinds = [0usize; 2]; // pending token already listed / fresh
    for batch in 0..3u64 {
        // Logits in [-6, 6): repetition divides the positive ones and multiplies the negative.
        let mut logits: Vec<f32> = values(40 + batch, rows * vocab)
            .iter()
            .map(|x| x * 6.0)
            .collect();
        let (mut params, mut cases, mut idx) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            // Histories over a small token range, so tokens repeat, plus the row's top tokens.
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut top: Vec<u32> = (0..vocab as u32).collect();
            top.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            let len = 2 + next(40) as usize;
            let mut history: Vec<u32> = (0..len)
                .map(|_| {
                    if next(3) == 0 {
                        top[next(4) as usize]
                    } else {
                        next(60) as u32 * 5
                    }
                })
                .collect();
            let prompt_len = next(len as u64) as usize; // at least one output
            let pending = r % 4 != 3;
            if pending {
                // The pending output: half the time a token the host list already has.
                let last = if r % 2 == 0 {
                    history[next((len - 1) as u64) as usize]
                } else {
                    // A fresh token, the row's best one that the history lacks (so penalizing
                    // it or not decides a greedy row's token).
                    *top.iter()
                        .find(|t| !history[..len - 1].contains(t))
                        .unwrap()
                };
                history[len - 1] = last;
                pending_kinds[usize::from(!history[..len - 1].contains(&last))] += 1;
            }
            let pick = |n: u64, v: &[f32]| v[n as usize % v.len()];
            let mut p = SamplingParams {
                presence_penalty: pick(next(4), &[0.0, 0.5, -0.75, 2.0]),
                frequency_penalty: pick(next(4), &[0.0, 0.3, -0.4, 1.25]),
                repetition_penalty: pick(next(5), &[1.0, 1.3, 0.8, 2.0, 0.0]),
                want_logprob: 1,
                top_logprobs: 3,
                ..SamplingParams::greedy()
            };
            if r % 3 == 1 {
                p.temperature = 0.9;
                p.top_k = 50;
                p.top_p = 0.95;
                p.seed = 77 + r as u64 + 100 * batch;
            }
            if r == 5 {
                // Row 5: no penalties, next to penalized rows.
                p.presence_penalty = 0.0;
                p.frequency_penalty = 0.0;
                p.repetition_penalty = 1.0;
            }
            if r == 0 {
                p.presence_penalty = 3.0; // strong enough to move the argmax
            }
            // A logit bias on every third row (row 4: a bias and no penalties): a boost for a
            // runner-up, a cut for a history token, a ban for a third token.
            let mut bias = Vec::new();
            if r % 3 == 1 || r == 4 {
                bias = vec![
                    (top[1], 2.5),
                    (history[0], -1.5),
                    (next(vocab as u64) as u32, -100.0),
                ];
            }
            if r == 4 {
                p.presence_penalty = 0.0;
                p.frequency_penalty = 0.0;
                p.repetition_penalty = 1.0;
            }
            p.logit_bias_len = bias.len() as u32;
            params.push(p);
            idx.push((len - prompt_len) as u32);
            cases.push(PenaltyCase {
                history,
                prompt_len,
                pending,
                bias,
            });
        }
        // Odd logits on history tokens of row 2: +inf and -0.
        let h2 = &cases[2].history;
        logits[2 * vocab + h2[0] as usize] = f32::INFINITY;
        logits[2 * vocab + h2[1] as usize] = -0.0;

        // The host side, as the executor: lists without the pending token, which lives in the
        // input-id buffer (here at index 3 * r + 1, between unrelated ids).
        let mut input_ids = vec![u32::MAX; 3 * rows];
        let (mut scratch, mut lists) = (Vec::new(), Vec::new());
        for (r, c) in cases.iter().enumerate() {
            let list = c.list(&params[r], false, &mut scratch);
            if c.pending {
                input_ids[3 * r + 1] = *c.history.last().unwrap();
            }
            lists.push(list);
        }
        let (mut prow, mut entries) = (Vec::new(), Vec::new());
        pack_penalties(
            lists.iter().zip(&cases).zip(&params).map(|((l, c), p)| {
                let pend = (c.pending && p.has_penalties()).then_some(0);
                (&l[..], pend)
            }),
            &mut prow,
            &mut entries,
        )
        .unwrap();
        for (r, pr) in prow.iter_mut().enumerate() {
            if pr.pending_index >= 0 {
                pr.pending_index = 3 * r as i32 + 1;
            }
        }
        assert_eq!((prow[5].count, prow[5].pending_index), (0, -1));

        every_schedule(|| {
            let o = sample_penalized(
                &logits,
                vocab,
                &params,
                &idx,
                &prow,
                &mut entries.clone(),
                &input_ids,
            );
            for (r, c) in cases.iter().enumerate() {
                let raw = &logits[r * vocab..(r + 1) * vocab];
                let p = &params[r];
                let full = c.list(p, true, &mut Vec::new());
                let cpu = Sampler::new().sample_penalized(raw, p, idx[r], &full);
                assert_eq!(
                    o.tokens[r], cpu.token,
                    "batch {batch} row {r} token ({p:?})"
                );
                // Log-probabilities are the raw ones, whatever the penalties.
                assert_matches_cpu_penalized(&o, r, raw, p, idx[r], &full);
            }
        });
        let o = sample(&logits, vocab, &params, &idx);
        let pen = sample_penalized(
            &logits,
            vocab,
            &params,
            &idx,
            &prow,
            &mut entries.clone(),
            &input_ids,
        );
        changed += (0..rows).filter(|&r| o.tokens[r] != pen.tokens[r]).count();
        assert_eq!(o.tokens[5], pen.tokens[5], "an unpenalized row moved");
        // Top log-probabilities are the raw ones, whatever the penalties (up to float
        // rounding: the unpenalized rows of `o` are split rows, summed per slice).
        assert_eq!(o.top_ids, pen.top_ids);
        let close = |x: f32, y: f32| x == y || (x - y).abs() <= 1e-6 * (1.0 + y.abs());
        for (i, (x, y)) in o.top_lp.iter().zip(&pen.top_lp).enumerate() {
            assert!(close(*x, *y), "top slot {i}: {x} vs {y}");
        }
        assert!(close(o.logprob[5], pen.logprob[5]));
    }
    assert!(changed >= 6, "penalties changed only {changed} tokens");
    assert!(
        pending_kinds.iter().all(|&k| k >= 3),
        "pending cases {pending_kinds:?}"
    );
}

#[test]
fn philox_and_uniform_bits_probes_match_the_cpu_rng() {
    every_schedule(|| {
        let n = 300usize;
        let ctr: Vec<[u32; 4]> = (0..n as u32)
            .map(|i| [i, i * 3, !i, 0xFFFF_FFFF - i])
            .collect();
        let key: Vec<[u32; 2]> = (0..n as u32)
            .map(|i| [i.wrapping_mul(0x9E37_79B9), i ^ 0x5555])
            .collect();
        let mut out = vec![[0u32; 4]; n];
        // philox4x32_10_probe(out, ctr, key, n): uint4 / uint2 arrays.
        run(
            Dtype::F32,
            "baton_philox4x32_10_probe",
            (n.div_ceil(256) as u32, 1, 1),
            256,
            Params::new()
                .ptr_mut(out.as_mut_ptr())
                .ptr(ctr.as_ptr())
                .ptr(key.as_ptr())
                .int(n as i32),
        );
        for i in 0..n {
            assert_eq!(
                out[i],
                baton_worker::sampling::philox4x32_10(ctr[i], key[i]),
                "probe {i}"
            );
        }
        let seeds: Vec<u64> = (0..n as u64).map(|i| i * 0x1_0000_0001 + 17).collect();
        let oidx: Vec<u32> = (0..n as u32).map(|i| i * 31).collect();
        let mut bits = vec![0u32; n];
        // sampling_uniform_bits(out, seeds, output_index, n)
        run(
            Dtype::F32,
            "baton_sampling_uniform_bits",
            (n.div_ceil(256) as u32, 1, 1),
            256,
            Params::new()
                .ptr_mut(bits.as_mut_ptr())
                .ptr(seeds.as_ptr())
                .ptr(oidx.as_ptr())
                .int(n as i32),
        );
        for i in 0..n {
            let u = baton_worker::sampling::uniform(seeds[i], oidx[i]);
            assert_eq!(bits[i] as f32 / 16_777_216.0, u, "uniform {i}");
        }
    });
}

#[test]
fn sampling_a_llama_sized_vocabulary_matches_the_cpu() {
    every_schedule(|| {
        let vocab = 32_000usize;
        let logits: Vec<f32> = values(24, vocab).iter().map(|x| x * 8.0).collect();
        let params = [
            SamplingParams {
                temperature: 0.7,
                top_p: 0.95,
                top_k: 0,
                min_p: 0.0,
                seed: 7,
                top_logprobs: 20,
                want_logprob: 1,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                top_logprobs: 2,
                ..SamplingParams::greedy()
            },
        ];
        let batch: Vec<f32> = logits.iter().chain(&logits).copied().collect();
        let o = sample(&batch, vocab, &params, &[5, 6]);
        for (r, p) in params.iter().enumerate() {
            assert_matches_cpu(&o, r, &logits, p, 5 + r as u32);
        }
    });
}

#[path = "../../cuda/tests/support/device_sampler_model.rs"]
mod sampler_model;

/// The sampler's histogram path (kernels/sampling.cu, "Histogram selection") picks the token
/// of the device semantics (the model's sort-and-scan reference: fixed-point masses, key
/// order) on rows where it answers every question from its lists (a Llama-3-sized row with a
/// trained model's spread: top-p, plain temperature, top-k, all three with min-p), and on rows
/// where it must not: near-equal logits overflow a bin's list (the radix select inside the bin),
/// and a top-k that reaches the last, zero-mass bin. The model says which path each row takes;
/// both must occur. Then a top-3 row at a high temperature over twelve draws, which must draw
/// each of the three, and rows at an infinite temperature with -inf logits.
#[test]
fn the_histogram_sampler_picks_the_reference_token_on_either_path() {
    use sampler_model::{hist_model, logits, sorted_reference, Params as ModelParams, HIST_LIST};
    let case = |t: f32, top_p: f32, top_k: i32, min_p: f32, seed: u64| SamplingParams {
        temperature: t,
        top_p,
        top_k,
        min_p,
        seed,
        want_logprob: 1,
        ..SamplingParams::greedy()
    };
    let model = |p: &SamplingParams| ModelParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        seed: p.seed,
    };
    let wide = [
        case(0.8, 0.95, 0, 0.0, 1),
        case(1.0, 1.0, 0, 0.0, 2),
        case(0.7, 1.0, 50, 0.0, 3),
        case(1.0, 0.9, 40, 0.05, 4),
    ];
    let narrow = [
        case(1.0, 0.9, 0, 0.0, 5),
        case(0.3, 1.0, 2990, 0.0, 6),
        case(0.9, 0.8, 0, 0.02, 7),
    ];
    every_schedule(|| {
        let mut fell_back = Vec::new();
        for (vocab, rows) in [
            (
                128_256usize,
                wide.iter().map(|p| (p, 30.0f32)).collect::<Vec<_>>(),
            ),
            (
                3000,
                narrow.iter().zip([0.001f32, 12.0, 0.0]).collect::<Vec<_>>(),
            ),
        ] {
            let xs: Vec<Vec<f32>> = rows
                .iter()
                .enumerate()
                .map(|(r, &(_, spread))| logits(vocab, 40 + r as u32, spread, false))
                .collect();
            let params: Vec<SamplingParams> = rows.iter().map(|&(p, _)| *p).collect();
            let idx: Vec<u32> = (0..rows.len() as u32).map(|i| 100 + i).collect();
            let batch: Vec<f32> = xs.concat();
            let o = sample(&batch, vocab, &params, &idx);
            for (r, p) in params.iter().enumerate() {
                let mp = model(p);
                let (_, _, q) = hist_model(&xs[r], &mp, idx[r], HIST_LIST);
                fell_back.push(q.restricted > 0);
                assert_eq!(
                    o.tokens[r],
                    sorted_reference(&xs[r], &mp, idx[r]),
                    "vocab {vocab} row {r}"
                );
            }
        }
        assert_eq!(
            fell_back,
            [false, false, false, false, true, false, true],
            "which rows the model says search a bin too full to list"
        );
        // Top-3 at a high temperature, over many draws: the third token is drawn too, so a
        // boundary off by one in the list's count would show.
        let vocab = 3000usize;
        let x = logits(vocab, 77, 12.0, false);
        let params: Vec<SamplingParams> = (0..12).map(|i| case(5.0, 1.0, 3, 0.0, i)).collect();
        let idx: Vec<u32> = (0..12).collect();
        let o = sample(&x.repeat(params.len()), vocab, &params, &idx);
        for (r, p) in params.iter().enumerate() {
            assert_eq!(
                o.tokens[r],
                sorted_reference(&x, &model(p), idx[r]),
                "top-3 row {r}"
            );
        }
        let mut drawn = o.tokens.clone();
        drawn.sort_unstable();
        drawn.dedup();
        assert_eq!(drawn.len(), 3, "top-3 draws {:?}", o.tokens);

        // An infinite temperature (no API sends one: it is refused) weighs every finite logit
        // alike and a -inf one (exp(-inf * 0) = NaN) not at all, on either path.
        let mut x = logits(vocab, 78, 12.0, false);
        for v in x.iter_mut().step_by(2) {
            *v = f32::NEG_INFINITY;
        }
        let params: Vec<SamplingParams> = (0..6)
            .map(|i| case(f32::INFINITY, [1.0, 0.5][i as usize % 2], 0, 0.0, i))
            .collect();
        let idx: Vec<u32> = (0..6).collect();
        let o = sample(&x.repeat(params.len()), vocab, &params, &idx);
        for (r, p) in params.iter().enumerate() {
            assert!(
                x[o.tokens[r] as usize].is_finite(),
                "row {r}: {}",
                o.tokens[r]
            );
            assert_eq!(
                o.tokens[r],
                sorted_reference(&x, &model(p), idx[r]),
                "row {r}"
            );
        }
        // The same through an allow-list (the radix select over the list weighs every listed
        // token): tokens 0..=100, 51 of them -inf (an odd count: 2^63 twice wraps to 0).
        let list: Vec<PenaltyEntry> = (0..101)
            .map(|token| PenaltyEntry {
                token,
                output_count: 0,
                in_prompt: false,
                bias: 0.0,
                listed: true,
            })
            .collect();
        let allowed: Vec<f32> = (0..vocab)
            .map(|i| if i < 101 { x[i] } else { f32::NEG_INFINITY })
            .collect();
        for (i, p) in params.iter().enumerate() {
            let p = SamplingParams {
                allowed_only: 1,
                ..*p
            };
            let (mut prow, mut entries) = (Vec::new(), Vec::new());
            pack_penalties([(&list[..], None)], &mut prow, &mut entries).unwrap();
            let o = sample_penalized(&x, vocab, &[p], &[idx[i]], &prow, &mut entries, &[]);
            let want = sorted_reference(&allowed, &model(&p), idx[i]);
            assert!(o.tokens[0] < 101 && allowed[o.tokens[0] as usize].is_finite());
            assert_eq!(o.tokens[0], want, "allow-list row {i}");
        }
    });
}

/// `baton_score_rows` (prompt log-probabilities) against the CPU worker's `Sampler::score` and
/// `sampling::rank_of`: rows with ties at the token's logit and in the top entries, NaN (as
/// -inf), +inf (as f32::MAX), an all -inf row, a token that is the row's only finite logit, and
/// a Llama-sized row; n_top 0, 1, 5 and 20 (the cap) over a vocabulary that is smaller or larger.
#[test]
fn prompt_scoring_matches_the_cpu_scorer() {
    every_schedule(|| {
        for (vocab, n_top) in [
            (1000usize, 5usize),
            (1000, 0),
            (7, 20),
            (128_256, 20),
            (300, 1),
        ] {
            let rows = 6usize;
            let mut logits: Vec<f32> = (0..rows * vocab)
                .map(|i| ((i * 7919 % 1013) as f32 / 97.0 - 5.0).sin() * 8.0)
                .collect();
            let row = |r: usize| r * vocab..(r + 1) * vocab;
            // Row 1: ties at the token's logit and at the top.
            for i in row(1).step_by(3) {
                logits[i] = 4.0;
            }
            // Row 2: NaN and +inf.
            logits[row(2).start + 1] = f32::NAN;
            logits[row(2).start + vocab / 2] = f32::INFINITY;
            // Row 3: every logit -inf.
            logits[row(3)].fill(f32::NEG_INFINITY);
            // Row 4: one finite logit, the token's.
            logits[row(4)].fill(f32::NEG_INFINITY);
            logits[row(4).start + vocab - 1] = 0.5;
            let tokens: Vec<u32> = vec![
                (vocab / 3) as u32,
                3,
                (vocab / 2) as u32,
                0,
                (vocab - 1) as u32,
                1,
            ];
            let mut lp = vec![f32::NAN; rows];
            let mut rank = vec![u32::MAX - 1; rows];
            let mut top_ids = vec![0u32; rows * TOP];
            let mut top_lp = vec![f32::NAN; rows * TOP];
            // score_rows(out_logprob, out_rank, out_top_ids, out_top_logprobs, logits, tokens,
            //            vocab, n_top)
            run(
                Dtype::F32,
                "baton_score_rows",
                (rows as u32, 1, 1),
                baton_cuda::plan::SAMPLE_BLOCK as u32,
                Params::new()
                    .ptr_mut(lp.as_mut_ptr())
                    .ptr_mut(rank.as_mut_ptr())
                    .ptr_mut(top_ids.as_mut_ptr())
                    .ptr_mut(top_lp.as_mut_ptr())
                    .ptr(logits.as_ptr())
                    .ptr(tokens.as_ptr())
                    .int(vocab as i32)
                    .int(n_top as i32),
            );
            let mut cpu = Sampler::new();
            for r in 0..rows {
                let x = &logits[row(r)];
                let what = format!("vocab {vocab} n_top {n_top} row {r}");
                let (want_lp, want_top) = cpu.score(x, tokens[r], n_top);
                let close = |a: f32, b: f32| (a == b) || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
                assert!(
                    close(lp[r], want_lp),
                    "{what}: logprob {} vs {want_lp}",
                    lp[r]
                );
                assert_eq!(
                    rank[r],
                    baton_worker::sampling::rank_of(x, tokens[r]),
                    "{what}: rank"
                );
                let got_top: Vec<(u32, f32)> = (0..TOP)
                    .map(|j| (top_ids[r * TOP + j], top_lp[r * TOP + j]))
                    .take_while(|&(id, _)| id != u32::MAX)
                    .collect();
                assert_eq!(got_top.len(), want_top.len(), "{what}: top count");
                for (g, w) in got_top.iter().zip(&want_top) {
                    assert_eq!(g.0, w.0, "{what}: top ids {got_top:?} vs {want_top:?}");
                    assert!(close(g.1, w.1), "{what}: top {got_top:?} vs {want_top:?}");
                }
                for j in got_top.len()..TOP {
                    assert_eq!(top_lp[r * TOP + j], f32::NEG_INFINITY, "{what}: slot {j}");
                }
            }
        }
    });
}

// ---- Token masks (structured outputs) ------------------------------------------------------------

/// Runs `baton_apply_token_mask` over `logits` ([rows, stride] f32) as the executor launches it,
/// but with grid.y = `splits`: row `r` takes mask `mask_rows[r]` of `masks` (compacted,
/// `ceil(vocab / 32)` words each) or none for `-1`.
fn apply_token_mask_dev(
    logits: &mut [f32],
    stride: usize,
    vocab: usize,
    mask_rows: &[i32],
    masks: &[u32],
    splits: usize,
) {
    let rows = mask_rows.len();
    assert_eq!(logits.len(), rows * stride);
    let table: u64 = masks.as_ptr() as u64;
    // apply_token_mask(logits, logits_stride, mask_rows, mask_table, vocab)
    run(
        Dtype::Bf16, // f32 logits whatever the module's elem_t
        "baton_apply_token_mask",
        (rows as u32, splits as u32, 1),
        baton_cuda::plan::TOKEN_MASK_BLOCK as u32,
        Params::new()
            .ptr_mut(logits.as_mut_ptr())
            .int(stride as i32)
            .ptr(mask_rows.as_ptr())
            .ptr(&table)
            .int(vocab as i32),
    );
}

/// The CPU worker's masking of the same rows: `baton_worker::sampling::apply_token_mask` on
/// each row's first `vocab` logits (the padding past `vocab` is never touched).
fn apply_token_mask_ref(
    logits: &[f32],
    stride: usize,
    vocab: usize,
    mask_rows: &[i32],
    masks: &[u32],
) -> Vec<f32> {
    let words = baton_proto::token_mask_words(vocab);
    let mut want = logits.to_vec();
    for (r, &m) in mask_rows.iter().enumerate() {
        if m >= 0 {
            let mask = &masks[m as usize * words..][..words];
            baton_worker::sampling::apply_token_mask(&mut want[r * stride..][..vocab], mask);
        }
    }
    want
}

/// Random mask words with about `density` of the bits set (an LCG, as [`values`]).
fn mask_words(seed: u64, words: usize, density: f32) -> Vec<u32> {
    let v = values(seed, 32 * words);
    (0..words)
        .map(|w| {
            (0..32).fold(0u32, |acc, b| {
                acc | (u32::from(v[32 * w + b] < 2.0 * density - 1.0) << b)
            })
        })
        .collect()
}

/// Compares logits bit for bit (NaN payloads and signed zeros included).
#[track_caller]
fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

/// `baton_apply_token_mask` against the CPU worker's `apply_token_mask`: rows with and without
/// a mask (masks taken out of row order, one row's mask used twice), a vocabulary that is not a
/// multiple of 32 with set bits past it in the last word, logits padded past the vocabulary
/// (untouched), NaN / +inf / -0 logits, empty, full and sparse masks, and grids of 1 block per
/// row up to more blocks than mask words (empty slices).
#[test]
fn token_masks_set_every_disallowed_logit_to_minus_infinity_as_the_cpu_worker() {
    every_schedule(|| {
        let vocab = 1000usize; // 31 full words and 8 tokens of a 32nd
        let words = baton_proto::token_mask_words(vocab);
        assert_eq!(words, 32);
        let stride = vocab + 13;
        let rows = 7usize;
        let mut logits: Vec<f32> = values(41, rows * stride).iter().map(|x| x * 6.0).collect();
        logits[3] = f32::NAN;
        logits[stride + 5] = f32::INFINITY;
        logits[2 * stride + 999] = -0.0;
        logits[4 * stride + 31] = f32::NEG_INFINITY;
        let mut last = mask_words(44, 1, 0.5)[0];
        last |= 0xffff_ff00; // bits of tokens 1000.. (past the vocabulary)
        let masks: Vec<u32> = [
            mask_words(42, words, 0.1), // 0: sparse (a grammar's usual mask)
            vec![0; words],             // 1: nothing allowed
            vec![u32::MAX; words],      // 2: everything allowed
            mask_words(43, words - 1, 0.5) // 3: half, with bits past the vocabulary
                .into_iter()
                .chain([last])
                .collect(),
        ]
        .concat();
        let mask_rows = [3, -1, 0, 1, -1, 3, 2];
        let want = apply_token_mask_ref(&logits, stride, vocab, &mask_rows, &masks);
        // The masks did something, and left the unmasked rows and the padding alone.
        assert!(want[3 * stride..3 * stride + vocab]
            .iter()
            .all(|x| *x == f32::NEG_INFINITY));
        assert_same_bits(
            &want[stride..2 * stride],
            &logits[stride..2 * stride],
            "row 1",
        );
        let executor = baton_cuda::plan::token_mask_splits(vocab);
        assert_eq!(executor, 1);
        for splits in [executor, 2, 3, 7, 32, 64] {
            let mut got = logits.clone();
            apply_token_mask_dev(&mut got, stride, vocab, &mask_rows, &masks, splits);
            assert_same_bits(&got, &want, &format!("{splits} blocks per row"));
        }
        // A full mask changes nothing, an empty one everything.
        let mut got = logits[..stride].to_vec();
        apply_token_mask_dev(&mut got, stride, vocab, &[2], &masks, 1);
        assert_same_bits(&got, &logits[..stride], "full mask");
    });
}

/// A Llama-3-sized vocabulary (128256 tokens, 4008 mask words, the executor's 16 blocks per
/// row) with a guided row between unguided ones, then the sampler over the masked logits: the
/// greedy and seeded draws, log-probabilities and top entries are the CPU worker's on the
/// masked logits (the mask excludes the unmasked argmax, so an ignored mask would fail).
#[test]
fn token_masks_over_a_llama_3_vocabulary_then_sampling_match_the_cpu_worker() {
    every_schedule(|| {
        let vocab = 128_256usize;
        let words = baton_proto::token_mask_words(vocab);
        assert_eq!(words, 4008);
        let raw: Vec<f32> = values(51, vocab).iter().map(|x| x * 10.0).collect();
        let argmax = (0..vocab)
            .max_by(|&a, &b| raw[a].total_cmp(&raw[b]).then(b.cmp(&a)))
            .unwrap();
        let mut mask = mask_words(52, words, 0.3);
        mask[argmax / 32] &= !(1 << (argmax % 32));
        let logits: Vec<f32> = raw.iter().chain(&raw).chain(&raw).copied().collect();
        let mask_rows = [-1, 0, -1];
        let want = apply_token_mask_ref(&logits, vocab, vocab, &mask_rows, &mask);
        let splits = baton_cuda::plan::token_mask_splits(vocab);
        assert_eq!(splits, 16);
        let mut got = logits.clone();
        apply_token_mask_dev(&mut got, vocab, vocab, &mask_rows, &mask, splits);
        assert_same_bits(&got, &want, "128256 tokens");

        let masked = &want[vocab..2 * vocab];
        let params = [
            SamplingParams {
                top_logprobs: 5,
                want_logprob: 1,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: 77,
                top_logprobs: 3,
                want_logprob: 1,
                ..SamplingParams::greedy()
            },
        ];
        // The sampler over the first two rows (unguided, guided) of the masked logits.
        for p in &params {
            let o = sample(&got[..2 * vocab], vocab, &[*p, *p], &[4, 4]);
            assert_matches_cpu(&o, 0, &raw, p, 4);
            assert_matches_cpu(&o, 1, masked, p, 4);
            let t = o.tokens[1] as usize;
            assert_ne!(t, argmax, "the mask was ignored");
            assert!(
                mask[t / 32] >> (t % 32) & 1 == 1,
                "token {t} is not allowed"
            );
            if p.temperature == 0.0 {
                assert_eq!(o.tokens[0], argmax as u32);
            }
        }
    });
}

// ---- Mixture of experts --------------------------------------------------------------------------

/// One MoE layer through the executor's launch sequence (`baton_moe_route`, `baton_moe_align`,
/// `baton_moe_gemm` for gate|up gathering the tokens, `baton_silu_and_mul` over the pairs,
/// `baton_moe_gemm` for down, `baton_moe_combine` with and without a shared expert's output)
/// against a direct reference: softmax, top-k with ties to the lower id, renormalized or not,
/// `Σ w_e expert_e(x)` in ascending expert id. Token counts from one to several tiles per
/// expert, an odd hidden width (scalar paths, a partial column block), a K past one chunk.
#[test]
fn moe_kernels_route_group_and_combine_as_the_reference() {
    // (tokens, experts, top_k, hidden, inter, renorm)
    let cases = [
        (1usize, 8usize, 2usize, 40usize, 24usize, true),
        (21, 6, 3, 37, 600, false),
        (5, 4, 4, 40, 16, true),
    ];
    every_schedule(|| {
        for (ci, &(t, ne, k, h, im, renorm)) in cases.iter().enumerate() {
            for dtype in Dtype::ALL {
                let seed = 100 + ci as u64;
                let x = rounded_values(dtype, seed, t * h, 1.0);
                let wgu = rounded_values(dtype, seed + 1, ne * 2 * im * h, 0.2);
                let wd = rounded_values(dtype, seed + 2, ne * h * im, 0.2);
                // Router logits (the router GEMM's f32 output); token 0 has a three-way tie at
                // the top (experts 1, 2, 3), which the lower ids win.
                let mut logits = values(seed + 3, t * ne)
                    .into_iter()
                    .map(|v| v * 3.0)
                    .collect::<Vec<f32>>();
                logits[1..4].fill(5.0);
                let (mut ids, mut wts) = (vec![-1i32; t * k], vec![f32::NAN; t * k]);
                // moe_route(topk_ids, topk_w, logits, num_tokens, num_experts, top_k, renorm)
                run(
                    dtype,
                    "baton_moe_route",
                    (t as u32, 1, 1),
                    32,
                    Params::new()
                        .ptr_mut(ids.as_mut_ptr())
                        .ptr_mut(wts.as_mut_ptr())
                        .ptr(logits.as_ptr())
                        .int(t as i32)
                        .int(ne as i32)
                        .int(k as i32)
                        .int(i32::from(renorm)),
                );
                // Reference routing.
                let mut want_route = Vec::new();
                for i in 0..t {
                    let l = &logits[i * ne..(i + 1) * ne];
                    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let s: f32 = l.iter().map(|v| (v - m).exp()).sum();
                    let p: Vec<f32> = l.iter().map(|v| (v - m).exp() / s).collect();
                    let mut order: Vec<usize> = (0..ne).collect();
                    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                    let top = &mut order[..k];
                    let sum: f32 = top.iter().map(|&e| p[e]).sum();
                    top.sort_unstable();
                    for &e in top.iter() {
                        want_route.push((e as i32, if renorm { p[e] / sum } else { p[e] }));
                    }
                }
                for (j, &(e, w)) in want_route.iter().enumerate() {
                    assert_eq!(ids[j], e, "case {ci} pair {j}: expert");
                    assert!(
                        (wts[j] - w).abs() <= 1e-5,
                        "case {ci} pair {j}: {} vs {w}",
                        wts[j]
                    );
                }
                let pairs = t * k;
                let max_tiles = pairs.div_ceil(8) + ne;
                let mut sorted = vec![-1i32; pairs];
                let mut tiles = vec![-1i32; 1 + 3 * max_tiles];
                // moe_align(sorted_pairs, tiles, topk_ids, num_pairs, num_experts)
                run(
                    dtype,
                    "baton_moe_align",
                    (1, 1, 1),
                    1024,
                    Params::new()
                        .ptr_mut(sorted.as_mut_ptr())
                        .ptr_mut(tiles.as_mut_ptr())
                        .ptr(ids.as_ptr())
                        .int(pairs as i32)
                        .int(ne as i32),
                );
                // Every pair once, grouped by expert, tiles covering each run in order.
                let mut seen = sorted.clone();
                seen.sort_unstable();
                assert_eq!(seen, (0..pairs as i32).collect::<Vec<_>>(), "case {ci}");
                let n_tiles = tiles[0] as usize;
                assert!(n_tiles <= max_tiles);
                let mut covered = 0usize;
                for tile in tiles[1..1 + 3 * n_tiles].chunks_exact(3) {
                    let (e, s, end) = (tiles_at(tile, 0), tiles_at(tile, 1), tiles_at(tile, 2));
                    assert_eq!(s, covered, "case {ci}: tiles in order");
                    covered = (s + 8).min(end);
                    for &p in &sorted[s..covered] {
                        assert_eq!(ids[p as usize] as usize, e, "case {ci}: pair in its run");
                    }
                }
                assert_eq!(covered, pairs, "case {ci}: tiles cover every pair");

                let mut xin = Elems::new(dtype, &x);
                let mut wgu_d = Elems::new(dtype, &wgu);
                let mut wd_d = Elems::new(dtype, &wd);
                let mut gu = Elems::filled(dtype, pairs * 2 * im, f32::NAN);
                let mut act = Elems::filled(dtype, pairs * im, f32::NAN);
                let mut y = Elems::filled(dtype, pairs * h, f32::NAN);
                let gemm = |out: &mut Elems,
                            inp: &mut Elems,
                            w: &mut Elems,
                            n: usize,
                            kin: usize,
                            gather: bool| {
                    // moe_gemm(out, in, w, sorted_pairs, tiles, n_out, k_in, top_k, gather_tokens)
                    run(
                        dtype,
                        "baton_moe_gemm",
                        (max_tiles as u32, n.div_ceil(32) as u32, 1),
                        256,
                        Params::new()
                            .ptr_mut(out.ptr())
                            .ptr(inp.ptr())
                            .ptr(w.ptr())
                            .ptr(sorted.as_ptr())
                            .ptr(tiles.as_ptr())
                            .int(n as i32)
                            .int(kin as i32)
                            .int(k as i32)
                            .int(i32::from(gather)),
                    );
                };
                gemm(&mut gu, &mut xin, &mut wgu_d, 2 * im, h, true);
                run(
                    dtype,
                    "baton_silu_and_mul",
                    (pairs as u32, 1, 1),
                    256,
                    Params::new()
                        .ptr_mut(act.ptr())
                        .ptr(gu.ptr())
                        .int(pairs as i32)
                        .int(im as i32),
                );
                gemm(&mut y, &mut act, &mut wd_d, h, im, false);
                // Reference per pair, rounding where the device stores elem_t.
                let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
                let mut y_ref = vec![0f32; pairs * h];
                for p in 0..pairs {
                    let (tok, e) = (p / k, want_route[p].0 as usize);
                    let xr = &x[tok * h..(tok + 1) * h];
                    let g: Vec<f32> = (0..2 * im)
                        .map(|n| round(dtype, dot(&wgu[(e * 2 * im + n) * h..][..h], xr)))
                        .collect();
                    let a: Vec<f32> = (0..im)
                        .map(|j| round(dtype, g[j] / (1.0 + (-g[j]).exp()) * g[im + j]))
                        .collect();
                    for n in 0..h {
                        y_ref[p * h + n] = round(dtype, dot(&wd[(e * h + n) * im..][..im], &a));
                    }
                }
                // Sums of rounded products: an error of a few units of the element type
                // relative to the largest output (a gate rounded the other way moves a small
                // output by more than its own ulp).
                let tol = if dtype == Dtype::F32 {
                    1e-5
                } else {
                    4.0 * ulp(dtype)
                };
                let big = y_ref.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_close(
                    &format!("case {ci} {} experts' outputs", dtype.name()),
                    &y.read(),
                    &y_ref,
                    tol,
                    tol * big,
                );
                for with_shared in [false, true] {
                    let sh = rounded_values(dtype, seed + 4, t * h, 1.0);
                    let sg = values(seed + 5, t);
                    let mut sh_d = Elems::new(dtype, &sh);
                    let mut out = Elems::filled(dtype, t * h, f32::NAN);
                    let mut y_dev = Elems::new(dtype, &y.read());
                    let mut p = Params::new();
                    // moe_combine(out, y, topk_w, shared, shared_gate, num_tokens, top_k, hidden)
                    p.ptr_mut(out.ptr()).ptr(y_dev.ptr()).ptr(wts.as_ptr());
                    if with_shared {
                        p.ptr(sh_d.ptr()).ptr(sg.as_ptr());
                    } else {
                        p.ptr(std::ptr::null::<u8>()).ptr(std::ptr::null::<f32>());
                    }
                    p.int(t as i32).int(k as i32).int(h as i32);
                    run(dtype, "baton_moe_combine", (t as u32, 1, 1), 256, &mut p);
                    let got_y = y_dev.read();
                    let want: Vec<f32> = (0..t * h)
                        .map(|i| {
                            let (tok, c) = (i / h, i % h);
                            let mut acc = 0f32;
                            for j in 0..k {
                                acc += got_y[(tok * k + j) * h + c] * wts[tok * k + j];
                            }
                            if with_shared {
                                acc += 1.0 / (1.0 + (-sg[tok]).exp()) * sh[i];
                            }
                            round(dtype, acc)
                        })
                        .collect();
                    assert_close(
                        &format!("case {ci} {} combine (shared {with_shared})", dtype.name()),
                        &out.read(),
                        &want,
                        ulp(dtype),
                        1e-6,
                    );
                }
            }
        }
    });
}

fn tiles_at(tile: &[i32], i: usize) -> usize {
    tile[i] as usize
}

// ---- LoRA --------------------------------------------------------------------------------------

/// `baton_lora_shrink` then `baton_lora_expand` (kernels/lora.cu) as the executor launches them
/// for one linear layer, against an f64 reference: two adapters, the first with overlapping
/// parts (a fused part over two slices, as q_proj beside qkv_proj) and the second with one part
/// past the first column block; tokens of the base model (id 0) and of an id past the loaded
/// adapters are left untouched, and the parts are found at their adapter's stride in a table
/// whose other slots hold junk.
#[test]
fn lora_shrink_and_expand_match_the_reference_and_skip_base_tokens() {
    use baton_cuda::lora::{
        DeviceLoraPart, LORA_COLS, LORA_EXPAND_BLOCK, LORA_MAX_PARTS, LORA_SHRINK_WARPS,
    };
    // (adapter, out_offset, rank, n); in slot order within each adapter.
    let parts = [
        (1usize, 0usize, 3usize, 500usize),
        (1, 0, 2, 1100),
        (1, 500, 5, 600),
        (2, 1000, 7, 100),
    ];
    let (k, n_out, rank_stride) = (37usize, 1100usize, 7usize);
    let ids = [1u32, 0, 2, 1, 3];
    let t = ids.len();
    // Adapter a's slots start at (a - 1) * stride; the slots of other layers in between.
    let stride = 3 * LORA_MAX_PARTS;
    every_schedule(|| {
        for dtype in Dtype::ALL {
            let x = rounded_values(dtype, 7, t * k, 1.0);
            let y0 = rounded_values(dtype, 8, t * n_out, 2.0);
            let mut x_dev = Elems::new(dtype, &x);
            let mut y_dev = Elems::new(dtype, &y0);
            let mut mats: Vec<(Vec<f32>, Vec<f32>, Elems, Elems)> = parts
                .iter()
                .enumerate()
                .map(|(pi, &(_, _, r, n))| {
                    let a = rounded_values(dtype, 20 + pi as u64, r * k, 0.5);
                    let b = rounded_values(dtype, 40 + pi as u64, n * r, 0.5);
                    let (ad, bd) = (Elems::new(dtype, &a), Elems::new(dtype, &b));
                    (a, b, ad, bd)
                })
                .collect();
            // A slot read by mistake adds a rank-1 update over every column.
            let junk = DeviceLoraPart {
                a: mats[0].2.ptr() as u64,
                b: mats[0].3.ptr() as u64,
                out_offset: 0,
                rank: 1,
                k: k as i32,
                n: n_out as i32,
            };
            let mut table = vec![junk; 2 * stride];
            let mut slot = [0usize; 3];
            for (pi, &(ad, off, r, n)) in parts.iter().enumerate() {
                let m = &mut mats[pi];
                table[(ad - 1) * stride + slot[ad]] = DeviceLoraPart {
                    a: m.2.ptr() as u64,
                    b: m.3.ptr() as u64,
                    out_offset: off as i32,
                    rank: r as i32,
                    k: k as i32,
                    n: n as i32,
                };
                slot[ad] += 1;
            }
            for (ad, &used) in slot.iter().enumerate().skip(1) {
                for s in used..LORA_MAX_PARTS {
                    table[(ad - 1) * stride + s] = DeviceLoraPart::default();
                }
            }
            let mut v = vec![f32::NAN; t * LORA_MAX_PARTS * rank_stride];
            // lora_shrink(v, x, tok_lora, parts, adapter_stride, num_adapters, num_tokens,
            //             x_stride, rank_stride)
            run(
                dtype,
                "baton_lora_shrink",
                (
                    t as u32,
                    LORA_MAX_PARTS as u32,
                    rank_stride.div_ceil(LORA_SHRINK_WARPS) as u32,
                ),
                32 * LORA_SHRINK_WARPS as u32,
                Params::new()
                    .ptr_mut(v.as_mut_ptr())
                    .ptr(x_dev.ptr())
                    .ptr(ids.as_ptr())
                    .ptr(table.as_ptr())
                    .int(stride as i32)
                    .int(2)
                    .int(t as i32)
                    .int(k as i32)
                    .int(rank_stride as i32),
            );
            // lora_expand(y, v, tok_lora, parts, adapter_stride, num_adapters, num_tokens,
            //             y_stride, rank_stride)
            run(
                dtype,
                "baton_lora_expand",
                (t as u32, n_out.div_ceil(LORA_COLS) as u32, 1),
                LORA_EXPAND_BLOCK,
                Params::new()
                    .ptr_mut(y_dev.ptr())
                    .ptr(v.as_ptr())
                    .ptr(ids.as_ptr())
                    .ptr(table.as_ptr())
                    .int(stride as i32)
                    .int(2)
                    .int(t as i32)
                    .int(n_out as i32)
                    .int(rank_stride as i32),
            );
            let mut want = y0.clone();
            for (tok, &id) in ids.iter().enumerate() {
                let mine: Vec<usize> = (0..parts.len())
                    .filter(|&pi| parts[pi].0 as u32 == id)
                    .collect();
                let mut out: Vec<f64> = y0[tok * n_out..(tok + 1) * n_out]
                    .iter()
                    .map(|&y| f64::from(y))
                    .collect();
                for (s, &pi) in mine.iter().enumerate() {
                    let (_, off, r, n) = parts[pi];
                    let (a, b) = (&mats[pi].0, &mats[pi].1);
                    let vr: Vec<f64> = (0..r)
                        .map(|ri| {
                            (0..k)
                                .map(|i| f64::from(a[ri * k + i]) * f64::from(x[tok * k + i]))
                                .sum()
                        })
                        .collect();
                    let got_v = &v[(tok * LORA_MAX_PARTS + s) * rank_stride..][..r];
                    let want_v: Vec<f32> = vr.iter().map(|&x| x as f32).collect();
                    assert_close(
                        &format!("{} token {tok} slot {s} v", dtype.name()),
                        got_v,
                        &want_v,
                        1e-5,
                        1e-5,
                    );
                    for j in 0..n {
                        out[off + j] += (0..r)
                            .map(|ri| f64::from(b[j * r + ri]) * vr[ri])
                            .sum::<f64>();
                    }
                }
                if !mine.is_empty() {
                    for (w, o) in want[tok * n_out..(tok + 1) * n_out].iter_mut().zip(out) {
                        *w = round(dtype, o as f32);
                    }
                }
            }
            let got = y_dev.read();
            for (tok, &id) in ids.iter().enumerate() {
                let row = tok * n_out..(tok + 1) * n_out;
                if id == 0 || id > 2 {
                    assert_eq!(
                        got[row.clone()],
                        y0[row],
                        "{} token {tok} (id {id}) was touched",
                        dtype.name()
                    );
                } else {
                    assert_close(
                        &format!("{} token {tok} (adapter {id}) y", dtype.name()),
                        &got[row.clone()],
                        &want[row],
                        ulp(dtype),
                        1e-5,
                    );
                }
            }
        }
    });
}
