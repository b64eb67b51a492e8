//! The CUDA backend (`baton_cuda::CudaWorker`, the real executor and the real kernels of
//! `kernels/`) on the host emulator (`baton_cuda_emu::EmuDevice`), running the checks that
//! `scripts/gpu-check.sh` runs on an H200 through the same `baton debug` code:
//!
//! - stories260K in f32 reproduces golden.json exactly, alone and batched, with decode graphs
//!   (captured and replayed) and eagerly;
//! - bf16 first-step logits within 2e-2 of the CPU reference;
//! - every layer's output of a GQA model with head dim 64 (the split-K decode and varlen prefill
//!   kernels) within 1e-2 (bf16) and 1e-4 (f32) of the CPU reference, over a batch mixing
//!   prefill chunks and decodes, then a decode-only batch;
//! - a seeded sampled request gives the same tokens alone and in a batch.
//!
//! What this does not cover: the cudarc/cuBLAS/NVRTC calls of `baton_cuda::CudaDevice`, real
//! GPU timing, races between GPU threads, and the GPU's own rounding of `expf` and friends.

mod common;
use baton::cuda_args::{cuda_options, CudaArgs, CudaSizes};
use baton::debug_cmd::{compare, golden, CompareArgs};
use baton::engine::LocalEngine;
use baton::generate::LoadFormatArg;
use baton_cuda::{CudaWorker, Dtype};
use baton_cuda_emu::EmuDevice;
use baton_model::{LlamaWeights, ModelConfig, ModelDir, ModelWeights};
use baton_scheduler::SchedulerConfig;
use common::*;
use std::sync::{Arc, Mutex};

/// Emulated device memory reported to KV sizing.
const EMU_MEMORY: usize = 2 << 30;

/// A worker builder on a fresh emulated device, which it also leaves in `last` (to inspect
/// launch and graph counts afterwards).
fn emu(
    dtype: Dtype,
    enforce_eager: bool,
    last: &Mutex<Option<Arc<EmuDevice>>>,
) -> impl Fn(ModelConfig, ModelWeights, CudaSizes) -> anyhow::Result<CudaWorker> + '_ {
    emu_with(
        CudaArgs {
            dtype,
            enforce_eager,
            ..CudaArgs::default()
        },
        last,
    )
}

/// [`emu`] with every CUDA flag given.
fn emu_with(
    args: CudaArgs,
    last: &Mutex<Option<Arc<EmuDevice>>>,
) -> impl Fn(ModelConfig, ModelWeights, CudaSizes) -> anyhow::Result<CudaWorker> + '_ {
    move |cfg, weights, sizes| {
        let dev = Arc::new(EmuDevice::new(args.dtype, EMU_MEMORY));
        *last.lock().unwrap() = Some(dev.clone());
        Ok(CudaWorker::with_device(
            dev,
            cfg,
            weights,
            cuda_options(&args, sizes)?,
        )?)
    }
}

fn compare_args(dtype: Dtype, tol: f64) -> CompareArgs {
    CompareArgs {
        model: None,
        config: None,
        load_format: LoadFormatArg::Auto,
        seed: 0,
        prompt_ids: Vec::new(),
        tol,
        dump: None,
        cuda: CudaArgs {
            dtype,
            ..CudaArgs::default()
        },
    }
}

/// [`compare_args`] for dummy weights of the config.json text `config` (vocabulary 1000 or
/// more), with a prompt of `prompt_len` ids `(3 + 41 p) % 1000` (none: the comparison's
/// default prompt).
fn dummy_args(config: impl Into<String>, dtype: Dtype, tol: f64, prompt_len: u32) -> CompareArgs {
    let mut a = compare_args(dtype, tol);
    a.config = Some(config.into());
    a.load_format = LoadFormatArg::Dummy;
    a.prompt_ids = (0..prompt_len).map(|p| (3 + 41 * p) % 1000).collect();
    a
}

/// A GQA Llama with head dim 64 (4 query heads, 2 KV heads), small enough to emulate.
const HD64: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":256,
    "rms_norm_eps":1e-5,"rope_theta":10000.0}"#;

#[test]
fn f32_goldens_are_exact_with_decode_graphs() {
    let last = Mutex::new(None);
    golden(&model_dir(), &emu(Dtype::F32, false, &last)).expect("f32 goldens on the emulator");
    let dev = last.lock().unwrap().take().expect("a device was built");
    assert!(dev.graphs() > 0, "no decode graph was captured");
    assert!(dev.launches() > 0);
}

/// `BATON_GEMV1_BLOCKS_PER_SM=1` (a tuning knob for GPU A/B runs): batch-of-one GEMV grids of
/// one block per SM, so each warp pipelines across twice the rows.
#[test]
fn f32_goldens_are_exact_with_one_gemv_block_per_sm() {
    let last = Mutex::new(None);
    let build = |cfg, weights, sizes| {
        let dev = Arc::new(EmuDevice::new(Dtype::F32, EMU_MEMORY));
        *last.lock().unwrap() = Some(dev.clone());
        let args = CudaArgs {
            dtype: Dtype::F32,
            ..CudaArgs::default()
        };
        let mut opts = cuda_options(&args, sizes)?;
        opts.tuning.gemv1_blocks_per_sm = 1;
        Ok(CudaWorker::with_device(dev, cfg, weights, opts)?)
    };
    golden(&model_dir(), &build).expect("f32 goldens, one GEMV block per SM");
    let dev = last.lock().unwrap().take().expect("a device was built");
    assert!(dev.graphs() > 0, "no decode graph was captured");
}

#[test]
fn f32_goldens_are_exact_eagerly_and_without_the_fused_decode_kernels() {
    for fused in [true, false] {
        let last = Mutex::new(None);
        let args = CudaArgs {
            dtype: Dtype::F32,
            enforce_eager: true,
            no_fused_decode: !fused,
            ..CudaArgs::default()
        };
        golden(&model_dir(), &emu_with(args, &last))
            .unwrap_or_else(|e| panic!("f32 goldens on the emulator (fused decode {fused}): {e}"));
        let dev = last.lock().unwrap().take().expect("a device was built");
        assert_eq!(dev.graphs(), 0, "--enforce-eager captured a graph");
    }
}

#[test]
fn bf16_first_step_logits_are_within_2e_2_of_the_cpu_reference() {
    let mut a = compare_args(Dtype::Bf16, 2e-2);
    a.model = Some(model_dir());
    let last = Mutex::new(None);
    compare(&a, false, &emu(Dtype::Bf16, true, &last)).expect("bf16 logits");
}

#[test]
fn every_layer_of_a_head_dim_64_gqa_model_matches_the_cpu_reference() {
    for (dtype, tol) in [(Dtype::Bf16, 1e-2), (Dtype::F32, 1e-4)] {
        let a = dummy_args(HD64, dtype, tol, 0);
        let last = Mutex::new(None);
        compare(&a, true, &emu(dtype, true, &last))
            .unwrap_or_else(|e| panic!("{dtype:?} layers: {e:#}"));
    }
}

/// [`HD64`] with room for long contexts.
const HD64_LONG: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":1024}"#;

/// Head dim 128 (Llama-8B's), 2 query heads sharing 1 KV head.
const HD128: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":2,
    "num_key_value_heads":1,"vocab_size":1000,"max_position_embeddings":256}"#;

/// [`HD64`] as a Phi-3 with partial RoPE (half of each head rotated; the frequency-0 pairs of
/// the permuted layout must pass through the CUDA kernels unchanged).
const HD64_PARTIAL: &str = r#"{"architectures":["Phi3ForCausalLM"],"model_type":"phi3",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":256,
    "partial_rotary_factor":0.5}"#;

/// [`HD64_PARTIAL`] with LongRoPE and a large attention factor, which the CUDA worker puts
/// into the rotated dims' q rows (the CPU into their cos and sin); the comparison serves 256
/// positions, past the original 128, so the long factors apply.
const HD64_PARTIAL_LONGROPE: &str = r#"{"architectures":["Phi3ForCausalLM"],"model_type":"phi3",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":256,
    "partial_rotary_factor":0.5,"original_max_position_embeddings":128,"rope_scaling":{"type":
    "longrope","attention_factor":1.6,"short_factor":[1.0,1.1,1.3,1.6,2.0,2.5,3.1,3.8,4.6,5.5,
    6.5,7.6,8.8,10.1,11.5,13.0],"long_factor":[1.5,1.9,2.4,3.0,3.7,4.5,5.4,6.4,7.5,8.7,10.0,
    11.4,12.9,14.5,16.2,18.0]}}"#;

#[test]
fn head_dim_128_f16_and_partial_rope_layers_match_the_cpu_reference() {
    for (config, dtype, tol) in [
        (HD128, Dtype::Bf16, 1e-2),
        (HD128, Dtype::F32, 1e-4),
        (HD64, Dtype::F16, 1e-2),
        (HD64_PARTIAL, Dtype::F32, 1e-4),
        (HD64_PARTIAL_LONGROPE, Dtype::F32, 1e-4),
        (HD64_PARTIAL_LONGROPE, Dtype::Bf16, 1e-2),
    ] {
        let a = dummy_args(config, dtype, tol, 0);
        let last = Mutex::new(None);
        compare(&a, true, &emu(dtype, true, &last))
            .unwrap_or_else(|e| panic!("{dtype:?} layers: {e:#}"));
    }
}

#[test]
fn a_530_token_prefill_and_a_decode_over_two_partitions_match_the_cpu_reference() {
    // Past 512 keys: the prefill kernel walks two chunks, the decode kernel splits into
    // partitions and the block that finishes last combines them. f32, so the tolerance is
    // tight. With the default minimum partition (64 keys) and larger ones (256: 3 partitions;
    // 1024: one block per kv head walks all 531 keys, no combine).
    let a = dummy_args(HD64_LONG, Dtype::F32, 1e-4, 530);
    for min_partition in [baton_cuda::plan::ATTN_MIN_PARTITION, 256, 1024] {
        let last = Mutex::new(None);
        let build = |cfg, weights, sizes| {
            let dev = Arc::new(EmuDevice::new(Dtype::F32, EMU_MEMORY));
            *last.lock().unwrap() = Some(dev.clone());
            let args = CudaArgs {
                dtype: Dtype::F32,
                enforce_eager: true,
                ..CudaArgs::default()
            };
            let mut opts = cuda_options(&args, sizes)?;
            opts.tuning.attn_min_partition = min_partition;
            Ok(CudaWorker::with_device(dev, cfg, weights, opts)?)
        };
        compare(&a, false, &build)
            .unwrap_or_else(|e| panic!("long context, f32, min partition {min_partition}: {e:#}"));
    }
}

/// Sliding-window models (`ModelConfig::sliding_window`) over a 530-token prompt, against the
/// CPU reference in f32: a Mistral with a 200-key window on every layer (the prefill kernel's
/// chunks and the decode kernel's partitions start at the window's first key), a Qwen2 whose
/// second layer alone slides, and head dim 8 (the generic kernel); then layer by layer in bf16.
#[test]
fn sliding_window_models_match_the_cpu_reference_past_the_window() {
    let mistral = r#"{"architectures":["MistralForCausalLM"],"model_type":"mistral",
        "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":1024,
        "sliding_window":200}"#;
    let qwen2 = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2",
        "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":1024,
        "use_sliding_window":true,"sliding_window":100,"max_window_layers":1}"#;
    let hd8 = r#"{"architectures":["MistralForCausalLM"],"model_type":"mistral",
        "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8,
        "num_key_value_heads":4,"vocab_size":1000,"max_position_embeddings":1024,
        "sliding_window":300}"#;
    for config in [mistral, qwen2, hd8] {
        let a = dummy_args(config, Dtype::F32, 1e-4, 530);
        let last = Mutex::new(None);
        compare(&a, false, &emu(Dtype::F32, true, &last))
            .unwrap_or_else(|e| panic!("{config}: {e:#}"));
    }
    // Layer by layer in bf16 (gpu-check.sh's 3f): a 100-token prompt under a 32-key window.
    let a = dummy_args(
        mistral.replace(r#""sliding_window":200"#, r#""sliding_window":32"#),
        Dtype::Bf16,
        1e-2,
        100,
    );
    let last = Mutex::new(None);
    compare(&a, true, &emu(Dtype::Bf16, true, &last)).expect("bf16 layers, sliding window");
}

