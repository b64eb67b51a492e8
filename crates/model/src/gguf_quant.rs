//! ggml's tensor types as GGUF stores them, and their dequantization to f32.
//!
//! Block layouts and formulas follow ggml's reference (scalar) implementation,
//! `ggml/src/ggml-quants.c` (`dequantize_row_*`) and the block structs of
//! `ggml/src/ggml-common.h`, <https://github.com/ggml-org/llama.cpp>.
//! The CPU backend keeps a GGUF file's quantized matrices as stored and dequantizes a block
//! of rows at a time inside its linear layers (`crate::linear`); the CUDA backend takes them
//! dequantized into the model's 16-bit dtype ([`crate::WeightSource::get`]), as it does FP8
//! checkpoints.

/// A ggml tensor type Baton reads. The discriminant is ggml's type id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float.
    F32 = 0,
    /// IEEE half.
    F16 = 1,
    /// Blocks of 32: an f16 scale `d`, 16 bytes of 4-bit quants; `x = d·(q − 8)`.
    Q4_0 = 2,
    /// Blocks of 32: f16 `d` and `m`, 16 bytes of 4-bit quants; `x = d·q + m`.
    Q4_1 = 3,
    /// Blocks of 32: f16 `d`, 32 high bits, 16 bytes of low nibbles; `x = d·(q − 16)`.
    Q5_0 = 6,
    /// Blocks of 32: f16 `d` and `m`, 32 high bits, 16 bytes of low nibbles; `x = d·q + m`.
    Q5_1 = 7,
    /// Blocks of 32: f16 `d`, 32 signed bytes; `x = d·q`.
    Q8_0 = 8,
    /// Super-blocks of 256: 2-bit quants in 16 groups with 4-bit scales and mins.
    Q2_K = 10,
    /// Super-blocks of 256: 3-bit quants in 16 groups with 6-bit scales.
    Q3_K = 11,
    /// Super-blocks of 256: 4-bit quants in 8 groups with 6-bit scales and mins.
    Q4_K = 12,
    /// Super-blocks of 256: 5-bit quants in 8 groups with 6-bit scales and mins.
    Q5_K = 13,
    /// Super-blocks of 256: 6-bit quants in 16 groups with 8-bit scales.
    Q6_K = 14,
    /// Blocks of 32: an f16 scale `d`, 16 bytes of 4-bit indices into a fixed non-uniform
    /// table of 16 levels (`IQ4_LEVELS`); `x = d·level[q]`.
    IQ4_NL = 20,
    /// Super-blocks of 256: IQ4_NL's indices in 8 groups of 32, each with a 6-bit scale.
    IQ4_XS = 23,
    /// bfloat16.
    BF16 = 30,
}

/// ggml type ids Baton does not read, by name, for refusals.
const UNREAD: &[(u32, &str)] = &[
    (9, "Q8_1"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

impl GgmlType {
    /// Every type read, in id order.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::BF16,
    ];

    /// The type of ggml id `id`, `None` for one Baton does not read.
    pub fn from_u32(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// ggml's name of type id `id` (`"IQ2_XS"`), also for types Baton does not read.
    pub fn name_of(id: u32) -> Option<&'static str> {
        match Self::from_u32(id) {
            Some(t) => Some(t.name()),
            None => UNREAD.iter().find(|(i, _)| *i == id).map(|(_, n)| *n),
        }
    }

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::IQ4_NL => "IQ4_NL",
            GgmlType::IQ4_XS => "IQ4_XS",
            GgmlType::BF16 => "BF16",
        }
    }

    /// The names of every type read, comma-separated, for errors.
    pub fn names() -> String {
        Self::ALL.map(GgmlType::name).join(", ")
    }

    /// Elements per block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL => 32,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => 256,
        }
    }

    /// Bytes per block (`ggml_type_size`).
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::IQ4_NL => 18,
            GgmlType::IQ4_XS => 136,
        }
    }

    /// Bytes of a row of `n` elements (`ggml_row_size`); `None` when `n` is not a whole
    /// number of blocks or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
}

/// Elements below which [`GgmlType::dequantize_par`] runs on the calling thread: a tensor
/// this small dequantizes in well under a millisecond, less than rayon's fan-out costs.
const PAR_MIN_ELEMS: usize = 1 << 18;

/// Elements per rayon task in [`GgmlType::dequantize_par`] (a whole number of blocks for
/// every type: 2048 blocks of 32, 256 super-blocks of 256).
const PAR_CHUNK_ELEMS: usize = 1 << 16;

