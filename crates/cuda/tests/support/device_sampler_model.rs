//! CPU model of the device sampler's selection algorithm (`kernels/sampling.cu`), shared by the
//! CPU model test and the GPU smoke test. Mirrors the kernel line by line; keep them in step.
#![allow(dead_code)]

pub const FIX_ONE: f32 = 1_099_511_627_776.0; // 2^40

pub fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for r in 0..10 {
        if r > 0 {
            k[0] = k[0].wrapping_add(0x9E37_79B9);
            k[1] = k[1].wrapping_add(0xBB67_AE85);
        }
        let p0 = u64::from(0xD251_1F53u32) * u64::from(c[0]);
        let p1 = u64::from(0xCD9E_8D57u32) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

pub fn uniform_bits(seed: u64, idx: u32) -> u64 {
    u64::from(philox4x32_10([idx, 0, 0, 0], [seed as u32, (seed >> 32) as u32])[0] >> 8)
}

pub fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        f32::MAX
    } else {
        x + 0.0
    }
}

pub fn sort_key(x: f32, id: u32) -> u64 {
    let b = x.to_bits();
    let ord = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ord) << 32) | u64::from(id)
}

/// `__float2ull_rn(e * 2^40)`.
pub fn fixed(e: f32) -> u64 {
    (e * FIX_ONE).round_ties_even() as u64
}

#[derive(Clone, Copy)]
pub struct Select<'a> {
    x: &'a [f32],
    maxv: f32,
    inv_t: f32,
    min_p: f32,
    bound: u64,
    by_count: bool,
    /// Only the tokens of this `hist_bin` are candidates.
    bin: Option<usize>,
}

impl Select<'_> {
    fn metric(&self, i: usize) -> (u64, u64) {
        let c = clean(self.x[i]);
        let key = sort_key(c, i as u32);
        if key > self.bound {
            return (0, key);
        }
        if self
            .bin
            .is_some_and(|b| hist_bin(c, self.maxv, self.inv_t) != b)
        {
            return (0, key);
        }
        let e = ((c - self.maxv) * self.inv_t).exp();
        if e < self.min_p {
            return (0, key);
        }
        (if self.by_count { 1 } else { fixed(e) }, key)
    }

    fn total(&self) -> u64 {
        (0..self.x.len()).map(|i| self.metric(i).0).sum()
    }

    /// Mirrors `baton_radix_select`, counting passes over the row.
    fn radix_select(&self, t: u64, passes: &mut u32) -> u64 {
        let (mut prefix, mut below) = (0u64, 0u64);
        let mut shift = 56i32;
        while shift >= 0 {
            let s = shift as u32;
            let mut hw = [0u64; 256];
            let mut hc = [0u32; 256];
            *passes += 1;
            for i in 0..self.x.len() {
                let (m, key) = self.metric(i);
                if m == 0 {
                    continue;
                }
                if s < 56 && (key >> (s + 8)) != (prefix >> (s + 8)) {
                    continue;
                }
                let d = ((key >> s) & 255) as usize;
                hw[d] += m;
                hc[d] += 1;
            }
            let mut b = below;
            let (mut chosen, mut last) = (None, None);
            for d in 0..256 {
                if hc[d] == 0 {
                    continue;
                }
                last = Some(d);
                if b + hw[d] > t {
                    chosen = Some(d);
                    break;
                }
                b += hw[d];
            }
            let d = match chosen {
                Some(d) => d,
                None => {
                    b = below;
                    last.unwrap_or(0)
                }
            };
            prefix |= (d as u64) << s;
            below = b;
            if hc[d] == 1 && s > 0 {
                *passes += 1;
                return (0..self.x.len())
                    .filter_map(|i| {
                        let (m, key) = self.metric(i);
                        (m != 0 && (key >> s) == (prefix >> s)).then_some(key)
                    })
                    .min()
                    .unwrap_or(!0);
            }
            shift -= 8;
        }
        prefix
    }
}

/// `BATON_HIST_BINS` / `BATON_HIST_SCALE` / `BATON_HIST_LIST` of `kernels/sampling.cu`.
pub const HIST_BINS: usize = 1024;
pub const HIST_SCALE: f32 = 32.0;
pub const HIST_LIST: usize = 2048;

/// `baton_hist_bin`: the bin of cleaned logit `c`, monotone in the key order.
pub fn hist_bin(c: f32, maxv: f32, inv_t: f32) -> usize {
    let d = (maxv - c) * inv_t * HIST_SCALE;
    if d < (HIST_BINS - 1) as f32 {
        d as usize
    } else {
        HIST_BINS - 1
    }
}

