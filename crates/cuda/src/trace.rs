//! The launch trace: where a step's device time goes inside a CUDA graph replay, with
//! programmatic dependent launch (PDL) overlapping the kernels, which neither an event pair
//! per kernel (`bench decode --breakdown`, eager and serialized) nor Nsight Compute (one
//! kernel at a time) shows.
//!
//! Kernels compiled with `BATON_KERNEL_DEFINES=BATON_TRACE=1` (never by default on a GPU;
//! always in the host emulator, where `EmuDevice::set_launch_trace` turns it on) fold, at each
//! `BATON_PDL_WAIT` of each thread block, `%globaltimer` before and after the wait into their
//! launch's [`TraceSlot`] (kernels/common.cuh: a table of [`TRACE_SLOTS`] slots indexed by a
//! hash of `%gridid`, updated with atomics whose results the block never waits for). A wait
//! returns only once every earlier kernel in the stream has completed, so sorting launches by
//! their first release orders them as the stream does, and the first release of launch
//! `i + 1` minus that of launch `i` is launch `i`'s share of the step: the time the stream
//! spent with launch `i` as its oldest unfinished kernel, including the PDL hand-over to the
//! next. [`StepTrace::launches`] turns one step's table into [`LaunchSpan`]s; [`summarize`]
//! averages steps position by position and per wait site ([`TraceSummary`]). Only kernels of
//! `kernels/` record: a cuBLAS call (the unfused and prefill paths) has no wait of ours, so
//! its time lands in the share of the traced launch before it.

use bytemuck::{Pod, Zeroable};

/// Slots in the trace table: `1 << BATON_TRACE_SLOT_BITS` (kernels/common.cuh). A step of
/// `n` launches puts two in one slot with probability about `n^2 / 2^19` (0.05 for the 165
/// launches of a batch-1 8B step); such a step is left out of the summary.
pub const TRACE_SLOTS: usize = 1 << 18;

/// One launch's slot as the kernels leave it (128 bytes, all ones before the step): see
/// kernels/common.cuh for each field.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TraceSlot {
    /// Minimum `%gridid` of the blocks folded in.
    pub grid: u64,
    /// Minimum of `!%gridid`: `!not_grid != grid` when two launches share the slot.
    pub not_grid: u64,
    /// Earliest `%globaltimer` (ns) before a block's wait.
    pub first_pre: u64,
    /// Earliest `%globaltimer` (ns) after a block's wait returned.
    pub release: u64,
    /// `!` the latest `%globaltimer` after a block's wait returned.
    pub not_last_release: u64,
    /// Blocks folded in, counted up from `u64::MAX` (so one block leaves 0).
    pub blocks: u64,
    /// The smallest wait site of the launch's blocks: [`file_hash`] of the file in bits
    /// 16..32, the line in bits 0..16 ([`tag_name`]).
    pub tag: u64,
    /// Blocks in the grid.
    pub nblocks: u64,
    /// `!` the latest `%globaltimer` at which a warp left the kernel (`BATON_TRACE_SCOPE`).
    pub not_last_exit: u64,
    /// Unused (all ones).
    pub reserved: [u64; 7],
}

impl TraceSlot {
    /// A slot no block wrote (the table's fill).
    pub const EMPTY: TraceSlot = TraceSlot {
        grid: u64::MAX,
        not_grid: u64::MAX,
        first_pre: u64::MAX,
        release: u64::MAX,
        not_last_release: u64::MAX,
        blocks: u64::MAX,
        tag: u64::MAX,
        nblocks: u64::MAX,
        not_last_exit: u64::MAX,
        reserved: [u64::MAX; 7],
    };

    /// Folds in one block's wait as `baton_trace_wait` (kernels/common.cuh) does: a launch
    /// `grid` of `nblocks` blocks whose block reached wait site `tag` at `t_pre` and left it
    /// at `t_wait` (ns). The kernels' copy of this runs on the GPU; this one documents and
    /// tests it.
    pub fn fold(&mut self, grid: u64, t_pre: u64, t_wait: u64, tag: u32, nblocks: u32) {
        self.grid = self.grid.min(grid);
        self.not_grid = self.not_grid.min(!grid);
        self.first_pre = self.first_pre.min(t_pre);
        self.release = self.release.min(t_wait);
        self.not_last_release = self.not_last_release.min(!t_wait);
        self.blocks = self.blocks.wrapping_add(1);
        self.tag = self.tag.min(u64::from(tag));
        self.nblocks = self.nblocks.min(u64::from(nblocks));
    }

