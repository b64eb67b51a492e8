//! Compiles every kernel in `kernels/` for sm_90 with NVRTC and checks each expected
//! `extern "C"` entry point is in the PTX and that a CUBIN (what the worker loads) came out.
//! ptxas' resource report (registers, spills, shared memory) is printed per function, and in
//! bf16 and f16 no function may spill more than [`SPILL_BUDGET`] allows: spills in the
//! decode path cost speed that only a GPU run would otherwise show.
//!
//! Needs NVRTC (no GPU): run `scripts/nvrtc-check.sh`, which installs the CUDA 13 NVRTC and
//! runtime-header wheels and sets `LD_LIBRARY_PATH` / `BATON_CUDA_INCLUDE`. Without NVRTC the
//! test is skipped with a loud message, unless `BATON_REQUIRE_NVRTC=1`, which makes it fail.

use baton_cuda::kernels::{
    compile_with_options, include_dir_from_env, kernel_entry_points, nvrtc_available,
    ptx_entry_points, ptxas_usage, Dtype, PTXAS_VERBOSE,
};
use baton_cuda::trace::file_hash;

/// Bytes per thread a function may spill (stores, and loads alike) in bf16 and f16: what
/// ptxas (CUDA 13.0) does today. A function matches an entry whose name its (possibly
/// mangled) name contains. Every other function: none. f32 is the exact-comparison
/// dtype, not a speed path: its prefill kernel for head dim 256 spills over a KB.
const SPILL_BUDGET: [(&str, u32); 10] = [
    // 64 registers at 1024 threads, with calls to the __noinline__ selection and top
    // log-probabilities: single spills between phases (SASS, session 37: the loops that
    // reload a spilled value are the penalty-entry loops, a few entries a thread; none is a
    // loop over the row).
    ("baton_sample_f32", 64),
    // The sampler's __noinline__ selection functions, also at 64 registers: registers saved
    // around their calls (stores in `baton_sample_token`'s prologue, no loads), a handful of
    // times per sampled row, none inside a loop over the row.
    ("baton_sample_token", 48),
    ("baton_answer", 32),
    ("baton_hist_select", 16),
    ("baton_radix_select", 16),
    ("baton_top_logprobs", 16),
    // Head dims other than 64/128/256 (no Llama or Qwen model uses one).
    ("baton_paged_attention_generic", 16),
    // The persistent decode kernels (`baton_decode_layers_hd64/128`) and their __noinline__
    // phases (`baton_layers_gemv<SILU>`, `baton_layers_attention<D>`, matched inside their
    // mangled names): values kept across the phase calls, at 168 registers.
    ("baton_decode_layers_hd", 64),
    ("baton_layers_gemv", 64),
    ("baton_layers_attention", 16),
];