/// The histogram path's state (`BatonHistShared`): per-bin mass and count, the cut bin (the
/// bin of the current bound; `HIST_BINS` for none) and the compacted list of one bin (or, with
/// `prefix`, of every bin up to it), sorted by key, as (key, e); `paths` counts the ways the
/// questions were answered.
pub struct Hist {
    w: Vec<u64>,
    c: Vec<u32>,
    cut: usize,
    list_bin: Option<usize>,
    prefix: bool,
    list: Vec<(u64, f32)>,
    cap: usize,
    paths: Paths,
}

/// How [`hist_model`]'s questions were answered: lists made of a prefix of bins, lists of one
/// bin, and radix selects inside a bin too full to list.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Paths {
    pub prefix: u32,
    pub single: u32,
    pub restricted: u32,
}

impl Select<'_> {
    fn e_of(&self, c: f32) -> f32 {
        ((c - self.maxv) * self.inv_t).exp()
    }

    /// `baton_list_metric`: the metric of a list entry under this filter.
    fn metric_of(&self, key: u64, e: f32) -> u64 {
        if key > self.bound || e < self.min_p {
            0
        } else if self.by_count {
            1
        } else {
            fixed(e)
        }
    }

    /// `baton_hist_build`: every token's bin, mass under this filter (and, with `counts`, its
    /// count; the first build is unfiltered).
    fn hist_build(&self, h: &mut Hist, counts: bool, passes: &mut u32) {
        *passes += 1;
        h.w.iter_mut().for_each(|w| *w = 0);
        if counts {
            h.c.iter_mut().for_each(|c| *c = 0);
        }
        for (i, &xi) in self.x.iter().enumerate() {
            let c = clean(xi);
            let b = hist_bin(c, self.maxv, self.inv_t);
            let m = self.metric_of(sort_key(c, i as u32), self.e_of(c));
            // The kernel weighs no token of the last bin: each has a zero mass.
            assert!(
                b < HIST_BINS - 1 || m == 0,
                "token {i} of the last bin weighs {m}"
            );
            h.w[b] += m;
            if counts {
                h.c[b] += 1;
            }
        }
        h.cut = HIST_BINS;
    }

    /// `baton_hist_total`: the total metric (mass) of the candidates.
    fn hist_total(&self, h: &Hist, passes: &mut u32) -> u64 {
        if h.prefix {
            return self.list_sum(h);
        }
        let before: u64 = h.w[..h.cut.min(HIST_BINS)].iter().sum();
        before + self.cut_total(h, passes)
    }

    fn list_sum(&self, h: &Hist) -> u64 {
        h.list.iter().map(|&(k, e)| self.metric_of(k, e)).sum()
    }

    /// The key of the first list entry whose running metric exceeds t (`baton_list_select`).
    fn list_select(&self, h: &Hist, t: u64) -> u64 {
        let mut cum = 0u64;
        h.list
            .iter()
            .find(|&&(k, e)| {
                cum += self.metric_of(k, e);
                cum > t
            })
            .expect("the list holds mass above t")
            .0
    }

    /// `baton_hist_compact`: lists the tokens of bins `lo..=b`, sorted by key.
    fn compact(&self, h: &mut Hist, lo: usize, b: usize, passes: &mut u32) {
        *passes += 1;
        h.list = (0..self.x.len())
            .filter_map(|i| {
                let c = clean(self.x[i]);
                (lo..=b)
                    .contains(&hist_bin(c, self.maxv, self.inv_t))
                    .then(|| (sort_key(c, i as u32), self.e_of(c)))
            })
            .collect();
        h.list.sort_unstable_by_key(|o| o.0);
        h.list_bin = Some(b);
        h.prefix = lo == 0;
        if h.prefix {
            h.paths.prefix += 1;
        } else {
            h.paths.single += 1;
        }
    }

    /// `baton_cut_total`: the cut bin's candidates, from its list or a restricted pass.
    fn cut_total(&self, h: &Hist, passes: &mut u32) -> u64 {
        if h.cut >= HIST_BINS {
            0
        } else if h.list_bin == Some(h.cut) {
            self.list_sum(h)
        } else {
            *passes += 1;
            Select {
                bin: Some(h.cut),
                ..*self
            }
            .total()
        }
    }

    /// `baton_hist_select`: `radix_select(t)` from the histogram and one bin's list (or the
    /// radix select inside a bin too full to list), or `None` when the kernel falls back to
    /// the radix select over the row (t not below the total).
    fn hist_select(&self, h: &mut Hist, t: u64, passes: &mut u32) -> Option<u64> {
        if h.prefix {
            return Some(self.list_select(h, t));
        }
        let cutv = self.cut_total(h, passes);
        let value = |b: usize| -> u64 {
            match b.cmp(&h.cut) {
                std::cmp::Ordering::Less if self.by_count => u64::from(h.c[b]),
                std::cmp::Ordering::Less => h.w[b],
                std::cmp::Ordering::Equal => cutv,
                std::cmp::Ordering::Greater => 0,
            }
        };
        let mut before = 0u64;
        let mut chosen = None;
        for b in 0..HIST_BINS {
            let v = value(b);
            if before + v > t {
                chosen = Some(b);
                break;
            }
            before += v;
        }
        let b = chosen?;
        if self.by_count && b == HIST_BINS - 1 {
            // Every token of the last bin has zero mass: no bound changes a later answer.
            assert_eq!(h.w[b], 0, "the last bin holds mass");
            return Some(!0);
        }
        let up_to_b: u64 = h.c[..=b].iter().map(|&c| u64::from(c)).sum();
        if up_to_b <= h.cap as u64 {
            self.compact(h, 0, b, passes);
            let key = self.list_select(h, t);
            h.cut = b;
            return Some(key);
        }
        if h.c[b] as usize > h.cap {
            h.paths.restricted += 1;
            let r = Select {
                bin: Some(b),
                ..*self
            };
            let key = r.radix_select(t - before, passes);
            h.cut = b;
            return Some(key);
        }
        if h.list_bin != Some(b) {
            self.compact(h, b, b, passes);
        }
        let key = self.list_select(h, t - before);
        h.cut = b;
        Some(key)
    }
}

