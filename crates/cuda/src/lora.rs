//! LoRA adapters on the device (`kernels/lora.cu`): the adapters' `A` and `B` matrices in the
//! worker's element type, the part tables the kernels read, and the per-step buffers.
//!
//! Layout (`LoraDevice`): one allocation holds every adapter's matrices, adapter by adapter,
//! layer by layer, linear kind by kind ([`LoraLinear`]), part by part: `A` `[rank, k]` then
//! `B` `[n, rank]` (the scaling folded in), row-major, each at a 16-byte aligned offset. A
//! second allocation is the part table, [`DeviceLoraPart`] entries indexed
//! `((adapter * layers + layer) * LORA_LINEARS + kind) * LORA_MAX_PARTS + slot`: a linear
//! layer's used slots first, by ascending output offset (the CPU's order), the rest zero
//! (rank 0). Per step: the tokens' adapter ids (`[max_tokens]` u32, uploaded from a pinned
//! buffer per fence frame) and the shrink's output `v` (`[max_tokens, LORA_MAX_PARTS,
//! max_rank]` f32).
//!
//! A partial-RoPE model with a RoPE attention factor has the rotated dims' q rows of its
//! q/k/v weights scaled at upload (`executor::rotated_q_scale`); the same rows of the
//! adapters' `B` are scaled here, so `W x + B A x` keeps its meaning.

use crate::device::{Buf, Device, Pinned, FENCE_FRAMES};
use crate::executor::{rotated_q_scale, to_device_bytes, CudaWorkerError};
use crate::kernels::Dtype;
use baton_model::lora::{LoraLinear, LORA_LINEARS};
use baton_model::{LoraAdapter, ModelConfig};
use std::sync::Arc;

/// Part slots per linear layer (`BATON_LORA_MAX_PARTS` in `kernels/lora.cu`): q, k, v and a
/// fused `qkv_proj` at most.
pub const LORA_MAX_PARTS: usize = 4;

/// The largest rank the kernels take (`BATON_LORA_MAX_RANK`, the shrink's shared staging):
/// [`baton_model::lora::MAX_LORA_RANK`].
pub const LORA_MAX_RANK: usize = 512;

/// Warps (rank rows) per `baton_lora_shrink` block (`BATON_LORA_SHRINK_WARPS`).
pub const LORA_SHRINK_WARPS: usize = 4;

/// Output columns per `baton_lora_expand` block (`BATON_LORA_COLS`).
pub const LORA_COLS: usize = 1024;

/// Threads per `baton_lora_expand` block.
pub const LORA_EXPAND_BLOCK: u32 = 256;

/// One part slot as the kernels read it (`BatonLoraPart` in `kernels/lora.cu`, 32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DeviceLoraPart {
    /// Device address of `A`, `[rank, k]` elements.
    pub a: u64,
    /// Device address of `B`, `[n, rank]` elements.
    pub b: u64,
    /// First output column of the fused layer the part updates.
    pub out_offset: i32,
    /// Rank; 0 marks an empty slot.
    pub rank: i32,
    /// Input width.
    pub k: i32,
    /// Output columns.
    pub n: i32,
}

/// `(input width, fused output width)` of each [`LoraLinear`] of `cfg`'s dense layers.
pub fn linear_widths(cfg: &ModelConfig) -> [(usize, usize); LORA_LINEARS] {
    let q_w = cfg.num_attention_heads * cfg.head_dim;
    let kv_w = cfg.num_key_value_heads * cfg.head_dim;
    let (h, im) = (cfg.hidden_size, cfg.intermediate_size);
    [(h, q_w + 2 * kv_w), (q_w, h), (h, 2 * im), (im, h)]
}

const KIND_NAMES: [&str; LORA_LINEARS] = ["q/k/v", "o", "gate/up", "down"];

