//! Tests of the emulator itself: registry, launch validation, thread/block coordinates, shared
//! memory, shuffles and the detection of deadlocked or divergent barriers (`csrc/selftest.cu`).

use baton_cuda_emu::{
    entry_points, has_entry, launch, launch_cooperative, launch_with, param_count, Dtype, EmuError,
    Params, Schedule,
};

/// Launches `name` (f32 module) with `params`.
fn run(
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    params: &mut Params,
) -> Result<(), EmuError> {
    let args = params.as_args();
    // SAFETY: every test below passes the argument list of the kernel's C signature in
    // csrc/selftest.cu, with buffers at least as large as the grid and block it launches touch.
    unsafe { launch(Dtype::F32, name, grid, block, &args) }
}

#[test]
fn every_kernel_entry_point_is_registered_for_every_dtype_with_nothing_extra() {
    let expected: Vec<&str> = baton_cuda::kernels::kernel_entry_points()
        .iter()
        .flat_map(|(_, e)| e.iter().copied())
        .collect();
    assert_eq!(expected.len(), 34, "kernels.rs lists 34 entry points today");
    for dtype in Dtype::ALL {
        for e in &expected {
            assert!(
                has_entry(dtype, e),
                "{e} missing from the {} module",
                dtype.name()
            );
            // The smallest signature: baton_trace_tick(out, changes).
            assert!(param_count(dtype, e).is_some_and(|n| n >= 2), "{e}");
        }
        let got = entry_points(dtype);
        for e in &got {
            assert!(
                expected.contains(e) || e.starts_with("emu_test_"),
                "{e} is registered but not in ENTRY_POINTS"
            );
        }
        assert_eq!(
            got.iter().filter(|e| !e.starts_with("emu_test_")).count(),
            expected.len()
        );
    }
    assert_eq!(param_count(Dtype::Bf16, "baton_rmsnorm"), Some(6));
    assert_eq!(
        param_count(Dtype::F32, "baton_paged_attention_decode_hd64"),
        Some(23)
    );
    assert_eq!(param_count(Dtype::F16, "baton_sample_f32"), Some(14));
    assert_eq!(param_count(Dtype::Bf16, "baton_lora_shrink"), Some(9));
    assert_eq!(
        param_count(Dtype::F16, "baton_gemv_silu_t1_async"),
        Some(10)
    );
    assert_eq!(param_count(Dtype::F32, "baton_lora_expand"), Some(9));
    assert_eq!(
        param_count(Dtype::Bf16, "baton_decode_layers_hd128"),
        Some(27)
    );
    assert!(!has_entry(Dtype::F32, "baton_nope"));
}

#[test]
fn launch_rejects_unknown_kernels_wrong_arg_counts_and_bad_sizes() {
    let mut out = vec![0f32; 64];
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr());
    let e = run("baton_nope", (1, 1, 1), (32, 1, 1), &mut p).unwrap_err();
    assert!(matches!(e, EmuError::UnknownKernel { .. }), "{e}");
    let e = run("emu_test_shuffle", (1, 1, 1), (32, 1, 1), &mut p).unwrap_err();
    assert_eq!(
        e,
        EmuError::ArgCount {
            name: "emu_test_shuffle".into(),
            expected: 2,
            got: 1
        }
    );
    for block in [
        (0, 1, 1),
        (1025, 1, 1),
        (64, 32, 1),
        (1, 1, 65),
        (2048, 1, 1),
    ] {
        let e = run("emu_test_deadlock", (1, 1, 1), block, &mut p).unwrap_err();
        assert!(matches!(e, EmuError::InvalidBlock { .. }), "{block:?}: {e}");
    }
    for grid in [(0, 1, 1), (1, 0, 1), (1, 1, 65536)] {
        let e = run("emu_test_deadlock", grid, (32, 1, 1), &mut p).unwrap_err();
        assert!(matches!(e, EmuError::InvalidGrid { .. }), "{grid:?}: {e}");
    }
}

