//! Compiles every kernel in `kernels/` for sm_90 with NVRTC and checks each expected
//! `extern "C"` entry point is in the PTX and that a CUBIN (what the worker loads) came out.
//!
//! Needs NVRTC (no GPU): run `scripts/nvrtc-check.sh`, which installs the CUDA 13 NVRTC and
//! runtime-header wheels and sets `LD_LIBRARY_PATH` / `BATON_CUDA_INCLUDE`. Without NVRTC the
//! test is skipped with a loud message, unless `BATON_REQUIRE_NVRTC=1`, which makes it fail.

use baton_cuda::kernels::{
    compile_for, include_dir_from_env, kernel_entry_points, nvrtc_available, ptx_entry_points,
    Dtype,
};

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

fn check_dtype(dtype: Dtype, include: &std::path::Path) {
    let started = std::time::Instant::now();
    let compiled = compile_for("sm_90", include, dtype).unwrap_or_else(|e| panic!("{e}"));
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
    }
}
