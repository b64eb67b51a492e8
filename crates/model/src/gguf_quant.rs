//! ggml's tensor types as GGUF stores them, and their dequantization to f32.
//!
//! Block layouts and formulas follow ggml's reference (scalar) implementation,
//! `ggml/src/ggml-quants.c` (`dequantize_row_*`) and the block structs of
//! `ggml/src/ggml-common.h`, <https://github.com/ggml-org/llama.cpp>.
//! Baton has no quantized matrix multiply: [`crate::WeightSource`] dequantizes a GGUF file's
//! quantized tensors at load into the model's 16-bit dtype, as it does FP8 checkpoints.

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
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
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
    pub const ALL: [GgmlType; 13] = [
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
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                256
            }
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
        }
    }

    /// Bytes of a row of `n` elements (`ggml_row_size`); `None` when `n` is not a whole
    /// number of blocks or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if n % self.block_size() != 0 {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
}