    /// Folds in a warp leaving the kernel at `t` (ns), as `BATON_TRACE_SCOPE`'s destructor
    /// does.
    pub fn fold_exit(&mut self, t: u64) {
        self.not_last_exit = self.not_last_exit.min(!t);
    }
}

/// One step's trace table as read back from the device: the slots some block wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTrace {
    /// The written slots, in table order.
    pub slots: Vec<TraceSlot>,
    /// The device clock's smallest step (ns; `baton_trace_tick` in kernels/trace.cu), 0 when
    /// unknown: every time in the trace is a multiple of it.
    pub tick_ns: u64,
}

impl StepTrace {
    /// The written slots of a whole table, on a clock of `tick_ns`.
    pub fn from_table(table: &[TraceSlot], tick_ns: u64) -> Self {
        StepTrace {
            slots: table
                .iter()
                .filter(|s| **s != TraceSlot::EMPTY)
                .copied()
                .collect(),
            tick_ns,
        }
    }

    /// The step's launches in stream order (by release, then by first arrival, then by
    /// `%gridid`, which grows with launch order: ties are common on a coarse clock), or `None`
    /// when two launches shared a slot (their times are mixed): two grids in it, or more
    /// waiting blocks than the grid has (one launch number reused). Slots with exits but no
    /// wait (a launch all of whose blocks returned before waiting, which the kernels' rule
    /// excludes) are left out.
    pub fn launches(&self) -> Option<Vec<LaunchSpan>> {
        let mut out = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            if s.grid == u64::MAX && s.not_grid == u64::MAX {
                continue;
            }
            let blocks = s.blocks.wrapping_add(1);
            if !s.not_grid != s.grid || blocks > s.nblocks {
                return None;
            }
            out.push(LaunchSpan {
                grid: s.grid,
                tag: s.tag as u32,
                blocks: blocks as usize,
                nblocks: s.nblocks as u32,
                first_pre: s.first_pre,
                release: s.release,
                last_release: !s.not_last_release,
                last_exit: (s.not_last_exit != u64::MAX).then_some(!s.not_last_exit),
            });
        }
        out.sort_by_key(|s| (s.release, s.first_pre, s.grid));
        Some(out)
    }
}

/// FNV-1a (32-bit) of `name`, low 16 bits: `baton_trace_file` in kernels/common.cuh.
pub fn file_hash(name: &str) -> u32 {
    let mut h: u32 = 2_166_136_261;
    for b in name.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(16_777_619);
    }
    h & 0xffff
}

/// `file:line` of a wait site's tag, the file found among the kernel files and headers (the
/// hash in hex when none matches).
pub fn tag_name(tag: u32) -> String {
    let (hash, line) = (tag >> 16, tag & 0xffff);
    let file = crate::kernels::kernel_sources()
        .iter()
        .chain(crate::kernels::kernel_headers())
        .map(|(name, _)| *name)
        .chain(["common.cuh"])
        .find(|name| file_hash(name) == hash);
    match file {
        Some(f) => format!("{f}:{line}"),
        None => format!("#{hash:04x}:{line}"),
    }
}

/// One launch of a traced step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpan {
    /// Its `%gridid`.
    pub grid: u64,
    /// Its wait site (the smallest when its blocks wait at different lines).
    pub tag: u32,
    /// Blocks that waited (blocks that return before waiting are not counted).
    pub blocks: usize,
    /// Blocks in the grid.
    pub nblocks: u32,
    /// When the first block reached its wait (ns).
    pub first_pre: u64,
    /// When the launch was released (every earlier kernel done): the first block's return
    /// from the wait.
    pub release: u64,
    /// The last block's return from its wait (later than `release` when that block started
    /// only after the release, e.g. waiting for an SM).
    pub last_release: u64,
    /// When its last warp left (ns); `None` when none recorded it.
    pub last_exit: Option<u64>,
}