#[test]
fn threads_and_blocks_get_cuda_coordinates_and_blocks_run_in_x_fastest_order() {
    let (grid, block) = ((3u32, 2u32, 2u32), (4u32, 3u32, 2u32));
    let nb = (grid.0 * grid.1 * grid.2) as usize;
    let nt = (block.0 * block.1 * block.2) as usize;
    let mut out = vec![u32::MAX; nb * nt];
    let mut order = vec![u32::MAX; nb];
    let mut counter = 0u32;
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr())
        .ptr_mut(order.as_mut_ptr())
        .ptr_mut(&mut counter as *mut u32);
    run("emu_test_coords", grid, block, &mut p).unwrap();
    for b in 0..nb {
        for t in 0..nt {
            assert_eq!(
                out[b * nt + t],
                ((b as u32) << 16) | t as u32,
                "block {b} thread {t}"
            );
        }
    }
    assert_eq!(order, (0..nb as u32).collect::<Vec<_>>());
    assert_eq!(counter, nb as u32);
}

#[test]
fn shared_memory_barriers_and_block_reductions_work_for_every_warp_count() {
    for threads in [32u32, 64, 96, 1024] {
        let blocks = 3usize;
        let n = threads as usize;
        let input: Vec<f32> = (0..blocks * n)
            .map(|i| ((i * 37) % 101) as f32 - 50.0)
            .collect();
        let (mut mirrored, mut sums, mut maxes) = (
            vec![0f32; blocks * n],
            vec![0f32; blocks * n],
            vec![0f32; blocks * n],
        );
        let mut p = Params::new();
        p.ptr_mut(mirrored.as_mut_ptr())
            .ptr_mut(sums.as_mut_ptr())
            .ptr_mut(maxes.as_mut_ptr())
            .ptr(input.as_ptr());
        run(
            "emu_test_block_reduce",
            (blocks as u32, 1, 1),
            (threads, 1, 1),
            &mut p,
        )
        .unwrap();
        for b in 0..blocks {
            let x = &input[b * n..(b + 1) * n];
            let sum: f32 = x.iter().sum(); // small integers: exact in any order
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for t in 0..n {
                assert_eq!(mirrored[b * n + t], x[n - 1 - t]);
                assert_eq!(
                    sums[b * n + t],
                    sum,
                    "{threads} threads, block {b}, thread {t}"
                );
                assert_eq!(maxes[b * n + t], max);
            }
        }
    }
}

#[test]
fn a_shuffle_reads_the_partner_lane() {
    for lane_mask in [0, 1, 5, 16, 31] {
        let mut out = vec![0f32; 64];
        let mut p = Params::new();
        p.ptr_mut(out.as_mut_ptr()).int(lane_mask);
        run("emu_test_shuffle", (1, 1, 1), (64, 1, 1), &mut p).unwrap();
        for (t, v) in out.iter().enumerate() {
            assert_eq!(*v, (t ^ lane_mask as usize) as f32);
        }
    }
}

#[test]
fn threads_that_exit_early_do_not_block_a_barrier() {
    let mut out = vec![0f32; 32];
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr());
    run("emu_test_exit_then_sync", (2, 1, 1), (128, 1, 1), &mut p).unwrap();
    assert_eq!(out, (1..=32).map(|t| t as f32).collect::<Vec<_>>());
}

#[test]
fn lanes_split_between_a_shuffle_and_syncthreads_are_a_deadlock_not_a_hang() {
    let mut out = vec![0f32; 64];
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr());
    let e = run("emu_test_deadlock", (2, 1, 1), (64, 1, 1), &mut p).unwrap_err();
    let EmuError::Deadlock {
        name,
        block_idx,
        detail,
    } = &e
    else {
        panic!("expected a deadlock, got {e}");
    };
    assert_eq!(
        (name.as_str(), *block_idx),
        ("emu_test_deadlock", (0, 0, 0))
    );
    assert!(detail.contains("32 at selftest.cu:"), "{detail}");
    assert!(
        detail.contains("__syncthreads") && detail.contains("__shfl_xor_sync"),
        "{detail}"
    );
    // The emulator is usable again after a failed launch.
    run(
        "emu_test_shuffle",
        (1, 1, 1),
        (32, 1, 1),
        Params::new().ptr_mut(out.as_mut_ptr()).int(1),
    )
    .unwrap();
    assert_eq!(out[0], 1.0);
}

