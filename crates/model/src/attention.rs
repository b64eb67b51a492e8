//! Batch-invariant causal GQA attention over the paged KV cache, for the CPU reference.
//!
//! Numerics (HF eager attention, `modeling_llama.py`): per query head `h` and position `p`
//! the score `s = (q_h · k_p) * scale`, then `softmax(s)` in f32 and `Σ_p softmax_p v_p`.
//! The softmax is computed per partition of [`PARTITION`] positions (`0..256`, `256..512`,
//! ...) and the partitions are combined exactly as split-K decode attention does (vLLM's
//! paged attention v2, FlashAttention's rescaling):
//!
//! - per partition `j`: `m_j = max s`, `e_p = exp(s_p - m_j)`, `l_j = Σ e_p`, `o_j = Σ e_p v_p`;
//! - then `M = max_j m_j`, `w_j = exp(m_j - M)`, `out = (Σ_j w_j o_j) * (1 / Σ_j w_j l_j)`.
//!
//! Invariant: every value is computed by one fixed sequence of IEEE operations that depends
//! only on the token's own query, its context's keys and values and the positions, never on
//! the batch, the block size, the page ids, the thread count or which path (AVX2 or portable)
//! runs it:
//!
//! - `q · k` is [`crate::linear::dot_order`] (8 fused lanes, fixed combine);
//! - `exp` is [`crate::vmath::exp_order`];
//! - `Σ e_p` is [`sum_order`] (8 lanes by `p mod 8` from the partition's start, ascending,
//!   zero-padded, the same lane combine);
//! - `o_j[d]` is a fused multiply-add chain over `p` ascending from `+0`; the combine chains
//!   over `j` ascending from `+0`.
//!
//! Partitions are fixed by position, so a long context splits into independent tasks (the
//! parallelism a batch-of-one decode step needs: tasks are (token, KV head, partition)), and
//! the bits stay the same whichever thread runs a task.
//!
//! K and V are stored as [`KvElem`]s (f32, bf16 or f16: vLLM's `--kv-cache-dtype`); every
//! read widens them to f32 exactly, so a 16-bit cache changes only the values stored (rounded
//! to nearest-even once, when written), never the order of the arithmetic above.

use crate::linear::dot_order;
use crate::vmath::exp_order;
use crate::weights::DType;

/// An element type of the KV cache: f32, bf16 or f16. Widening to f32 is exact; narrowing
/// rounds to nearest, ties to even (`half`'s conversions, as PyTorch's `.to(dtype)`).
pub(crate) trait KvElem: Copy + Default + Send + Sync + 'static {
    /// The dtype this type stores.
    const DTYPE: DType;
    /// The exact f32 value.
    fn to_f32(self) -> f32;
    /// The nearest value (ties to even; overflow gives infinity, NaN stays NaN).
    fn from_f32(x: f32) -> Self;
}

impl KvElem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElem for half::bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl KvElem for half::f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// Whether this CPU runs the vector partition kernel (AVX2, FMA and F16C; every AVX2 CPU
/// has F16C).
#[cfg(target_arch = "x86_64")]
#[inline]
fn vector_path() -> bool {
    crate::vmath::avx2::available() && std::arch::is_x86_feature_detected!("f16c")
}

/// Positions per softmax partition (a multiple of 8).
pub(crate) const PARTITION: usize = 256;

/// Positions per pass of the vector path's `Σ e·v` loop over the group's heads: 32 V rows
/// of a head dim of 128 in f32 are 16 KiB, which stays in L1 while each head reads them.
#[cfg(target_arch = "x86_64")]
const V_CHUNK: usize = 32;

/// Where one layer's K and V rows are: `k` and `v` are the whole cache (`[layer][page][slot]
/// [kv_head][head_dim]` of `E`); position `p` of a sequence with block table `table` is at
/// `layer_off + (table[p / block_size] * block_size + p % block_size) * stride`, plus
/// `kv_head * head_dim`.
pub(crate) struct KvLayer<'a, E> {
    /// The whole K cache.
    pub k: &'a [E],
    /// The whole V cache (same layout).
    pub v: &'a [E],
    /// Offset of the layer's page 0, slot 0.
    pub layer_off: usize,
    /// Tokens per page.
    pub block_size: usize,
    /// Values per position: `kv_heads * head_dim`.
    pub stride: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl<E> Clone for KvLayer<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for KvLayer<'_, E> {}

/// Values one task writes: per query head of the group, `[m, l, o[0..head_dim]]`.
pub(crate) fn task_len(group: usize, head_dim: usize) -> usize {
    group * (head_dim + 2)
}