/// A launch position of the traced steps, averaged over them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TracePosition {
    /// Index of the launch in the step.
    pub index: usize,
    /// Its wait site ([`tag_name`]).
    pub site: String,
    /// Mean blocks that waited.
    pub blocks: f64,
    /// Blocks in the grid.
    pub nblocks: u32,
    /// Mean share of the step, µs: the next launch's release minus this one's (`None` for the
    /// step's last launch, whose end the trace does not see).
    pub share_us: Option<f64>,
    /// Mean µs from the first block reaching its wait to the release: how far ahead of its
    /// release PDL had the launch resident (0 when it started after it).
    pub early_us: f64,
    /// Mean µs from the first to the last recorded release (blocks that started late).
    pub spread_us: f64,
    /// Mean µs from the release to the last warp's exit: the kernel's work once released
    /// (`None` when an exit is missing).
    pub body_us: Option<f64>,
    /// Mean µs from the last warp's exit to the next launch's release: the hand-over between
    /// kernels (`None` for the last launch or when an exit is missing).
    pub handoff_us: Option<f64>,
}

/// A wait site's launches per step, summed.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceSite {
    /// [`tag_name`] of the site.
    pub site: String,
    /// Its launches per step.
    pub launches: usize,
    /// Their mean summed share of a step, µs (launches whose share is unknown left out).
    pub share_us: f64,
}

/// [`summarize`]'s result.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceSummary {
    /// Steps averaged: those with the first step's sequence of wait sites.
    pub steps: usize,
    /// Steps left out: another sequence of launches than the most common one (another graph
    /// bucket, an eager step, launches tied on a coarse clock), or two launches in one slot.
    pub skipped: usize,
    /// The device clock's step (ns; 0: unknown): each step's times are multiples of it.
    pub tick_ns: u64,
    /// Mean µs from the first launch's release to the last launch's.
    pub span_us: f64,
    /// Of it, the hand-overs between kernels (each launch's last exit to the next release),
    /// summed over the positions that have them.
    pub handoff_us: f64,
    /// Every launch position of a step.
    pub positions: Vec<TracePosition>,
    /// Per wait site, most time first.
    pub sites: Vec<TraceSite>,
}

