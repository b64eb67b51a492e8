//! `baton debug …`: hidden comparison hooks for bringing up a device backend against the CPU
//! reference (used by `scripts/gpu-check.sh`). Each prints PASS or FAIL lines and fails (non-zero
//! exit) on a mismatch.

use crate::cuda_args::{build_cuda, check_cuda_device, CudaArgs, CudaSizes};
use crate::engine::LocalEngine;
use crate::generate::LoadFormatArg;
use anyhow::{bail, Context, Result};
use baton_cuda::executor::RowInput;
use baton_cuda::CudaWorker;
use baton_model::{
    CpuModel, ForwardRow, LlamaWeights, LoadFormat, ModelConfig, ModelDir, ModelWeights,
    PagedKvCache,
};
use baton_proto::SamplingParams;
use baton_scheduler::{Event, NewRequest, SchedulerConfig};
use baton_worker::Backend;
use clap::{Args, Subcommand};
use std::collections::HashMap;
use std::path::PathBuf;

/// `baton debug …`
#[derive(Subcommand, Clone, Debug)]
pub enum DebugCmd {
    /// Greedy goldens of `<model>/golden.json` on CUDA, alone and batched (exact ids).
    Golden(GoldenArgs),
    /// First-step logits of a prompt on CUDA against the CPU reference.
    Logits(CompareArgs),
    /// Every layer's output on CUDA against the CPU reference on the same (rounded) weights,
    /// each layer from the GPU's input to it (a mixture-of-experts layer a half at a time),
    /// for a batch mixing prefill chunks and decodes.
    Layers(CompareArgs),
    /// Writes a seeded random LoRA adapter (PEFT layout) for a model, updating every q, k, v,
    /// o, gate, up and down projection (for tests and benchmarks of --lora-modules).
    LoraAdapter(LoraAdapterArgs),
}

/// Flags of `baton debug lora-adapter`.
#[derive(Args, Clone, Debug)]
pub struct LoraAdapterArgs {
    /// The model directory whose config.json gives the shapes.
    #[arg(long)]
    pub model: PathBuf,
    /// The adapter directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Rank `r`.
    #[arg(long, default_value_t = 8)]
    pub rank: usize,
    /// `lora_alpha`.
    #[arg(long, default_value_t = 16.0)]
    pub alpha: f64,
    /// The values of A and B are uniform in +-this.
    #[arg(long, default_value_t = 0.05)]
    pub amplitude: f32,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Flags of `baton debug golden`.
#[derive(Args, Clone, Debug)]
pub struct GoldenArgs {
    /// Model directory holding golden.json.
    #[arg(long)]
    pub model: PathBuf,
    /// CUDA flags (use --dtype f32 for exact goldens).
    #[command(flatten)]
    pub cuda: CudaArgs,
}

/// Flags of `baton debug logits` and `baton debug layers`.
#[derive(Args, Clone, Debug)]
pub struct CompareArgs {
    /// Model directory (config.json; weights unless --load-format dummy).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A config.json file or its JSON text (with --load-format dummy, instead of --model).
    #[arg(long)]
    pub config: Option<String>,
    /// Weight loading.
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// Seed of dummy weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt token ids (comma-separated; default: a fixed synthetic prompt).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<u32>,
    /// Largest accepted relative error, max |cuda - cpu| / max |cpu| (per layer for layers).
    #[arg(long, default_value_t = 2e-2)]
    pub tol: f64,
    /// Write both sides' values as JSON here.
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// CUDA flags.
    #[command(flatten)]
    pub cuda: CudaArgs,
}

/// Runs a `baton debug` subcommand.
///
/// # Errors
/// A mismatch, bad flags, a backend failure.
pub fn run(mut cmd: DebugCmd) -> Result<()> {
    let (cuda, model) = match &mut cmd {
        DebugCmd::LoraAdapter(a) => return lora_adapter(a),
        DebugCmd::Golden(a) => (&mut a.cuda, Some(&a.model)),
        DebugCmd::Logits(a) | DebugCmd::Layers(a) => (&mut a.cuda, a.model.as_ref()),
    };
    let cfg = model.and_then(|m| ModelConfig::from_file(&m.join("config.json")).ok());
    cuda.resolve_dtype(cfg.as_ref());
    check_cuda_device(cuda, cfg.as_ref())?;
    match cmd {
        DebugCmd::Golden(a) => golden(&a.model, &|c, w, s| build_cuda(c, w, &a.cuda, s)),
        DebugCmd::Logits(a) => compare(&a, false, &eager(&a.cuda)),
        DebugCmd::Layers(a) => compare(&a, true, &eager(&a.cuda)),
        DebugCmd::LoraAdapter(_) => Ok(()),
    }
}

/// Builds the worker a check runs on, from the model and the sizes the check needs: the CUDA
/// device from the flags, or (in tests) the host emulator.
pub type BuildWorker<'a> = dyn Fn(ModelConfig, ModelWeights, CudaSizes) -> Result<CudaWorker> + 'a;

/// A builder on the CUDA device with graphs off (the comparisons dump per-layer outputs, which
/// graphs cannot).
fn eager(a: &CudaArgs) -> impl Fn(ModelConfig, ModelWeights, CudaSizes) -> Result<CudaWorker> + '_ {
    move |c, w, s| {
        let mut args = a.clone();
        args.enforce_eager = true;
        build_cuda(c, w, &args, s)
    }
}