/// Gemma 3 text on the CUDA worker against the CPU reference: (1 + w) norms folded at upload,
/// the output norms, GELU(tanh), the scaled embedding, query_pre_attn_scalar, local RoPE on
/// the sliding layers and linear scaling on the full one; layer by layer in f32 and bf16, a
/// 530-token prompt past the 100-key window and a decode step after it (the per-kernel path:
/// Gemma's decode steps do not take the fused GEMVs), and head dim 8 (the generic kernel).
#[test]
fn gemma3_text_layers_and_long_prompts_match_the_cpu_reference() {
    let gemma = r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text",
        "hidden_size":256,"intermediate_size":512,"num_hidden_layers":3,"num_attention_heads":4,
        "num_key_value_heads":2,"head_dim":64,"vocab_size":1000,"max_position_embeddings":1024,
        "sliding_window":100,"sliding_window_pattern":3,"query_pre_attn_scalar":48,
        "rope_local_base_freq":500.0,"rope_scaling":{"rope_type":"linear","factor":4.0}}"#;
    for (dtype, tol) in [(Dtype::F32, 1e-4), (Dtype::Bf16, 1.5e-2)] {
        let a = dummy_args(gemma, dtype, tol, 0);
        let last = Mutex::new(None);
        compare(&a, true, &emu(dtype, true, &last))
            .unwrap_or_else(|e| panic!("{dtype:?} Gemma 3 layers: {e:#}"));
    }
    let hd8 = gemma.replace(r#""head_dim":64"#, r#""head_dim":8"#);
    for config in [gemma.to_owned(), hd8] {
        let a = dummy_args(config.clone(), Dtype::F32, 1e-4, 530);
        let last = Mutex::new(None);
        compare(&a, false, &emu(Dtype::F32, false, &last))
            .unwrap_or_else(|e| panic!("{config}: {e:#}"));
    }
}

/// Mixture-of-experts models on the CUDA worker against the CPU reference (kernels/moe.cu
/// beside cuBLAS): Mixtral; Qwen2-MoE with its shared expert and a dense first layer; Qwen3-MoE
/// with renormalized top-k on every second layer and q/k norms. Layer by layer in f32 and bf16
/// for a batch mixing prefill chunks and decodes, and the last logits of a 300-token prompt
/// (tiles of many pairs per expert).
#[test]
fn mixture_of_experts_layers_match_the_cpu_reference() {
    let base = r#""hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":1024"#;
    let configs = [
        format!(
            r#"{{"architectures":["MixtralForCausalLM"],"model_type":"mixtral",{base},
            "intermediate_size":96,"num_local_experts":6,"num_experts_per_tok":2}}"#
        ),
        format!(
            r#"{{"architectures":["Qwen2MoeForCausalLM"],"model_type":"qwen2_moe",{base},
            "intermediate_size":128,"num_experts":5,"num_experts_per_tok":3,
            "moe_intermediate_size":48,"shared_expert_intermediate_size":80,
            "mlp_only_layers":[0]}}"#
        ),
        format!(
            r#"{{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",{base},
            "head_dim":16,"intermediate_size":128,"num_experts":8,"num_experts_per_tok":2,
            "moe_intermediate_size":32,"norm_topk_prob":true,"decoder_sparse_step":2}}"#
        ),
    ];
    for config in &configs {
        for (dtype, tol) in [(Dtype::F32, 1e-4), (Dtype::Bf16, 1.5e-2)] {
            let a = dummy_args(config.clone(), dtype, tol, 0);
            let last = Mutex::new(None);
            compare(&a, true, &emu(dtype, true, &last))
                .unwrap_or_else(|e| panic!("{dtype:?} layers: {config}: {e:#}"));
        }
        let a = dummy_args(config.clone(), Dtype::F32, 1e-4, 300);
        let last = Mutex::new(None);
        compare(&a, false, &emu(Dtype::F32, false, &last))
            .unwrap_or_else(|e| panic!("300-token prompt: {config}: {e:#}"));
    }
}

/// stories260K as a Mixtral of copies of its MLP (`common::mixtral_copy`) reproduces the f32
/// goldens exactly on the CUDA worker, alone and batched, with decode graphs.
#[test]
fn a_mixtral_of_copies_of_the_test_model_gives_the_f32_goldens_with_graphs() {
    let dir = mixtral_copy("emu-mixtral");
    let last = Mutex::new(None);
    let r = golden(&dir, &emu(Dtype::F32, false, &last));
    let _ = std::fs::remove_dir_all(&dir);
    r.expect("f32 goldens of the Mixtral copy on the emulator");
}

#[test]
fn a_seeded_request_samples_the_same_alone_and_in_a_batch() {
    let sched = config(16, 256, 2);
    let engine = |sched: &SchedulerConfig| {
        let loaded = ModelDir::new(model_dir())
            .load(baton_model::LoadFormat::Auto)
            .expect("model");
        let sizes = sizes_of(sched);
        let last = Mutex::new(None);
        let w =
            emu(Dtype::Bf16, false, &last)(loaded.config, loaded.weights.into(), sizes).unwrap();
        LocalEngine::new(sched.clone(), w)
    };
    let prompt = goldens()[0].prompt_ids.clone();
    let mut alone = engine(&sched);
    let a = run(
        &mut alone,
        vec![request(7, prompt.clone(), 32, seeded(1234))],
    );
    assert_pool_full(&alone);

    let mut batch = engine(&sched);
    let mut reqs: Vec<_> = filler_prompts(6)
        .into_iter()
        .enumerate()
        .map(|(i, p)| request(100 + i as u64, p, 24, seeded(99 + i as u64)))
        .collect();
    reqs.insert(3, request(7, prompt.clone(), 32, seeded(1234)));
    let b = run(&mut batch, reqs);
    assert_eq!(
        a[&7].0, b[&7].0,
        "a seeded request depends on its batchmates"
    );
    assert_pool_full(&batch);

    let mut other = engine(&sched);
    let c = run(&mut other, vec![request(7, prompt, 32, seeded(4321))]);
    assert_ne!(a[&7].0, c[&7].0, "different seeds gave identical samples");
}

#[test]
fn bench_decode_runs_on_the_executor_and_its_breakdown_names_every_kernel_of_a_step() {
    let cfg = ModelConfig::from_json_str(HD64).unwrap();
    let weights = LlamaWeights::dummy(&cfg, 0);
    let (prompt, gen, bs) = (8usize, 4usize, 16usize);
    // A batch of one (the specialized GEMV entries) and of three (the general one).
    for batch in [1usize, 3] {
        let pages = (prompt + gen + 1).div_ceil(bs);
        let sizes = CudaSizes {
            block_size: bs,
            num_blocks: Some(batch * pages),
            max_tokens: batch * prompt,
            max_rows: batch,
            max_model_len: prompt + gen + 1,
        };
        for fused in [true, false] {
            bench_decode_case(
                &cfg,
                weights.clone(),
                sizes,
                fused,
                pages,
                (batch, prompt, gen, bs),
            );
        }
    }
}

/// The launch trace end to end on the emulator (whose kernels always have it compiled in):
/// through graph replays of batch-1 decode steps, every kernel launched in a step leaves one
/// slot, named by its wait site, in launch order, with its exit after its release.
#[test]
fn the_launch_trace_has_one_position_per_kernel_of_a_decode_step_in_launch_order() {
    use baton::bench_decode::{measure_batch, BenchTables};
    use baton_cuda::trace::{summarize, StepTrace};
    let cfg = ModelConfig::from_json_str(HD64).unwrap();
    let layers = cfg.num_hidden_layers;
    let (prompt, gen, bs) = (8usize, 4usize, 16usize);
    // A second run decodes two steps more.
    let pages = (prompt + gen + 3).div_ceil(bs);
    let sizes = CudaSizes {
        block_size: bs,
        num_blocks: Some(pages),
        max_tokens: prompt,
        max_rows: 1,
        max_model_len: prompt + gen + 3,
    };
    let last = Mutex::new(None);
    let args = CudaArgs {
        dtype: Dtype::Bf16,
        ..CudaArgs::default()
    };
    let mut w =
        emu_with(args, &last)(cfg.clone(), LlamaWeights::dummy(&cfg, 0).into(), sizes).unwrap();
    let dev = last.lock().unwrap().take().unwrap();
    // Off: no trace.
    assert_eq!(w.take_launch_trace().unwrap(), None);
    dev.set_launch_trace(true).unwrap();
    let tables = BenchTables::new(cfg.vocab_size, pages);
    let mut seq = 0;
    let replays = dev.graph_launches();
    let mut run = |gen: usize| {
        let launches = dev.launches();
        let t = measure_batch(
            &mut w,
            &tables,
            &mut seq,
            1,
            prompt,
            gen,
            bs,
            prompt,
            baton_proto::SamplingParams::greedy(),
            1,
            0,
        )
        .unwrap();
        (t, dev.launches() - launches)
    };
    let (timing, launches) = run(gen);
    let (_, launches_2_more) = run(gen + 2);
    assert!(
        dev.graph_launches() >= replays + 3,
        "decode steps replay graphs"
    );
    assert_eq!(timing.traces.len(), gen - 1);
    let steps: Vec<_> = timing.traces.iter().map(StepTrace::launches).collect();
    let tick = timing.traces[0].tick_ns;
    assert!(tick > 0, "the emulator's clock ticks");
    let s = summarize(&steps, tick);
    assert_eq!((s.steps, s.skipped), (gen - 1, 0), "{s:?}");
    // One position per kernel launched in a decode step: two more decode steps (after the
    // same prefill) launched two steps' kernels more.
    let per_step = s.positions.len() as u64;
    assert_eq!(launches_2_more - launches, 2 * per_step);
    let gemvs = s
        .positions
        .iter()
        .filter(|p| p.site.starts_with("gemv.cuh:"))
        .count();
    // Per layer QKV, O, gate_up and down, then the LM head: the batch-of-one GEMVs.
    assert_eq!(gemvs, 4 * layers + 1, "{:?}", s.sites);
    assert_eq!(
        s.positions
            .iter()
            .filter(|p| p.site.starts_with("attention.cu:"))
            .count(),
        layers,
        "{:?}",
        s.sites
    );
    assert!(
        s.positions[0].site.starts_with("embedding.cu:"),
        "{:?}",
        s.positions[0]
    );
    assert!(
        s.positions.last().unwrap().site.starts_with("sampling.cu:"),
        "{:?}",
        s.positions.last()
    );
    for p in &s.positions {
        assert!(p.blocks >= 1.0 && p.blocks <= f64::from(p.nblocks), "{p:?}");
        // Every entry point's scope records its exit, after its release.
        assert!(p.body_us.is_some_and(|b| b >= 0.0), "{p:?}");
        assert!(p.early_us >= 0.0 && p.spread_us >= 0.0, "{p:?}");
    }
    // Steps run one at a time: each step's launches released in order.
    for step in steps.iter().flatten() {
        assert!(step.windows(2).all(|w| w[0].release <= w[1].release));
        assert!(step
            .iter()
            .all(|l| l.last_exit.is_some_and(|e| e >= l.release)));
    }
    // Off again: launches leave the table alone.
    dev.set_launch_trace(false).unwrap();
    assert_eq!(w.take_launch_trace().unwrap(), None);
}