/// Averages traced steps (each [`StepTrace::launches`] of one step) position by position on
/// a clock of `tick_ns` (reported, 0: unknown). Only steps whose sequence of launch tags is the
/// most common one (the earliest of equals) are averaged; the others are counted in
/// [`TraceSummary::skipped`], as are empty steps and steps given as `None` (two launches in
/// one slot).
pub fn summarize(steps: &[Option<Vec<LaunchSpan>>], tick_ns: u64) -> TraceSummary {
    let tags = |s: &[LaunchSpan]| s.iter().map(|l| l.tag).collect::<Vec<_>>();
    let seqs: Vec<Vec<u32>> = steps
        .iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .map(|s| tags(s))
        .collect();
    let mut reference: Option<(&Vec<u32>, usize)> = None;
    for q in &seqs {
        let n = seqs.iter().filter(|o| *o == q).count();
        if reference.is_none_or(|(_, best)| n > best) {
            reference = Some((q, n));
        }
    }
    let Some(reference) = reference.map(|(q, _)| q.clone()) else {
        return TraceSummary {
            steps: 0,
            skipped: steps.len(),
            tick_ns,
            span_us: 0.0,
            handoff_us: 0.0,
            positions: Vec::new(),
            sites: Vec::new(),
        };
    };
    let used: Vec<&Vec<LaunchSpan>> = steps
        .iter()
        .flatten()
        .filter(|s| tags(s) == reference)
        .collect();
    let n = used.len() as f64;
    let us = |ns: u64| ns as f64 / 1e3;
    let mean = |f: &dyn Fn(&Vec<LaunchSpan>) -> f64| used.iter().map(|s| f(s)).sum::<f64>() / n;
    let len = reference.len();
    let positions: Vec<TracePosition> = (0..len)
        .map(|i| TracePosition {
            index: i,
            site: tag_name(reference[i]),
            blocks: mean(&|s| s[i].blocks as f64),
            nblocks: used[0][i].nblocks,
            share_us: (i + 1 < len)
                .then(|| mean(&|s| us(s[i + 1].release.saturating_sub(s[i].release)))),
            early_us: mean(&|s| us(s[i].release.saturating_sub(s[i].first_pre))),
            spread_us: mean(&|s| us(s[i].last_release.saturating_sub(s[i].release))),
            body_us: used
                .iter()
                .all(|s| s[i].last_exit.is_some())
                .then(|| mean(&|s| us(s[i].last_exit.unwrap_or(0).saturating_sub(s[i].release)))),
            handoff_us: (i + 1 < len && used.iter().all(|s| s[i].last_exit.is_some())).then(|| {
                mean(&|s| us(s[i + 1].release.saturating_sub(s[i].last_exit.unwrap_or(0))))
            }),
        })
        .collect();
    let mut sites: Vec<TraceSite> = Vec::new();
    for p in &positions {
        let i = match sites.iter().position(|s| s.site == p.site) {
            Some(i) => i,
            None => {
                sites.push(TraceSite {
                    site: p.site.clone(),
                    launches: 0,
                    share_us: 0.0,
                });
                sites.len() - 1
            }
        };
        sites[i].launches += 1;
        sites[i].share_us += p.share_us.unwrap_or(0.0);
    }
    sites.sort_by(|a, b| b.share_us.total_cmp(&a.share_us));
    TraceSummary {
        steps: used.len(),
        skipped: steps.len() - used.len(),
        tick_ns,
        span_us: mean(&|s| us(s[len - 1].release.saturating_sub(s[0].release))),
        handoff_us: positions.iter().filter_map(|p| p.handoff_us).sum(),
        positions,
        sites,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's table of 8 slots (slot = grid % 8) from `(grid, t_pre, t_wait, tag)` per
    /// block of 4-block grids.
    fn step(blocks: &[(u64, u64, u64, u32)]) -> StepTrace {
        step_exits(blocks, &[])
    }

    /// [`step`] with warps leaving grid `g` at `t` for each `(g, t)` of `exits`.
    fn step_exits(blocks: &[(u64, u64, u64, u32)], exits: &[(u64, u64)]) -> StepTrace {
        let mut table = vec![TraceSlot::EMPTY; 8];
        for &(grid, t_pre, t_wait, tag) in blocks {
            table[(grid % 8) as usize].fold(grid, t_pre, t_wait, tag, 4);
        }
        for &(grid, t) in exits {
            table[(grid % 8) as usize].fold_exit(t);
        }
        StepTrace::from_table(&table, 1)
    }

    #[test]
    fn a_slot_is_the_kernels_128_bytes_of_ones_when_empty() {
        assert_eq!(std::mem::size_of::<TraceSlot>(), 128);
        assert_eq!(bytemuck::bytes_of(&TraceSlot::EMPTY), &[0xffu8; 128][..]);
    }

    #[test]
    fn tags_name_the_kernel_file_and_line() {
        // FNV-1a 32 of "a" is 0xe40c292c (the published test vector).
        assert_eq!(file_hash("a"), 0x292c);
        assert_eq!(file_hash(""), 2_166_136_261 & 0xffff);
        let tag = (file_hash("gemv.cuh") << 16) | 270;
        assert_eq!(tag_name(tag), "gemv.cuh:270");
        assert_eq!(
            tag_name((file_hash("attention.cu") << 16) | 9),
            "attention.cu:9"
        );
        assert_eq!(
            tag_name((file_hash("common.cuh") << 16) | 1),
            "common.cuh:1"
        );
        // No kernel file has this hash (checked against every name).
        let unknown = (0..=0xffffu32)
            .find(|h| {
                crate::kernels::kernel_sources()
                    .iter()
                    .chain(crate::kernels::kernel_headers())
                    .all(|(n, _)| file_hash(n) != *h)
                    && file_hash("common.cuh") != *h
            })
            .unwrap();
        assert_eq!(tag_name((unknown << 16) | 5), format!("#{unknown:04x}:5"));
    }

    #[test]
    fn launches_come_out_of_their_slots_in_release_order() {
        // Launch 7 (tag 1) released at 100, launch 3 (tag 2) at 250; one block of launch 7
        // released late (it started after an SM freed up), one waited at another line.
        let s = step(&[
            (3, 90, 250, 2),
            (7, 10, 100, 1),
            (7, 20, 180, 5),
            (3, 240, 260, 2),
            (7, 15, 101, 1),
        ]);
        assert_eq!(s.slots.len(), 2);
        let l = s.launches().unwrap();
        assert_eq!(
            l[0],
            LaunchSpan {
                tag: 1,
                blocks: 3,
                nblocks: 4,
                first_pre: 10,
                release: 100,
                last_release: 180,
                last_exit: None,
                grid: 7,
            }
        );
        assert_eq!(
            (
                l[1].tag,
                l[1].blocks,
                l[1].first_pre,
                l[1].release,
                l[1].last_release
            ),
            (2, 2, 90, 250, 260)
        );
        assert_eq!(step(&[]).launches(), Some(Vec::new()));
    }

    #[test]
    fn two_launches_in_one_slot_void_the_step() {
        // Grids 1 and 9 share slot 1 of the test's 8.
        assert_eq!(step(&[(1, 0, 5, 1), (9, 0, 7, 1)]).launches(), None);
        assert!(step(&[(1, 0, 5, 1), (2, 0, 7, 1)]).launches().is_some());
        // One launch number on two launches: more waiting blocks than a grid of 4 has.
        let five = [(3, 0, 5, 1); 5];
        assert_eq!(step(&five).launches(), None);
        assert!(step(&five[..4]).launches().is_some());
    }

    #[test]
    fn launches_tied_on_a_coarse_clock_keep_launch_order_and_exit_only_slots_are_skipped() {
        // Grids 5 and 4 released at the same tick, 4 was launched first.
        let mut table = vec![TraceSlot::EMPTY; 8];
        table[5].fold(5, 0, 1000, 2, 4);
        table[4].fold(4, 0, 1000, 3, 4);
        // A launch whose blocks all returned before waiting: an exit only.
        table[6].fold_exit(900);
        let l = StepTrace::from_table(&table, 1000).launches().unwrap();
        assert_eq!(l.iter().map(|s| s.grid).collect::<Vec<_>>(), [4, 5]);
    }

    #[test]
    fn summaries_average_positions_and_sum_sites() {
        let ns = |x: u64| x * 1000; // µs -> ns
        let one = |base: u64, gap: u64| {
            step_exits(
                &[
                    (base, ns(base), ns(base), 1),
                    (base + 1, ns(base), ns(base + gap), 2),
                    (base + 2, ns(base + 1), ns(base + gap + 4), 1),
                    (base + 2, ns(base + 1), ns(base + gap + 6), 1),
                ],
                &[
                    (base, ns(base) + 500),
                    (base + 1, ns(base + gap + 2)),
                    (base + 1, ns(base + gap + 3)),
                    (base + 2, ns(base + gap + 7)),
                ],
            )
            .launches()
        };
        // Two steps whose first launch takes 2 and 4 µs and whose second takes 4, one of
        // another shape (skipped), one with a shared slot.
        let other = step(&[(100, 0, 0, 3)]).launches();
        let s = summarize(&[one(10, 2), other.clone(), one(20, 4), other, None], 32);
        // The most common sequence wins, though another step came first.
        assert_eq!((s.steps, s.skipped, s.tick_ns), (2, 3, 32));
        assert_eq!(s.positions.len(), 3);
        assert_eq!(s.positions[0].share_us, Some(3.0));
        assert_eq!(s.positions[1].share_us, Some(4.0));
        assert_eq!(s.positions[2].share_us, None);
        assert_eq!(s.positions[1].early_us, 3.0);
        assert_eq!(s.positions[2].spread_us, 2.0);
        assert_eq!(s.positions[2].blocks, 2.0);
        assert!((s.span_us - 7.0).abs() < 1e-9);
        // Work after the release and hand-over to the next launch, from the last exit.
        assert_eq!(s.positions[0].body_us, Some(0.5));
        assert_eq!(s.positions[0].handoff_us, Some(2.5));
        assert_eq!(s.positions[1].body_us, Some(3.0));
        assert_eq!(s.positions[1].handoff_us, Some(1.0));
        assert_eq!(s.positions[2].body_us, Some(3.0));
        assert_eq!(s.positions[2].handoff_us, None);
        assert_eq!(s.handoff_us, 3.5);
        // A launch whose exit no step saw has neither.
        let no_exit = step(&[(1, 0, 10, 1), (2, 0, 20, 2)]).launches();
        let n = summarize(&[no_exit], 0);
        assert_eq!(
            (n.positions[0].body_us, n.positions[0].handoff_us),
            (None, None)
        );
        // Sites: tag 1 twice (3 µs + unknown), tag 2 once (4 µs), most time first.
        assert_eq!(s.sites.len(), 2);
        assert_eq!((s.sites[0].launches, s.sites[0].share_us), (1, 4.0));
        assert_eq!((s.sites[1].launches, s.sites[1].share_us), (2, 3.0));
        let empty = summarize(&[None, Some(Vec::new())], 0);
        assert_eq!((empty.steps, empty.skipped), (0, 2));
    }
}