/// `"PASS"` when `err <= tol`, else `"FAIL"`, counted in `failed`.
fn judge(err: f64, tol: f64, failed: &mut usize) -> &'static str {
    if err <= tol {
        "PASS"
    } else {
        *failed += 1;
        "FAIL"
    }
}

/// Index of the largest value (the first of equals; NaN never wins); 0 when empty.
fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |m, (i, &x)| if x > m.1 { (i, x) } else { m },
        )
        .0
}

/// `max |a - b| / max |b|` (0 when both are empty; infinite when the lengths differ or a
/// difference is NaN).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    rel_err_rows(a, b, a.len().max(1), &[])
}

/// [`rel_err`] over the rows (`width` values each) whose `skip` flag is not set (rows past
/// `skip` are kept); the scale is still `max |b|` over every row.
pub fn rel_err_rows(a: &[f32], b: &[f32], width: usize, skip: &[bool]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let mut diff = 0f64;
    for (i, (ra, rb)) in a.chunks(width).zip(b.chunks(width)).enumerate() {
        if skip.get(i) == Some(&true) {
            continue;
        }
        for (&x, &y) in ra.iter().zip(rb) {
            let d = (f64::from(x) - f64::from(y)).abs();
            // f64::max drops a NaN: a NaN output must not pass.
            diff = if d.is_nan() {
                f64::INFINITY
            } else {
                diff.max(d)
            };
            if diff.is_infinite() {
                return f64::INFINITY;
            }
        }
    }
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// Per token, whether its experts in one mixture-of-experts layer differ between `a` and `b`
/// (`[T * top_k]` ids each, every token's ascending); `None` when the lists do not match in
/// length.
fn routes_differ(a: &[u32], b: &[u32], top_k: usize) -> Option<Vec<bool>> {
    (a.len() == b.len() && top_k > 0).then(|| {
        a.chunks(top_k)
            .zip(b.chunks(top_k))
            .map(|(x, y)| x != y)
            .collect()
    })
}

/// Most tokens of a step whose experts may differ between the GPU and the CPU in one
/// mixture-of-experts layer of `debug layers`: the larger of 2 and this fraction of them.
/// Both route from the GPU's MLP input, but the GPU's router reads it normalized and rounded
/// to the 16-bit dtype, the CPU's in f32, so a token whose k-th and (k+1)-th router logits
/// lie within that rounding takes another expert (a numpy model of Qwen3-30B-A3B's dummy
/// router, 128 experts, top 8: 1.8 % of tokens in bf16). A routing bug moves most tokens.
const MAX_ROUTE_DIFF: f64 = 0.1;

/// `baton debug golden`: the greedy goldens of `<model>/golden.json`, each alone and then all
/// together (asynchronous scheduling, so `PendingFrom` rows and decode graphs are used), on
/// the worker `build` makes. Prints a PASS/FAIL line per run.
///
/// # Errors
/// Any differing id, a missing or malformed golden.json, a backend failure.
pub fn golden(model: &std::path::Path, build: &BuildWorker<'_>) -> Result<()> {
    let text = std::fs::read_to_string(model.join("golden.json"))
        .with_context(|| format!("reading {}/golden.json", model.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let goldens: Vec<(Vec<u32>, Vec<u32>)> = v["prompts"]
        .as_array()
        .context("golden.json has no prompts array")?
        .iter()
        .map(|p| (ids(&p["prompt_ids"]), ids(&p["greedy_ids"])))
        .collect();
    // Mapped: the worker reads the checkpoint in its stored dtype, as generate and serve do.
    let loaded = ModelDir::new(model).load_mapped(LoadFormat::Auto)?;
    let cfg = loaded.config.clone();
    let eos = loaded.eos_token_ids();
    let sched = SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 2048,
        block_size: 16,
        num_blocks: 512,
        max_model_len: cfg.max_position_embeddings,
        max_inflight: 2,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    };
    let sizes = CudaSizes {
        block_size: 16,
        num_blocks: Some(512),
        max_tokens: 2048,
        max_rows: 64,
        max_model_len: cfg.max_position_embeddings,
    };
    let backend = build(loaded.config, loaded.weights, sizes)?;
    let mut engine = LocalEngine::new(sched, backend);
    let mut failed = 0;
    // Alone, one at a time; then all together.
    for (i, (prompt, want)) in goldens.iter().enumerate() {
        let out = run_greedy(&mut engine, std::slice::from_ref(prompt), want.len(), &eos)?;
        failed += report(&format!("golden {i} alone"), &out[0], want);
    }
    let prompts: Vec<Vec<u32>> = goldens.iter().map(|g| g.0.clone()).collect();
    let n = goldens.iter().map(|g| g.1.len()).max().unwrap_or(0);
    let out = run_greedy(&mut engine, &prompts, n, &eos)?;
    for (i, (_, want)) in goldens.iter().enumerate() {
        let got: Vec<u32> = out[i].iter().take(want.len()).copied().collect();
        failed += report(&format!("golden {i} batched"), &got, want);
    }
    if failed > 0 {
        bail!("{failed} golden runs differ");
    }
    Ok(())
}

fn report(what: &str, got: &[u32], want: &[u32]) -> usize {
    if got == want {
        outln!("PASS {what}");
        0
    } else {
        let at = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        outln!("FAIL {what}: first difference at output {at} (got {got:?}, want {want:?})");
        1
    }
}

fn run_greedy<B: Backend>(
    engine: &mut LocalEngine<B>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    eos: &[u32],
) -> Result<Vec<Vec<u32>>> {
    for (i, p) in prompts.iter().enumerate() {
        engine
            .add_request(NewRequest {
                eos_ids: eos.to_vec(),
                ..NewRequest::new(
                    i as u64,
                    p.clone(),
                    max_tokens as u32,
                    SamplingParams::greedy(),
                )
            })
            .map_err(|e| anyhow::anyhow!("prompt {i}: {e:?}"))?;
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events)?;
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    for e in events {
        if let Event::Token { id, token, .. } = e {
            out.entry(id).or_default().push(token);
        }
    }
    Ok((0..prompts.len())
        .map(|i| out.remove(&(i as u64)).unwrap_or_default())
        .collect())
}

fn load(a: &CompareArgs) -> Result<(ModelConfig, LlamaWeights)> {
    let cfg = match (&a.config, &a.model) {
        (Some(c), _) if c.trim_start().starts_with('{') => {
            ModelConfig::from_json_str_named(c, "--config")?
        }
        (Some(c), _) => ModelConfig::from_file(std::path::Path::new(c))?,
        (None, Some(dir)) => ModelConfig::from_file(&ModelDir::new(dir).config_path())?,
        (None, None) => bail!("give --model DIR or --config JSON"),
    };
    let w = match (a.load_format, &a.model) {
        (LoadFormatArg::Dummy, _) => {
            baton_model::check_dummy_fits(&cfg)?;
            LlamaWeights::dummy(&cfg, a.seed)
        }
        (f, Some(dir)) => {
            let format = f.with_seed(a.seed, Some(dir))?;
            ModelDir::new(dir).load(format)?.weights
        }
        (_, None) => bail!("--config needs --load-format dummy"),
    };
    Ok((cfg, w))
}

/// One decode row per sequence of `prev`, right after it (the split-K decode kernel's path).
fn decode_step(prev: &Step, vocab: usize) -> Step {
    prev.iter()
        .enumerate()
        .map(|(i, (t, s, b))| {
            (
                vec![(7 + 31 * i as u32) % vocab as u32],
                s + t.len(),
                b.clone(),
            )
        })
        .collect()
}

/// The rows of the comparison: `(tokens, start_pos, block_table)` per step.
type Step = Vec<(Vec<u32>, usize, Vec<u32>)>;

/// Two steps over four sequences (block size 16, pages disjoint): step 1 prefills A (40
/// tokens), B (17) and D (5); step 2 mixes a prefill continuation of A (20 tokens), decodes of
/// B and D, and a fresh prefill of C (9 tokens).
fn mixed_steps(vocab: usize, prompt: &[u32]) -> (Step, Step) {
    let tok = |s: u32, p: usize| {
        if s == 0 && p < prompt.len() {
            prompt[p]
        } else {
            (5 + 13 * s + 29 * p as u32) % vocab as u32
        }
    };
    let pages = |s: u32| (0..8).map(|j| s * 8 + j).collect::<Vec<u32>>();
    let span = |s: u32, from: usize, n: usize| {
        (
            (from..from + n).map(|p| tok(s, p)).collect::<Vec<u32>>(),
            from,
            pages(s),
        )
    };
    let a_len = if prompt.is_empty() { 40 } else { prompt.len() };
    let step1 = vec![span(0, 0, a_len), span(1, 0, 17), span(3, 0, 5)];
    let step2 = vec![
        span(0, a_len, 20),
        span(1, 17, 1),
        span(2, 0, 9),
        span(3, 5, 1),
    ];
    (step1, step2)
}

/// `baton debug logits` (`layers` false: the logits after one prompt, then after one decode
/// step, against `CpuModel` on the f32 weights) and `baton debug layers` (every layer's output
/// and the logits over `mixed_steps` plus a decode-only step, against `CpuModel` on the weights
/// rounded to `--dtype`, each layer run on the GPU's input to it, see
/// [`CpuModel::forward_layers_forced`]; the drift accumulated from the embedding is printed
/// beside it; a mixture-of-experts layer a half at a time, its MLP block from the GPU's MLP
/// input, see [`CpuModel::forward_layers_forced_moe`]) on the worker `build` makes; relative
/// error [`rel_err`] at most `a.tol`. Prints a PASS/FAIL line per comparison.
///
/// # Errors
/// A comparison over the tolerance, bad flags, a backend failure.
pub fn compare(a: &CompareArgs, layers: bool, build: &BuildWorker<'_>) -> Result<()> {
    let (mut cfg, weights) = load(a)?;
    // The comparison's served length (sizes below) chooses LongRoPE's factors, for both sides.
    cfg.set_max_model_len(2048.min(cfg.max_position_embeddings));
    let vocab = cfg.vocab_size;
    // The layer comparison runs the CPU on the weights the GPU holds (rounded to --dtype):
    // rounding a dummy 1B model's weights to bf16 alone moves its layer outputs by 6e-3 at
    // layer 0 and 1e-2 by layer 3, which is not the kernels' error.
    let mut cpu_weights = weights.clone();
    if layers {
        let dtype = a.cuda.dtype;
        cpu_weights.map_values(|x| dtype.round(x));
    }
    let cpu = CpuModel::try_new(cfg.clone(), cpu_weights)?;
    let mut kv = PagedKvCache::new(&cfg, 128, 16);
    let mut kv_forced = PagedKvCache::new(&cfg, 128, 16);
    let sizes = CudaSizes {
        block_size: 16,
        num_blocks: Some(128),
        max_tokens: 1024,
        max_rows: 8,
        max_model_len: 2048.min(cfg.max_position_embeddings),
    };
    let sparse = cfg.moe.as_ref().map(|m| (m.layers.clone(), m.top_k));
    let hidden = cfg.hidden_size;
    let mut gpu = build(cfg, weights.into(), sizes)?;
    let steps: Vec<Step> = if layers {
        let (s1, s2) = mixed_steps(vocab, &a.prompt_ids);
        let s3 = decode_step(&s2, vocab);
        vec![s1, s2, s3]
    } else {
        let prompt = if a.prompt_ids.is_empty() {
            (0..24).map(|p| (1 + 37 * p) % vocab as u32).collect()
        } else {
            a.prompt_ids.clone()
        };
        let n = prompt.len();
        if n + 1 > sizes.max_tokens.min(sizes.max_model_len) {
            bail!(
                "a prompt of {n} tokens does not fit the comparison's limits ({} tokens)",
                sizes.max_tokens.min(sizes.max_model_len) - 1
            );
        }
        // The prompt, then one decode step after it (past 512 tokens of context, the split-K
        // decode path with several partitions).
        let first = vec![(prompt, 0, (0..(n + 1).div_ceil(16) as u32).collect())];
        let second = decode_step(&first, vocab);
        vec![first, second]
    };
    let mut failed = 0;
    let mut dump = Vec::new();
    for (si, step) in steps.iter().enumerate() {
        let fw: Vec<ForwardRow> = step
            .iter()
            .map(|(t, s, b)| ForwardRow {
                tokens: t,
                start_pos: *s,
                block_table: b,
                want_logits: true,
                all_logits: false,
                lora: 0,
            })
            .collect();
        let (cpu_logits, cpu_layers) = cpu.forward_with_layer_outputs(&mut kv, &fw)?;
        let rows: Vec<RowInput> = step
            .iter()
            .map(|(t, s, b)| RowInput {
                tokens: t.clone(),
                start_pos: *s,
                block_table: b.clone(),
                pending: None,
                sample: true,
                params: SamplingParams::greedy(),
                output_index: 0,
                penalties: Vec::new(),
                scored: Vec::new(),
            })
            .collect();
        let (gpu_logits, gpu_layers) = gpu
            .forward_debug(&rows, layers)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if layers {
            if gpu_layers.len() != cpu_layers.len() {
                bail!(
                    "the GPU dumped {} layers, the model has {}",
                    gpu_layers.len(),
                    cpu_layers.len()
                );
            }
            // Each layer's own error: the CPU layer on the GPU's input to that layer. The
            // drift accumulated from the embedding (the CPU's own residual stream) is shown
            // beside it; it grows with depth on random weights whatever the kernels do.
            // A mixture-of-experts layer is compared a half at a time: its attention half
            // (the CPU's MLP input from the GPU's layer input against the GPU's), then the
            // layer's output with the CPU's MLP block started from the GPU's MLP input. A
            // router magnifies its input's difference (the dummy router's logits have a
            // standard deviation of about 13 at hidden 2048, so bf16 rounding of the attention
            // half moves the routing weights by percents), which is not the MLP kernels'
            // error. Tokens the two sides still route to different experts are left out of
            // the layer's error and counted.
            let gpu_moe = gpu.debug_moe_trace().to_vec();
            let moe_inputs: Vec<Vec<f32>> = gpu_moe.iter().map(|m| m.input.clone()).collect();
            let (forced_logits, forced_layers) =
                cpu.forward_layers_forced_moe(&mut kv_forced, &fw, &gpu_layers, &moe_inputs)?;
            let cpu_moe = cpu.last_moe_trace();
            let mut sparse_seen = 0;
            for (li, g) in gpu_layers.iter().enumerate() {
                let mut differ = Vec::new();
                let mut routed = String::new();
                if let Some((_, top_k)) = sparse.as_ref().filter(|s| s.0[li]) {
                    let j = sparse_seen;
                    sparse_seen += 1;
                    let (Some(c), Some(gm)) = (cpu_moe.get(j), gpu_moe.get(j)) else {
                        bail!("layer {li}: no mixture-of-experts trace of both backends");
                    };
                    let e = rel_err(&gm.input, &c.input);
                    outln!(
                        "{} step {} layer {li} attention half: rel err {e:.3e} (tol {:.1e})",
                        judge(e, a.tol, &mut failed),
                        si + 1,
                        a.tol,
                    );
                    differ = routes_differ(&c.routes, &gm.routes, *top_k).with_context(|| {
                        format!("layer {li}: the backends' expert id lists differ in length")
                    })?;
                    let n = differ.iter().filter(|&&d| d).count();
                    let allowed = ((differ.len() as f64 * MAX_ROUTE_DIFF) as usize).max(2);
                    routed = format!("; {n} of {} tokens routed apart, left out", differ.len());
                    if n > allowed {
                        failed += 1;
                        outln!(
                            "FAIL step {} layer {li}: {n} of {} tokens took other experts than on the CPU (at most {allowed} may)",
                            si + 1,
                            differ.len(),
                        );
                    }
                }
                let e = rel_err_rows(g, &forced_layers[li], hidden, &differ);
                outln!(
                    "{} step {} layer {li}: rel err {e:.3e} (tol {:.1e}; accumulated from the embedding {:.3e}{routed})",
                    judge(e, a.tol, &mut failed),
                    si + 1,
                    a.tol,
                    rel_err(g, &cpu_layers[li])
                );
            }
            for (ri, g) in gpu_logits.iter().enumerate() {
                let (f, c) = (&forced_logits[ri], &cpu_logits[ri]);
                let e = rel_err(g, f);
                outln!(
                    "{} step {} row {ri} logits (final norm and LM head): rel err {e:.3e} (tol {:.1e}; accumulated {:.3e}), argmax cuda {} cpu {}",
                    judge(e, a.tol, &mut failed),
                    si + 1,
                    a.tol,
                    rel_err(g, c),
                    argmax(g),
                    argmax(c)
                );
            }
        } else {
            for (ri, (g, c)) in gpu_logits.iter().zip(&cpu_logits).enumerate() {
                let e = rel_err(g, c);
                outln!(
                    "{} step {} row {ri} logits: rel err {e:.3e} (tol {:.1e}), argmax cuda {} cpu {}",
                    judge(e, a.tol, &mut failed),
                    si + 1,
                    a.tol,
                    argmax(g),
                    argmax(c)
                );
            }
        }
        dump.push(serde_json::json!({
            "step": si + 1,
            "cpu_logits": cpu_logits,
            "cuda_logits": gpu_logits,
        }));
    }
    if let Some(p) = &a.dump {
        std::fs::write(p, serde_json::to_string(&dump)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if failed > 0 {
        bail!("{failed} comparisons exceed the tolerance");
    }
    Ok(())
}

/// `baton debug lora-adapter`.
fn lora_adapter(a: &LoraAdapterArgs) -> Result<()> {
    let max = baton_model::lora::MAX_LORA_RANK;
    if !(1..=max).contains(&a.rank) {
        anyhow::bail!("--rank must be from 1 to {max}, not {}", a.rank);
    }
    if !(a.amplitude.is_finite() && a.alpha.is_finite()) {
        anyhow::bail!("--alpha and --amplitude must be finite numbers");
    }
    let cfg = ModelConfig::from_file(&a.model.join("config.json"))?;
    baton_model::lora::write_dummy_adapter(&a.out, &cfg, a.rank, a.alpha, a.amplitude, a.seed)?;
    say!(
        "wrote a rank-{} LoRA adapter to {}",
        a.rank,
        a.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_counts_errors_over_the_tolerance_and_nan_as_failures() {
        let mut failed = 0;
        assert_eq!(judge(1e-3, 1e-2, &mut failed), "PASS");
        assert_eq!(judge(1e-2, 1e-2, &mut failed), "PASS");
        assert_eq!(failed, 0);
        assert_eq!(judge(2e-2, 1e-2, &mut failed), "FAIL");
        assert_eq!(judge(f64::NAN, 1e-2, &mut failed), "FAIL");
        assert_eq!(failed, 2);
    }

    #[test]
    fn rel_err_is_max_abs_diff_over_max_abs_reference() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[1.0, 2.1], &[1.0, 2.0]) - 0.05).abs() < 1e-6);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0, f32::NAN], &[1.0, 2.0]), f64::INFINITY);
    }

    #[test]
    fn rows_left_out_do_not_count_but_still_scale() {
        let b = [1.0, 2.0, 4.0, 1.0];
        let a = [1.0, 2.0, 3.0, 1.5];
        assert!((rel_err_rows(&a, &b, 2, &[]) - 0.25).abs() < 1e-9);
        assert!((rel_err_rows(&a, &b, 2, &[false, true]) - 0.0).abs() < 1e-9);
        assert!((rel_err_rows(&a, &b, 2, &[true]) - 0.25).abs() < 1e-9);
        assert_eq!(
            routes_differ(&[0, 3, 1, 2], &[0, 3, 1, 4], 2),
            Some(vec![false, true])
        );
        assert_eq!(routes_differ(&[0, 3], &[0, 3, 1, 4], 2), None);
    }

    #[test]
    fn mixed_steps_mix_prefill_chunks_and_decodes() {
        let (s1, s2) = mixed_steps(100, &[]);
        assert_eq!(
            s1.iter().map(|r| r.0.len()).collect::<Vec<_>>(),
            [40, 17, 5]
        );
        assert_eq!(
            s2.iter().map(|r| (r.0.len(), r.1)).collect::<Vec<_>>(),
            [(20, 40), (1, 17), (9, 0), (1, 5)]
        );
        // Every row's block table covers its last position at block size 16.
        for r in s1.iter().chain(&s2) {
            assert!(r.2.len() * 16 >= r.1 + r.0.len());
        }
    }
}