fn bench_decode_case(
    cfg: &ModelConfig,
    weights: LlamaWeights,
    sizes: CudaSizes,
    fused: bool,
    pages: usize,
    (batch, prompt, gen, bs): (usize, usize, usize, usize),
) {
    use baton::bench_decode::{measure_batch, profile_decode_step, BenchTables};
    let layers = cfg.num_hidden_layers;
    let last = Mutex::new(None);
    let args = CudaArgs {
        dtype: Dtype::Bf16,
        no_fused_decode: !fused,
        ..CudaArgs::default()
    };
    let mut w = emu_with(args, &last)(cfg.clone(), weights.into(), sizes).unwrap();
    let dev = last.lock().unwrap().take().unwrap();
    let tables = BenchTables::new(cfg.vocab_size, pages);
    let mut seq = 0;
    // One step in flight with step timing, then two on the deferred stream (timed as a
    // whole, no per-step device time).
    for in_flight in [1, 2] {
        w.set_step_timing(in_flight == 1).unwrap();
        dev.set_deferred(in_flight == 2).unwrap();
        let timing = measure_batch(
            &mut w,
            &tables,
            &mut seq,
            batch,
            prompt,
            gen,
            bs,
            batch * prompt,
            baton_proto::SamplingParams::greedy(),
            in_flight,
            0,
        )
        .expect("decode steps through graphs and pending ids");
        assert!(timing.step_s > 0.0);
        assert_eq!(timing.ctxs.len(), gen - 1, "step 0 is the warm-up");
        assert_eq!(timing.device_step_s.is_some(), in_flight == 1, "{timing:?}");
        assert!(timing.traces.is_empty(), "the emulator never traces");
        // The emulator's step time is the wall time from the upload to the fence: part of
        // the step, never more.
        if let Some(dev_s) = timing.device_step_s {
            assert!(dev_s > 0.0 && dev_s <= timing.step_s, "{timing:?}");
        }
    }
    dev.set_deferred(false).unwrap();
    w.set_step_timing(false).unwrap();
    assert!(dev.graphs() > 0);
    let k = profile_decode_step(
        &mut w,
        &tables,
        &mut seq,
        batch,
        prompt + gen - 1,
        bs,
        baton_proto::SamplingParams::greedy(),
    )
    .unwrap();
    let calls = |name: &str| k.iter().find(|x| x.name == name).map_or(0, |x| x.calls);
    if fused {
        // Per layer: QKV (norm prologue), O (+residual), gate_up (norm, SiLU), down
        // (+residual); then the LM head (final norm). No separate norm or activation kernel.
        if batch == 1 {
            // The batch-of-one entries: SiLU mode for gate_up, the rest plain.
            assert_eq!(calls("baton_gemv_t1"), 3 * layers + 1, "{k:?}");
            assert_eq!(calls("baton_gemv_silu_t1"), layers, "{k:?}");
        } else {
            assert_eq!(calls("baton_gemv"), 4 * layers + 1, "{k:?}");
        }
        for gone in ["baton_rmsnorm", "baton_add_rmsnorm", "baton_silu_and_mul"] {
            assert_eq!(calls(gone), 0, "{gone}: {k:?}");
        }
        assert!(k.iter().all(|x| !x.name.starts_with("gemm")), "{k:?}");
    } else {
        for gemm in ["gemm qkv", "gemm o", "gemm gate_up", "gemm down"] {
            assert_eq!(calls(gemm), layers, "{gemm}: {k:?}");
        }
        assert_eq!(calls("gemm lm_head"), 1);
        assert!(k.iter().all(|x| !x.name.starts_with("baton_gemv")), "{k:?}");
    }
    // Qwen's biases and q/k norms: one launch per layer after the QKV projection; a Llama
    // model launches none (exactly the kernels it launched before Qwen support).
    let post = if cfg.qkv_bias || cfg.qk_norm {
        layers
    } else {
        0
    };
    assert_eq!(calls("baton_qkv_post"), post, "{k:?}");
    // RoPE and the cache write of a decode step run inside the decode attention kernel.
    assert_eq!(calls("baton_rope_and_cache"), 0, "{k:?}");
    let decode = format!("baton_paged_attention_decode_hd{}", cfg.head_dim);
    assert_eq!(calls(&decode), layers, "{k:?}");
    assert_eq!(calls("baton_sample_f32"), 1);
    assert!(k.iter().all(|x| x.total_us >= 0.0));
}

/// A LocalEngine on the CUDA worker over an emulated device (left in `last`), sized as `sched`.
/// The device's stream is deferred (`EmuDevice::set_deferred`): the engine keeps two launches
/// in flight, and a host buffer reused before its launch's fence would change the results.
fn emu_engine(
    sched: &SchedulerConfig,
    dtype: Dtype,
    enforce_eager: bool,
    last: &Mutex<Option<Arc<EmuDevice>>>,
) -> LocalEngine<CudaWorker> {
    let loaded = ModelDir::new(model_dir())
        .load(baton_model::LoadFormat::Auto)
        .expect("model");
    let sizes = sizes_of(sched);
    let w = emu(dtype, enforce_eager, last)(loaded.config, loaded.weights.into(), sizes).unwrap();
    if let Some(dev) = last.lock().unwrap().as_ref() {
        dev.set_deferred(true).unwrap();
    }
    LocalEngine::new(sched.clone(), w)
}

/// The `allowed_token_ids` of the requests that have one (stories260K ids).
const ALLOWED: [u32; 6] = [261, 278, 300, 345, 403, 407];

#[test]
fn penalized_requests_match_the_cpu_worker_with_pending_rows_with_graphs_and_eagerly() {
    use baton_proto::SamplingParams;
    // Two launches in flight: decode rows take their input id from the previous launch on the
    // device (pending), so the sampler merges it into the host's penalty list. 32 batched
    // tokens: the penalty-entry buffer starts with room for 32 entries and has to grow (after
    // the decode graphs were captured, which then read the new address).
    let sched = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        ..config(16, 256, 2)
    };
    let greedy = SamplingParams::greedy;
    let variants = [
        // Every penalty at once.
        SamplingParams {
            presence_penalty: 0.6,
            frequency_penalty: 0.5,
            repetition_penalty: 1.3,
            ..greedy()
        },
        // Outputs only (the host list holds no prompt token).
        SamplingParams {
            frequency_penalty: 1.0,
            ..greedy()
        },
        // Repetition alone: prompt tokens too.
        SamplingParams {
            repetition_penalty: 1.8,
            ..greedy()
        },
        // Negative presence, repetition below 1 (rewarding repeats), sampled.
        SamplingParams {
            presence_penalty: -0.5,
            repetition_penalty: 0.8,
            ..seeded(5)
        },
        // Rewarding repeats strongly, by count: the latest output (often a pending input,
        // merged on the device) then decides the next greedy token.
        SamplingParams {
            frequency_penalty: -3.0,
            ..greedy()
        },
    ];
    let g = goldens();
    let n_tokens = 40usize;
    let reqs = || {
        let mut v: Vec<_> = variants
            .iter()
            .enumerate()
            .map(|(i, &p)| request(i as u64, g[i % g.len()].prompt_ids.clone(), 40, p))
            .collect();
        // An unpenalized greedy request in the same batches.
        v.push(request(9, g[0].prompt_ids.clone(), 40, greedy()));
        // A logit bias alone (banning the golden's first tokens, rewarding another), and one
        // with penalties and min_tokens (its stop id masked through the bias table).
        let mut b = request(
            7,
            g[1].prompt_ids.clone(),
            40,
            SamplingParams {
                logit_bias_len: 3,
                ..greedy()
            },
        );
        b.logit_bias = vec![
            (g[1].greedy_ids[0], -100.0),
            (g[1].greedy_ids[1], -100.0),
            (300, 3.5),
        ];
        v.push(b);
        let mut m = request(
            8,
            g[2].prompt_ids.clone(),
            40,
            SamplingParams {
                logit_bias_len: 1,
                presence_penalty: 0.4,
                ..greedy()
            },
        );
        m.logit_bias = vec![(17, 1.5)];
        m.stop_token_ids = vec![g[2].greedy_ids[3]];
        m.min_tokens = 10;
        v.push(m);
        // allowed_token_ids: greedy; sampled with top-k above the list's size, a bias on one
        // allowed token, a presence penalty and min_tokens (its stop id both allowed and
        // masked); sampled with top-p.
        for (id, params, extra_bias) in [
            (10, greedy(), None),
            (
                11,
                SamplingParams {
                    top_k: 50,
                    presence_penalty: 0.7,
                    ..seeded(11)
                },
                Some(ALLOWED[2]),
            ),
            (
                12,
                SamplingParams {
                    top_p: 0.6,
                    ..seeded(12)
                },
                None,
            ),
        ] {
            let mut a = request(
                id,
                g[id as usize % g.len()].prompt_ids.clone(),
                40,
                SamplingParams {
                    logit_bias_len: ALLOWED.len() as u32,
                    allowed_only: 1,
                    ..params
                },
            );
            a.logit_bias = ALLOWED
                .iter()
                .map(|&t| (t, if Some(t) == extra_bias { 2.0 } else { 0.0 }))
                .collect();
            if id == 11 {
                a.stop_token_ids = vec![ALLOWED[0]];
                a.min_tokens = 12;
            }
            v.push(a);
        }
        // vLLM's bad_words through the token mask: one-token words (a fixed mask, rows with
        // a pending input) and a word of two tokens (rows wait for their previous sample),
        // the latter with a presence penalty too.
        for (id, words, params) in [
            (13, vec![vec![g[0].greedy_ids[2]], vec![5]], greedy()),
            (
                14,
                vec![vec![g[1].greedy_ids[3], g[1].greedy_ids[4]]],
                SamplingParams {
                    presence_penalty: 0.3,
                    ..greedy()
                },
            ),
        ] {
            let mut b = request(id, g[id as usize % g.len()].prompt_ids.clone(), 40, params);
            b.bad_words = words;
            v.push(b);
        }
        v
    };
    let (mut cpu, _) = engine(sched.clone());
    let want = run(&mut cpu, reqs());
    for (id, word) in [
        (13, vec![g[0].greedy_ids[2]]),
        (14, g[1].greedy_ids[3..5].to_vec()),
    ] {
        let got = &want[&id].0;
        assert!(
            !got.windows(word.len()).any(|w| w == word),
            "request {id} generated its bad word: {got:?}"
        );
    }
    assert_ne!(
        want[&13].0[..],
        g[0].greedy_ids[..want[&13].0.len()],
        "the bad word changed nothing"
    );
    assert_pool_full(&cpu);
    assert_eq!(
        want[&9].0,
        g[0].greedy_ids[..n_tokens],
        "unpenalized golden"
    );
    assert_ne!(
        want[&7].0[0], g[1].greedy_ids[0],
        "the bias changed nothing"
    );
    assert!(
        want[&8].0.len() > 10,
        "min_tokens did not hold the stop id back"
    );
    for id in [10, 11, 12] {
        let got = &want[&id].0;
        assert!(
            got.iter().all(|t| ALLOWED.contains(t)),
            "request {id} sampled outside allowed_token_ids: {got:?}"
        );
        let distinct: std::collections::BTreeSet<_> = got.iter().collect();
        assert!(id == 10 || distinct.len() > 1, "request {id}: {got:?}");
    }
    for i in 0..3 {
        let golden = &g[i % g.len()].greedy_ids;
        let got = &want[&(i as u64)].0;
        assert_ne!(
            got[..],
            golden[..got.len()],
            "variant {i}: penalties left the greedy output unchanged"
        );
    }
    for eager in [false, true] {
        let last = Mutex::new(None);
        let mut e = emu_engine(&sched, Dtype::F32, eager, &last);
        let got = run(&mut e, reqs());
        assert_pool_full(&e);
        assert!(
            e.backend().penalty_capacity() > 32,
            "the penalty-entry buffer never grew"
        );
        for id in want.keys() {
            assert_eq!(
                got[id], want[id],
                "request {id} (eager {eager}): the CUDA worker differs from the CPU worker"
            );
        }
        assert!(
            e.backend().pending_inputs() > 0,
            "no pending row was exercised"
        );
        let dev = last.lock().unwrap().take().unwrap();
        if eager {
            assert_eq!(dev.graph_launches(), 0);
        } else {
            assert!(dev.graph_launches() > 0, "no decode graph was replayed");
        }
    }
}

