//! FP8 weight checkpoints: config.json's `quantization_config` and the dequantization of
//! float8 weights at load.
//!
//! Two checkpoint layouts store a linear layer's weight `W` (`[out, in]`) as float8 values
//! `Q` with f32, bf16 or f16 scales `S`, and both mean `W = Q * S` (each float8 value times
//! the scale of its tensor, output row or block):
//!
//! - `quant_method: "fp8"` (vLLM's `Fp8Config`, transformers' `FineGrainedFP8Config`):
//!   with `weight_block_size: [bn, bk]` each weight has a `weight_scale_inv` of shape
//!   `[ceil(out / bn), ceil(in / bk)]` (DeepSeek-V3, Qwen3-*-FP8; DeepSeek's reference
//!   `weight_dequant` multiplies by it despite the name); without it a `weight_scale` holding
//!   one value (AutoFP8's per-tensor checkpoints).
//! - `quant_method: "compressed-tensors"` (llm-compressor's `float-quantized` or
//!   `naive-quantized` formats, e.g. RedHatAI's `*-FP8` and `*-FP8-dynamic` models): every
//!   `config_groups` entry quantizes weights to `num_bits: 8`, `type: "float"` with the
//!   `strategy` `tensor` (`weight_scale` of one value), `channel` (`[out, 1]`) or `block`
//!   (`block_structure: [bn, bk]`, `[ceil(out / bn), ceil(in / bk)]`).
//!
//! Baton has no FP8 matrix multiply yet: [`crate::WeightSource::open_for`] dequantizes each
//! float8 weight once, at load, to the model's 16-bit dtype (`torch_dtype` bfloat16 or
//! float16; f32 for any other or none), so the model runs as that dtype's checkpoint would,
//! at its memory cost. Static activation scales (`input_scale`) and KV-cache scales
//! (`k_scale`, `v_scale`) are not used: activations and the KV cache stay in the serving
//! dtype. Other methods (GPTQ, AWQ, bitsandbytes, int8 or int4 compressed-tensors, MXFP4,
//! ...) are refused when config.json is read.

use serde_json::Value;

use crate::config::Fields;
use crate::error::ModelError;

/// How a checkpoint's float8 weights are scaled, from config.json's `quantization_config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Quant {
    /// `quant_method`: `"fp8"` or `"compressed-tensors"`.
    pub method: String,
    /// `[bn, bk]`: rows and columns of the weight each scale of a block-scaled weight covers
    /// (`weight_block_size` or `block_structure`); `None` when the config names no blocks
    /// (then every scale is per tensor or per output row, told apart by its shape).
    pub block: Option<[usize; 2]>,
}

/// Scale-tensor name suffixes of an FP8 checkpoint that the dequantized model reads only
/// through its weights (`weight_scale`, `weight_scale_inv`) or never (static activation and
/// KV-cache scales): the unused-tensor check passes them when the config declares FP8.
pub const FP8_SCALE_SUFFIXES: &[&str] = &[
    ".weight_scale",
    ".weight_scale_inv",
    ".input_scale",
    ".k_scale",
    ".v_scale",
    ".kv_scale",
    ".q_scale",
    ".prob_scale",
];

/// Parses config.json's `quantization_config` (`None` when absent or null).
///
/// # Errors
/// [`ModelError::InvalidField`] naming `quantization_config.*` for a method other than FP8
/// (`quant_method` not `fp8` or `compressed-tensors`; a compressed-tensors group whose weights
/// are not 8-bit floats, or a sparsity format), for a float8 format other than e4m3, and for
/// a malformed block size.
pub(crate) fn parse(f: &Fields<'_>) -> Result<Option<Fp8Quant>, ModelError> {
    let Some(q) = f.sub("quantization_config", "quantization_config.")? else {
        return Ok(None);
    };
    let method = q
        .opt_str("quant_method")?
        .ok_or_else(|| q.missing("quant_method"))?;
    let block = match method {
        "fp8" => {
            if let Some(fmt) = q.opt_str("fmt")? {
                if !fmt.eq_ignore_ascii_case("e4m3") {
                    return Err(q.invalid(
                        "fmt",
                        format!("float8 format {fmt:?} is not supported; supported: e4m3"),
                    ));
                }
            }
            block_size(&q, "weight_block_size", q.get("weight_block_size"))?
        }
        "compressed-tensors" => compressed_tensors(&q)?,
        other => {
            return Err(q.invalid(
                "quant_method",
                format!(
                    "quantization method {other:?} is not supported; Baton loads FP8 checkpoints \
                     (quant_method \"fp8\", or \"compressed-tensors\" with 8-bit float weights) \
                     and unquantized F32, F16 and BF16 ones"
                ),
            ))
        }
    };
    Ok(Some(Fp8Quant {
        method: method.to_owned(),
        block,
    }))
}

