//! KV-cache sizing: how many pages fit in the device memory this worker may use.
//!
//! Follows vLLM's `gpu_memory_utilization` contract: the instance may use
//! `total * gpu_memory_utilization` bytes in all (weights + activations + KV cache), and that
//! much must be free when the worker starts.

/// Bytes of one KV page across all layers: K and V, `num_layers * block_size * num_kv_heads *
/// head_dim` elements each, of `dtype_bytes` bytes (2 for bf16), in the layout of
/// `baton_rope_and_cache` in `kernels/rope.cu`. `None` on overflow.
pub fn kv_bytes_per_block(
    num_layers: usize,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype_bytes: usize,
) -> Option<usize> {
    2usize
        .checked_mul(num_layers)?
        .checked_mul(block_size)?
        .checked_mul(num_kv_heads)?
        .checked_mul(head_dim)?
        .checked_mul(dtype_bytes)
}

/// Why the KV cache cannot be sized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvSizingError {
    /// `gpu_memory_utilization` is not in `(0, 1]`.
    #[error("gpu_memory_utilization must be in (0, 1], got {0}")]
    InvalidUtilization(f64),
    /// `bytes_per_block` is 0.
    #[error("bytes per KV block must be positive")]
    ZeroBlockBytes,
    /// Other processes already use more than this instance's share allows.
    #[error(
        "free device memory {free_gib:.2} GiB is less than the requested \
         {budget_gib:.2} GiB (gpu_memory_utilization {utilization} of {total_gib:.2} GiB); \
         other processes use the rest: lower gpu_memory_utilization or free the device"
    )]
    InsufficientFree {
        /// Free memory at startup, GiB.
        free_gib: f64,
        /// `total * utilization`, GiB.
        budget_gib: f64,
        /// Device total, GiB.
        total_gib: f64,
        /// The utilization asked for.
        utilization: f64,
    },
    /// Weights plus activation reserve leave no room for even one KV block.
    #[error(
        "no room for the KV cache: budget {budget_gib:.2} GiB - weights {weights_gib:.2} GiB \
         - activations {activations_gib:.2} GiB leaves less than one block ({block_bytes} bytes)"
    )]
    NoRoomForKv {
        /// `total * utilization`, GiB.
        budget_gib: f64,
        /// Weight bytes, GiB.
        weights_gib: f64,
        /// Activation reserve, GiB.
        activations_gib: f64,
        /// Bytes of one block.
        block_bytes: usize,
    },
}

const GIB: f64 = (1u64 << 30) as f64;

/// Number of KV blocks (pages) to allocate.
///
/// Inputs, all in bytes: `free_bytes` and `total_bytes` as reported by `cuMemGetInfo` at worker
/// start, measured **before** loading weights; `weight_bytes` the weights the worker will load;
/// `bytes_per_block` from [`kv_bytes_per_block`]; `activation_reserve` the peak of activations,
/// workspaces and CUDA graphs (measured by a profiling run or estimated).
///
/// `budget = floor(total * gpu_memory_utilization)`; blocks =
/// `(budget - weight_bytes - activation_reserve) / bytes_per_block`.
///
/// Errors: [`KvSizingError::InvalidUtilization`] unless `0 < utilization <= 1`;
/// [`KvSizingError::ZeroBlockBytes`]; [`KvSizingError::InsufficientFree`] when `budget >
/// free_bytes`; [`KvSizingError::NoRoomForKv`] when fewer than one block fits.
pub fn kv_num_blocks(
    free_bytes: usize,
    total_bytes: usize,
    gpu_memory_utilization: f64,
    weight_bytes: usize,
    bytes_per_block: usize,
    activation_reserve: usize,
) -> Result<usize, KvSizingError> {
    if !(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0) {
        return Err(KvSizingError::InvalidUtilization(gpu_memory_utilization));
    }
    if bytes_per_block == 0 {
        return Err(KvSizingError::ZeroBlockBytes);
    }
    let budget = (total_bytes as f64 * gpu_memory_utilization).floor() as usize;
    if budget > free_bytes {
        return Err(KvSizingError::InsufficientFree {
            free_gib: free_bytes as f64 / GIB,
            budget_gib: budget as f64 / GIB,
            total_gib: total_bytes as f64 / GIB,
            utilization: gpu_memory_utilization,
        });
    }
    let blocks = budget
        .checked_sub(weight_bytes)
        .and_then(|b| b.checked_sub(activation_reserve))
        .map_or(0, |kv| kv / bytes_per_block);
    if blocks == 0 {
        return Err(KvSizingError::NoRoomForKv {
            budget_gib: budget as f64 / GIB,
            weights_gib: weight_bytes as f64 / GIB,
            activations_gib: activation_reserve as f64 / GIB,
            block_bytes: bytes_per_block,
        });
    }
    Ok(blocks)
}