/// Buffers for a worker that only loads weights (8 pages, 4 rows of 64 tokens).
/// The CUDA worker sizes that match a scheduler configuration.
fn sizes_of(sched: &SchedulerConfig) -> CudaSizes {
    CudaSizes {
        block_size: sched.block_size,
        num_blocks: Some(sched.num_blocks),
        max_tokens: sched.max_num_batched_tokens,
        max_rows: sched.max_num_seqs,
        max_model_len: sched.max_model_len,
    }
}

fn small_sizes() -> CudaSizes {
    CudaSizes {
        block_size: 16,
        num_blocks: Some(8),
        max_tokens: 64,
        max_rows: 4,
        max_model_len: 128,
    }
}

/// A copy of stories260K in `dir` with every tensor stored as `dtype` (converted from the f32
/// checkpoint, rounded to nearest even), the other files copied as they are.
fn stored_as(dtype: safetensors::Dtype, dir: &std::path::Path) {
    use safetensors::tensor::{serialize_to_file, TensorView};
    let src = model_dir();
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let converted: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
            let data: Vec<u8> = t
                .data()
                .chunks_exact(4)
                .flat_map(|c| {
                    let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    match dtype {
                        safetensors::Dtype::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
                        safetensors::Dtype::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
                        _ => x.to_le_bytes().to_vec(),
                    }
                })
                .collect();
            (name, t.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = converted
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(dtype, s.clone(), d).unwrap()))
        .collect();
    serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn a_mapped_checkpoint_puts_the_same_bits_on_the_device_as_the_f32_load() {
    use safetensors::Dtype as S;
    let root = std::env::temp_dir().join(format!("baton-mapped-{}", std::process::id()));
    for stored in [S::F32, S::BF16, S::F16] {
        let dir = root.join(format!("{stored:?}"));
        stored_as(stored, &dir);
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let a =
                assert_mapped_uploads_as_the_f32_load(&dir, dtype, &format!("{stored:?}"), |_| {});
            assert!(a.iter().any(|&x| x != 0), "nothing was uploaded");
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Builds the emulated CUDA worker in `dtype` from the checkpoint in `dir` twice, from its
/// mapped load (checked to stay mapped) and from its f32 load (which `check_host` looks at
/// first), and asserts that both put the same bytes on the device; returns those bytes.
/// `what` names the checkpoint in failures.
fn assert_mapped_uploads_as_the_f32_load(
    dir: &std::path::Path,
    dtype: Dtype,
    what: &str,
    check_host: impl FnOnce(&baton_model::LoadedModel),
) -> Vec<u8> {
    let last = Mutex::new(None);
    let build = emu(dtype, true, &last);
    let sizes = small_sizes();
    let mapped = ModelDir::new(dir)
        .load_mapped(baton_model::LoadFormat::Auto)
        .unwrap();
    assert!(
        matches!(mapped.weights, ModelWeights::Mapped(_)),
        "{what}: safetensors stay mapped"
    );
    let a = build(mapped.config, mapped.weights, sizes)
        .unwrap()
        .download_weights()
        .unwrap();
    let host = ModelDir::new(dir)
        .load(baton_model::LoadFormat::Auto)
        .unwrap();
    check_host(&host);
    let b = build(host.config, host.weights.into(), sizes)
        .unwrap()
        .download_weights()
        .unwrap();
    assert_eq!(a.len(), b.len(), "{what}");
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert!(
        first.is_none(),
        "stored {what}, device {dtype:?}: first differing byte {first:?}"
    );
    a
}

#[test]
fn mapped_weights_are_checked_against_the_workers_own_config() {
    let mapped = ModelDir::new(model_dir())
        .load_mapped(baton_model::LoadFormat::Auto)
        .unwrap();
    // A config one layer short of the checkpoint (bench decode --config with --model).
    let mut cfg = mapped.config.clone();
    cfg.num_hidden_layers -= 1;
    let last = Mutex::new(None);
    let sizes = small_sizes();
    let e = match emu(Dtype::F32, true, &last)(cfg, mapped.weights, sizes) {
        Ok(_) => panic!("a checkpoint with an extra layer was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("layer"), "{e}");
}

/// Prompt log-probabilities on the CUDA worker (the LM head over every scored position after
/// the fence, scored on the host) against the CPU worker: prompts chunked over several
/// launches (rows that end inside the prompt), beside a plain request whose decodes would
/// otherwise run from a graph, in f32.
#[test]
fn prompt_logprobs_match_the_cpu_worker() {
    use baton_proto::SamplingParams;
    let sched = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 8,
        ..config(16, 256, 2)
    };
    let g = goldens();
    let reqs = || {
        let mut v: Vec<_> = g
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let params = SamplingParams {
                    prompt_logprobs: 1 + 4,
                    ..SamplingParams::greedy()
                };
                request(i as u64, x.prompt_ids.clone(), 6, params)
            })
            .collect();
        v.push(request(
            99,
            g[0].prompt_ids.clone(),
            12,
            SamplingParams::greedy(),
        ));
        v
    };
    let (mut cpu, _) = engine(sched.clone());
    for r in reqs() {
        cpu.add_request(r).unwrap();
    }
    let mut want = Vec::new();
    cpu.run_until_idle(&mut want).unwrap();
    let want_lp = prompt_logprobs(&want);
    assert_eq!(want_lp.len(), g.len(), "every request that asked got them");
    let last = Mutex::new(None);
    let mut e = emu_engine(&sched, Dtype::F32, false, &last);
    for r in reqs() {
        e.add_request(r).unwrap();
    }
    let mut got = Vec::new();
    e.run_until_idle(&mut got).unwrap();
    assert_pool_full(&e);
    assert_eq!(
        collect(got.clone()),
        collect(want.clone()),
        "outputs differ"
    );
    let got_lp = prompt_logprobs(&got);
    for (id, w) in &want_lp {
        let gl = &got_lp[id];
        assert_eq!(gl.len(), w.len(), "request {id}");
        assert_eq!(
            w.len(),
            g[*id as usize].prompt_ids.len() - 1,
            "request {id}"
        );
        for ((wp, wt, wl, wtop, wr), (gp, gt, gl, gtop, gr)) in w.iter().zip(gl) {
            assert_eq!((wp, wt, wr), (gp, gt, gr), "request {id}");
            assert!(
                (wl - gl).abs() < 1e-4,
                "request {id} position {wp}: {wl} vs {gl}"
            );
            assert_eq!(wtop.len(), 4);
            assert_eq!(gtop.len(), 4);
            for ((a, al), (b, bl)) in wtop.iter().zip(gtop) {
                assert!(
                    (al - bl).abs() < 1e-4,
                    "request {id} position {wp}: {wtop:?} vs {gtop:?}"
                );
                // Equal ids, or a tie the two workers broke differently.
                assert!(
                    a == b || wtop.iter().any(|&(t, l)| t == *b && (l - bl).abs() < 1e-4),
                    "request {id} position {wp}: {wtop:?} vs {gtop:?}"
                );
            }
        }
    }
    let dev = last.lock().unwrap().take().unwrap();
    assert!(
        dev.graph_launches() > 0,
        "the plain request's decodes ran from graphs"
    );
}

/// Random token-mask words with about `density` of the bits set (an LCG seeded by `seed`).
fn random_mask(seed: u64, words: usize, density: f64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..words)
        .map(|_| {
            (0..32).fold(0u32, |acc, b| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                acc | (u32::from(u < density) << b)
            })
        })
        .collect()
}

/// Structured outputs (`SamplingParams::token_mask`): launches with guided rows (greedy and
/// seeded, with log-probabilities) beside unguided ones, on the CUDA worker (emulated, f32) and
/// the CPU worker over the same tables, step by step: a prefill launch (eager), then decode
/// launches (graph replays, or eager under --enforce-eager), the last with no guided row. Each
/// step's masks are random and exclude the token the row would take unmasked (what a third,
/// CPU worker gives with the masks off), so a CUDA worker that ignored them would differ. Two
/// guided rows need twice the initial mask buffer: it grows after the graphs were captured,
/// which then read its new address from the staging buffer.
#[test]
fn token_masked_rows_match_the_cpu_worker_with_graphs_and_eagerly() {
    use baton_proto::{
        token_mask_words, HeapSlotTables, Launch, LaunchRow, SamplingParams, SlotRef, NOT_PENDING,
    };
    use baton_worker::{Backend, CpuBackend};
    let (bs, pages, rows, max_len) = (16usize, 4usize, 4usize, 64usize);
    let g = goldens();
    let cpu_model = || {
        baton_model::load_model_dir(model_dir())
            .expect("test model loads")
            .into_cpu_model()
            .0
    };
    let vocab = cpu_model().config().vocab_size;
    let words = token_mask_words(vocab);
    let params = [
        // Guided, greedy, with log-probabilities.
        SamplingParams {
            top_logprobs: 3,
            want_logprob: 1,
            ..SamplingParams::greedy()
        },
        SamplingParams::greedy(),
        // Guided, seeded.
        SamplingParams {
            top_logprobs: 2,
            want_logprob: 1,
            ..seeded(21)
        },
        seeded(22),
    ];
    let guided = [true, false, true, false];
    let steps = 6usize;
    for eager in [false, true] {
        let tables = HeapSlotTables::new_heap_masked(rows, max_len, pages, words);
        let mut len = vec![0usize; rows];
        for s in 0..rows {
            let prompt = &g[s % g.len()].prompt_ids;
            for (p, &t) in prompt.iter().enumerate() {
                tables.set_token(s as u32, p, t);
            }
            len[s] = prompt.len();
            for i in 0..pages {
                tables.set_block(s as u32, i, (s * pages + i) as u32);
            }
        }
        let mut cpu = CpuBackend::new(cpu_model(), rows * pages, bs);
        let mut unmasked = CpuBackend::new(cpu_model(), rows * pages, bs);
        let last = Mutex::new(None);
        let loaded = ModelDir::new(model_dir())
            .load(baton_model::LoadFormat::Auto)
            .expect("model");
        let sizes = CudaSizes {
            block_size: bs,
            num_blocks: Some(rows * pages),
            max_tokens: max_len,
            max_rows: rows,
            max_model_len: max_len,
        };
        let mut gpu =
            emu(Dtype::F32, eager, &last)(loaded.config, loaded.weights.into(), sizes).unwrap();
        // Computed positions per slot (0 before the prefill).
        let mut done = vec![0usize; rows];
        for step in 0..steps {
            let masked = step + 1 < steps;
            let launch = |masks: bool| Launch {
                seq: step as u64 + 1,
                rows: (0..rows)
                    .map(|s| LaunchRow {
                        req: SlotRef {
                            slot: s as u32,
                            generation: 0,
                        },
                        first_pos: done[s] as u32,
                        num_tokens: (len[s] - done[s]) as u32,
                        num_blocks: len[s].div_ceil(bs) as u32,
                        sample: 1,
                        pending_launch: NOT_PENDING,
                        pending_row: 0,
                        output_index: step as u32,
                        lora: 0,
                        reserved: 0,
                        params: SamplingParams {
                            token_mask: u32::from(masks && guided[s]),
                            ..params[s]
                        },
                    })
                    .collect(),
            };
            let free = unmasked.execute(&launch(false), &tables).unwrap();
            if masked {
                for s in (0..rows).filter(|&s| guided[s]) {
                    let mut mask = random_mask((step * rows + s) as u64, words, 0.4);
                    let t = free.sampled[s].token as usize;
                    mask[t / 32] &= !(1 << (t % 32));
                    tables.set_token_mask(s as u32, &mask);
                }
            }
            let l = launch(masked);
            let want = cpu.execute(&l, &tables).unwrap();
            let got = gpu.execute(&l, &tables).unwrap();
            assert_eq!(want.sampled.len(), rows);
            assert_eq!(got.sampled.len(), rows);
            for (s, (w, o)) in want.sampled.iter().zip(&got.sampled).enumerate() {
                let what = format!("eager {eager}, step {step}, row {s}");
                assert_eq!(w.token, o.token, "{what}: token (CPU vs CUDA)");
                assert!(
                    (w.logprob - o.logprob).abs() <= 1e-4 * (1.0 + w.logprob.abs()),
                    "{what}: logprob {} vs {}",
                    w.logprob,
                    o.logprob
                );
                assert_eq!(w.top.len(), o.top.len(), "{what}: top entries");
                for (a, b) in w.top.iter().zip(&o.top) {
                    assert!(
                        (a.1 - b.1).abs() <= 1e-4 * (1.0 + a.1.abs()),
                        "{what}: top {:?} vs {:?}",
                        w.top,
                        o.top
                    );
                }
                if masked && guided[s] {
                    // The mask decided the token, and only allowed tokens have finite
                    // log-probabilities.
                    let mut mask = Vec::new();
                    tables.read_token_mask(s as u32, &mut mask);
                    let allowed = |t: u32| mask[t as usize / 32] >> (t % 32) & 1 == 1;
                    assert_ne!(
                        w.token, free.sampled[s].token,
                        "{what}: mask changed nothing"
                    );
                    assert!(allowed(w.token), "{what}: token {} not allowed", w.token);
                    for &(t, lp) in &w.top {
                        assert!(
                            allowed(t) || lp == f32::NEG_INFINITY,
                            "{what}: top {t} {lp}"
                        );
                    }
                } else {
                    assert_eq!(
                        w.token, free.sampled[s].token,
                        "{what}: unguided row changed"
                    );
                }
            }
            // Next step: decode the CPU's token (the same as the CUDA worker's).
            for (s, w) in want.sampled.iter().enumerate() {
                tables.set_token(s as u32, len[s], w.token);
                done[s] = len[s];
                len[s] += 1;
            }
        }
        assert_eq!(
            gpu.token_mask_capacity(),
            2 * words,
            "the mask buffer grew to two rows"
        );
        let dev = last.lock().unwrap().take().unwrap();
        let mask_launches = dev.launches_of("baton_apply_token_mask");
        if eager {
            assert_eq!(dev.graph_launches(), 0);
            // Only launches with a guided row run the kernel.
            assert_eq!(mask_launches, steps as u64 - 1);
        } else {
            // The decode steps replayed graphs (each runs the kernel, guided rows or not).
            assert!(
                dev.graph_launches() >= steps as u64 - 1,
                "decode graphs replayed"
            );
            assert!(mask_launches >= steps as u64, "{mask_launches}");
        }
    }
}