impl GgmlType {
    /// Dequantizes `out.len()` elements of this type from `bytes` into `out`, on the calling
    /// thread, with ggml's reference formulas (`dequantize_row_*` of `ggml/src/ggml-quants.c`;
    /// F16 and BF16 widen exactly, F32 is copied).
    ///
    /// `bytes` is the tensor data as GGUF stores it (little-endian), a whole number of blocks:
    /// `out.len()` must be a multiple of [`block_size`](Self::block_size) and `bytes.len()` must
    /// equal [`row_bytes`](Self::row_bytes)`(out.len())`, else this returns an `Err` naming the
    /// type and both lengths and writes nothing. Blocks are independent, so a tensor of any
    /// shape dequantizes as one flat run of `rows × columns` elements.
    ///
    /// Each value is computed with the same f32 operations, in the same order, as ggml's scalar
    /// C source, without fusing a multiply and an add (Rust never contracts `a * b + c` into an
    /// FMA); a C build that lets the compiler contract them may differ in the last bit. gguf-py's
    /// numpy dequantizers (`gguf.quants`) compute unfused too and agree bit for bit (see
    /// `tests/gguf_dequant.rs`). Never panics; NaN or infinite f16 scales propagate as in ggml.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
        self.check_lengths(bytes.len(), out.len())?;
        self.dequantize_blocks(bytes, out);
        Ok(())
    }

    /// [`dequantize`](Self::dequantize) split across rayon's thread pool: for `out.len()` of at
    /// least 2^18 elements, runs of 2^16 elements (whole blocks) dequantize in parallel; smaller
    /// tensors run on the calling thread. Same checks, errors and output, bit for bit, as
    /// [`dequantize`](Self::dequantize).
    pub fn dequantize_par(self, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
        use rayon::prelude::*;

        self.check_lengths(bytes.len(), out.len())?;
        if out.len() < PAR_MIN_ELEMS {
            self.dequantize_blocks(bytes, out);
            return Ok(());
        }
        let blocks = PAR_CHUNK_ELEMS / self.block_size();
        bytes
            .par_chunks(blocks * self.type_size())
            .zip(out.par_chunks_mut(blocks * self.block_size()))
            .for_each(|(b, o)| self.dequantize_blocks(b, o));
        Ok(())
    }

    /// `Err` unless `n_bytes` holds exactly `n_elems` elements as whole blocks.
    fn check_lengths(self, n_bytes: usize, n_elems: usize) -> Result<(), String> {
        let (name, bs) = (self.name(), self.block_size());
        if !n_elems.is_multiple_of(bs) {
            return Err(format!(
                "{name}: {n_elems} elements are not a whole number of {bs}-element blocks"
            ));
        }
        match self.row_bytes(n_elems) {
            Some(want) if want == n_bytes => Ok(()),
            Some(want) => Err(format!(
                "{name}: {n_elems} elements take {want} bytes ({} blocks of {} bytes), got {n_bytes}",
                n_elems / bs,
                self.type_size()
            )),
            None => Err(format!("{name}: the byte size of {n_elems} elements overflows")),
        }
    }

    /// Dequantizes whole blocks; the caller has checked that the lengths match (a mismatch
    /// would leave the tail of the longer side untouched, never panic). Always inlined, so
    /// that a caller compiled for AVX2 (the CPU backend's quantized linear layers,
    /// `crate::linear`) gets the per-block loops vectorized for it.
    #[inline(always)]
    pub(crate) fn dequantize_blocks(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            GgmlType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            GgmlType::F16 => {
                use half::slice::HalfFloatSliceExt;
                // Batches through a stack buffer so half's vectorized slice conversion runs
                // (the bytes need not be 2-aligned, so they cannot be cast in place).
                const BATCH: usize = 256;
                let mut buf = [half::f16::ZERO; BATCH];
                for (b, o) in bytes.chunks(2 * BATCH).zip(out.chunks_mut(BATCH)) {
                    let n = o.len().min(b.len() / 2);
                    for (h, p) in buf.iter_mut().zip(b.chunks_exact(2)) {
                        *h = half::f16::from_bits(u16::from_le_bytes([p[0], p[1]]));
                    }
                    buf[..n].convert_to_f32_slice(&mut o[..n]);
                }
            }
            GgmlType::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            GgmlType::Q4_0 => for_blocks(bytes, out, dequant_q4_0),
            GgmlType::Q4_1 => for_blocks(bytes, out, dequant_q4_1),
            GgmlType::Q5_0 => for_blocks(bytes, out, dequant_q5_0),
            GgmlType::Q5_1 => for_blocks(bytes, out, dequant_q5_1),
            GgmlType::Q8_0 => for_blocks(bytes, out, dequant_q8_0),
            GgmlType::Q2_K => for_blocks(bytes, out, dequant_q2_k),
            GgmlType::Q3_K => for_blocks(bytes, out, dequant_q3_k),
            GgmlType::Q4_K => for_blocks(bytes, out, dequant_q4_k),
            GgmlType::Q5_K => for_blocks(bytes, out, dequant_q5_k),
            GgmlType::Q6_K => for_blocks(bytes, out, dequant_q6_k),
            GgmlType::IQ4_NL => for_blocks(bytes, out, dequant_iq4_nl),
            GgmlType::IQ4_XS => for_blocks(bytes, out, dequant_iq4_xs),
        }
    }
}

/// Run `b` of a quantized row (its values `32b..32b + 32`) as small integers and scales:
/// value `i` is `scale[i / 16]·v[i] + min[i / 16]`, the same bits as
/// [`GgmlType::dequantize`] gives (ggml's `d·(q − 8)`, `d·q + m`, `d·sc·q − dmin·m`, ...
/// with the offset folded into `v` and the min, negated where ggml subtracts it, into
/// `min`; each `scale·v` is the product ggml rounds, or exact where ggml adds a min, so one
/// fused multiply-add rounds as ggml's pair). The form the CPU's 8-bit-activation dot
/// products read (`crate::q8`); `v` is in `-128..=127` (Q8_0), `-127..=113` (IQ4),
/// `-32..=31` (Q6_K) or smaller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct IntRun {
    /// The run's 32 quants, offsets applied (Q4_0's `q − 8`, IQ4's level).
    pub(crate) v: [i8; 32],
    /// The scale of values `0..16` and of `16..32` (equal for types of one scale a run).
    pub(crate) scale: [f32; 2],
    /// What each half adds (`m` of Q4_1/Q5_1, `−dmin·m` of the K-quants); zero for types
    /// without mins.
    pub(crate) min: [f32; 2],
}

/// How a type's mins are laid out, for the 8-bit-activation dot products (`crate::q8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mins {
    /// No min: `x = scale·v`.
    None,
    /// One min a run of 32 (Q4_1, Q5_1, Q4_K, Q5_K).
    Per32,
    /// One min a half run of 16 (Q2_K).
    Per16,
}

impl GgmlType {
    /// Whether this is a block-quantized type (not F32, F16 or BF16).
    pub(crate) fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// The type's [`Mins`]; `None` for the float types too.
    pub(crate) fn mins(self) -> Mins {
        match self {
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => Mins::Per32,
            GgmlType::Q2_K => Mins::Per16,
            _ => Mins::None,
        }
    }