/// Shape numbers the HBM floor needs (a subset of the model config, so this stays host-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Residual width.
    pub hidden: usize,
    /// MLP inner width.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// The mixture-of-experts layers, `None` for a dense model.
    pub moe: Option<MoeShape>,
}

/// Shape numbers of a model's mixture-of-experts layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Layers whose MLP is the mixture (the others are dense, of `intermediate`).
    pub sparse_layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's MLP inner width.
    pub expert_intermediate: usize,
    /// The shared expert's inner width, 0 for none.
    pub shared_intermediate: usize,
}

impl ModelShape {
    /// Elements of every weight a decode step of `batch` sequences reads in full: per layer
    /// the fused QKV, O, gate/up and down projections and two norms; the final norm and the
    /// LM head. A mixture-of-experts layer reads its router, the shared expert, and at least
    /// `min(experts, batch * top_k)` experts (each token's own; fewer distinct ones only when
    /// tokens share experts, so this is a floor). The embedding table is not counted (a step
    /// reads one row per token). Tied embeddings still read `vocab x hidden` for the head, so
    /// the count does not depend on tying.
    pub fn weight_elems_read_per_step(&self, batch: usize) -> usize {
        self.weight_elems(|m| m.experts.min(batch.max(1) * m.top_k))
    }

    /// Elements of every weight held on the device: every layer's, every expert's and the
    /// embedding table (a tied LM head is uploaded as its own copy, so always
    /// `2 x vocab x hidden`).
    pub fn weight_elems_resident(&self) -> usize {
        self.weight_elems(|m| m.experts) + self.vocab * self.hidden
    }

    /// The weights but the embedding table, with `experts(moe)` experts per sparse layer.
    fn weight_elems(&self, experts: impl Fn(&MoeShape) -> usize) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let attention = (q + 2 * kv) * h + h * q + 2 * h;
        let dense_mlp = 3 * i * h;
        let mlps = match &self.moe {
            None => self.layers * dense_mlp,
            Some(m) => {
                let shared = if m.shared_intermediate > 0 {
                    3 * m.shared_intermediate * h + h
                } else {
                    0
                };
                let sparse = m.experts * h + experts(m) * 3 * m.expert_intermediate * h + shared;
                m.sparse_layers * sparse + (self.layers - m.sparse_layers) * dense_mlp
            }
        };
        self.layers * attention + mlps + h + self.vocab * h
    }

    /// KV bytes one decode step reads for `batch` sequences of context `ctx` each (K and V,
    /// every layer), at `dtype_bytes` per element.
    pub fn kv_bytes_read(&self, batch: usize, ctx: usize, dtype_bytes: usize) -> usize {
        2 * self.layers * batch * ctx * self.kv_heads * self.head_dim * dtype_bytes
    }
}