#[test]
fn halves_of_a_block_at_different_syncthreads_are_reported_as_divergence() {
    let mut out = vec![0f32; 128];
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr());
    let e = run("emu_test_divergent_sync", (1, 1, 1), (128, 1, 1), &mut p).unwrap_err();
    let EmuError::Divergence { detail, .. } = &e else {
        panic!("expected divergence, got {e}");
    };
    assert!(detail.contains("different barriers"), "{detail}");
    assert!(detail.contains("64 at selftest.cu:"), "{detail}");
}

#[test]
fn a_shuffle_in_a_partial_warp_or_with_a_bad_lane_mask_is_an_error() {
    let mut out = vec![0f32; 64];
    // 48 threads: warp 1 has lanes 0..16 only, so lane 0's partner 16 does not exist.
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr()).int(16);
    let e = run("emu_test_shuffle", (1, 1, 1), (48, 1, 1), &mut p).unwrap_err();
    assert!(
        matches!(&e, EmuError::Divergence { detail, .. } if detail.contains("warp 1")),
        "{e}"
    );
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr()).int(32);
    let e = run("emu_test_shuffle", (1, 1, 1), (32, 1, 1), &mut p).unwrap_err();
    assert!(
        matches!(&e, EmuError::Divergence { detail, .. } if detail.contains("laneMask 32")),
        "{e}"
    );
}

#[test]
fn shared_memory_is_poisoned_before_every_block_in_plain_and_template_functions() {
    let (blocks, threads) = (3usize, 64usize);
    let mut out = vec![0f32; blocks * threads];
    let mut raw = vec![0u32; blocks * threads];
    let mut p = Params::new();
    p.ptr_mut(out.as_mut_ptr()).ptr_mut(raw.as_mut_ptr());
    run(
        "emu_test_uninit_shared",
        (blocks as u32, 1, 1),
        (threads as u32, 1, 1),
        &mut p,
    )
    .unwrap();
    assert!(out.iter().all(|v| v.to_bits() == u32::MAX), "{out:?}");
    assert!(raw.iter().all(|&v| v == u32::MAX), "{raw:?}");
}

#[test]
fn a_missing_barrier_shows_under_one_schedule_or_another() {
    let n = 64usize;
    let want: Vec<f32> = (0..n).map(|t| ((t + 1) % n) as f32).collect();
    let mut results = Vec::new();
    for schedule in Schedule::ALL {
        let mut out = vec![0f32; n];
        let mut p = Params::new();
        p.ptr_mut(out.as_mut_ptr());
        let args = p.as_args();
        // SAFETY: emu_test_race(float* out) writes out[0..64) for a block of 64 threads.
        unsafe {
            launch_with(
                Dtype::F32,
                "emu_test_race",
                (1, 1, 1),
                (n as u32, 1, 1),
                &args,
                schedule,
            )
        }
        .unwrap();
        results.push(out);
    }
    // In thread order each thread reads its neighbour's slot before the neighbour ran: poison.
    assert!(
        results[0][..n - 1].iter().all(|v| v.is_nan()),
        "{:?}",
        results[0]
    );
    // In reverse order the neighbour ran first (except thread 0, the last thread's neighbour):
    // the racy kernel happens to be right but for the wrap-around.
    assert_eq!(results[1][..n - 1], want[..n - 1]);
    assert!(results[1][n - 1].is_nan());
    assert_ne!(
        results[0], results[2],
        "the shuffle orders threads differently"
    );
}

#[test]
fn run_ahead_lets_one_warp_overwrite_shared_memory_the_others_have_not_read() {
    let n = 128usize;
    let want = vec![3.0 * n as f32; n];
    let mut outs = Vec::new();
    for schedule in [Schedule::InOrder, Schedule::RunAhead] {
        let mut out = vec![0f32; n];
        let mut p = Params::new();
        p.ptr_mut(out.as_mut_ptr());
        let args = p.as_args();
        // SAFETY: emu_test_scratch_reuse(float* out) writes out[0..128) for 128 threads.
        unsafe {
            launch_with(
                Dtype::F32,
                "emu_test_scratch_reuse",
                (1, 1, 1),
                (n as u32, 1, 1),
                &args,
                schedule,
            )
        }
        .unwrap();
        outs.push(out);
    }
    assert_eq!(outs[0], want, "in thread order the warps stay in step");
    assert_ne!(
        outs[1], want,
        "running warp 0 ahead exposes the missing barrier"
    );
}