/// Checks that `adapters` fit a model of config `cfg` and the kernels' limits: the layer
/// count, each part's input width, output range and matrix sizes, its rank (at most
/// [`LORA_MAX_RANK`]), at most [`LORA_MAX_PARTS`] parts per linear layer, and no part of a
/// mixture-of-experts MLP.
///
/// # Errors
/// A message naming the adapter, and the layer and part at fault.
pub fn check_adapters(cfg: &ModelConfig, adapters: &[LoraAdapter]) -> Result<(), String> {
    let widths = linear_widths(cfg);
    for (ai, ad) in adapters.iter().enumerate() {
        let name = format!(
            "LoRA adapter {} ({:?}, {})",
            ai + 1,
            ad.name,
            ad.path.display()
        );
        if ad.layers.len() != cfg.num_hidden_layers {
            return Err(format!(
                "{name} has {} layers but the model has {}: an adapter for another model",
                ad.layers.len(),
                cfg.num_hidden_layers
            ));
        }
        for (li, kinds) in ad.layers.iter().enumerate() {
            for (kind, parts) in kinds.iter().enumerate() {
                let what = format!("{name}, layer {li}, {}", KIND_NAMES[kind]);
                if parts.is_empty() {
                    continue;
                }
                if kind >= LoraLinear::GateUp as usize && cfg.layer_is_moe(li) {
                    return Err(format!(
                        "{what}: the layer's MLP is a mixture of experts (not served)"
                    ));
                }
                if parts.len() > LORA_MAX_PARTS {
                    return Err(format!(
                        "{what}: {} parts, more than the {LORA_MAX_PARTS} the CUDA kernels take",
                        parts.len()
                    ));
                }
                let (k, n) = widths[kind];
                for p in parts {
                    if p.rank == 0 || p.rank > LORA_MAX_RANK {
                        return Err(format!(
                            "{what}: rank {} (the CUDA kernels take 1 to {LORA_MAX_RANK})",
                            p.rank
                        ));
                    }
                    if p.k != k || p.out_offset + p.n > n || p.n == 0 {
                        return Err(format!(
                            "{what}: a part of input width {} updating columns {}..{} does \
                             not fit the layer's {k} inputs and {n} outputs: an adapter for \
                             another model",
                            p.k,
                            p.out_offset,
                            p.out_offset + p.n
                        ));
                    }
                    if p.a.len() != p.rank * p.k || p.b.len() != p.n * p.rank {
                        return Err(format!(
                            "{what}: A holds {} values and B {}, not rank {} x {} and {} x rank",
                            p.a.len(),
                            p.b.len(),
                            p.rank,
                            p.k,
                            p.n
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn align16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

/// Bytes of the adapters' matrices in `dtype` (each matrix 16-byte aligned).
pub fn weight_bytes(adapters: &[LoraAdapter], dtype: Dtype) -> usize {
    let es = dtype.size();
    adapters
        .iter()
        .flat_map(|a| a.layers.iter().flatten().flatten())
        .map(|p| align16(p.a.len() * es) + align16(p.b.len() * es))
        .sum()
}

/// The adapters on the device; see the module docs.
pub(crate) struct LoraDevice {
    /// Adapters loaded (ids `1..=count`).
    pub(crate) count: usize,
    /// The largest rank: `v`'s innermost stride.
    pub(crate) max_rank: usize,
    /// Part slots per adapter (`layers * LORA_LINEARS * LORA_MAX_PARTS`).
    pub(crate) adapter_stride: usize,
    /// Per layer and kind: whether some adapter updates it (no launch otherwise).
    pub(crate) updates: Vec<[bool; LORA_LINEARS]>,
    /// Keeps the matrices alive (the table points into it).
    _weights: Buf,
    /// The part table.
    pub(crate) table: Buf,
    /// `[max_tokens]` u32: the step's adapter id per token.
    pub(crate) tok: Buf,
    /// `[max_tokens, LORA_MAX_PARTS, max_rank]` f32: the shrink's output.
    pub(crate) v: Buf,
    /// Per fence frame, `[max_tokens]` u32 pinned: the ids a launch uploads.
    pub(crate) host: Vec<Pinned>,
    /// Device bytes of all of the above.
    pub(crate) device_bytes: usize,
}

impl LoraDevice {
    /// Uploads `adapters` (checked with [`check_adapters`] first) for steps of at most
    /// `max_tokens` tokens, after checking that everything fits the device's free memory.
    ///
    /// # Errors
    /// [`CudaWorkerError::Unsupported`] with the reason for adapters that do not fit the model
    /// or the kernels, or that need more device memory than is free; device errors.
    pub(crate) fn new(
        dev: &Arc<dyn Device>,
        cfg: &ModelConfig,
        dtype: Dtype,
        max_tokens: usize,
        adapters: &[LoraAdapter],
    ) -> Result<Self, CudaWorkerError> {
        check_adapters(cfg, adapters).map_err(CudaWorkerError::Unsupported)?;
        let layers = cfg.num_hidden_layers;
        let max_rank = adapters
            .iter()
            .map(|a| a.max_rank)
            .max()
            .unwrap_or(1)
            .max(1);
        let adapter_stride = layers * LORA_LINEARS * LORA_MAX_PARTS;
        let table_bytes = adapters.len() * adapter_stride * std::mem::size_of::<DeviceLoraPart>();
        let wbytes = weight_bytes(adapters, dtype);
        let tok_bytes = 4 * max_tokens.max(1);
        let v_bytes = 4 * max_tokens.max(1) * LORA_MAX_PARTS * max_rank;
        let device_bytes = wbytes + table_bytes + tok_bytes + v_bytes;
        let (free, _) = dev.mem_info()?;
        if device_bytes > free {
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            return Err(CudaWorkerError::Unsupported(format!(
                "{} LoRA adapters need {:.1} MiB of device memory ({:.1} MiB of {} weights, \
                 {:.1} MiB for the per-step buffers of {max_tokens} tokens at rank {max_rank}) \
                 but {:.1} MiB are free after the KV cache: lower --gpu-memory-utilization, \
                 --max-lora-rank or the number of adapters",
                adapters.len(),
                mib(device_bytes),
                mib(wbytes),
                dtype.name(),
                mib(tok_bytes + v_bytes + table_bytes),
                mib(free)
            )));
        }
        let weights = Buf::new(dev, wbytes)?;
        let scale = rotated_q_scale(cfg);
        let q_w = cfg.num_attention_heads * cfg.head_dim;
        let (d, rot) = (cfg.head_dim, cfg.rotary_dim);
        // Whether fused q/k/v output column `c` is a rotated dim's q row.
        let rotated_q = |c: usize| {
            let rr = c % d;
            c < q_w && (rr < rot / 2 || (rr >= d / 2 && rr < d / 2 + rot / 2))
        };
        let es = dtype.size();
        let mut table = vec![DeviceLoraPart::default(); adapters.len() * adapter_stride];
        let mut updates = vec![[false; LORA_LINEARS]; layers];
        let mut at = 0usize;
        for (ai, ad) in adapters.iter().enumerate() {
            // One host staging buffer per adapter.
            let start = at;
            let mut bytes: Vec<u8> = Vec::new();
            for (li, kinds) in ad.layers.iter().enumerate() {
                for (kind, parts) in kinds.iter().enumerate() {
                    let mut parts: Vec<_> = parts.iter().collect();
                    parts.sort_by_key(|p| p.out_offset);
                    for (slot, p) in parts.into_iter().enumerate() {
                        updates[li][kind] = true;
                        let a_at = at;
                        let a = to_device_bytes(&p.a, dtype);
                        bytes.extend_from_slice(&a);
                        bytes.resize(bytes.len() + align16(a.len()) - a.len(), 0);
                        at += align16(p.a.len() * es);
                        let b_at = at;
                        let b = match scale {
                            Some(f) if kind == LoraLinear::Qkv as usize => {
                                let mut b = p.b.clone();
                                for (j, row) in b.chunks_exact_mut(p.rank).enumerate() {
                                    if rotated_q(p.out_offset + j) {
                                        row.iter_mut().for_each(|x| *x *= f);
                                    }
                                }
                                to_device_bytes(&b, dtype)
                            }
                            _ => to_device_bytes(&p.b, dtype),
                        };
                        bytes.extend_from_slice(&b);
                        bytes.resize(bytes.len() + align16(b.len()) - b.len(), 0);
                        at += align16(p.b.len() * es);
                        let i = ((ai * layers + li) * LORA_LINEARS + kind) * LORA_MAX_PARTS + slot;
                        let int = |v: usize| v as i32;
                        table[i] = DeviceLoraPart {
                            a: weights.at(a_at),
                            b: weights.at(b_at),
                            out_offset: int(p.out_offset),
                            rank: int(p.rank),
                            k: int(p.k),
                            n: int(p.n),
                        };
                    }
                }
            }
            debug_assert_eq!(bytes.len(), at - start);
            // SAFETY: `start + bytes.len() = at <= wbytes`, the allocation's size (the same
            // sums as `weight_bytes`).
            unsafe { dev.copy_htod(weights.at(start), &bytes) }?;
        }
        let table_buf = Buf::new(dev, table_bytes)?;
        // SAFETY: the table allocation holds exactly `table_bytes` bytes.
        unsafe { dev.copy_htod(table_buf.ptr, bytemuck::cast_slice(&table)) }?;
        let host = (0..FENCE_FRAMES)
            .map(|_| Pinned::new(dev, tok_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LoraDevice {
            count: adapters.len(),
            max_rank,
            adapter_stride,
            updates,
            _weights: weights,
            table: table_buf,
            tok: Buf::new(dev, tok_bytes)?,
            v: Buf::new(dev, v_bytes)?,
            host,
            device_bytes,
        })
    }

    /// The device address of the first slot of `kind` of layer `li` for adapter 1.
    pub(crate) fn slots(&self, li: usize, kind: LoraLinear) -> u64 {
        let i = (li * LORA_LINEARS + kind as usize) * LORA_MAX_PARTS;
        self.table.at(i * std::mem::size_of::<DeviceLoraPart>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_model::lora::LoraPart;
    use std::path::PathBuf;

    fn cfg() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
            "hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "max_position_embeddings":64}"#,
        )
        .unwrap()
    }

    fn part(out_offset: usize, rank: usize, k: usize, n: usize) -> LoraPart {
        LoraPart {
            out_offset,
            rank,
            k,
            n,
            a: vec![0.5; rank * k],
            b: vec![0.25; n * rank],
        }
    }

    fn adapter(layers: usize, parts: Vec<(LoraLinear, LoraPart)>) -> LoraAdapter {
        let mut l: Vec<[Vec<LoraPart>; LORA_LINEARS]> =
            (0..layers).map(|_| Default::default()).collect();
        let mut max_rank = 0;
        for (kind, p) in parts {
            max_rank = max_rank.max(p.rank);
            l[0][kind as usize].push(p);
        }
        LoraAdapter {
            name: "t".into(),
            path: PathBuf::from("/t"),
            max_rank,
            layers: l,
        }
    }

    #[test]
    fn the_part_table_entry_is_the_kernels_32_byte_struct() {
        assert_eq!(std::mem::size_of::<DeviceLoraPart>(), 32);
        assert_eq!(std::mem::align_of::<DeviceLoraPart>(), 8);
        let src = crate::kernels::kernel_sources()
            .iter()
            .find(|(f, _)| *f == "lora.cu")
            .unwrap()
            .1;
        for (name, v) in [
            ("BATON_LORA_MAX_PARTS", LORA_MAX_PARTS),
            ("BATON_LORA_MAX_RANK", LORA_MAX_RANK),
            ("BATON_LORA_SHRINK_WARPS", LORA_SHRINK_WARPS),
            ("BATON_LORA_COLS", LORA_COLS),
        ] {
            assert!(
                src.contains(&format!("#define {name} {v}\n")),
                "{name} is not {v} in lora.cu"
            );
        }
        assert_eq!(LORA_MAX_RANK, baton_model::lora::MAX_LORA_RANK);
    }

    #[test]
    fn adapters_that_do_not_fit_the_model_or_the_kernels_are_refused() {
        let c = cfg();
        // q/k/v: 64 -> 64 + 2 * 32; o: 64 -> 64; gate/up 64 -> 192; down 96 -> 64.
        let good = adapter(
            2,
            vec![
                (LoraLinear::Qkv, part(0, 4, 64, 64)),
                (LoraLinear::Qkv, part(96, 4, 64, 32)),
                (LoraLinear::Down, part(0, 8, 96, 64)),
            ],
        );
        check_adapters(&c, std::slice::from_ref(&good)).unwrap();
        // bf16: A and B of each part, 16-byte aligned.
        assert_eq!(
            weight_bytes(&[good], Dtype::Bf16),
            512 + 512 + 512 + 256 + 1536 + 1024
        );
        let cases = [
            (adapter(3, vec![]), "3 layers"),
            (
                adapter(2, vec![(LoraLinear::O, part(0, 4, 32, 64))]),
                "another model",
            ),
            (
                adapter(2, vec![(LoraLinear::Qkv, part(100, 4, 64, 32))]),
                "another model",
            ),
            (
                adapter(2, vec![(LoraLinear::Down, part(0, 513, 96, 64))]),
                "rank 513",
            ),
            (
                adapter(
                    2,
                    (0..5)
                        .map(|_| (LoraLinear::Qkv, part(0, 2, 64, 8)))
                        .collect(),
                ),
                "5 parts",
            ),
        ];
        for (a, want) in cases {
            let e = check_adapters(&c, &[a]).unwrap_err();
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
        let mut short = adapter(2, vec![(LoraLinear::O, part(0, 4, 64, 64))]);
        short.layers[0][LoraLinear::O as usize][0].a.pop();
        assert!(check_adapters(&c, &[short])
            .unwrap_err()
            .contains("A holds 255"));
    }
}