/// The memory floor of one decode step: the bytes it must read from HBM (weights read in full,
/// `weight_bytes` per weight, fractional for quantized blocks, plus the KV of every sequence,
/// `kv_bytes` per element), in
/// seconds at `bandwidth` bytes/s. Compute, activations and launch gaps are ignored, so a
/// measured step time divided by this is >= 1 on a real device.
pub fn decode_floor_seconds(
    shape: &ModelShape,
    weight_bytes: f64,
    kv_bytes: usize,
    batch: usize,
    ctx: usize,
    bandwidth: f64,
) -> f64 {
    let bytes = shape.weight_elems_read_per_step(batch) as f64 * weight_bytes
        + shape.kv_bytes_read(batch, ctx, kv_bytes) as f64;
    bytes / bandwidth.max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3_8b() -> ModelShape {
        ModelShape {
            hidden: 4096,
            intermediate: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128256,
            moe: None,
        }
    }

    #[test]
    fn weight_accounting_matches_llama3_8b_parameter_count() {
        let s = llama3_8b();
        // Llama-3-8B has 8,030,261,248 parameters (untied head included).
        assert_eq!(s.weight_elems_resident(), 8_030_261_248);
        assert_eq!(
            s.weight_elems_read_per_step(1),
            8_030_261_248 - 128256 * 4096
        );
        // 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes = 128 KiB per token.
        assert_eq!(s.kv_bytes_read(1, 1, 2), 131072);
    }

    #[test]
    fn decode_floor_is_bytes_over_bandwidth() {
        let s = llama3_8b();
        let bw = 4.1e12;
        let t = decode_floor_seconds(&s, 2.0, 2, 1, 256, bw);
        let bytes = s.weight_elems_read_per_step(1) * 2 + 256 * 131072;
        assert!((t - bytes as f64 / bw).abs() < 1e-12);
        // About 3.7 ms for 8B in bf16 at 4.1 TB/s.
        assert!((0.0036..0.0038).contains(&t), "{t}");
        assert!(decode_floor_seconds(&s, 2.0, 2, 32, 256, bw) > t);
        // The CPU backend: 2-byte weights, an f32 cache.
        let cpu = decode_floor_seconds(&s, 2.0, 4, 1, 256, bw);
        assert!((cpu - (bytes + 256 * 131072) as f64 / bw).abs() < 1e-12);
    }

    /// Mixtral-8x7B: 46,702,792,704 parameters; a decode step of one token reads two of the
    /// eight experts per layer, of 32 tokens all eight.
    #[test]
    fn mixture_of_experts_steps_read_the_chosen_experts() {
        let mixtral = ModelShape {
            vocab: 32000,
            moe: Some(MoeShape {
                sparse_layers: 32,
                experts: 8,
                top_k: 2,
                expert_intermediate: 14336,
                shared_intermediate: 0,
            }),
            ..llama3_8b()
        };
        assert_eq!(mixtral.weight_elems_resident(), 46_702_792_704);
        let expert = 3 * 14336 * 4096;
        let all = mixtral.weight_elems_resident() - 32000 * 4096;
        assert_eq!(mixtral.weight_elems_read_per_step(1), all - 32 * 6 * expert);
        assert_eq!(mixtral.weight_elems_read_per_step(3), all - 32 * 2 * expert);
        assert_eq!(mixtral.weight_elems_read_per_step(32), all);
    }

    const GB: usize = 1 << 30;

    #[test]
    fn llama3_8b_on_h200_fits_the_expected_block_count() {
        // Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks: 2 MiB/block.
        let per_block = kv_bytes_per_block(32, 16, 8, 128, 2).unwrap();
        assert_eq!(per_block, 2 << 20);
        let total = 141 * GB;
        let blocks = kv_num_blocks(140 * GB, total, 0.9, 16 * GB, per_block, 4 * GB).unwrap();
        let budget = (total as f64 * 0.9).floor() as usize;
        assert_eq!(blocks, (budget - 20 * GB) / per_block);
        // The result really fits: weights + activations + KV <= budget.
        assert!(16 * GB + 4 * GB + blocks * per_block <= budget);
        assert!(16 * GB + 4 * GB + (blocks + 1) * per_block > budget);
    }

    #[test]
    fn rejects_bad_utilization_and_zero_block_bytes() {
        for u in [0.0, -0.1, 1.01, f64::NAN] {
            assert!(matches!(
                kv_num_blocks(GB, GB, u, 0, 1, 0),
                Err(KvSizingError::InvalidUtilization(_))
            ));
        }
        assert_eq!(
            kv_num_blocks(GB, GB, 0.5, 0, 0, 0),
            Err(KvSizingError::ZeroBlockBytes)
        );
        assert_eq!(kv_num_blocks(GB, GB, 1.0, 0, GB, 0), Ok(1));
    }

    #[test]
    fn rejects_budget_above_free_memory() {
        let e = kv_num_blocks(50 * GB, 100 * GB, 0.9, GB, 1 << 20, GB).unwrap_err();
        assert!(matches!(e, KvSizingError::InsufficientFree { .. }));
        assert!(
            e.to_string().contains("lower gpu_memory_utilization"),
            "{e}"
        );
    }

    #[test]
    fn rejects_when_weights_and_activations_leave_no_block() {
        let e = kv_num_blocks(100 * GB, 100 * GB, 0.5, 49 * GB, 2 * GB, GB).unwrap_err();
        assert!(matches!(e, KvSizingError::NoRoomForKv { .. }));
        let e = kv_num_blocks(100 * GB, 100 * GB, 0.5, 60 * GB, 1, 0).unwrap_err();
        assert!(matches!(e, KvSizingError::NoRoomForKv { .. }));
        // Exactly one block left.
        assert_eq!(
            kv_num_blocks(100 * GB, 100 * GB, 0.5, 47 * GB, 2 * GB, GB),
            Ok(1)
        );
    }

    #[test]
    fn bytes_per_block_overflow_is_none() {
        assert_eq!(kv_bytes_per_block(usize::MAX, 2, 1, 1, 1), None);
    }
}