// ---- Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) ---------------------------------------

/// Qwen2-shaped: q/k/v biases, head dim 64 (4 query heads, 2 KV heads).
const QWEN2: &str = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":1000,"max_position_embeddings":256,
    "rms_norm_eps":1e-6,"rope_theta":1000000.0}"#;

/// Qwen3-shaped: q/k norms, head dim 128 given explicitly (4 query heads: a query width of 512,
/// twice the hidden size, as in Qwen3-0.6B), 2 KV heads.
const QWEN3: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":128,"vocab_size":1000,"max_position_embeddings":256,
    "rms_norm_eps":1e-6,"rope_theta":1000000.0}"#;

/// Qwen3-shaped with head dim 32: the generic attention kernel, so decode steps launch
/// `baton_rope_and_cache` after the norms instead of fusing RoPE into attention.
const QWEN3_HD32: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3",
    "hidden_size":128,"intermediate_size":256,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":32,"vocab_size":1000,"max_position_embeddings":256}"#;

/// [`QWEN3`] with YaRN RoPE scaling and a visible attention factor (the CPU scales cos and
/// sin by it, the CUDA worker the attention scale by its square).
const QWEN3_YARN: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3",
    "hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":128,"vocab_size":1000,"max_position_embeddings":256,
    "rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_scaling":{"rope_type":"yarn",
    "factor":4.0,"original_max_position_embeddings":64,"attention_factor":1.7}}"#;

#[test]
fn every_layer_of_qwen2_and_qwen3_models_matches_the_cpu_reference() {
    // `baton debug layers`: a batch mixing prefill chunks and decodes (cuBLAS path), then a
    // decode-only batch of 4 rows (the fused GEMV path), each layer against the CPU layer on
    // the GPU's input.
    for (name, config, dtype, tol) in [
        ("qwen2", QWEN2, Dtype::F32, 1e-4),
        ("qwen2", QWEN2, Dtype::Bf16, 1e-2),
        ("qwen3", QWEN3, Dtype::F32, 1e-4),
        ("qwen3", QWEN3, Dtype::Bf16, 1e-2),
        ("qwen3 hd32", QWEN3_HD32, Dtype::F32, 1e-4),
        ("qwen3 yarn", QWEN3_YARN, Dtype::F32, 1e-4),
    ] {
        let a = dummy_args(config, dtype, tol, 0);
        let last = Mutex::new(None);
        compare(&a, true, &emu(dtype, true, &last))
            .unwrap_or_else(|e| panic!("{name} {dtype:?} layers: {e:#}"));
        let dev = last.lock().unwrap().take().unwrap();
        assert!(dev.launches_of("baton_qkv_post") > 0, "{name}");
    }
}

/// Greedy tokens of several requests on the CPU worker and on the CUDA worker (f32, decode
/// graphs and eagerly), dummy weights of `config`: prompts chunked over steps of 32 tokens
/// beside decodes, then one request alone (the batch-of-one GEMV entries).
fn qwen_greedy_matches_the_cpu_worker(name: &str, config: &str) {
    let cfg = ModelConfig::from_json_str(config).unwrap();
    let weights = LlamaWeights::dummy(&cfg, 3);
    let sched = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        max_model_len: 128,
        ..config_for_tests()
    };
    let prompt = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|p| (3 + seed * 101 + 37 * p) % 1000)
            .collect()
    };
    let batch = || {
        vec![
            request(0, prompt(0, 45), 10, baton_proto::SamplingParams::greedy()),
            request(1, prompt(1, 7), 10, baton_proto::SamplingParams::greedy()),
            request(2, prompt(2, 20), 10, baton_proto::SamplingParams::greedy()),
        ]
    };
    let alone = || {
        vec![request(
            3,
            prompt(3, 11),
            8,
            baton_proto::SamplingParams::greedy(),
        )]
    };
    let no_eos = |mut v: Vec<baton_scheduler::NewRequest>| {
        for r in &mut v {
            r.eos_ids.clear();
        }
        v
    };
    let model = baton_model::CpuModel::try_new(cfg.clone(), weights.clone()).unwrap();
    let cpu = baton_worker::CpuBackend::new(model, sched.num_blocks, sched.block_size);
    let mut cpu = LocalEngine::new(sched.clone(), cpu);
    let want_batch = run(&mut cpu, no_eos(batch()));
    let want_alone = run(&mut cpu, no_eos(alone()));
    assert_eq!(want_batch[&0].0.len(), 10, "{name}");
    let sizes = sizes_of(&sched);
    for eager in [false, true] {
        let last = Mutex::new(None);
        let w = emu(Dtype::F32, eager, &last)(cfg.clone(), weights.clone().into(), sizes).unwrap();
        let mut e = LocalEngine::new(sched.clone(), w);
        let got_batch = run(&mut e, no_eos(batch()));
        let got_alone = run(&mut e, no_eos(alone()));
        for (got, want) in [(&got_batch, &want_batch), (&got_alone, &want_alone)] {
            for id in want.keys() {
                assert_eq!(
                    got[id], want[id],
                    "{name} request {id} (eager {eager}): the CUDA worker differs from the CPU worker"
                );
            }
        }
        let dev = last.lock().unwrap().take().unwrap();
        assert!(dev.launches_of("baton_qkv_post") > 0, "{name}");
        if eager {
            assert_eq!(dev.graph_launches(), 0, "{name}");
        } else {
            assert!(
                dev.graph_launches() > 0,
                "{name}: no decode graph was replayed"
            );
        }
    }
}

/// A scheduler configuration with the tests' defaults (block size 16, 64 pages, two launches in
/// flight).
fn config_for_tests() -> SchedulerConfig {
    config(16, 64, 2)
}

#[test]
fn qwen2_greedy_tokens_match_the_cpu_worker_with_graphs_and_eagerly() {
    qwen_greedy_matches_the_cpu_worker("qwen2", QWEN2);
}

#[test]
fn qwen3_greedy_tokens_match_the_cpu_worker_with_graphs_and_eagerly() {
    qwen_greedy_matches_the_cpu_worker("qwen3", QWEN3);
}

#[test]
fn a_qwen_decode_step_launches_qkv_post_once_per_layer() {
    // Qwen2 and Qwen3 at once (both flags): the bias and the norm in one launch per layer.
    let mut cfg = ModelConfig::from_json_str(QWEN3).unwrap();
    cfg.qkv_bias = true;
    let weights = LlamaWeights::dummy(&cfg, 0);
    assert!(weights.layers[0].q_bias.is_some() && weights.layers[0].q_norm.is_some());
    let (prompt, gen, bs) = (8usize, 4usize, 16usize);
    for (batch, fused) in [(1usize, true), (3, false)] {
        let pages = (prompt + gen + 1).div_ceil(bs);
        let sizes = CudaSizes {
            block_size: bs,
            num_blocks: Some(batch * pages),
            max_tokens: batch * prompt,
            max_rows: batch,
            max_model_len: prompt + gen + 1,
        };
        bench_decode_case(
            &cfg,
            weights.clone(),
            sizes,
            fused,
            pages,
            (batch, prompt, gen, bs),
        );
    }
}