fn nvrtc_required() -> bool {
    std::env::var("BATON_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn kernels_compile_to_ptx_for_sm90() {
    if !nvrtc_available() {
        assert!(
            !nvrtc_required(),
            "BATON_REQUIRE_NVRTC=1 but NVRTC (libnvrtc.so*) cannot be loaded; \
             run scripts/nvrtc-check.sh or set LD_LIBRARY_PATH"
        );
        eprintln!(
            "\n==== SKIPPED kernels_compile_to_ptx_for_sm90: NVRTC not found on the loader path. \
             Run scripts/nvrtc-check.sh (or set BATON_REQUIRE_NVRTC=1 to make this fail). ====\n"
        );
        return;
    }
    let include = include_dir_from_env();
    assert!(
        include.join("cuda_bf16.h").is_file(),
        "cuda_bf16.h not found in {} (set BATON_CUDA_INCLUDE)",
        include.display()
    );
    for dtype in Dtype::ALL {
        check_dtype(dtype, &include);
    }
}

/// `BATON_TRACE=1` (the launch trace, `baton_cuda::trace`) compiles in every file, and every
/// file then reads %globaltimer at its waits, folds it into its slot with reductions, and has
/// the `baton_trace_buf` global the worker sets; without it no file does (the trace costs
/// nothing by default).
#[test]
fn kernels_compile_with_the_launch_trace_and_only_with_it() {
    if !nvrtc_available() {
        assert!(
            !nvrtc_required(),
            "BATON_REQUIRE_NVRTC=1 but NVRTC cannot be loaded"
        );
        eprintln!("\n==== SKIPPED kernels_compile_with_the_launch_trace: no NVRTC ====\n");
        return;
    }
    let include = include_dir_from_env();
    for (defines, traced) in [(vec!["-DBATON_TRACE=1".to_owned()], true), (vec![], false)] {
        let compiled = compile_with_options("sm_90", &include, Dtype::Bf16, &defines)
            .unwrap_or_else(|e| panic!("{defines:?}: {e}"));
        for (file, c) in &compiled {
            // trace.cu's clock probe reads the timer either way.
            assert_eq!(
                c.ptx.contains("%globaltimer"),
                traced || file == "trace.cu",
                "{file} {defines:?}: %globaltimer"
            );
            assert_eq!(
                c.ptx.contains(".u64 baton_trace_buf"),
                traced,
                "{file} {defines:?}: the trace buffer's global"
            );
            if traced {
                // Each wait site's tag names its own file (FNV-1a of the bare name in the high
                // 16 bits): the immediates of the slot's `red.min`s.
                // The tag goes through a register: `mov.u64 %rdN, TAG;` then
                // `red.global.min.u64 [..], %rdN;`.
                let mut imm: std::collections::HashMap<&str, u64> = Default::default();
                let mut hashes: Vec<u32> = Vec::new();
                for l in c.ptx.lines().map(str::trim) {
                    if let Some(rest) = l.strip_prefix("mov.u64") {
                        if let Some((reg, v)) = rest.trim().trim_end_matches(';').split_once(',') {
                            if let Ok(v) = v.trim().parse::<u64>() {
                                imm.insert(reg.trim(), v);
                            }
                        }
                    } else if let Some(rest) = l.strip_prefix("red.global.min.u64") {
                        let reg = rest.rsplit(',').next().unwrap_or("").trim();
                        // (Registers reassigned by other instructions are not tracked: only
                        // values of a tag's range count.)
                        if let Some(&v) = imm.get(reg.trim_end_matches(';')) {
                            if (1 << 16..1 << 32).contains(&v) {
                                hashes.push((v >> 16) as u32);
                            }
                        }
                    }
                }
                let own = [file_hash(file), file_hash("gemv.cuh")];
                assert!(!hashes.is_empty(), "{file}: no wait-site tag");
                assert!(
                    hashes.iter().all(|h| own.contains(h)),
                    "{file}: wait-site tags of other files {hashes:x?} (own {own:x?})"
                );
                assert!(c.ptx.contains("%gridid"), "{file}: no %gridid");
                // The slot updates are reductions the block never waits for, not atomics
                // that return a value.
                assert!(
                    c.ptx.contains("red.global.min.u64"),
                    "{file}: no red.min:\n{}",
                    c.ptx
                        .lines()
                        .filter(|l| l.contains("atom") || l.contains("red."))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                assert!(c.ptx.contains("red.global.add.u64"), "{file}: no red.add");
            }
        }
    }
}

/// Every tunable kernel constant at the values `scripts/gpu-ab.sh` times (and its own
/// non-default ones) compiles for sm_90: a variant that does not compile would cost a GPU run
/// its time. Each must also leave the default build's PTX (the tunable is read).
#[test]
fn every_kernel_tunable_compiles_at_its_a_b_values() {
    if !nvrtc_available() {
        assert!(
            !nvrtc_required(),
            "BATON_REQUIRE_NVRTC=1 but NVRTC cannot be loaded"
        );
        eprintln!("\n==== SKIPPED every_kernel_tunable_compiles: no NVRTC ====\n");
        return;
    }
    let include = include_dir_from_env();
    let ptx = |defines: &[String]| -> Vec<(String, String)> {
        compile_with_options("sm_90", &include, Dtype::Bf16, defines)
            .unwrap_or_else(|e| panic!("{defines:?}: {e}"))
            .into_iter()
            .map(|(f, c)| (f, c.ptx))
            .collect()
    };
    let base = ptx(&[]);
    let values = [
        "BATON_GEMV_T1_U=2",
        "BATON_GEMV_PREWAIT_L2=65536",
        "BATON_SAMPLE_BIN_CACHE=0",
        "BATON_SAMPLE_HIST=0",
        "BATON_SELECT_U=1",
        "BATON_SELECT_U=8",
    ];
    // Every tunable but the trace (its own test) is listed here.
    for t in baton_cuda::kernels::KERNEL_TUNABLES {
        assert!(
            *t == "BATON_TRACE" || values.iter().any(|v| v.starts_with(&format!("{t}="))),
            "{t} has no A/B value here"
        );
    }
    for v in values {
        let got = ptx(&[format!("-D{v}")]);
        assert!(got != base, "{v} changes no kernel");
    }
}

fn check_dtype(dtype: Dtype, include: &std::path::Path) {
    let started = std::time::Instant::now();
    let compiled = compile_with_options("sm_90", include, dtype, &[PTXAS_VERBOSE.to_owned()])
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "compiled {} kernel files for sm_90 ({}) in {:.1?}",
        compiled.len(),
        dtype.name(),
        started.elapsed()
    );
    assert_eq!(compiled.len(), kernel_entry_points().len());
    for ((file, c), &(efile, entries)) in compiled.iter().zip(kernel_entry_points()) {
        assert_eq!(file, efile);
        // The worker loads the CUBIN: an ELF image (ptxas ran, so no JIT on the device).
        assert!(
            c.cubin.len() > 64 && c.cubin.starts_with(b"\x7fELF"),
            "{file}: no CUBIN ({} bytes)",
            c.cubin.len()
        );
        let src = &c.ptx;
        assert!(src.contains(".target sm_90"), "{file}: PTX not for sm_90");
        let found = ptx_entry_points(src);
        for entry in entries {
            assert!(
                found.iter().any(|f| f == entry),
                "{file}: entry {entry} missing from PTX (found {found:?})"
            );
        }
        // No stray kernels: every PTX entry is one we expect to load.
        for f in &found {
            assert!(
                entries.contains(&f.as_str()),
                "{file}: unexpected entry {f}"
            );
        }
        eprintln!(
            "  {file}: {} bytes of PTX, {} of CUBIN, entries {found:?}",
            src.len(),
            c.cubin.len()
        );
        let usage = ptxas_usage(&c.log);
        for entry in entries {
            assert!(
                usage.iter().any(|u| u.function == *entry),
                "{file}: no ptxas report for {entry} in the log:\n{}",
                c.log
            );
        }
        for u in &usage {
            eprintln!(
                "    {:<40} {:>3} registers, {:>5} B smem, {:>3} B stack, spills {} B stored {} B loaded",
                u.function, u.registers, u.smem_bytes, u.stack_bytes, u.spill_store_bytes,
                u.spill_load_bytes
            );
            if dtype == Dtype::F32 {
                continue;
            }
            let budget = SPILL_BUDGET
                .iter()
                .find(|(f, _)| u.function.contains(f))
                .map_or(0, |&(_, b)| b);
            assert!(
                u.spill_store_bytes <= budget && u.spill_load_bytes <= budget,
                "{file} ({}): {} spills {} B stored and {} B loaded per thread, {budget} allowed \
                 (SPILL_BUDGET); check its registers and launch bounds",
                dtype.name(),
                u.function,
                u.spill_store_bytes,
                u.spill_load_bytes
            );
        }
    }
}