/// The block size of a compressed-tensors config whose every group quantizes weights to
/// 8-bit floats; `None` when no group uses blocks.
fn compressed_tensors(q: &Fields<'_>) -> Result<Option<[usize; 2]>, ModelError> {
    if let Some(fmt) = q.opt_str("format")? {
        if !matches!(fmt, "float-quantized" | "naive-quantized") {
            return Err(q.invalid(
                "format",
                format!(
                    "compressed-tensors format {fmt:?} is not supported; supported: \
                     float-quantized and naive-quantized with 8-bit float weights (FP8)"
                ),
            ));
        }
    }
    if let Some(s) = q.get("sparsity_config") {
        let dense = s
            .get("format")
            .and_then(Value::as_str)
            .is_none_or(|f| f == "dense");
        if !dense {
            return Err(q.invalid(
                "sparsity_config",
                "sparse (compressed) weights are not supported; supported: dense FP8 weights",
            ));
        }
    }
    let groups = match q.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        Some(_) => return Err(q.invalid("config_groups", "expected a non-empty object")),
        None => return Err(q.missing("config_groups")),
    };
    let mut block = None;
    for (name, group) in groups {
        let field = format!("config_groups.{name}.weights");
        let Some(w) = group.get("weights").filter(|w| !w.is_null()) else {
            return Err(q.invalid(&field, "missing: every group must quantize weights"));
        };
        let num_bits = w.get("num_bits").and_then(Value::as_u64);
        let kind = w.get("type").and_then(Value::as_str);
        if num_bits != Some(8) || kind != Some("float") {
            return Err(q.invalid(
                &field,
                format!(
                    "weights of {} bits of type {} are not supported; supported: 8-bit float \
                     (FP8) weights",
                    num_bits.map_or("unknown".to_owned(), |b| b.to_string()),
                    kind.unwrap_or("unknown"),
                ),
            ));
        }
        match w.get("strategy").and_then(Value::as_str) {
            Some("tensor" | "channel") | None => {}
            Some("block") => {
                let b = block_size(
                    q,
                    &format!("{field}.block_structure"),
                    w.get("block_structure"),
                )?
                .ok_or_else(|| {
                    q.invalid(
                        &format!("{field}.block_structure"),
                        "missing for strategy \"block\"",
                    )
                })?;
                if block.is_some_and(|prev| prev != b) {
                    return Err(q.invalid(
                        &format!("{field}.block_structure"),
                        "groups with different block sizes are not supported",
                    ));
                }
                block = Some(b);
            }
            Some(other) => {
                return Err(q.invalid(
                    &format!("{field}.strategy"),
                    format!(
                    "weight strategy {other:?} is not supported; supported: tensor, channel, block"
                ),
                ))
            }
        }
    }
    Ok(block)
}

/// A `[rows, cols]` block size (two positive integers), `None` when absent or null.
fn block_size(
    q: &Fields<'_>,
    field: &str,
    v: Option<&Value>,
) -> Result<Option<[usize; 2]>, ModelError> {
    let v = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let dims: Option<Vec<usize>> = v.as_array().and_then(|a| {
        a.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0)
            })
            .collect()
    });
    match dims.as_deref() {
        Some(&[bn, bk]) => Ok(Some([bn, bk])),
        _ => Err(q.invalid(field, format!("expected two positive integers, found {v}"))),
    }
}