pub struct Params {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub seed: u64,
}

impl<'a> Select<'a> {
    /// The first question's filter over row `x`: no bound, no min-p.
    fn new(x: &'a [f32], p: &Params, by_count: bool) -> Self {
        Select {
            x,
            maxv: x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(clean(v))),
            inv_t: 1.0 / p.temperature,
            min_p: 0.0,
            bound: !0,
            by_count,
            bin: None,
        }
    }
}

/// The top-p question's t for a total mass z: ceil(top_p * z) - 1, within [0, z).
fn top_p_target(top_p: f32, z: u64) -> u64 {
    let target = (f64::from(top_p) * z as f64).ceil();
    let t = if target > 0.0 { target as u64 - 1 } else { 0 };
    t.min(z - 1)
}

/// The draw's t for a total mass m: floor(u * m), u = `uniform_bits` / 2^24.
fn draw_target(m: u64, p: &Params, output_index: u32) -> u64 {
    let bits = uniform_bits(p.seed, output_index);
    (m >> 24) * bits + (((m & 0xFF_FFFF) * bits) >> 24)
}

/// The kernel's non-greedy path (`baton_sample_f32`), returning (token, passes over the row).
pub fn device_model(x: &[f32], p: &Params, output_index: u32) -> (u32, u32) {
    let mut passes = 1;
    let mut s = Select::new(x, p, true);
    if p.top_k > 0 && (p.top_k as usize) < x.len() {
        s.bound = s.radix_select((p.top_k - 1) as u64, &mut passes);
    }
    s.by_count = false;
    if p.top_p < 1.0 {
        let z = s.total();
        passes += 1;
        s.bound = s.radix_select(top_p_target(p.top_p, z), &mut passes);
    }
    s.min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    let m = s.total();
    passes += 1;
    let t = draw_target(m, p, output_index);
    (s.radix_select(t, &mut passes) as u32, passes)
}