    /// Run `b` (values `32b..32b + 32`) of `row`, a row of this quantized type, as an
    /// [`IntRun`]; `None` for the float types.
    ///
    /// # Panics
    /// If `row` is shorter than the block holding run `b` (a caller bug: rows come from
    /// checked tensors).
    pub(crate) fn int_run(self, row: &[u8], b: usize) -> Option<IntRun> {
        let mut v = [0i8; 32];
        let (scale, min);
        // Small blocks: block b; super-blocks: block b / 8, run s = b % 8 of it.
        let (blk, s) = (b / 8, b % 8);
        let sb = |size: usize| &row[size * blk..size * (blk + 1)];
        let nibbles = |qs: &[u8], v: &mut [i8; 32], f: &dyn Fn(u8) -> i8| {
            for j in 0..16 {
                v[j] = f(qs[j] & 0x0F);
                v[j + 16] = f(qs[j] >> 4);
            }
        };
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
            GgmlType::Q4_0 | GgmlType::IQ4_NL => {
                let blk = &row[18 * b..18 * (b + 1)];
                let d = f16_le(blk[0], blk[1]);
                if self == GgmlType::Q4_0 {
                    nibbles(&blk[2..], &mut v, &|q| q as i8 - 8);
                } else {
                    nibbles(&blk[2..], &mut v, &|q| IQ4_LEVELS[usize::from(q)]);
                }
                (scale, min) = ([d, d], [0.0, 0.0]);
            }
            GgmlType::Q4_1 => {
                let blk = &row[20 * b..20 * (b + 1)];
                let (d, m) = (f16_le(blk[0], blk[1]), f16_le(blk[2], blk[3]));
                nibbles(&blk[4..], &mut v, &|q| q as i8);
                (scale, min) = ([d, d], [m, m]);
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let (size, at) = if self == GgmlType::Q5_0 {
                    (22, 2)
                } else {
                    (24, 4)
                };
                let blk = &row[size * b..size * (b + 1)];
                let d = f16_le(blk[0], blk[1]);
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                nibbles(&blk[at + 4..], &mut v, &|q| q as i8);
                let off = if self == GgmlType::Q5_0 { 16 } else { 0 };
                for (i, x) in v.iter_mut().enumerate() {
                    *x = (*x | (((qh >> i) & 1) << 4) as i8) - off;
                }
                let m = if self == GgmlType::Q5_1 {
                    f16_le(blk[2], blk[3])
                } else {
                    0.0
                };
                (scale, min) = ([d, d], [m, m]);
            }
            GgmlType::Q8_0 => {
                let blk = &row[34 * b..34 * (b + 1)];
                let d = f16_le(blk[0], blk[1]);
                for (x, &q) in v.iter_mut().zip(&blk[2..]) {
                    *x = q as i8;
                }
                (scale, min) = ([d, d], [0.0, 0.0]);
            }
            GgmlType::Q2_K | GgmlType::Q3_K => {
                // Run s = 4n + j of half n: bits 2j.. of byte 32n + i of the quants; scale
                // 8n + 2j + i / 16 (as `dequant_q2_k` / `dequant_q3_k`).
                let q3 = self == GgmlType::Q3_K;
                let b = sb(if q3 { 110 } else { 84 });
                let (n, j) = (s / 4, s % 4);
                let qs = &b[if q3 { 32 } else { 16 } + 32 * n..];
                for (i, x) in v.iter_mut().enumerate() {
                    let q = ((qs[i] >> (2 * j)) & 3) as i8;
                    *x = if q3 && b[i] & (1 << s) == 0 { q - 4 } else { q };
                }
                let is = 8 * n + 2 * j;
                if q3 {
                    let d = f16_le(b[108], b[109]);
                    scale = [0, 1].map(|h| d * q3_k_scale(is + h, &b[96..108]) as f32);
                    min = [0.0, 0.0];
                } else {
                    let (d, dmin) = (f16_le(b[80], b[81]), f16_le(b[82], b[83]));
                    scale = [0, 1].map(|h| d * (b[is + h] & 0x0F) as f32);
                    min = [0, 1].map(|h| -(dmin * (b[is + h] >> 4) as f32));
                }
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                // Run s: nibble s % 2 of byte 32 (s / 2) + i of the quants; Q5_K's bit s of
                // qh[i] as bit 4.
                let q5 = self == GgmlType::Q5_K;
                let b = sb(if q5 { 176 } else { 144 });
                let qs = &b[if q5 { 48 } else { 16 } + 32 * (s / 2)..];
                for (i, x) in v.iter_mut().enumerate() {
                    let q = (qs[i] >> (4 * (s % 2))) & 0x0F;
                    let h = if q5 { ((b[16 + i] >> s) & 1) << 4 } else { 0 };
                    *x = (q | h) as i8;
                }
                let (d, dmin) = (f16_le(b[0], b[1]), f16_le(b[2], b[3]));
                let (sc, m) = scale_min_k4(s, &k4_scales(b));
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                (scale, min) = ([d1, d1], [-m1, -m1]);
            }
            GgmlType::Q6_K => {
                // Run s = 4n + r of half n: nibble r / 2 of ql[64n + 32(r % 2) + i], bits 2r..
                // of qh[32n + i] as bits 4..6, less 32; scale 8n + 2r + i / 16.
                let b = sb(210);
                let (n, r) = (s / 4, s % 4);
                for (i, x) in v.iter_mut().enumerate() {
                    let lo = (b[64 * n + 32 * (r % 2) + i] >> (4 * (r / 2))) & 0x0F;
                    let hi = (b[128 + 32 * n + i] >> (2 * r)) & 3;
                    *x = (lo | (hi << 4)) as i8 - 32;
                }
                let d = f16_le(b[208], b[209]);
                scale = [0, 1].map(|h| d * f32::from(b[192 + 8 * n + 2 * r + h] as i8));
                min = [0.0, 0.0];
            }
            GgmlType::IQ4_XS => {
                let b = sb(136);
                nibbles(&b[8 + 16 * s..], &mut v, &|q| IQ4_LEVELS[usize::from(q)]);
                let dl = f16_le(b[0], b[1]) * iq4_xs_scale(s, b) as f32;
                (scale, min) = ([dl, dl], [0.0, 0.0]);
            }
        }
        Some(IntRun { v, scale, min })
    }
}