/// The reference sum of `e` (see the module documentation).
#[inline(always)]
pub(crate) fn sum_order(e: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for c in e.chunks(8) {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    let s = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Per-thread scratch of a partition task: the scores `[group][PARTITION]`, the
/// positions' row offsets and one widened row (the portable path over a 16-bit cache).
pub(crate) struct TaskScratch {
    scores: Vec<f32>,
    rows: Vec<usize>,
    row: Vec<f32>,
}

impl TaskScratch {
    /// Scratch for groups of up to `group` query heads per KV head.
    pub(crate) fn new(group: usize) -> Self {
        TaskScratch {
            scores: vec![0.0; group * PARTITION],
            rows: Vec::with_capacity(PARTITION),
            row: Vec::new(),
        }
    }
}

/// Per-thread scratch of [`attend`]: the partition results of one (token, KV head) and a
/// partition task's scratch.
pub(crate) struct JobScratch {
    parts: Vec<f32>,
    task: TaskScratch,
    /// [`attend_tile`]'s shared partitions: `[partition][token][task_len]`.
    shared: Vec<f32>,
    /// [`attend_tile`]'s gathered queries, `[token][group][head_dim]`.
    pub(crate) q: Vec<f32>,
}

impl JobScratch {
    /// Scratch for groups of up to `group` query heads per KV head.
    pub(crate) fn new(group: usize) -> Self {
        JobScratch {
            parts: Vec::new(),
            task: TaskScratch::new(group),
            shared: Vec::new(),
            q: Vec::new(),
        }
    }
}

/// Query tokens of one sequence per [`attend_tile`] call: a prefill chunk's tokens read each
/// shared partition's K and V rows once per tile instead of once per token.
pub(crate) const TILE: usize = 8;

/// The first position a query attends to when it attends to `n_ctx` positions (itself the
/// last) under the sliding window `window` ([`crate::ModelConfig::sliding_window`]: its last
/// `w` keys); 0 without one.
#[inline]
pub(crate) fn window_start(n_ctx: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| n_ctx.saturating_sub(w))
}

/// Partition `j`'s positions for a query that attends to `lo..n_ctx`: the fixed range
/// `j * PARTITION..(j + 1) * PARTITION`, clipped to it.
#[inline]
fn bounds(j: usize, lo: usize, n_ctx: usize) -> (usize, usize) {
    ((j * PARTITION).max(lo), ((j + 1) * PARTITION).min(n_ctx))
}

/// Causal attention of one token's query heads `q` (`[group][head_dim]`, those of KV head
/// `kv_head`) over positions `window_start(n_ctx, window)..n_ctx` of the sequence whose pages
/// are `table`: every partition the range touches (clipped to it), then [`combine`]; writes
/// `[group][head_dim]` into `out`. With `split` the partitions run as tasks on the current
/// rayon pool (for a step with fewer (token, KV head) jobs than threads); the bits are the
/// same either way.
///
/// Memory: `ceil(n_ctx / PARTITION) * task_len(group, head_dim)` values of scratch, held per
/// thread, not per token.
///
/// # Panics
/// As [`partition`]; `n_ctx` is at least 1, and so is a window.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend<E: KvElem>(
    kv: KvLayer<E>,
    table: &[u32],
    kv_head: usize,
    n_ctx: usize,
    window: Option<usize>,
    q: &[f32],
    scale: f32,
    split: bool,
    scratch: &mut JobScratch,
    out: &mut [f32],
) {
    use rayon::prelude::*;
    let group = q.len() / kv.head_dim;
    let tl = task_len(group, kv.head_dim);
    let lo = window_start(n_ctx, window);
    let first = lo / PARTITION;
    let n_parts = n_ctx.div_ceil(PARTITION) - first;
    if scratch.parts.len() < n_parts * tl {
        scratch.parts.resize(n_parts * tl, 0.0);
    }
    let parts = &mut scratch.parts[..n_parts * tl];
    if split && n_parts > 1 {
        parts.par_chunks_mut(tl).enumerate().for_each_init(
            || TaskScratch::new(group),
            |task, (j, o)| {
                let (p0, p1) = bounds(first + j, lo, n_ctx);
                partition(kv, table, kv_head, p0, p1, q, scale, task, o);
            },
        );
    } else {
        for (j, o) in parts.chunks_mut(tl).enumerate() {
            let (p0, p1) = bounds(first + j, lo, n_ctx);
            partition(kv, table, kv_head, p0, p1, q, scale, &mut scratch.task, o);
        }
    }
    let parts = &scratch.parts[..n_parts * tl];
    combine(
        |j| &parts[j * tl..(j + 1) * tl],
        n_parts,
        group,
        kv.head_dim,
        out,
    );
}

/// The partitions [`attend_tile`] runs once for all `t` query tokens of a tile whose first
/// token attends to `n0` positions: those every token sees whole, `js..je` (empty when
/// `je <= js`). Without a window `js` is 0; with one the last token's window start bounds it.
pub(crate) fn tile_shared(n0: usize, t: usize, window: Option<usize>) -> (usize, usize) {
    let lo_last = window_start(n0 + t - 1, window);
    (lo_last.div_ceil(PARTITION), n0 / PARTITION)
}