/// The kernel's histogram path (`BATON_SAMPLE_HIST`, `baton_sample_f32` on a row without an
/// allow-list): (token, passes over the row, how its questions were answered). `cap` is the
/// list's capacity (`HIST_LIST`, smaller in tests).
pub fn hist_model(x: &[f32], p: &Params, output_index: u32, cap: usize) -> (u32, u32, Paths) {
    let mut passes = 1;
    let mut s = Select::new(x, p, false);
    let mut h = Hist {
        w: vec![0; HIST_BINS],
        c: vec![0; HIST_BINS],
        cut: HIST_BINS,
        list_bin: None,
        prefix: false,
        list: Vec::new(),
        cap,
        paths: Paths::default(),
    };
    s.hist_build(&mut h, true, &mut passes);
    let mut fast = true;
    // Each question: the histogram's answer, else (once it falls back) the radix select's.
    let select = |s: &Select, h: &mut Hist, t: u64, fast: &mut bool, passes: &mut u32| {
        if *fast {
            if let Some(k) = s.hist_select(h, t, passes) {
                return k;
            }
            *fast = false;
        }
        s.radix_select(t, passes)
    };
    s.by_count = true;
    if p.top_k > 0 && (p.top_k as usize) < x.len() {
        s.bound = select(&s, &mut h, (p.top_k - 1) as u64, &mut fast, &mut passes);
    }
    s.by_count = false;
    if p.top_p < 1.0 {
        let z = if fast {
            s.hist_total(&h, &mut passes)
        } else {
            passes += 1;
            s.total()
        };
        let t = top_p_target(p.top_p, z);
        s.bound = select(&s, &mut h, t, &mut fast, &mut passes);
    }
    s.min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    if fast && !h.prefix && s.min_p > 0.0 {
        s.hist_build(&mut h, false, &mut passes);
    }
    let m = if fast {
        s.hist_total(&h, &mut passes)
    } else {
        passes += 1;
        s.total()
    };
    let t = draw_target(m, p, output_index);
    let token = select(&s, &mut h, t, &mut fast, &mut passes) as u32;
    assert!(
        fast,
        "t below the total: the histogram answers every question"
    );
    (token, passes, h.paths)
}

/// `baton_top_logprobs_hist`: the ids of the `n` most likely tokens of the raw row (the smallest
/// keys) from a count histogram at temperature 1 and a prefix list of `cap` entries, or `None`
/// where the kernel takes n passes instead (those bins hold more than the list, or the n-th is
/// in the last bin, or the row is all -inf).
pub fn top_ids_hist(x: &[f32], n: usize, cap: usize) -> Option<Vec<u32>> {
    let maxv = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(clean(v)));
    if n == 0 || maxv == f32::NEG_INFINITY {
        return None;
    }
    let bin = |v: f32| hist_bin(clean(v), maxv, 1.0);
    let mut c = vec![0usize; HIST_BINS];
    x.iter().for_each(|&v| c[bin(v)] += 1);
    let mut running = 0;
    let b = (0..HIST_BINS).find(|&b| {
        running += c[b];
        running > n - 1
    })?;
    if b == HIST_BINS - 1 || c[..=b].iter().sum::<usize>() > cap {
        return None;
    }
    let mut list: Vec<u64> = (0..x.len())
        .filter(|&i| bin(x[i]) <= b)
        .map(|i| sort_key(clean(x[i]), i as u32))
        .collect();
    list.sort_unstable();
    Some(list[..n].iter().map(|&k| k as u32).collect())
}

/// The same semantics by sorting: prefixes of the key order, fixed-point masses.
pub fn sorted_reference(x: &[f32], p: &Params, output_index: u32) -> u32 {
    let maxv = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(clean(v)));
    let inv_t = 1.0 / p.temperature;
    let mut order: Vec<(u64, f32)> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            (
                sort_key(clean(v), i as u32),
                ((clean(v) - maxv) * inv_t).exp(),
            )
        })
        .collect();
    order.sort_unstable_by_key(|o| o.0);
    if p.top_k > 0 && (p.top_k as usize) < x.len() {
        order.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let z: u64 = order.iter().map(|o| fixed(o.1)).sum();
        let need = ((f64::from(p.top_p) * z as f64).ceil() as u64).clamp(1, z);
        let mut cum = 0;
        let keep = order
            .iter()
            .position(|o| {
                cum += fixed(o.1);
                cum >= need
            })
            .unwrap();
        order.truncate(keep + 1);
    }
    let min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    order.retain(|o| o.1 >= min_p);
    let m: u64 = order.iter().map(|o| fixed(o.1)).sum();
    let t = ((u128::from(m) * u128::from(uniform_bits(p.seed, output_index))) >> 24) as u64;
    let mut cum = 0;
    let pick = order
        .iter()
        .find(|o| {
            cum += fixed(o.1);
            cum > t
        })
        .unwrap();
    pick.0 as u32
}

pub fn logits(n: usize, salt: u32, spread: f32, quantize: bool) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let w = philox4x32_10([i, salt, 1, 2], [3, 4])[0];
            let v = (w >> 8) as f32 / 16_777_216.0 * spread - spread / 2.0;
            // Quantized logits create many exact ties, exercising the id half of the key.
            if quantize {
                (v * 2.0).round() / 2.0
            } else {
                v
            }
        })
        .collect()
}
