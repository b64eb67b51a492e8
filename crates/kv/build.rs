//! Declares `--cfg baton_no_fence`, the mutation that removes the fence check from the reclaim
//! path so that the loom models and the scheduler's tests can be shown to catch its absence
//! (see `src/fence.rs`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(baton_no_fence)");
    println!("cargo::rerun-if-changed=build.rs");
}