/// [`attend`] for `t` consecutive query tokens of one sequence, token `i` attending to
/// positions `window_start(n0 + i, window)..n0 + i` (a prefill chunk): `q` is
/// `[t][group][head_dim]` (those of KV head `kv_head`), `out` gets `[t][group][head_dim]`. The
/// partitions every token sees whole ([`tile_shared`]) run once for all `t * group` query
/// heads, as if they were one token's group (each head's arithmetic is its own, so the bits
/// are those of `attend`); the rest run per token, and each token's partitions are combined
/// in position order as in `attend`.
///
/// Memory: `(je - js) * t * task_len(group, head_dim)` values of scratch, per thread.
///
/// # Panics
/// As [`partition`]; `n0` and `t` are at least 1.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_tile<E: KvElem>(
    kv: KvLayer<E>,
    table: &[u32],
    kv_head: usize,
    n0: usize,
    t: usize,
    window: Option<usize>,
    q: &[f32],
    scale: f32,
    scratch: &mut JobScratch,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let group = q.len() / hd / t;
    let tl = task_len(group, hd);
    let (js, je) = tile_shared(n0, t, window);
    let n_shared = je.saturating_sub(js);
    if scratch.shared.len() < n_shared * t * tl {
        scratch.shared.resize(n_shared * t * tl, 0.0);
    }
    for (j, o) in scratch.shared[..n_shared * t * tl]
        .chunks_mut(t * tl)
        .enumerate()
    {
        let (p0, p1) = ((js + j) * PARTITION, (js + j + 1) * PARTITION);
        partition(kv, table, kv_head, p0, p1, q, scale, &mut scratch.task, o);
    }
    for i in 0..t {
        let n_ctx = n0 + i;
        let lo = window_start(n_ctx, window);
        let (first, last) = (lo / PARTITION, n_ctx.div_ceil(PARTITION));
        // This token's shared partitions: `js..je` (inside `first..last`), or none.
        let (s0, s1) = if n_shared > 0 {
            (js, je)
        } else {
            (first, first)
        };
        let own = (last - first) - (s1 - s0);
        if scratch.parts.len() < own * tl {
            scratch.parts.resize(own * tl, 0.0);
        }
        let qi = &q[i * group * hd..(i + 1) * group * hd];
        let own_parts = (first..s0).chain(s1..last);
        for (j, o) in own_parts.zip(scratch.parts[..own * tl].chunks_mut(tl)) {
            let (p0, p1) = bounds(j, lo, n_ctx);
            partition(kv, table, kv_head, p0, p1, qi, scale, &mut scratch.task, o);
        }
        let (shared, parts) = (&scratch.shared, &scratch.parts);
        combine(
            |k| {
                let j = first + k;
                let slot = if j < s0 {
                    j - first
                } else if j < s1 {
                    return &shared[((j - s0) * t + i) * tl..((j - s0) * t + i + 1) * tl];
                } else {
                    (s0 - first) + (j - s1)
                };
                &parts[slot * tl..(slot + 1) * tl]
            },
            last - first,
            group,
            hd,
            &mut out[i * group * hd..(i + 1) * group * hd],
        );
    }
}

/// One partition task: the query heads `q` (`[group][head_dim]`, those of KV head `kv_head`)
/// against positions `p0..p1` (`p1 - p0 <= PARTITION`, inside one partition) of the sequence
/// whose pages are `table`; writes `[m, l, o]` per query head into `out`
/// ([`task_len`] values).
///
/// # Panics
/// If a position's row is outside the cache or `out`/`q` are too short (a caller bug: the
/// forward pass validates block tables first).
#[allow(clippy::too_many_arguments)]
pub(crate) fn partition<E: KvElem>(
    kv: KvLayer<E>,
    table: &[u32],
    kv_head: usize,
    p0: usize,
    p1: usize,
    q: &[f32],
    scale: f32,
    scratch: &mut TaskScratch,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let group = q.len() / hd;
    assert!(p1 > p0 && p1 - p0 <= PARTITION && out.len() >= task_len(group, hd));
    // Row offsets, page by page (one division per page, not per position).
    scratch.rows.clear();
    let mut p = p0;
    while p < p1 {
        let page = table[p / kv.block_size] as usize;
        let slot = p % kv.block_size;
        let n = (kv.block_size - slot).min(p1 - p);
        let first = kv.layer_off + (page * kv.block_size + slot) * kv.stride + kv_head * hd;
        let last = first + (n - 1) * kv.stride + hd;
        assert!(last <= kv.k.len() && last <= kv.v.len());
        scratch.rows.extend((0..n).map(|i| first + i * kv.stride));
        p += n;
    }
    if scratch.scores.len() < group * PARTITION {
        scratch.scores.resize(group * PARTITION, 0.0);
    }
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: AVX2, FMA and F16C are available (checked just above); every row offset
        // plus head_dim is inside k and v (asserted above), q holds group * head_dim values,
        // the scores group * PARTITION, out task_len(group, hd).
        unsafe { avx2::partition(kv, &scratch.rows, q, group, scale, &mut scratch.scores, out) };
        return;
    }
    let TaskScratch { scores, rows, row } = scratch;
    partition_portable(kv, rows, q, group, scale, scores, row, out);
}