/// A super-block of 256 values of a K-quant or IQ4_XS in integers, for products with
/// activations quantized per 256 (llama.cpp's `block_q8_K`, `crate::linear_q8`): value `i` is
/// `d·sc[i / 16]·v[i] + cm·mc[i / 16]` in exact arithmetic (ggml's f32 value is that, rounded).
/// `v` is unsigned (`0..=63`) for every type but IQ4_XS, whose levels are signed: the fixed
/// offsets of Q3_K (`−4`) and Q6_K (`−32`) move into `mc` (`4·sc`, `32·sc`, with `cm = −d`),
/// as the K-quants' mins do (`mc = m`, `cm = −dmin`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KInts {
    /// The 256 quants, offset-free.
    pub(crate) v: [i8; 256],
    /// The integer scale of each 16 values (`−128..=127`).
    pub(crate) sc: [i16; 16],
    /// The integer min (or offset) coefficient of each 16 values (`0..=4096` in magnitude).
    pub(crate) mc: [i16; 16],
    /// The super-block's scale (f16, widened).
    pub(crate) d: f32,
    /// The coefficient of `mc`: `−dmin`, `−d`, or 0 (IQ4_XS).
    pub(crate) cm: f32,
}

impl GgmlType {
    /// Whether products with 8-bit activations read this type a super-block of 256 at a time
    /// ([`GgmlType::k_ints`]), not a run of 32 ([`GgmlType::int_run`]).
    pub(crate) fn super_blocks(self) -> bool {
        matches!(
            self,
            GgmlType::Q2_K
                | GgmlType::Q3_K
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
                | GgmlType::IQ4_XS
        )
    }

    /// The integer scales, min coefficients and float factors of one super-block `b` (its
    /// bytes) of this type, as [`KInts`] holds them: `(sc, mc, d, cm)`.
    ///
    /// # Panics
    /// If `b` is shorter than a block, or this is not a [`super_blocks`] type (caller bugs).
    ///
    /// [`super_blocks`]: GgmlType::super_blocks
    #[inline]
    #[allow(clippy::needless_range_loop)] // sc[j] and mc[j] together
    pub(crate) fn k_scales(self, b: &[u8]) -> ([i16; 16], [i16; 16], f32, f32) {
        let (mut sc, mut mc) = ([0i16; 16], [0i16; 16]);
        match self {
            GgmlType::Q2_K => {
                for j in 0..16 {
                    sc[j] = i16::from(b[j] & 0x0F);
                    mc[j] = i16::from(b[j] >> 4);
                }
                (sc, mc, f16_le(b[80], b[81]), -f16_le(b[82], b[83]))
            }
            GgmlType::Q3_K => {
                for j in 0..16 {
                    sc[j] = q3_k_scale(j, &b[96..108]) as i16;
                    mc[j] = 4 * sc[j];
                }
                let d = f16_le(b[108], b[109]);
                (sc, mc, d, -d)
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                // `scale_min_k4`'s unpacking four at a time in u32s (llama.cpp's `utmp`
                // masks): the scales are the bytes of u[0..2], the mins of u[2..4].
                let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
                let (u0, u1, u2) = (w(4), w(8), w(12));
                let (m6, m4, m2) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
                let scales = [u0 & m6, (u2 & m4) | (((u0 >> 6) & m2) << 4)];
                let mins = [u1 & m6, ((u2 >> 4) & m4) | (((u1 >> 6) & m2) << 4)];
                for j in 0..16 {
                    let byte = |v: [u32; 2]| (v[j / 8] >> (8 * ((j / 2) % 4))) as u8;
                    sc[j] = i16::from(byte(scales));
                    mc[j] = i16::from(byte(mins));
                }
                (sc, mc, f16_le(b[0], b[1]), -f16_le(b[2], b[3]))
            }
            GgmlType::Q6_K => {
                for j in 0..16 {
                    // Group j of 16 values has scale j.
                    sc[j] = i16::from(b[192 + j] as i8);
                    mc[j] = 32 * sc[j];
                }
                let d = f16_le(b[208], b[209]);
                (sc, mc, d, -d)
            }
            GgmlType::IQ4_XS => {
                for j in 0..16 {
                    sc[j] = iq4_xs_scale(j / 2, b) as i16;
                }
                (sc, mc, f16_le(b[0], b[1]), 0.0)
            }
            _ => panic!("k_scales of {}", self.name()),
        }
    }

    /// Super-block `blk` of `row` (a row of this type, one of [`super_blocks`]) as
    /// [`KInts`]; `None` for other types.
    ///
    /// # Panics
    /// If `row` is shorter than the block (a caller bug: rows come from checked tensors).
    ///
    /// [`super_blocks`]: GgmlType::super_blocks
    pub(crate) fn k_ints(self, row: &[u8], blk: usize) -> Option<KInts> {
        if !self.super_blocks() {
            return None;
        }
        let b = &row[self.type_size() * blk..self.type_size() * (blk + 1)];
        let mut k = KInts {
            v: [0; 256],
            sc: [0; 16],
            mc: [0; 16],
            d: 0.0,
            cm: 0.0,
        };
        // Values 32s..32s + 32 of each type as its int_run decodes run s, offsets removed.
        for s in 0..8 {
            let run = self.int_run(b, s).expect("quantized");
            let off = match self {
                GgmlType::Q3_K => 4,
                GgmlType::Q6_K => 32,
                _ => 0,
            };
            for i in 0..32 {
                k.v[32 * s + i] = run.v[i] + off;
            }
        }
        (k.sc, k.mc, k.d, k.cm) = self.k_scales(b);
        Some(k)
    }
}