#[test]
fn mapped_qwen_checkpoints_put_the_same_bits_on_the_device_as_the_f32_load() {
    // Dummy Qwen2 and Qwen3 weights stored as bf16 safetensors (the HF names of
    // `layer_tensor_shapes`, biases and q/k norms included), next to stories260K's tokenizer
    // (vocab 512): the mapped load must upload the fused bias and norm groups exactly as the
    // host load does.
    use safetensors::tensor::{serialize_to_file, TensorView};
    let root = std::env::temp_dir().join(format!("baton-mapped-qwen-{}", std::process::id()));
    for (name, config) in [("qwen2", QWEN2), ("qwen3", QWEN3)] {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(model_dir().join(f), dir.join(f)).unwrap();
        }
        let config = config.replace(r#""vocab_size":1000"#, r#""vocab_size":512"#);
        std::fs::write(dir.join("config.json"), &config).unwrap();
        let cfg = ModelConfig::from_json_str(&config).unwrap();
        let w = LlamaWeights::dummy(&cfg, 9);
        let bf16 = |t: &baton_model::Tensor| -> Vec<u8> {
            t.data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect()
        };
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = vec![
            (
                "model.embed_tokens.weight".into(),
                w.embed.shape.clone(),
                bf16(&w.embed),
            ),
            (
                "model.norm.weight".into(),
                w.norm.shape.clone(),
                bf16(&w.norm),
            ),
        ];
        if !cfg.tie_word_embeddings {
            tensors.push((
                "lm_head.weight".into(),
                w.lm_head.shape.clone(),
                bf16(&w.lm_head),
            ));
        }
        for (i, l) in w.layers.iter().enumerate() {
            let shapes = baton_model::weights::layer_tensor_shapes(&cfg, i);
            let ts = l.tensors();
            assert_eq!(shapes.len(), ts.len(), "{name}");
            assert_eq!(shapes.len(), 9 + if cfg.qkv_bias { 3 } else { 2 }, "{name}");
            for ((n, s), t) in shapes.into_iter().zip(ts) {
                assert_eq!(s, t.shape, "{name} {n}");
                tensors.push((n, s, bf16(t)));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| {
                let v = TensorView::new(safetensors::Dtype::BF16, s.clone(), d).unwrap();
                (n.clone(), v)
            })
            .collect();
        serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        for dtype in [Dtype::Bf16, Dtype::F32] {
            assert_mapped_uploads_as_the_f32_load(&dir, dtype, name, |host| {
                assert!(
                    host.weights.layers[1].q_bias.is_some() == cfg.qkv_bias,
                    "{name}"
                );
                assert!(
                    host.weights.layers[1].k_norm.is_some() == cfg.qk_norm,
                    "{name}"
                );
            });
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Two launches in flight (`Backend::submit` / `Backend::finish`, as the worker daemon drives
/// the CUDA worker) give every launch the completion it gets when each runs alone to its fence.
/// The in-flight worker's emulated stream is deferred (`EmuDevice::set_deferred`): nothing
/// enqueued runs until a fence wait or a synchronous call needs it, so a launch whose pinned
/// staging, penalty, mask or output buffer the next launch reused before the fence would read
/// the next launch's inputs or lose its ids; once more with waits that run the whole queue
/// (`set_run_ahead`). Some launches run alone (a finish that waited on the wrong fence would
/// read them early), and the penalty lists outgrow their buffers while a launch is in flight
/// (freeing them without waiting panics in the emulator). Each of these was checked by
/// mutation. The rows: greedy; seeded with penalties (the
/// host's list plus the pending id merged on the device, rewarding repeats so that a list read
/// from the wrong launch changes the draw); greedy with a logit bias; and two guided rows with
/// log-probabilities and different masks that, as the scheduler keeps them, never have a
/// sampling row in flight behind another (each joins every other launch, the two in turn, and
/// reads its input id from the token table).
#[test]
fn launches_in_flight_complete_as_launches_run_one_at_a_time() {
    use baton_proto::{
        token_mask_words, Completion, HeapSlotTables, Launch, LaunchRow, SamplingParams, SlotRef,
        NOT_PENDING,
    };
    use baton_worker::Backend;
    let (bs, pages, rows, max_len, steps) = (16usize, 4usize, 5usize, 64usize, 10usize);
    let g = goldens();
    let loaded = || {
        ModelDir::new(model_dir())
            .load(baton_model::LoadFormat::Auto)
            .expect("model")
    };
    let vocab = loaded().config.vocab_size;
    let words = token_mask_words(vocab);
    let params = [
        SamplingParams {
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 0.3,
            frequency_penalty: -2.5,
            repetition_penalty: 1.2,
            ..seeded(31)
        },
        SamplingParams {
            logit_bias_len: 2,
            presence_penalty: 0.2,
            repetition_penalty: 1.05,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            top_p: 0.8,
            top_logprobs: 2,
            want_logprob: 1,
            token_mask: 1,
            ..seeded(32)
        },
        SamplingParams {
            top_logprobs: 3,
            want_logprob: 1,
            token_mask: 1,
            ..SamplingParams::greedy()
        },
    ];
    let prompt_len: Vec<usize> = (0..rows).map(|s| g[s % g.len()].prompt_ids.len()).collect();
    let new_tables = || {
        let t = HeapSlotTables::new_heap_masked(rows, max_len, pages, words);
        for (s, &n) in prompt_len.iter().enumerate() {
            for (p, &id) in g[s % g.len()].prompt_ids[..n].iter().enumerate() {
                t.set_token(s as u32, p, id);
            }
            for i in 0..pages {
                t.set_block(s as u32, i, (s * pages + i) as u32);
            }
        }
        t.set_logit_bias(2, &[(g[2 % g.len()].greedy_ids[0], -50.0), (300, 2.5)]);
        t.set_token_mask(3, &random_mask(7, words, 0.3));
        t.set_token_mask(4, &random_mask(8, words, 0.3));
        t
    };
    // Launch 1 prefills every prompt; launch k > 1 decodes slots 0-2 at position prompt + k - 2,
    // from the previous launch's id on the device (rows 0-2 of every launch). The guided slots
    // decode from the token table, one position per two launches: slot 3 in odd launches,
    // slot 4 in even ones from launch 4 on (its first output comes from launch 1, which is
    // still in flight while launch 2 is staged).
    let launch = |k: usize| Launch {
        seq: k as u64,
        rows: (0..rows)
            .filter(|&s| {
                k == 1
                    || s < 3
                    || (s == 3 && k % 2 == 1)
                    || (s == 4 && k.is_multiple_of(2) && k >= 4)
            })
            .map(|s| {
                let row = |first: usize, n: usize, out: usize| LaunchRow {
                    req: SlotRef {
                        slot: s as u32,
                        generation: 0,
                    },
                    first_pos: first as u32,
                    num_tokens: n as u32,
                    num_blocks: (first + n).div_ceil(bs) as u32,
                    sample: 1,
                    pending_launch: NOT_PENDING,
                    pending_row: 0,
                    output_index: out as u32,
                    lora: 0,
                    reserved: 0,
                    params: params[s],
                };
                if k == 1 {
                    row(0, prompt_len[s], 0)
                } else if s >= 3 {
                    let j = (k + 3 - s) / 2;
                    row(prompt_len[s] + j - 1, 1, j)
                } else {
                    let j = k - 1;
                    LaunchRow {
                        pending_launch: k as u64 - 1,
                        pending_row: s as u32,
                        ..row(prompt_len[s] + j - 1, 1, j)
                    }
                }
            })
            .collect(),
    };
    // Writes a finished launch's ids into the token table, as the scheduler does.
    let record = |t: &HeapSlotTables, l: &Launch, c: &Completion| {
        for s in &c.sampled {
            let r = &l.rows[s.row as usize];
            t.set_token(r.req.slot, (r.first_pos + r.num_tokens) as usize, s.token);
        }
    };
    let sizes = CudaSizes {
        block_size: bs,
        num_blocks: Some(rows * pages),
        // 32 penalty entries to start with: the three penalized rows' lists outgrow them while
        // launches are in flight, so the buffers are replaced under them (after a wait).
        max_tokens: 32,
        max_rows: rows,
        max_model_len: max_len,
    };
    for eager in [false, true] {
        let last = Mutex::new(None);
        let l = loaded();
        let mut one = emu(Dtype::Bf16, eager, &last)(l.config, l.weights.into(), sizes).unwrap();
        let tables = new_tables();
        let mut want = Vec::new();
        for k in 1..=steps {
            let c = one.execute(&launch(k), &tables).expect("launch alone");
            record(&tables, &launch(k), &c);
            want.push(c);
        }

        // A wait runs the stream to its fence only, or (ahead) all of it, as a GPU that
        // already ran the next launch: its copy-back then lands before the host reads.
        for ahead in [false, true] {
            let l = loaded();
            let mut two =
                emu(Dtype::Bf16, eager, &last)(l.config, l.weights.into(), sizes).unwrap();
            let dev = last.lock().unwrap().take().unwrap();
            dev.set_deferred(true).unwrap();
            dev.set_run_ahead(ahead);
            assert_eq!(two.max_in_flight(), 2);
            let tables = new_tables();
            let mut got = Vec::new();
            let finish = |w: &mut CudaWorker, got: &mut Vec<Completion>| {
                let (seq, c) = w.finish().expect("a launch in flight");
                let c = c.expect("launch in flight");
                assert_eq!(seq, c.seq);
                record(&tables, &launch(seq as usize), &c);
                got.push(c);
            };
            // The prefill scores nothing, so it overlaps too. Launches 2, 6, 10, ... run
            // alone: everything is finished before them and they are finished at once (so
            // their own fence is the only one that makes their results ready).
            let mut inflight = 0;
            for k in 1..=steps {
                let alone = k % 4 == 2;
                while inflight == 2 || (alone && inflight > 0) {
                    finish(&mut two, &mut got);
                    inflight -= 1;
                }
                assert!(
                    two.submit(&launch(k), &tables).expect("submit"),
                    "launch {k} was not taken in flight"
                );
                inflight += 1;
                if alone {
                    finish(&mut two, &mut got);
                    inflight -= 1;
                }
            }
            while inflight > 0 {
                finish(&mut two, &mut got);
                inflight -= 1;
            }
            assert!(two.finish().is_none(), "nothing is left in flight");
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(w, g, "launch {} (eager: {eager}, ahead: {ahead})", w.seq);
            }
            assert_eq!(got.len(), steps);
        }
        for (slot, n) in [(3, 1 + (steps - 1) / 2), (4, 1 + (steps - 2) / 2)] {
            let samples = want.iter().flat_map(|c| &c.sampled);
            let count = samples.filter(|s| s.req.slot == slot).count();
            assert_eq!(count, n, "guided slot {slot}'s samples");
        }
    }
}

/// The scheduler, worker sizes and sampling parameters of the bit-for-bit path comparisons:
/// four rows of up to 128 tokens, greedy, with the chosen token's log-probability and the top 5.
fn bits_setup() -> (SchedulerConfig, CudaSizes, baton_proto::SamplingParams) {
    let sched = SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 32,
        max_model_len: 128,
        ..config_for_tests()
    };
    let sizes = sizes_of(&sched);
    let params = baton_proto::SamplingParams {
        want_logprob: 1,
        top_logprobs: 5,
        ..baton_proto::SamplingParams::greedy()
    };
    (sched, sizes, params)
}

/// Each token event's request, token, log-probability bits and top (token, bits) pairs.
#[allow(clippy::type_complexity)]
fn token_bits(ev: Vec<baton_scheduler::Event>) -> Vec<(u64, u32, u32, Vec<(u32, u32)>)> {
    ev.into_iter()
        .filter_map(|ev| match ev {
            baton_scheduler::Event::Token {
                id,
                token,
                logprob,
                top,
                ..
            } => Some((
                id,
                token,
                logprob.to_bits(),
                top.iter().map(|&(t, l)| (t, l.to_bits())).collect(),
            )),
            _ => None,
        })
        .collect()
}

/// `BATON_PERSISTENT_DECODE=1`: a batch-of-one decode step runs every layer in one cooperative
/// launch of `baton_decode_layers_hdD` (grid barriers between the phases, emulated by parking
/// every block at each barrier). Its phases are the per-kernel fused path's bodies, so the
/// tokens and their log-probabilities (and top-5) are bit-identical to the per-kernel path's,
/// with graphs and eagerly, in bf16 and f32, for head dims 64 and 128; batches of several rows
/// keep the per-kernel path. The persistent runs use other thread and block orders (the
/// emulator's reverse and shuffled schedules) and, eagerly, one block per SM instead of three.
#[test]
fn the_persistent_decode_kernel_gives_the_per_kernel_paths_bits() {
    let (sched, sizes, params) = bits_setup();
    let reqs = |base: u64| -> Vec<baton_scheduler::NewRequest> {
        // Two requests side by side (the per-kernel path), then one alone past 64 keys
        // (the persistent kernel over two decode partitions).
        let prompt = |n: u32, a: u32, b: u32| (0..n).map(|p| (a + b * p) % 1000).collect();
        let mut v = if base == 0 {
            vec![
                request(base, prompt(9, 5, 31), 6, params),
                request(base + 1, prompt(20, 7, 17), 6, params),
            ]
        } else {
            vec![request(base, prompt(60, 11, 13), 12, params)]
        };
        for r in &mut v {
            r.eos_ids.clear();
        }
        v
    };
    let events = |e: &mut LocalEngine<CudaWorker>, base: u64| {
        for r in reqs(base) {
            e.add_request(r).unwrap();
        }
        let mut ev = Vec::new();
        e.run_until_idle(&mut ev).unwrap();
        token_bits(ev)
    };
    // Asked for where it cannot run (q/k norms, head dim 8, the cuBLAS path): an error that
    // names the variable, never a silent fallback.
    for (config, no_fused_decode) in [(QWEN3, false), (HD64, true)] {
        let cfg = ModelConfig::from_json_str(config).unwrap();
        let args = CudaArgs {
            dtype: Dtype::F32,
            no_fused_decode,
            ..CudaArgs::default()
        };
        let mut opts = cuda_options(&args, sizes).unwrap();
        opts.tuning.persistent_decode = true;
        let dev = Arc::new(EmuDevice::new(Dtype::F32, EMU_MEMORY));
        let weights = ModelWeights::from(LlamaWeights::dummy(&cfg, 5));
        let e = CudaWorker::with_device(dev, cfg, weights, opts)
            .err()
            .expect("refused");
        assert!(
            e.to_string()
                .contains(baton_cuda::plan::PERSISTENT_DECODE_ENV),
            "{e}"
        );
    }
    // Hidden 2048: rows of more than 128 vectors, where the norm statistic's order depends
    // on the block size (the persistent kernel's blocks have half the entry points' threads).
    const WIDE: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
        "hidden_size":2048,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"head_dim":64,"vocab_size":1000,"max_position_embeddings":256}"#;
    for (config, dtype) in [
        (HD64, Dtype::Bf16),
        (HD64, Dtype::F32),
        (HD128, Dtype::Bf16),
        (WIDE, Dtype::F32),
    ] {
        let cfg = ModelConfig::from_json_str(config).unwrap();
        let weights = LlamaWeights::dummy(&cfg, 5);
        let layers = format!("baton_decode_layers_hd{}", cfg.head_dim);
        for eager in [false, true] {
            let mut got = Vec::new();
            for persistent in [false, true] {
                let last = Mutex::new(None);
                let dev = Arc::new(EmuDevice::new(dtype, EMU_MEMORY));
                if persistent {
                    // Other thread and block orders than the per-kernel run's: other blocks
                    // combine the split-K partitions, and reach each grid barrier last.
                    dev.set_schedule(if eager {
                        baton_cuda_emu::Schedule::Reverse
                    } else {
                        baton_cuda_emu::Schedule::Shuffled(7)
                    });
                }
                *last.lock().unwrap() = Some(dev.clone());
                let args = CudaArgs {
                    dtype,
                    enforce_eager: eager,
                    ..CudaArgs::default()
                };
                let mut opts = cuda_options(&args, sizes).unwrap();
                opts.tuning.persistent_decode = persistent;
                // Eager persistent runs take one block per SM (BATON_PERSISTENT_BLOCKS_PER_SM):
                // other rows per block in every phase, the same bits.
                let per_sm = if eager { 1 } else { 3 };
                opts.tuning.persistent_blocks_per_sm = per_sm;
                let w = CudaWorker::with_device(
                    dev,
                    cfg.clone(),
                    ModelWeights::from(weights.clone()),
                    opts,
                )
                .unwrap();
                let what = format!("{dtype:?} hd{} eager {eager}", cfg.head_dim);
                let grid = w.persistent_decode();
                assert_eq!(grid.is_some(), persistent, "{what}");
                if persistent {
                    // The emulator's 4 SMs, each holding at least 3 blocks.
                    assert_eq!(grid, Some(4 * per_sm as u32), "{what}");
                }
                let mut e = LocalEngine::new(sched.clone(), w);
                let mut ev = events(&mut e, 0);
                ev.extend(events(&mut e, 10));
                assert_eq!(ev.len(), 24, "{what}");
                let dev = last.lock().unwrap().take().unwrap();
                let n = dev.launches_of(&layers);
                if persistent {
                    // The lone request's decode steps (its first token comes from a prefill).
                    assert!(n >= 11, "{what}: {n} persistent launches");
                } else {
                    assert_eq!(n, 0, "{what}");
                }
                got.push(ev);
            }
            assert_eq!(got[0], got[1], "{dtype:?} hd{} eager {eager}", cfg.head_dim);
        }
    }
}

/// `BATON_GEMV_ASYNC=1`: the batch-of-one GEMVs stream their weights through a shared-memory
/// ring (`baton_gemv_t1_async`, `baton_gemv_silu_t1_async`) with the register entries' sums,
/// so the tokens and log-probabilities (and top-5) are bit-identical, with graphs and eagerly,
/// in bf16 and f32; a row longer than the ring entries' buffer (here the down projection of
/// an 8192-wide MLP in f32) keeps the register entry.
#[test]
fn the_gemv_ring_entries_give_the_register_paths_bits() {
    let (sched, sizes, params) = bits_setup();
    const LONG_MLP: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
        "hidden_size":256,"intermediate_size":8192,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"head_dim":64,"vocab_size":1000,"max_position_embeddings":256}"#;
    for (config, dtype) in [
        (HD64, Dtype::Bf16),
        (HD128, Dtype::F32),
        (LONG_MLP, Dtype::F32),
    ] {
        let cfg = ModelConfig::from_json_str(config).unwrap();
        let weights = LlamaWeights::dummy(&cfg, 5);
        for eager in [false, true] {
            let mut got = Vec::new();
            for ring in [false, true] {
                let dev = Arc::new(EmuDevice::new(dtype, EMU_MEMORY));
                if ring {
                    dev.set_schedule(baton_cuda_emu::Schedule::Shuffled(3));
                }
                let args = CudaArgs {
                    dtype,
                    enforce_eager: eager,
                    ..CudaArgs::default()
                };
                let mut opts = cuda_options(&args, sizes).unwrap();
                opts.tuning.gemv_async = ring;
                let w = CudaWorker::with_device(
                    dev.clone(),
                    cfg.clone(),
                    ModelWeights::from(weights.clone()),
                    opts,
                )
                .unwrap();
                let mut e = LocalEngine::new(sched.clone(), w);
                let prompt = |n: u32, a: u32, b: u32| (0..n).map(|p| (a + b * p) % 1000).collect();
                let mut r = request(0, prompt(30, 11, 13), 10, params);
                r.eos_ids.clear();
                e.add_request(r).unwrap();
                let mut ev = Vec::new();
                e.run_until_idle(&mut ev).unwrap();
                let ev: Vec<_> = token_bits(ev)
                    .into_iter()
                    .map(|(_, t, l, top)| (t, l, top))
                    .collect();
                let what = format!("{dtype:?} hd{} eager {eager} ring {ring}", cfg.head_dim);
                assert_eq!(ev.len(), 10, "{what}");
                let (reg, asy) = (
                    dev.launches_of("baton_gemv_t1") + dev.launches_of("baton_gemv_silu_t1"),
                    dev.launches_of("baton_gemv_t1_async")
                        + dev.launches_of("baton_gemv_silu_t1_async"),
                );
                if ring {
                    // Nine decode steps of two layers, each with 4 GEMVs a layer and the LM
                    // head (the long MLP's down projections stay on the register entry).
                    let long = cfg.intermediate_size * dtype.size()
                        > baton_cuda::plan::GEMV_ASYNC_XS_BYTES;
                    let per_step = 2 * if long { 3 } else { 4 } + 1;
                    assert!(asy >= 9 * per_step, "{what}: {asy} ring launches");
                    assert_eq!(reg > 0, long, "{what}: {reg} register launches");
                } else {
                    assert_eq!(asy, 0, "{what}");
                }
                got.push(ev);
            }
            assert_eq!(got[0], got[1], "{dtype:?} hd{} eager {eager}", cfg.head_dim);
        }
    }
}

/// Two seeded dummy adapters for `cfg` (PEFT layout, every q/k/v/o/gate/up/down module of
/// every layer; ranks 4 and 8, different seeds) written under `root` and loaded.
fn lora_adapters(cfg: &ModelConfig, root: &std::path::Path) -> Vec<baton_model::LoraAdapter> {
    use baton_model::lora::{write_dummy_adapter, LoraAdapter, LoraModule};
    [(4usize, 8.0, 11u64), (8, 16.0, 12)]
        .iter()
        .enumerate()
        .map(|(i, &(rank, alpha, seed))| {
            let dir = root.join(format!("adapter{i}"));
            write_dummy_adapter(&dir, cfg, rank, alpha, 0.25, seed).expect("adapter written");
            let module = LoraModule {
                name: format!("a{i}"),
                path: dir,
            };
            LoraAdapter::load(&module, cfg, 16).expect("adapter loads")
        })
        .collect()
}

/// A fresh directory under the system's temporary directory for `tag`.
fn lora_root(tag: &str) -> std::path::PathBuf {
    let root = std::env::temp_dir().join(format!("baton-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// A sampled token with its log-probability and top entries.
type TokenOutput = (u32, f32, Vec<(u32, f32)>);

/// Per request, each [`TokenOutput`].
type TokenOutputs = std::collections::HashMap<u64, Vec<TokenOutput>>;

/// Runs `reqs` to the end on `engine` and returns every request's [`TokenOutputs`].
fn run_with_logprobs<B: baton_worker::Backend>(
    engine: &mut LocalEngine<B>,
    reqs: Vec<baton_scheduler::NewRequest>,
) -> TokenOutputs {
    for r in reqs {
        engine.add_request(r).expect("admitted");
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events).expect("runs");
    assert_pool_full(engine);
    let mut out = TokenOutputs::new();
    for e in events {
        if let baton_scheduler::Event::Token {
            id,
            token,
            logprob,
            top,
            ..
        } = e
        {
            out.entry(id).or_default().push((token, logprob, top));
        }
    }
    out
}

/// Asserts `got` has `want`'s tokens, and log-probabilities and top entries within `tol`
/// (top ids equal, or a tie the two workers broke differently).
#[track_caller]
fn assert_outputs_close(what: &str, got: &TokenOutputs, want: &TokenOutputs, tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: requests");
    for (id, w) in want {
        let g = &got[id];
        let tokens = |v: &[TokenOutput]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(tokens(g), tokens(w), "{what}: request {id}'s tokens");
        for (step, ((_, gl, gtop), (_, wl, wtop))) in g.iter().zip(w).enumerate() {
            assert!(
                (gl - wl).abs() < tol,
                "{what}: request {id} step {step}: log-probability {gl} vs {wl}"
            );
            assert_eq!(gtop.len(), wtop.len(), "{what}: request {id} step {step}");
            for (&(a, al), &(b, bl)) in gtop.iter().zip(wtop) {
                assert!(
                    (al - bl).abs() < tol
                        && (a == b || wtop.iter().any(|&(t, l)| t == a && (l - al).abs() < tol)),
                    "{what}: request {id} step {step}: top {gtop:?} vs {wtop:?}"
                );
            }
        }
    }
}

/// Greedy requests with log-probabilities and the top 5, no EOS (fixed lengths): prompt `i`
/// (of `20 + 7 * (i % 4)` tokens; requests 0, 1 and 2 share theirs) with adapter `lora[i]`.
fn lora_requests(lora: &[u32], vocab: u32) -> Vec<baton_scheduler::NewRequest> {
    let params = baton_proto::SamplingParams {
        want_logprob: 1,
        top_logprobs: 5,
        ..baton_proto::SamplingParams::greedy()
    };
    lora.iter()
        .enumerate()
        .map(|(i, &l)| {
            let p = if i < 3 { 0 } else { i as u32 };
            let prompt = (0..20 + 7 * (p % 4))
                .map(|j| (3 + p * 101 + 37 * j) % vocab)
                .collect();
            baton_scheduler::NewRequest {
                eos_ids: Vec::new(),
                lora: l,
                ..baton_scheduler::NewRequest::new(i as u64, prompt, 8, params)
            }
        })
        .collect()
}

/// The CUDA worker with LoRA adapters, against the CPU worker with the same adapters, in f32:
/// a run whose launches mix adapter 0, 1 and 2 rows, prefill chunks (a 24-token budget) and
/// decodes gives the CPU's greedy tokens, log-probabilities and top entries (within the 1e-4
/// of the other f32 comparisons), through graphs or eagerly; requests that share a prompt
/// but not an adapter differ (the adapters act); with graphs, decode launches with adapter
/// rows replay the LoRA graphs `set_lora_adapters` captured. Then base-model requests alone
/// on the same worker replay graphs and launch no LoRA kernel. `graphs` runs the
/// graph-enabled worker too (eager always).
fn lora_rows_match_the_cpu_worker(
    name: &str,
    cfg: &ModelConfig,
    weights: &LlamaWeights,
    graphs: bool,
) {
    use baton_worker::Backend;
    let root = lora_root(name);
    let adapters = lora_adapters(cfg, &root);
    let sched = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 24,
        max_model_len: 128,
        ..config(16, 128, 2)
    };
    let mixed = [0u32, 1, 2, 1, 0, 2, 2, 1];
    let vocab = cfg.vocab_size as u32;
    let mut model = baton_model::CpuModel::try_new(cfg.clone(), weights.clone()).unwrap();
    model.set_lora_adapters(adapters.clone()).unwrap();
    let cpu = baton_worker::CpuBackend::new(model, sched.num_blocks, sched.block_size);
    let mut cpu = LocalEngine::new(sched.clone(), cpu);
    let want = run_with_logprobs(&mut cpu, lora_requests(&mixed, vocab));
    let want_base = run_with_logprobs(&mut cpu, lora_requests(&[0; 4], vocab));
    // Requests 0, 1 and 2 share a prompt with adapters 0, 1 and 2.
    for (a, b) in [(0, 1), (0, 2), (1, 2)] {
        assert_ne!(
            want[&a], want[&b],
            "{name}: adapters {a} and {b} give the same outputs"
        );
    }
    let eager_modes: &[bool] = if graphs { &[false, true] } else { &[true] };
    for &eager in eager_modes {
        let what = format!("{name} (eager {eager})");
        let last = Mutex::new(None);
        let mut w =
            emu(Dtype::F32, eager, &last)(cfg.clone(), weights.clone().into(), sizes_of(&sched))
                .unwrap();
        w.set_lora_adapters(adapters.clone())
            .expect("the CUDA worker takes the adapters");
        assert_eq!(w.lora_usage().0, 2, "{what}");
        let dev = last.lock().unwrap().take().unwrap();
        dev.set_deferred(true).unwrap();
        let mut e = LocalEngine::new(sched.clone(), w);
        let replays = dev.graph_launches();
        let got = run_with_logprobs(&mut e, lora_requests(&mixed, vocab));
        assert_outputs_close(&what, &got, &want, 1e-4);
        assert_eq!(
            dev.graph_launches() > replays,
            !eager,
            "{what}: decodes with adapter rows replay graphs unless eager"
        );
        let layers = cfg.num_hidden_layers as u64;
        let shrinks = dev.launches_of("baton_lora_shrink");
        assert!(
            shrinks >= 4 * layers,
            "{what}: {shrinks} LoRA shrink launches"
        );
        assert_eq!(dev.launches_of("baton_lora_expand"), shrinks, "{what}");
        let graphs_before = dev.graph_launches();
        let got_base = run_with_logprobs(&mut e, lora_requests(&[0; 4], vocab));
        assert_outputs_close(&format!("{what}, base rows"), &got_base, &want_base, 1e-4);
        assert_eq!(
            dev.launches_of("baton_lora_shrink"),
            shrinks,
            "{what}: a launch without adapter rows ran a LoRA kernel"
        );
        if eager {
            assert_eq!(dev.graph_launches(), 0, "{what}");
        } else {
            assert!(
                dev.graph_launches() > graphs_before,
                "{what}: base-model decodes did not replay graphs"
            );
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn lora_rows_of_mixed_batches_match_the_cpu_worker_with_graphs_and_eagerly() {
    let loaded = ModelDir::new(model_dir())
        .load(baton_model::LoadFormat::Auto)
        .expect("model");
    lora_rows_match_the_cpu_worker("stories260K", &loaded.config, &loaded.weights, true);
}

/// Partial RoPE with an attention factor: the CUDA worker scales the rotated dims' q rows of
/// the q/k/v weights at upload, and must scale the adapters' matching `B` rows too.
#[test]
fn lora_rows_of_a_partial_rope_model_with_an_attention_factor_match_the_cpu_worker() {
    let cfg = ModelConfig::from_json_str(HD64_PARTIAL_LONGROPE).unwrap();
    let weights = LlamaWeights::dummy(&cfg, 3);
    lora_rows_match_the_cpu_worker("partial-longrope", &cfg, &weights, false);
}

/// Loading adapters changes nothing for base-model rows: the same requests (adapter 0) give
/// the same bits (tokens, log-probabilities, top entries) on a worker with adapters as on one
/// without, with graphs.
#[test]
fn base_rows_give_the_same_bits_with_and_without_lora_adapters() {
    use baton_worker::Backend;
    let loaded = ModelDir::new(model_dir())
        .load(baton_model::LoadFormat::Auto)
        .expect("model");
    let root = lora_root("base-bits");
    let adapters = lora_adapters(&loaded.config, &root);
    let sched = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 24,
        max_model_len: 128,
        ..config(16, 128, 2)
    };
    let vocab = loaded.config.vocab_size as u32;
    let mut outs = Vec::new();
    for with in [false, true] {
        let last = Mutex::new(None);
        let mut w = emu(Dtype::F32, false, &last)(
            loaded.config.clone(),
            loaded.weights.clone().into(),
            sizes_of(&sched),
        )
        .unwrap();
        if with {
            w.set_lora_adapters(adapters.clone()).unwrap();
        }
        let dev = last.lock().unwrap().take().unwrap();
        if with {
            // Loading adapters again captures new LoRA graphs and destroys the old ones (they
            // read the old adapters' buffers); loading none destroys them.
            let (live, captured) = (dev.live_graphs(), dev.graphs());
            w.set_lora_adapters(adapters.clone()).unwrap();
            assert!(dev.graphs() > captured, "new LoRA graphs captured");
            assert_eq!(dev.live_graphs(), live, "the old LoRA graphs destroyed");
            w.set_lora_adapters(Vec::new()).unwrap();
            assert!(
                dev.live_graphs() < live,
                "unloading destroys the LoRA graphs"
            );
            w.set_lora_adapters(adapters.clone()).unwrap();
            assert_eq!(dev.live_graphs(), live);
        }
        // Capturing the LoRA graphs launches the LoRA kernels; serving base rows must not.
        let (shrinks, replays) = (dev.launches_of("baton_lora_shrink"), dev.graph_launches());
        assert_eq!(shrinks > 0, with, "adapters {with}: LoRA graphs captured");
        let mut e = LocalEngine::new(sched.clone(), w);
        outs.push(run_with_logprobs(&mut e, lora_requests(&[0; 6], vocab)));
        assert!(
            dev.graph_launches() > replays,
            "adapters {with}: no graph replay"
        );
        assert_eq!(
            dev.launches_of("baton_lora_shrink"),
            shrinks,
            "adapters {with}"
        );
    }
    assert_eq!(outs[0], outs[1], "adapters change base-model rows");
    std::fs::remove_dir_all(&root).ok();
}

/// Adapters for another model (another layer count; the same layer count but other widths)
/// and ranks past the kernels' limit are refused with an error naming the problem, never a
/// panic; the worker then serves no adapter, and a row that asks for one fails its launch.
#[test]
fn lora_adapters_for_another_model_or_past_the_kernels_limits_are_refused() {
    use baton_worker::Backend;
    let loaded = ModelDir::new(model_dir())
        .load(baton_model::LoadFormat::Auto)
        .expect("model");
    let cfg = loaded.config.clone();
    let root = lora_root("refused");
    let sched = SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 32,
        max_model_len: 128,
        ..config(16, 64, 2)
    };
    let last = Mutex::new(None);
    let mut w =
        emu(Dtype::F32, true, &last)(cfg.clone(), loaded.weights.into(), sizes_of(&sched)).unwrap();
    let two_layers = ModelConfig::from_json_str(HD64).unwrap();
    let mut wide = ModelConfig::from_json_str(HD64).unwrap();
    wide.num_hidden_layers = cfg.num_hidden_layers;
    let mut big_rank = lora_adapters(&cfg, &root.join("big")).remove(0);
    {
        let p = &mut big_rank.layers[1][baton_model::lora::LoraLinear::Down as usize][0];
        p.rank = 513;
        p.a = vec![0.01; 513 * p.k];
        p.b = vec![0.01; p.n * 513];
        big_rank.max_rank = 513;
    }
    let cases = [
        (
            lora_adapters(&two_layers, &root.join("two")),
            "another model",
        ),
        (lora_adapters(&wide, &root.join("wide")), "another model"),
        (vec![big_rank], "rank 513"),
    ];
    for (adapters, want) in cases {
        let e = w
            .set_lora_adapters(adapters)
            .expect_err("adapters that do not fit are refused");
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg:?} should say {want:?}");
        assert_eq!(w.lora_usage(), (0, 0), "a refused set left adapters behind");
    }
    let mut e = LocalEngine::new(sched, w);
    let mut reqs = lora_requests(&[1], cfg.vocab_size as u32);
    e.add_request(reqs.remove(0)).unwrap();
    let err = e
        .run_until_idle(&mut Vec::new())
        .expect_err("a row with an adapter that is not loaded fails");
    assert!(
        err.to_string().contains("LoRA adapter 1"),
        "unexpected error: {err}"
    );
    std::fs::remove_dir_all(&root).ok();
}

/// Qwen3-30B-A3B's routing (128 experts, top 8) at a quarter of its widths, layer by layer in
/// bf16 over a 100-token prompt. The dummy router's logits have a standard deviation of about
/// 6.5 here (13 at the real widths), so the attention half's bf16 rounding moves the routing
/// weights by percents: `debug layers` compares a mixture-of-experts layer a half at a time
/// (the CPU's MLP block starts from the GPU's MLP input). Compared whole, this layer is
/// 1.0e-2 to 1.5e-2 off (and 2.1e-2 at the real widths: session 35's H200 run of gpu-check
/// 3h); a half at a time, about 5e-3.
#[test]
fn mixture_of_experts_layers_are_compared_a_half_at_a_time() {
    let config = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
        "hidden_size":512,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,
        "head_dim":16,"vocab_size":1000,"max_position_embeddings":1024,"intermediate_size":128,
        "num_experts":128,"num_experts_per_tok":8,"moe_intermediate_size":512,
        "norm_topk_prob":true}"#;
    let a = dummy_args(config, Dtype::Bf16, 1e-2, 100);
    let last = Mutex::new(None);
    compare(&a, true, &emu(Dtype::Bf16, true, &last))
        .unwrap_or_else(|e| panic!("bf16 layers: {e:#}"));
}