/// [`partition`]'s reference computation over the row offsets `rows` (`row`: scratch for one
/// widened row).
#[allow(clippy::too_many_arguments)]
fn partition_portable<E: KvElem>(
    kv: KvLayer<E>,
    rows: &[usize],
    q: &[f32],
    group: usize,
    scale: f32,
    scores: &mut [f32],
    row: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let n = rows.len();
    row.resize(hd, 0.0);
    let widen = |x: &[E], row: &mut [f32]| {
        for (w, &e) in row.iter_mut().zip(x) {
            *w = e.to_f32();
        }
    };
    for h in 0..group {
        let qh = &q[h * hd..(h + 1) * hd];
        let s = &mut scores[h * PARTITION..h * PARTITION + n];
        for (x, &r) in s.iter_mut().zip(rows) {
            widen(&kv.k[r..r + hd], row);
            *x = dot_order(qh, row) * scale;
        }
        let m = s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        for x in s.iter_mut() {
            *x = exp_order(*x - m);
        }
        let l = sum_order(s);
        let o = &mut out[h * (hd + 2)..(h + 1) * (hd + 2)];
        o[0] = m;
        o[1] = l;
        let o = &mut o[2..];
        o.fill(0.0);
        for (&e, &r) in s.iter().zip(rows) {
            for (a, &v) in o.iter_mut().zip(&kv.v[r..r + hd]) {
                *a = e.mul_add(v.to_f32(), *a);
            }
        }
    }
}

/// Combines one token's partition results for one KV head: `part(j)` is partition `j`'s task
/// output ([`task_len`] values) for `j` in `0..n_parts`; writes `[group][head_dim]` into
/// `out`.
pub(crate) fn combine<'a>(
    part: impl Fn(usize) -> &'a [f32],
    n_parts: usize,
    group: usize,
    hd: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if vector_path() {
        // SAFETY: AVX2 and FMA are available (checked just above).
        unsafe { avx2::combine(part, n_parts, group, hd, out) };
        return;
    }
    combine_portable(part, n_parts, group, hd, out);
}