/// The float8 encodings a checkpoint may store (safetensors' `F8_E4M3` and `F8_E5M2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// OCP FP8 E4M3 in PyTorch's `float8_e4m3fn` form: 4 exponent bits (bias 7), 3 mantissa
    /// bits, no infinities, `0x7f`/`0xff` NaN; largest finite value 448.
    E4M3,
    /// OCP FP8 E5M2: IEEE-style, 5 exponent bits (bias 15), 2 mantissa bits, infinities and
    /// NaNs; the top byte of an IEEE binary16.
    E5M2,
}

impl Fp8Format {
    /// The value one stored byte encodes (exact in f32). Source: the OCP 8-bit floating point
    /// specification (OFP8) v1.0, table 1.
    pub fn to_f32(self, b: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => {
                let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
                let exp = i32::from((b >> 3) & 0x0f);
                let man = f32::from(b & 0x07);
                if exp == 0x0f && man == 7.0 {
                    f32::NAN
                } else if exp == 0 {
                    // Subnormal: 0.mmm * 2^(1 - 7).
                    sign * man / 8.0 * 2f32.powi(-6)
                } else {
                    sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
                }
            }
            Fp8Format::E5M2 => half::f16::from_bits(u16::from(b) << 8).to_f32(),
        }
    }

    /// A 256-entry table of [`Fp8Format::to_f32`], indexed by the stored byte.
    pub fn table(self) -> [f32; 256] {
        std::array::from_fn(|b| self.to_f32(b as u8))
    }
}

/// How a scale tensor of shape `scale_shape` covers a weight of shape `[rows, cols]`, given
/// the config's block size: one value for the whole tensor, one per output row, or one per
/// `[bn, bk]` block (the last blocks of a row or column may be partial).
///
/// # Errors
/// A description of the shapes that would fit, for any other shape.
pub(crate) fn scale_layout(
    rows: usize,
    cols: usize,
    scale_shape: &[usize],
    block: Option<[usize; 2]>,
) -> Result<[usize; 2], String> {
    let n: usize = scale_shape.iter().product();
    if n == 1 {
        return Ok([rows, cols]);
    }
    if let Some([bn, bk]) = block {
        if scale_shape == [rows.div_ceil(bn), cols.div_ceil(bk)] {
            return Ok([bn, bk]);
        }
    }
    if scale_shape == [rows, 1] || scale_shape == [rows] {
        return Ok([1, cols]);
    }
    let mut fits = format!("[1] (per tensor) or [{rows}, 1] (per output row)");
    if let Some([bn, bk]) = block {
        fits.push_str(&format!(
            " or [{}, {}] (per {bn}x{bk} block)",
            rows.div_ceil(bn),
            cols.div_ceil(bk)
        ));
    }
    Err(format!("expected {fits}, found {scale_shape:?}"))
}