/// Launches `name` (f32 module) cooperatively under `schedule`.
fn run_cooperative(
    name: &str,
    grid: u32,
    block: u32,
    params: &mut Params,
    schedule: Schedule,
) -> Result<(), EmuError> {
    let args = params.as_args();
    // SAFETY: as in `run`: the argument lists of csrc/selftest.cu, buffers sized for the grid.
    unsafe {
        launch_cooperative(
            Dtype::F32,
            name,
            (grid, 1, 1),
            (block, 1, 1),
            &args,
            schedule,
        )
    }
}

#[test]
fn a_grid_barrier_shows_every_blocks_writes_and_keeps_each_blocks_shared_memory() {
    for schedule in Schedule::ALL {
        for (nb, threads) in [(1u32, 32u32), (5, 64), (16, 128)] {
            let n = nb as usize;
            let mut a = vec![u32::MAX; n];
            let mut out = vec![u32::MAX; n];
            let mut bar = [0u32; 2];
            let mut p = Params::new();
            p.ptr_mut(a.as_mut_ptr())
                .ptr_mut(out.as_mut_ptr())
                .ptr_mut(bar.as_mut_ptr());
            run_cooperative("emu_test_grid_sync", nb, threads, &mut p, schedule).unwrap();
            let sum: u32 = (1..=nb).sum();
            let want: Vec<u32> = (0..nb).map(|b| sum + 1000 * (b + 1)).collect();
            assert_eq!(out, want, "{schedule:?}, {nb} blocks");
            let rotated: Vec<u32> = (0..n).map(|b| want[(b + 1) % n]).collect();
            assert_eq!(a, rotated, "{schedule:?}, {nb} blocks");
        }
    }
}

#[test]
fn a_grid_barrier_outside_a_cooperative_launch_or_missed_by_a_block_is_an_error() {
    let mut bar = [0u32; 2];
    let (mut a, mut out) = (vec![0u32; 2], vec![0u32; 2]);
    let mut p = Params::new();
    p.ptr_mut(a.as_mut_ptr())
        .ptr_mut(out.as_mut_ptr())
        .ptr_mut(bar.as_mut_ptr());
    let e = run("emu_test_grid_sync", (2, 1, 1), (32, 1, 1), &mut p).unwrap_err();
    assert!(
        matches!(&e, EmuError::Divergence { detail, .. } if detail.contains("not cooperative")),
        "{e}"
    );
    for early in [0, 3] {
        let mut p = Params::new();
        p.ptr_mut(bar.as_mut_ptr()).int(early);
        let e = run_cooperative(
            "emu_test_grid_sync_early_exit",
            4,
            32,
            &mut p,
            Schedule::InOrder,
        )
        .unwrap_err();
        let EmuError::Deadlock {
            block_idx, detail, ..
        } = &e
        else {
            panic!("expected a deadlock, got {e}");
        };
        assert_eq!(*block_idx, (early as u32, 0, 0), "{detail}");
        assert!(detail.contains("3 of 4 blocks wait"), "{detail}");
    }
    // Every block reaching the barrier (no block index 7 in a grid of 4) is fine.
    let mut p = Params::new();
    p.ptr_mut(bar.as_mut_ptr()).int(7);
    run_cooperative(
        "emu_test_grid_sync_early_exit",
        4,
        32,
        &mut p,
        Schedule::Reverse,
    )
    .unwrap();
    let mut p = Params::new();
    p.ptr_mut(bar.as_mut_ptr());
    let e =
        run_cooperative("emu_test_grid_sync_mixed", 2, 64, &mut p, Schedule::InOrder).unwrap_err();
    assert!(
        matches!(&e, EmuError::Deadlock { detail, .. }
            if detail.contains("__syncthreads") && detail.contains("grid barrier")),
        "{e}"
    );
}