/// Runs `f` over each `B`-byte block of `bytes` and the `N` outputs it fills, as fixed-size
/// arrays so the per-block kernels index without bounds checks.
#[inline(always)]
fn for_blocks<const B: usize, const N: usize>(
    bytes: &[u8],
    out: &mut [f32],
    f: impl Fn(&[u8; B], &mut [f32; N]),
) {
    for (b, o) in bytes.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
        // `chunks_exact` yields exactly B and N elements, so both conversions succeed.
        if let (Ok(b), Ok(o)) = (b.try_into(), o.try_into()) {
            f(b, o);
        }
    }
}

/// The little-endian IEEE half with bytes `lo`, `hi` (ggml's `ggml_half`, read with
/// `GGML_FP16_TO_FP32`), as f32.
#[inline(always)]
fn f16_le(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// `block_q4_0` (18 bytes): `d: f16`, `qs: [u8; 16]`. Element `j < 16` is the low nibble of
/// `qs[j]`, element `j + 16` its high nibble; `y = (q − 8)·d`.
#[inline(always)]
fn dequant_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// `block_q4_1` (20 bytes): `d: f16`, `m: f16`, `qs: [u8; 16]` (nibbles as Q4_0); `y = q·d + m`.
#[inline(always)]
fn dequant_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// `block_q5_0` (22 bytes): `d: f16`, `qh: [u8; 4]` (a little-endian u32 whose bit `i` is bit 4
/// of element `i`), `qs: [u8; 16]` (low nibbles as Q4_0); `y = (q − 16)·d`.
#[inline(always)]
fn dequant_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((u32::from(q & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = ((u32::from(q >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `block_q5_1` (24 bytes): `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]` (bits as Q5_0);
/// `y = q·d + m`.
#[inline(always)]
fn dequant_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (u32::from(q & 0x0F) | h0) as f32 * d + m;
        y[j + 16] = (u32::from(q >> 4) | h1) as f32 * d + m;
    }
}

/// `block_q8_0` (34 bytes): `d: f16`, `qs: [i8; 32]`; `y = q·d`.
#[inline(always)]
fn dequant_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    for j in 0..32 {
        y[j] = f32::from(b[2 + j] as i8) * d;
    }
}

/// `block_q2_K` (84 bytes): `scales: [u8; 16]` (per 16 elements, low nibble a scale, high nibble
/// a min), `qs: [u8; 64]`, `d: f16`, `dmin: f16`. Each 128-element half `n` reads `qs[32n..]`; its
/// 32-element group `j` takes bits `2j..2j+2` of those 32 bytes, 16 per scale;
/// `y = d·sc·q − dmin·m`.
#[inline(always)]
fn dequant_q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let d = f16_le(b[80], b[81]);
    let min = f16_le(b[82], b[83]);
    for n in 0..2 {
        for j in 0..4 {
            let shift = 2 * j;
            for h in 0..2 {
                let is = 8 * n + 2 * j + h;
                let sc = b[is];
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                let base = 128 * n + 32 * j + 16 * h;
                for l in 0..16 {
                    let q = (b[16 + 32 * n + 16 * h + l] >> shift) & 3;
                    y[base + l] = dl * q as f32 - ml;
                }
            }
        }
    }
}

/// `block_q3_K` (110 bytes): `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]` (sixteen 6-bit
/// scales offset by 32: low nibbles in bytes 0..8, high 2 bits in bytes 8..12), `d: f16`. The
/// 2-bit quants are laid out as Q2_K's; bit `4n + j` of `hmask[l]` set means no −4 offset;
/// `y = d·(sc − 32)·q`.
#[inline(always)]
fn dequant_q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let d_all = f16_le(b[108], b[109]);
    let mut scales = [0f32; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        *s = q3_k_scale(j, &b[96..108]) as f32;
    }
    for n in 0..2 {
        for j in 0..4 {
            let shift = 2 * j;
            let m = 1u8 << (4 * n + j);
            for h in 0..2 {
                let dl = d_all * scales[8 * n + 2 * j + h];
                let base = 128 * n + 32 * j + 16 * h;
                for l in 0..16 {
                    let i = 16 * h + l;
                    let q = ((b[32 + 32 * n + i] >> shift) & 3) as i32;
                    let q = q - if b[i] & m != 0 { 0 } else { 4 };
                    y[base + l] = dl * q as f32;
                }
            }
        }
    }
}

/// Scale `j` (0..16) of a Q3_K block, less 32 (−32..=31), from its packed `scales: [u8; 12]`:
/// low 4 bits from nibble `j / 8` of byte `j % 8`, high 2 bits from bits `2(j / 4)..` of byte
/// `8 + j % 4`.
#[inline(always)]
fn q3_k_scale(j: usize, sb: &[u8]) -> i32 {
    let low = if j < 8 { sb[j] & 0x0F } else { sb[j - 8] >> 4 };
    let high = (sb[8 + j % 4] >> (2 * (j / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of 32-element group `j` (0..8) from a
/// Q4_K/Q5_K `scales: [u8; 12]`.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The Q4_K/Q5_K `scales` bytes `b[4..16]` as an array.
#[inline(always)]
fn k4_scales(b: &[u8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    s.copy_from_slice(&b[4..16]);
    s
}

/// `block_q4_K` (144 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight 6-bit scales and
/// mins, [`scale_min_k4`]), `qs: [u8; 128]`. Each 64 elements read 32 bytes, low nibbles then
/// high nibbles; `y = d·sc·q − dmin·m`.
#[inline(always)]
fn dequant_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_le(b[0], b[1]);
    let min = f16_le(b[2], b[3]);
    let scales = k4_scales(b);
    for j in 0..4 {
        let (sc, m) = scale_min_k4(2 * j, &scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * j + 1, &scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            let q = b[16 + 32 * j + l];
            y[64 * j + l] = d1 * (q & 0x0F) as f32 - m1;
            y[64 * j + 32 + l] = d2 * (q >> 4) as f32 - m2;
        }
    }
}

/// `block_q5_K` (176 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (as Q4_K), `qh: [u8; 32]`,
/// `qs: [u8; 128]` (low nibbles as Q4_K). Bit `2j` of `qh[l]` is bit 4 of element `64j + l`, bit
/// `2j + 1` of element `64j + 32 + l`; `y = d·sc·q − dmin·m`.
#[inline(always)]
fn dequant_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_le(b[0], b[1]);
    let min = f16_le(b[2], b[3]);
    let scales = k4_scales(b);
    for j in 0..4 {
        let (sc, m) = scale_min_k4(2 * j, &scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * j + 1, &scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        for l in 0..32 {
            let ql = b[48 + 32 * j + l];
            let qh = b[16 + l];
            let h1 = if qh & u1 != 0 { 16 } else { 0 };
            let h2 = if qh & u2 != 0 { 16 } else { 0 };
            y[64 * j + l] = d1 * ((ql & 0x0F) + h1) as f32 - m1;
            y[64 * j + 32 + l] = d2 * ((ql >> 4) + h2) as f32 - m2;
        }
    }
}

/// `block_q6_K` (210 bytes): `ql: [u8; 128]` (low nibbles), `qh: [u8; 64]` (high 2 bits),
/// `scales: [i8; 16]` (one per 16 elements), `d: f16`. In each 128-element half `n`, element
/// `32k + l` (`k` 0..4) takes nibble `k / 2` of `ql[64n + 32(k % 2) + l]` and bits `2k..2k+2` of
/// `qh[32n + l]`; `y = d·sc·(q − 32)`.
#[inline(always)]
fn dequant_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_le(b[208], b[209]);
    for n in 0..2 {
        let sc = |i: usize| f32::from(b[192 + 8 * n + i] as i8);
        for l in 0..32 {
            let is = l / 16;
            let ql0 = b[64 * n + l];
            let ql1 = b[64 * n + 32 + l];
            let qh = b[128 + 32 * n + l];
            let q1 = ((ql0 & 0x0F) | ((qh & 3) << 4)) as i32 - 32;
            let q2 = ((ql1 & 0x0F) | (((qh >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql0 >> 4) | (((qh >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql1 >> 4) | (((qh >> 6) & 3) << 4)) as i32 - 32;
            let base = 128 * n + l;
            y[base] = d * sc(is) * q1 as f32;
            y[base + 32] = d * sc(is + 2) * q2 as f32;
            y[base + 64] = d * sc(is + 4) * q3 as f32;
            y[base + 96] = d * sc(is + 6) * q4 as f32;
        }
    }
}

/// The 16 levels of IQ4_NL and IQ4_XS, indexed by a 4-bit quant (ggml's `kvalues_iq4nl`,
/// `ggml/src/ggml-common.h`): non-uniform, denser near zero, where trained weights cluster.
pub(crate) const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `block_iq4_nl` (18 bytes): `d: f16`, `qs: [u8; 16]` (nibbles as Q4_0's: element `j < 16` the
/// low nibble of `qs[j]`, element `j + 16` its high nibble); `y = d·IQ4_LEVELS[q]`.
#[inline(always)]
fn dequant_iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * f32::from(IQ4_LEVELS[usize::from(q & 0x0F)]);
        y[j + 16] = d * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
    }
}

/// The 6-bit scale of 32-element group `g` (0..8) of an IQ4_XS block, less 32 (−32..=31): low
/// 4 bits from nibble `g % 2` of `scales_l[g / 2]` (block bytes 4..8), high 2 bits from bits
/// `2g..2g + 2` of the little-endian u16 `scales_h` (bytes 2..4).
#[inline(always)]
pub(crate) fn iq4_xs_scale(g: usize, b: &[u8]) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + g / 2] >> (4 * (g % 2))) & 0x0F;
    let high = ((high >> (2 * g)) & 3) as u8;
    i32::from(low | (high << 4)) - 32
}

/// `block_iq4_xs` (136 bytes): `d: f16`, `scales_h: u16`, `scales_l: [u8; 4]`, `qs: [u8; 128]`.
/// Group `g` of 32 elements reads `qs[16g..16g + 16]` as IQ4_NL reads its block, scaled by
/// `dl = d·(sc − 32)` ([`iq4_xs_scale`]); `y = dl·IQ4_LEVELS[q]`.
#[inline(always)]
fn dequant_iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_le(b[0], b[1]);
    for g in 0..8 {
        let dl = d * iq4_xs_scale(g, b) as f32;
        for j in 0..16 {
            let q = b[8 + 16 * g + j];
            y[32 * g + j] = dl * f32::from(IQ4_LEVELS[usize::from(q & 0x0F)]);
            y[32 * g + j + 16] = dl * f32::from(IQ4_LEVELS[usize::from(q >> 4)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f16 bit pattern of `x`, little-endian.
    fn h(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_bits().to_le_bytes()
    }

    fn deq(t: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / t.type_size() * t.block_size();
        let mut out = vec![f32::NAN; n];
        t.dequantize(bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn q8_0_by_hand() {
        // d = 0.5, qs = 0, 1, -1, 2, -2, ..., then 127 and -128 at the end.
        let mut b = h(0.5).to_vec();
        let mut qs: Vec<i8> = (0..30)
            .map(|j| if j % 2 == 1 { j / 2 + 1 } else { -(j / 2) })
            .collect();
        qs.extend([127, -128]);
        b.extend(qs.iter().map(|&q| q as u8));
        let y = deq(GgmlType::Q8_0, &b);
        assert_eq!(&y[..5], &[0.0, 0.5, -0.5, 1.0, -1.0]);
        assert_eq!(y[29], 7.5);
        assert_eq!(y[30], 63.5);
        assert_eq!(y[31], -64.0);
        for (v, q) in y.iter().zip(&qs) {
            assert_eq!(*v, f32::from(*q) * 0.5);
        }
    }

    #[test]
    fn q4_0_by_hand() {
        // d = 2; qs[j] = j (low nibble) | (15 − j) << 4: element j is (j − 8)·2, element
        // j + 16 is (7 − j)·2.
        let mut b = h(2.0).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        // A second block: d = −0.25, every nibble 0x0 low and 0xF high.
        b.extend(h(-0.25));
        b.extend([0xF0u8; 16]);
        let y = deq(GgmlType::Q4_0, &b);
        assert_eq!(y[0], -16.0);
        assert_eq!(y[8], 0.0);
        assert_eq!(y[15], 14.0);
        assert_eq!(y[16], 14.0);
        assert_eq!(y[31], -16.0);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0);
            assert_eq!(y[j + 16], (7.0 - j as f32) * 2.0);
        }
        assert!(y[32..48].iter().all(|&v| v == 2.0), "(0 − 8)·−0.25");
        assert!(y[48..64].iter().all(|&v| v == -1.75), "(15 − 8)·−0.25");
    }

    #[test]
    fn q4_1_and_q5_by_hand() {
        // Q4_1: d = 0.5, m = −1; nibbles 3 (low) and 12 (high): 0.5 and 5.
        let mut b = h(0.5).to_vec();
        b.extend(h(-1.0));
        b.extend([0xC3u8; 16]);
        let y = deq(GgmlType::Q4_1, &b);
        assert!(y[..16].iter().all(|&v| v == 0.5) && y[16..].iter().all(|&v| v == 5.0));

        // Q5_0: d = 1; low nibbles 1 and high nibbles 2; qh bits set for elements 0 and 17:
        // element 0 is (1 + 16) − 16 = 1, element 1 is 1 − 16 = −15, element 16 is 2 − 16 =
        // −14, element 17 is 18 − 16 = 2.
        let mut b = h(1.0).to_vec();
        b.extend((1u32 | 1 << 17).to_le_bytes());
        b.extend([0x21u8; 16]);
        let y = deq(GgmlType::Q5_0, &b);
        assert_eq!(
            [y[0], y[1], y[16], y[17], y[31]],
            [1.0, -15.0, -14.0, 2.0, -14.0]
        );

        // Q5_1: d = 2, m = 0.5, the same quants without the −16: 2·17 + 0.5, 2·1 + 0.5, ...
        let mut b = h(2.0).to_vec();
        b.extend(h(0.5));
        b.extend((1u32 | 1 << 17).to_le_bytes());
        b.extend([0x21u8; 16]);
        let y = deq(GgmlType::Q5_1, &b);
        assert_eq!([y[0], y[1], y[16], y[17]], [34.5, 2.5, 4.5, 36.5]);
    }

    #[test]
    fn q4_k_scale_unpacking_by_hand() {
        // d = 1, dmin = 0.5, every qs byte 0x73 (low nibble 3, high 7).
        // Group 0: sc = scales[0] & 63 = 5, m = scales[4] & 63 = 4: 5·3 − 0.5·4 = 13.
        // Group 1: sc = scales[1] & 63 = 2, m = scales[5] & 63 = 0: 2·7 = 14.
        // Group 5: sc = (scales[9] & 15) | (scales[1] >> 6) << 4 = 0xA | 0x30 = 58,
        //          m = (scales[9] >> 4) | (scales[5] >> 6) << 4 = 2 | 16 = 18: 58·7 − 9 = 397.
        // Every other group has sc = m = 0.
        let mut b = h(1.0).to_vec();
        b.extend(h(0.5));
        let mut scales = [0u8; 12];
        scales[0] = 5;
        scales[1] = 0xC0 | 2;
        scales[4] = 4;
        scales[5] = 0x40;
        scales[9] = 0x2A;
        b.extend(scales);
        b.extend([0x73u8; 128]);
        let y = deq(GgmlType::Q4_K, &b);
        assert!(y[..32].iter().all(|&v| v == 13.0));
        assert!(y[32..64].iter().all(|&v| v == 14.0));
        assert!(y[64..160].iter().all(|&v| v == 0.0));
        assert!(y[160..192].iter().all(|&v| v == 397.0));
        assert!(y[192..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn iq4_by_hand() {
        // IQ4_NL: d = 0.5; qs[j] = j | (15 − j) << 4: element j is 0.5·level[j], element
        // j + 16 is 0.5·level[15 − j].
        let mut b = h(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(GgmlType::IQ4_NL, &b);
        assert_eq!([y[0], y[7], y[8], y[15]], [-63.5, -5.0, 0.5, 56.5]);
        assert_eq!([y[16], y[31]], [56.5, -63.5]);

        // IQ4_XS: d = 0.25. Group 0: low nibble of scales_l[0] = 1, high bits 0b10 (bits 0..2
        // of scales_h): 33 − 32 = 1. Group 3: high nibble of scales_l[1] = 0xF, high bits 0b01
        // (bits 6..8): 31 − 32 = −1. Group 7: high nibble of scales_l[3] = 0, high bits 0b11
        // (bits 14..16): 48 − 32 = 16. Every other group: 0 − 32 = −32. Every qs byte 0x8F:
        // level[15] = 113 low, level[8] = 1 high.
        let mut b = h(0.25).to_vec();
        b.extend((0b10u16 | 0b01 << 6 | 0b11 << 14).to_le_bytes());
        b.extend([0x01, 0xF0, 0x00, 0x00]);
        b.extend([0x8Fu8; 128]);
        let y = deq(GgmlType::IQ4_XS, &b);
        let group = |g: usize, sc: f32| {
            let want = |lv: f32| 0.25 * sc * lv;
            y[32 * g..32 * g + 16].iter().all(|&v| v == want(113.0))
                && y[32 * g + 16..32 * g + 32].iter().all(|&v| v == want(1.0))
        };
        assert!(group(0, 1.0) && group(3, -1.0) && group(7, 16.0));
        for g in [1, 2, 4, 5, 6] {
            assert!(group(g, -32.0), "group {g}");
        }
    }

    #[test]
    fn float_types() {
        let xs = [1.5f32, -0.0, 65504.0, -2.0e-7, f32::INFINITY];
        let b: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let y = deq(GgmlType::F32, &b);
        assert_eq!(
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            xs.map(f32::to_bits)
        );

        // 300 halves, more than the conversion's 256-element batch.
        let hs: Vec<half::f16> = (0..300)
            .map(|i| half::f16::from_f32(i as f32 * 0.37 - 50.0))
            .collect();
        let b: Vec<u8> = hs.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        let y = deq(GgmlType::F16, &b);
        assert_eq!(y, hs.iter().map(|x| x.to_f32()).collect::<Vec<_>>());

        let b = [0x80u8, 0x3F, 0x49, 0xC0]; // bf16 1.0, −3.140625
        assert_eq!(deq(GgmlType::BF16, &b), [1.0, -3.140625]);
    }

    #[test]
    fn length_errors() {
        let mut out = [0f32; 32];
        let e = GgmlType::Q8_0.dequantize(&[0; 33], &mut out).unwrap_err();
        assert!(
            e.contains("Q8_0") && e.contains("34") && e.contains("33"),
            "{e}"
        );
        let e = GgmlType::Q8_0.dequantize(&[0; 68], &mut out).unwrap_err();
        assert!(e.contains("68"), "{e}");
        let e = GgmlType::Q4_K.dequantize(&[0; 144], &mut out).unwrap_err();
        assert!(e.contains("whole number of 256-element blocks"), "{e}");
        let mut out = [0f32; 31];
        let e = GgmlType::Q4_0.dequantize(&[0; 18], &mut out).unwrap_err();
        assert!(e.contains("31 elements") && e.contains("32-element"), "{e}");
        let e = GgmlType::F16.dequantize(&[0; 61], &mut out).unwrap_err();
        assert!(e.contains("62"), "{e}");
        assert!(GgmlType::Q6_K.dequantize_par(&[0; 210], &mut out).is_err());
        // Nothing is written on an error.
        let mut out = [7f32; 32];
        assert!(GgmlType::Q4_0.dequantize(&[0; 17], &mut out).is_err());
        assert!(out.iter().all(|&v| v == 7.0));
        // Zero elements is zero blocks.
        assert!(GgmlType::Q3_K.dequantize(&[], &mut []).is_ok());
    }

    /// Deterministic pseudo-random bytes (SplitMix64).
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u8
            })
            .collect()
    }

    #[test]
    fn int_runs_rebuild_the_dequantized_bits() {
        // Every quantized type over arbitrary bytes (NaN, infinite and subnormal scales
        // included): scale·v + min, one rounding (or scale·v alone), is ggml's value bit for
        // bit (both NaN counts as equal).
        for t in GgmlType::ALL {
            let n = 4 * t.block_size().max(32);
            let bytes = noise(t.row_bytes(n).unwrap(), 11 + t as u64);
            let mut want = vec![0f32; n];
            t.dequantize(&bytes, &mut want).unwrap();
            if matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                assert!(t.int_run(&bytes, 0).is_none());
                continue;
            }
            for b in 0..n / 32 {
                let run = t.int_run(&bytes, b).unwrap();
                if t.mins() == Mins::None {
                    assert_eq!(run.min, [0.0, 0.0], "{}", t.name());
                }
                if t.mins() != Mins::Per16 {
                    assert_eq!(run.min[0].to_bits(), run.min[1].to_bits(), "{}", t.name());
                }
                for i in 0..32 {
                    let h = i / 16;
                    let v = f32::from(run.v[i]);
                    let got = if t.mins() == Mins::None {
                        run.scale[h] * v
                    } else {
                        run.scale[h].mul_add(v, run.min[h])
                    };
                    let w = want[32 * b + i];
                    assert!(
                        got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan()),
                        "{} run {b} value {i}: {got} vs {w}",
                        t.name()
                    );
                }
            }
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)] // value i of three arrays
    fn k_ints_rebuild_the_dequantized_values() {
        // d·sc·v + cm·mc in f64 is ggml's f32 value before its last rounding: equal within
        // a few ulps (exactly for most), on moderate random blocks of every super-block type.
        for t in GgmlType::ALL {
            if !t.super_blocks() {
                assert!(t.k_ints(&[0; 256], 0).is_none());
                continue;
            }
            let mut checked = 0;
            for seed in 0..64 {
                let bytes = noise(t.type_size(), 1000 + seed);
                let mut want = vec![0f32; 256];
                t.dequantize(&bytes, &mut want).unwrap();
                if !want.iter().all(|v| v.is_finite() && v.abs() < 1e4) {
                    continue;
                }
                let k = t.k_ints(&bytes, 0).unwrap();
                if t != GgmlType::IQ4_XS {
                    assert!(k.v.iter().all(|&v| (0..64).contains(&v)), "{}", t.name());
                }
                for i in 0..256 {
                    let got = k.d as f64 * k.sc[i / 16] as f64 * k.v[i] as f64
                        + k.cm as f64 * k.mc[i / 16] as f64;
                    let w = want[i] as f64;
                    assert!(
                        (got - w).abs() <= 4.0 * f32::EPSILON as f64 * w.abs().max(1e-30),
                        "{} value {i}: {got} vs {w}",
                        t.name()
                    );
                }
                checked += 1;
            }
            assert!(checked > 8, "{}: {checked} blocks", t.name());
        }
    }

    #[test]
    fn parallel_matches_serial_on_any_bytes() {
        // Arbitrary bytes (NaN and infinite scales included): no panic, and the parallel
        // split gives the serial result bit for bit, past the parallel threshold and not.
        for t in GgmlType::ALL {
            for n in [t.block_size() * 3, PAR_MIN_ELEMS + 5 * PAR_CHUNK_ELEMS / 2] {
                let n = n / t.block_size() * t.block_size();
                let bytes = noise(t.row_bytes(n).unwrap(), t as u64);
                let (mut a, mut b) = (vec![0f32; n], vec![1f32; n]);
                t.dequantize(&bytes, &mut a).unwrap();
                t.dequantize_par(&bytes, &mut b).unwrap();
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{} n={n}",
                    t.name()
                );
            }
        }
    }
}