/// Dequantizes a `[rows, cols]` float8 weight into `out` (`rows * cols` elements of `E`
/// bytes, row-major): element `(r, c)` is `encode(table[q[r * cols + c]] *
/// scales[(r / bn) * scale_cols + c / bk])`, the product in f32 (`[bn, bk]` from
/// [`scale_layout`], `scale_cols = ceil(cols / bk)`), rows in parallel (rayon). `encode`
/// returns `None` for a value the target dtype cannot hold (NaN, or past its range).
///
/// Returns such an element's `(row, column, f32 value)`, or `None` when every one encoded.
pub(crate) fn dequantize_rows<const E: usize>(
    q: &[u8],
    table: &[f32; 256],
    scales: &[f32],
    [rows, cols]: [usize; 2],
    [bn, bk]: [usize; 2],
    out: &mut [u8],
    encode: impl Fn(f32) -> Option<[u8; E]> + Sync,
) -> Option<(usize, usize, f32)> {
    use rayon::prelude::*;
    let scale_cols = cols.div_ceil(bk);
    debug_assert_eq!(q.len(), rows * cols);
    debug_assert_eq!(out.len(), rows * cols * E);
    out.par_chunks_mut((cols * E).max(1))
        .zip(q.par_chunks(cols.max(1)))
        .enumerate()
        .try_for_each(|(r, (dst, src))| {
            let srow = &scales[(r / bn) * scale_cols..];
            for (c, (&b, d)) in src.iter().zip(dst.chunks_exact_mut(E)).enumerate() {
                let x = table[b as usize] * srow[c / bk];
                d.copy_from_slice(&encode(x).ok_or((r, c, x))?);
            }
            Ok(())
        })
        .err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_matches_the_ocp_table_anchors() {
        let t = Fp8Format::E4M3.table();
        // OFP8 v1.0 table 1 (E4M3): max normal S.1111.110 = 448, min normal S.0001.000 =
        // 2^-6, max subnormal S.0000.111 = 0.875 * 2^-6, min subnormal S.0000.001 = 2^-9.
        assert_eq!(t[0x7e], 448.0);
        assert_eq!(t[0xfe], -448.0);
        assert_eq!(t[0x08], 2f32.powi(-6));
        assert_eq!(t[0x07], 0.875 * 2f32.powi(-6));
        assert_eq!(t[0x01], 2f32.powi(-9));
        assert_eq!(t[0x38], 1.0);
        assert_eq!(t[0xc0], -2.0);
        assert_eq!(t[0x00], 0.0);
        assert!(t[0x80] == 0.0 && t[0x80].is_sign_negative());
        assert!(t[0x7f].is_nan() && t[0xff].is_nan());
        // 0x78..0x7e are finite in the fn variant (no infinities).
        assert_eq!(t[0x78], 256.0);
        // Positive codes increase strictly up to the max.
        assert!(t[..0x7f].windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn e5m2_matches_the_ocp_table_anchors() {
        let t = Fp8Format::E5M2.table();
        // OFP8 v1.0 table 1 (E5M2): max normal 57344, min normal 2^-14, min subnormal 2^-16,
        // S.11111.00 infinity.
        assert_eq!(t[0x7b], 57344.0);
        assert_eq!(t[0x04], 2f32.powi(-14));
        assert_eq!(t[0x01], 2f32.powi(-16));
        assert_eq!(t[0x3c], 1.0);
        assert_eq!(t[0x7c], f32::INFINITY);
        assert!(t[0x7d].is_nan());
    }

    #[test]
    fn scale_layouts_are_told_apart_by_shape() {
        assert_eq!(scale_layout(300, 200, &[], None), Ok([300, 200]));
        assert_eq!(
            scale_layout(300, 200, &[1], Some([128, 128])),
            Ok([300, 200])
        );
        assert_eq!(scale_layout(300, 200, &[300, 1], None), Ok([1, 200]));
        assert_eq!(scale_layout(300, 200, &[300], None), Ok([1, 200]));
        assert_eq!(
            scale_layout(300, 200, &[3, 2], Some([128, 128])),
            Ok([128, 128])
        );
        let e = scale_layout(300, 200, &[2, 2], Some([128, 128])).unwrap_err();
        assert!(e.contains("[3, 2]") && e.contains("[2, 2]"), "{e}");
        assert!(scale_layout(300, 200, &[3, 2], None).is_err());
    }

    #[test]
    fn blocks_scale_their_own_rows_and_columns_including_partial_ones() {
        // A 3x5 weight of ones (0x38) in 2x2 blocks: scales [[1, 2, 4], [8, 16, 32]].
        let q = [0x38u8; 15];
        let scales = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let mut out = vec![0u8; 15 * 4];
        let table = Fp8Format::E4M3.table();
        let bad = dequantize_rows(&q, &table, &scales, [3, 5], [2, 2], &mut out, |x| {
            Some(x.to_le_bytes())
        });
        assert_eq!(bad, None);
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        #[rustfmt::skip]
        let want = [
            1.0, 1.0, 2.0, 2.0, 4.0,
            1.0, 1.0, 2.0, 2.0, 4.0,
            8.0, 8.0, 16.0, 16.0, 32.0,
        ];
        assert_eq!(got, want);
    }
}