/// [`combine`]'s reference loop (compiled with FMA instructions inside [`avx2::combine`]).
#[inline(always)]
fn combine_portable<'a>(
    part: impl Fn(usize) -> &'a [f32],
    n_parts: usize,
    group: usize,
    hd: usize,
    out: &mut [f32],
) {
    for h in 0..group {
        let part = |j: usize| &part(j)[h * (hd + 2)..(h + 1) * (hd + 2)];
        let big_m = (0..n_parts).fold(f32::NEG_INFINITY, |a, j| a.max(part(j)[0]));
        let o = &mut out[h * hd..(h + 1) * hd];
        o.fill(0.0);
        let mut big_l = 0.0f32;
        for j in 0..n_parts {
            let pj = part(j);
            let w = exp_order(pj[0] - big_m);
            big_l = w.mul_add(pj[1], big_l);
            for (a, &x) in o.iter_mut().zip(&pj[2..]) {
                *a = w.mul_add(x, *a);
            }
        }
        let inv = 1.0 / big_l;
        for a in o.iter_mut() {
            *a *= inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The partition task with AVX2 + FMA (a head dim's last partial group of eight read
    //! and written through lane masks).

    use super::{KvElem, KvLayer, PARTITION, V_CHUNK};
    use crate::linear::avx2::hsum;
    use crate::vmath::avx2::exp8;
    use crate::weights::DType;
    use std::arch::x86_64::*;

    /// `TAIL_MASKS[8 - r..16 - r]` sets the first `r` lanes, `r` in `1..8` (for `r` = 0 no
    /// tail is read).
    static TAIL_MASKS: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    /// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` of each of 8 accumulators, as
    /// `[f(a[0]), .., f(a[7])]` (the lane combine of `dot_order`, eight at a time).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum8(a: [__m256; 8]) -> __m256 {
        // (l0+l4, l1+l5, l2+l6, l3+l7) of a[i] in the low half and of a[i + 4] in the high.
        let s = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(x, y),
                _mm256_permute2f128_ps::<0x31>(x, y),
            )
        };
        let (s04, s15, s26, s37) = (s(a[0], a[4]), s(a[1], a[5]), s(a[2], a[6]), s(a[3], a[7]));
        // Per accumulator (s0 + s2, s1 + s3): [a0, a1 | a4, a5] and [a2, a3 | a6, a7].
        let t = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        let (r01, r23) = (t(s04, s15), t(s26, s37));
        // (s0 + s2) + (s1 + s3): [a0, a1, a2, a3 | a4, a5, a6, a7].
        _mm256_hadd_ps(r01, r23)
    }

    /// As [`super::partition_portable`]. A 16-bit K or V row is widened in registers (bf16:
    /// a 16-bit shift; f16: F16C's `vcvtph2ps`), exactly as `KvElem::to_f32`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; every `rows[i] + head_dim`
    /// is inside `kv.k` and `kv.v`; `q` holds `group * head_dim` values, `scores` `group *
    /// PARTITION`, `out` `group * (head_dim + 2)`; `rows.len() <= PARTITION`.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn partition<E: KvElem>(
        kv: KvLayer<E>,
        rows: &[usize],
        q: &[f32],
        group: usize,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = kv.head_dim;
        let n = rows.len();
        let n8 = n / 8 * 8;
        let (kp, vp, qp) = (kv.k.as_ptr(), kv.v.as_ptr(), q.as_ptr());
        // A head dim's last partial group of eight is read with a lane mask: the masked lanes
        // read nothing and give +0, as dot_order's zero padding.
        // SAFETY: 8 - hd % 8 + 8 <= 16 values of TAIL_MASKS.
        let tail = unsafe { _mm256_loadu_si256(TAIL_MASKS.as_ptr().add(8 - hd % 8).cast()) };
        // Eight values of a row at offset d < hd (masked past hd).
        // SAFETY (callers): p points to a row of at least hd values.
        let ld = |p: *const f32, d: usize| unsafe {
            if d + 8 <= hd {
                _mm256_loadu_ps(p.add(d))
            } else {
                _mm256_maskload_ps(p.add(d), tail)
            }
        };
        // Eight 16-bit values at p widened to f32 (E::DTYPE is a constant: one arm is
        // compiled).
        // SAFETY (callers): p points to 8 readable values.
        let widen8 = |p: *const u16| unsafe {
            let x = _mm_loadu_si128(p.cast());
            match E::DTYPE {
                DType::BF16 => {
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(x)))
                }
                _ => _mm256_cvtph_ps(x),
            }
        };
        // Eight values of a K or V row of E at offset d, d + 8 <= hd.
        // SAFETY (callers): p points to a row of at least hd values.
        let ld_kv_full = |p: *const E, d: usize| unsafe {
            match E::DTYPE {
                DType::F32 => _mm256_loadu_ps(p.cast::<f32>().add(d)),
                _ => widen8(p.cast::<u16>().add(d)),
            }
        };
        // Eight values of a K or V row at offset d < hd (as `ld`). A 16-bit tail is copied
        // into zeros, which widen to +0 as the masked lanes do.
        // SAFETY (callers): p points to a row of at least hd values.
        let ld_kv = |p: *const E, d: usize| unsafe {
            if d + 8 <= hd {
                ld_kv_full(p, d)
            } else if E::DTYPE == DType::F32 {
                ld(p.cast::<f32>(), d)
            } else {
                let mut t = [0u16; 8];
                std::ptr::copy_nonoverlapping(p.cast::<u16>().add(d), t.as_mut_ptr(), hd - d);
                widen8(t.as_ptr())
            }
        };
        let sc = scores.as_mut_ptr();
        let scale8 = _mm256_set1_ps(scale);
        // Scores, eight positions at a time: their K rows stay in L1 across the group's heads.
        let mut i = 0;
        while i < n8 {
            for h in 0..group {
                let mut acc = [_mm256_setzero_ps(); 8];
                let mut d = 0;
                while d < hd {
                    // SAFETY: q's head h and each position's K row hold hd values.
                    unsafe {
                        let qv = ld(qp.add(h * hd), d);
                        for a in 0..8 {
                            let kv8 = ld_kv(kp.add(rows[i + a]), d);
                            acc[a] = _mm256_fmadd_ps(qv, kv8, acc[a]);
                        }
                    }
                    d += 8;
                }
                let s = _mm256_mul_ps(hsum8(acc), scale8);
                // SAFETY: h * PARTITION + i + 8 <= group * PARTITION.
                unsafe { _mm256_storeu_ps(sc.add(h * PARTITION + i), s) };
            }
            i += 8;
        }
        for i in n8..n {
            for h in 0..group {
                let mut acc = _mm256_setzero_ps();
                let mut d = 0;
                while d < hd {
                    // SAFETY: as above.
                    unsafe {
                        let qv = ld(qp.add(h * hd), d);
                        acc = _mm256_fmadd_ps(qv, ld_kv(kp.add(rows[i]), d), acc);
                    }
                    d += 8;
                }
                // SAFETY: inside head h's scores.
                unsafe { *sc.add(h * PARTITION + i) = hsum(acc) * scale };
            }
        }
        let n_pad = n.div_ceil(8) * 8;
        for h in 0..group {
            // SAFETY: head h's scores are PARTITION >= n_pad values from sc + h * PARTITION.
            let s = unsafe { std::slice::from_raw_parts_mut(sc.add(h * PARTITION), n_pad) };
            let m = s[..n].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
            // Padding scores exp to +0, which the lane sums add exactly (sum_order's zero
            // padding).
            s[n..].fill(f32::NEG_INFINITY);
            let m8 = _mm256_set1_ps(m);
            let mut lanes = _mm256_setzero_ps();
            for c in s.chunks_exact_mut(8) {
                // SAFETY: c holds 8 values.
                unsafe {
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m8));
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                    lanes = _mm256_add_ps(lanes, e);
                }
            }
            out[h * (hd + 2)] = m;
            out[h * (hd + 2) + 1] = hsum(lanes);
        }
        // o = Σ_p e_p v_p per head, [`V_CHUNK`] positions at a time with the group's heads
        // inside, so a chunk's V rows are read from memory once and from L1 by the other
        // heads. Each value's chain is the same: p ascending from +0, its running value kept
        // in `out` between chunks (an exact f32 store and load).
        let op = out.as_mut_ptr();
        let mut c0 = 0;
        while c0 < n {
            let chunk = &rows[c0..(c0 + V_CHUNK).min(n)];
            for h in 0..group {
                // SAFETY: head h's scores hold n values from sc + h * PARTITION + c0.
                let e_h = unsafe { sc.add(h * PARTITION + c0) };
                // SAFETY: head h's o holds hd values from op + h * (hd + 2) + 2.
                let oh = unsafe { op.add(h * (hd + 2) + 2) };
                // Up to eight vectors of head_dim at a time (independent FMA chains).
                let mut d = 0;
                // Whole groups of 64 values: a fixed eight accumulators, which stay in
                // registers.
                while d + 64 <= hd {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    if c0 > 0 {
                        for (c, a) in acc.iter_mut().enumerate() {
                            // SAFETY: d + 8 * c + 8 <= hd values of o.
                            *a = unsafe { _mm256_loadu_ps(oh.add(d + 8 * c)) };
                        }
                    }
                    for (p, &r) in chunk.iter().enumerate() {
                        // SAFETY: p < chunk.len() scores of this chunk.
                        let e = _mm256_set1_ps(unsafe { *e_h.add(p) });
                        for (c, a) in acc.iter_mut().enumerate() {
                            // SAFETY: position p's V row holds hd values; d + 8 * c + 8 <= hd.
                            let v = unsafe { ld_kv_full(vp.add(r), d + 8 * c) };
                            *a = _mm256_fmadd_ps(e, v, *a);
                        }
                    }
                    for (c, a) in acc.iter().enumerate() {
                        // SAFETY: o holds hd values and d + 8 * c + 8 <= hd.
                        unsafe { _mm256_storeu_ps(oh.add(d + 8 * c), *a) };
                    }
                    d += 64;
                }
                while d < hd {
                    let w = (hd - d).div_ceil(8).min(8);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    if c0 > 0 {
                        for (c, a) in acc.iter_mut().enumerate().take(w) {
                            // o holds hd values; d + 8 * c < hd (masked past hd).
                            *a = ld(oh.cast_const(), d + 8 * c);
                        }
                    }
                    for (p, &r) in chunk.iter().enumerate() {
                        // SAFETY: p < chunk.len() scores of this chunk.
                        let e = _mm256_set1_ps(unsafe { *e_h.add(p) });
                        for (c, a) in acc.iter_mut().enumerate().take(w) {
                            // SAFETY: position p's V row holds hd values; d + 8 * c < hd.
                            let v = unsafe { ld_kv(vp.add(r), d + 8 * c) };
                            *a = _mm256_fmadd_ps(e, v, *a);
                        }
                    }
                    for (c, a) in acc.iter().enumerate().take(w) {
                        let dc = d + 8 * c;
                        // SAFETY: o holds hd values and dc < hd; the masked store writes
                        // dc..hd.
                        unsafe {
                            if dc + 8 <= hd {
                                _mm256_storeu_ps(oh.add(dc), *a)
                            } else {
                                _mm256_maskstore_ps(oh.add(dc), tail, *a)
                            }
                        }
                    }
                    d += 8 * w;
                }
            }
            c0 += V_CHUNK;
        }
    }

    /// [`super::combine_portable`] compiled with FMA instructions.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn combine<'a>(
        part: impl Fn(usize) -> &'a [f32],
        n_parts: usize,
        group: usize,
        hd: usize,
        out: &mut [f32],
    ) {
        super::combine_portable(part, n_parts, group, hd, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::rnd;

    /// Attention of one token (positions `0..n_ctx`, all partitions, combined) for KV head
    /// `g`, through `partition` (or the portable body when `portable`) and `combine`.
    #[allow(clippy::too_many_arguments)]
    fn attend_parts<E: KvElem>(
        kv: KvLayer<E>,
        table: &[u32],
        g: usize,
        (lo, n_ctx): (usize, usize),
        q: &[f32],
        scale: f32,
        portable: bool,
    ) -> Vec<f32> {
        let hd = kv.head_dim;
        let group = q.len() / hd;
        let first = lo / PARTITION;
        let n_parts = n_ctx.div_ceil(PARTITION) - first;
        let tl = task_len(group, hd);
        let mut parts = vec![f32::NAN; n_parts * tl];
        let mut scratch = TaskScratch::new(group);
        for j in 0..n_parts {
            let (p0, p1) = (
                ((first + j) * PARTITION).max(lo),
                ((first + j + 1) * PARTITION).min(n_ctx),
            );
            let out = &mut parts[j * tl..(j + 1) * tl];
            if portable {
                // The portable body over the same rows.
                scratch.rows.clear();
                for p in p0..p1 {
                    let page = table[p / kv.block_size] as usize;
                    scratch.rows.push(
                        kv.layer_off
                            + (page * kv.block_size + p % kv.block_size) * kv.stride
                            + g * hd,
                    );
                }
                let rows = scratch.rows.clone();
                let (scores, row) = (&mut scratch.scores, &mut scratch.row);
                partition_portable(kv, &rows, q, group, scale, scores, row, out);
            } else {
                partition(kv, table, g, p0, p1, q, scale, &mut scratch, out);
            }
        }
        let mut out = vec![f32::NAN; group * hd];
        let part = |j: usize| &parts[j * tl..(j + 1) * tl];
        if portable {
            combine_portable(part, n_parts, group, hd, &mut out);
        } else {
            combine(part, n_parts, group, hd, &mut out);
        }
        out
    }

    /// One case of the test below over a cache of `E`: the vector path's bits equal the
    /// portable reference's, `attend` (split or not) gives the same bits, and the result is
    /// softmax attention over the stored (widened) K and V of the window's positions against
    /// an f64 computation.
    #[allow(clippy::too_many_arguments)]
    fn check_case<E: KvElem>(
        k: &[f32],
        v: &[f32],
        table: &[u32],
        (hd, kvh, bs): (usize, usize, usize),
        (n_ctx, window): (usize, Option<usize>),
        q: &[f32],
        pool: &rayon::ThreadPool,
    ) {
        let group = q.len() / hd;
        let stride = kvh * hd;
        let k: Vec<E> = k.iter().map(|&x| E::from_f32(x)).collect();
        let v: Vec<E> = v.iter().map(|&x| E::from_f32(x)).collect();
        let kv = KvLayer {
            k: &k,
            v: &v,
            layer_off: 0,
            block_size: bs,
            stride,
            head_dim: hd,
        };
        let scale = (hd as f64).powf(-0.5) as f32;
        let what = format!("{:?} hd={hd} bs={bs} n={n_ctx} window={window:?}", E::DTYPE);
        // The window's first position, computed here rather than by `window_start`.
        let lo = window.map_or(0, |w| n_ctx.saturating_sub(w));
        for g in 0..kvh {
            let fast = attend_parts(kv, table, g, (lo, n_ctx), q, scale, false);
            let reference = attend_parts(kv, table, g, (lo, n_ctx), q, scale, true);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&reference), "{what}");
            // `attend`, its partitions split over a pool of three or not.
            for split in [false, true] {
                let mut out = vec![f32::NAN; group * hd];
                let mut scratch = JobScratch::new(group);
                pool.install(|| {
                    attend(
                        kv,
                        table,
                        g,
                        n_ctx,
                        window,
                        q,
                        scale,
                        split,
                        &mut scratch,
                        &mut out,
                    )
                });
                assert_eq!(bits(&out), bits(&fast), "split={split} {what}");
            }
            // f64 softmax attention over the stored values.
            let row = |p: usize| (table[p / bs] as usize * bs + p % bs) * stride + g * hd;
            let (kf, vf) = (
                |i: usize| k[i].to_f32() as f64,
                |i: usize| v[i].to_f32() as f64,
            );
            for h in 0..group {
                let qh = &q[h * hd..(h + 1) * hd];
                let sc: Vec<f64> = (lo..n_ctx)
                    .map(|p| {
                        let r = row(p);
                        (0..hd).map(|d| qh[d] as f64 * kf(r + d)).sum::<f64>() * scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (lo..n_ctx).map(|p| e[p - lo] / sum * vf(row(p) + d)).sum();
                    let got = fast[h * hd + d] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{what} h={h} d={d}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The result is softmax attention (against an f64 computation), and the vector path
    /// gives the portable reference's bits, over f32, bf16 and f16 caches, for head dims with
    /// and without a partial group of 8, contexts within one partition and across several
    /// with partial groups of eight, block sizes 1, 16 and 7, groups of 1 to 5 query heads
    /// per KV head, and sliding windows that start inside, on and past partition boundaries.
    #[test]
    fn partitions_combine_to_softmax_attention_with_the_reference_bits() {
        let mut s = 0xfeed_beefu64;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for &(hd, kvh, group) in &[
            (64usize, 2usize, 3usize),
            (8, 4, 2),
            (128, 1, 5),
            (12, 2, 1),
            (20, 1, 2),
        ] {
            for &bs in &[16usize, 1, 7] {
                for &n_ctx in &[1usize, 5, 8, 255, 256, 257, 600, 1030] {
                    let stride = kvh * hd;
                    let pages = n_ctx.div_ceil(bs) + 3;
                    let k = rnd(pages * bs * stride, &mut s);
                    let v = rnd(pages * bs * stride, &mut s);
                    // Pages in a scrambled order, as a block table is.
                    let table: Vec<u32> = (0..pages as u32).rev().collect();
                    let q: Vec<f32> = rnd(group * hd, &mut s).iter().map(|x| x * 8.0).collect();
                    let case = (hd, kvh, bs);
                    // Windows where n_ctx - w lands mid-partition, on a boundary, at 0.
                    let windows: &[Option<usize>] = if bs == 1 {
                        &[None]
                    } else {
                        &[
                            None,
                            Some(1),
                            Some(3),
                            Some(300),
                            Some(n_ctx.saturating_sub(256).max(1)),
                        ]
                    };
                    for &w in windows {
                        let c = (n_ctx, w);
                        check_case::<f32>(&k, &v, &table, case, c, &q, &pool);
                        check_case::<half::bf16>(&k, &v, &table, case, c, &q, &pool);
                        check_case::<half::f16>(&k, &v, &table, case, c, &q, &pool);
                    }
                }
            }
        }
    }

    /// A tile of a prefill chunk's tokens gives each token `attend`'s bits, over each cache
    /// dtype, for tiles starting on, just after and well past a partition boundary, head dims
    /// with and without a partial group of 8, groups of 1 to 5, and sliding windows that
    /// leave some, one or no partition shared.
    #[test]
    fn a_tile_of_tokens_gives_each_token_attends_bits() {
        fn case<E: KvElem>(
            k: &[f32],
            v: &[f32],
            table: &[u32],
            (hd, bs): (usize, usize),
            (n0, window): (usize, Option<usize>),
            q: &[f32],
        ) {
            let group_hd = q.len() / TILE;
            let group = group_hd / hd;
            let k: Vec<E> = k.iter().map(|&x| E::from_f32(x)).collect();
            let v: Vec<E> = v.iter().map(|&x| E::from_f32(x)).collect();
            let kv = KvLayer {
                k: &k,
                v: &v,
                layer_off: 0,
                block_size: bs,
                stride: hd,
                head_dim: hd,
            };
            let scale = 0.125;
            for t in [1, 2, 5, TILE] {
                let q = &q[..t * group_hd];
                let mut tile = vec![f32::NAN; t * group_hd];
                let mut scratch = JobScratch::new(group);
                attend_tile(
                    kv,
                    table,
                    0,
                    n0,
                    t,
                    window,
                    q,
                    scale,
                    &mut scratch,
                    &mut tile,
                );
                for i in 0..t {
                    let mut one = vec![f32::NAN; group_hd];
                    let qi = &q[i * group_hd..(i + 1) * group_hd];
                    attend(
                        kv,
                        table,
                        0,
                        n0 + i,
                        window,
                        qi,
                        scale,
                        false,
                        &mut scratch,
                        &mut one,
                    );
                    let got = &tile[i * group_hd..(i + 1) * group_hd];
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(&one),
                        "{:?} hd={hd} n0={n0} window={window:?} t={t} token {i}",
                        E::DTYPE
                    );
                }
            }
        }
        let mut s = 0x5eed_0001u64;
        for &(hd, group) in &[(64usize, 3usize), (12, 1), (20, 5)] {
            for &n0 in &[256usize, 257, 300, 512, 700] {
                let bs = 16;
                let pages = (n0 + TILE).div_ceil(bs) + 2;
                let k = rnd(pages * bs * hd, &mut s);
                let v = rnd(pages * bs * hd, &mut s);
                let table: Vec<u32> = (0..pages as u32).rev().collect();
                let q: Vec<f32> = rnd(TILE * group * hd, &mut s)
                    .iter()
                    .map(|x| x * 8.0)
                    .collect();
                for w in [
                    None,
                    Some(1),
                    Some(5),
                    Some(200),
                    Some(256),
                    Some(263),
                    Some(520),
                ] {
                    case::<f32>(&k, &v, &table, (hd, bs), (n0, w), &q);
                    case::<half::bf16>(&k, &v, &table, (hd, bs), (n0, w), &q);
                    case::<half::f16>(&k, &v, &table, (hd, bs), (n0, w), &q);
                }
            }
        }
    }

    /// Storing rounds to nearest, ties to even, and widening is exact: the values a 16-bit
    /// cache holds are the f32 values' nearest, and differ from them (so a cache that kept
    /// f32 or truncated would fail).
    #[test]
    fn sixteen_bit_elements_round_to_nearest_even() {
        // 1 + 2^-8 + 2^-9 is above bf16's halfway point 1 + 2^-8: rounds up to 1 + 2^-7.
        let x = 1.0f32 + 2f32.powi(-8) + 2f32.powi(-9);
        assert_eq!(half::bf16::from_f32(x).to_f32(), 1.0 + 2f32.powi(-7));
        // Exactly halfway (1 + 2^-8): ties to the even 1.0.
        let tie = 1.0f32 + 2f32.powi(-8);
        assert_eq!(<half::bf16 as KvElem>::from_f32(tie).to_f32(), 1.0);
        assert_eq!(
            <half::f16 as KvElem>::from_f32(1.0 + 2f32.powi(-11)).to_f32(),
            1.0
        );
        assert_eq!(
            <half::f16 as KvElem>::from_f32(70000.0).to_f32(),
            f32::INFINITY
        );
        assert_eq!(<f32 as KvElem>::from_f32(x), x);
        let mut s = 9u64;
        for &x in &rnd(1000, &mut s) {
            let b = <half::bf16 as KvElem>::from_f32(x).to_f32();
            assert!((b - x).abs() <= x.abs() * 2f32.powi(-8));
            let h = <half::f16 as KvElem>::from_f32(x).to_f32();
            assert!((h - x).abs() <= x.abs() * 2f32.powi(-11) + 2f32.powi(-25));
        }
    }

    /// `sum_order` is the lane order, not the plain one (so the test above can tell them
    /// apart), and sums.
    #[test]
    fn sum_order_is_a_sum_in_lane_order() {
        let mut s = 5u64;
        let x = rnd(1000, &mut s);
        let exact: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum_order(&x) as f64 - exact).abs() < 1e-3);
        let differs = (0..50).any(|_| {
            let a = rnd(77, &mut s);
            a.iter().fold(0.0f32, |acc, v| acc + v).to_bits() != sum_order(&a).to_bits()
        });
        assert!(differs);
    }
}
