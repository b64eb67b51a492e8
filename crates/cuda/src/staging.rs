//! The per-step input block: every host-side input of one launch (ids, positions, slots, row
//! metadata, block tables, pending-id references, sampling parameters, penalty rows, token-mask
//! rows) packed into one byte buffer at fixed offsets, copied to the device with one
//! `cuMemcpyHtoDAsync`.
//!
//! The penalty entries themselves ([`DevicePenaltyEntry`], built by [`pack_penalties`]) vary in
//! number, so they live in a separate buffer that grows when a launch needs more; the staging
//! buffer carries its device address (the `penalty_table` region), which the sampler reads
//! through, so a captured graph keeps working after the entry buffer was reallocated. The
//! token masks of structured-output rows (`SamplingParams::token_mask`) work the same way: each
//! row's `mask_rows` entry is the index of its mask among the launch's masks (or `-1`), and the
//! masks of the guided rows, compacted, live in a growable buffer whose address the
//! `mask_table` region carries (`baton_apply_token_mask` in `kernels/token_mask.cu`).
//!
//! Why fixed offsets: a captured CUDA graph bakes in device pointers, so each region lives at
//! the same device address on every step; only the contents change. Regions are 16-byte
//! aligned. Row-indexed regions have room for `max_rows` rows, token-indexed ones for
//! `max_tokens`, block tables are `max_rows x max_blocks` with a fixed row stride.

use crate::plan::LaunchPlan;
use baton_proto::SamplingParams;
use baton_worker::penalty::PenaltyEntry;

/// Marks a staged input id as a `PendingFrom` reference: the low 31 bits are an index into
/// the device ring of sampled ids, which `baton_embedding_gather` reads and writes back in its
/// place (kernels/embedding.cu; `BATON_PENDING_TAG` in kernels/common.cuh). Token ids are
/// below it (vocabularies are far smaller than 2^31).
pub const PENDING_TAG: u32 = 0x8000_0000;

/// Where a row's penalty entries are (`BatonPenaltyRow` in `kernels/sampling.cu`, 16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PenaltyRow {
    /// Index of the row's first entry in the launch's entry array.
    pub offset: u32,
    /// Number of entries (distinct history tokens the host knows), ascending by token.
    pub count: u32,
    /// Index in the launch's input-id buffer of the row's pending first input (an output the
    /// device resolves, counted as one more output occurrence), or `-1`.
    pub pending_index: i32,
    /// Zero.
    pub reserved: u32,
}

impl PenaltyRow {
    /// A row without penalties.
    pub const NONE: PenaltyRow = PenaltyRow {
        offset: 0,
        count: 0,
        pending_index: -1,
        reserved: 0,
    };
}

/// One penalty entry as the sampler reads it (`BatonPenaltyEntry` in `kernels/sampling.cu`, 16
/// bytes): a [`PenaltyEntry`] plus a slot where the kernel saves the raw logit it penalizes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DevicePenaltyEntry {
    /// Token id.
    pub token: u32,
    /// Occurrences among the outputs the host knows.
    pub output_count: u32,
    /// Bit 0 ([`ENTRY_IN_PROMPT`]): the token occurs in the prompt. Bit 1 ([`ENTRY_LISTED`]):
    /// the token has a logit-bias entry (with `allowed_only`, it may be sampled).
    pub flags: u32,
    /// The request's logit bias for the token (0 for none), added before the penalties.
    pub bias: f32,
    /// Written by the kernel (the raw logit); 0 on upload.
    pub saved: f32,
}

/// [`DevicePenaltyEntry::flags`]: the token occurs in the prompt.
pub const ENTRY_IN_PROMPT: u32 = 1;
/// [`DevicePenaltyEntry::flags`]: the token is listed in the logit-bias row.
pub const ENTRY_LISTED: u32 = 2;

impl From<&PenaltyEntry> for DevicePenaltyEntry {
    fn from(e: &PenaltyEntry) -> Self {
        DevicePenaltyEntry {
            token: e.token,
            output_count: e.output_count,
            flags: if e.in_prompt { ENTRY_IN_PROMPT } else { 0 }
                | if e.listed { ENTRY_LISTED } else { 0 },
            bias: e.bias,
            saved: 0.0,
        }
    }
}

/// Packs the penalty lists of a launch's rows: for each row `(list, pending_index)` (an empty
/// list and `None` for a row without penalties), one [`PenaltyRow`] into `rows` and its entries,
/// concatenated, into `entries` (both cleared first).
///
/// # Errors
/// [`CapacityError`] (`penalty entries`) when the entries exceed `u32` offsets.
pub fn pack_penalties<'a>(
    lists: impl IntoIterator<Item = (&'a [PenaltyEntry], Option<u32>)>,
    rows: &mut Vec<PenaltyRow>,
    entries: &mut Vec<DevicePenaltyEntry>,
) -> Result<(), CapacityError> {
    rows.clear();
    entries.clear();
    for (list, pending) in lists {
        let too_many = |have| CapacityError {
            what: "penalty entries",
            have,
            cap: i32::MAX as usize,
        };
        let offset = u32::try_from(entries.len()).map_err(|_| too_many(entries.len()))?;
        let count = u32::try_from(list.len()).map_err(|_| too_many(list.len()))?;
        let pending_index = match pending {
            Some(p) => i32::try_from(p).map_err(|_| too_many(p as usize))?,
            None => -1,
        };
        entries.extend(list.iter().map(DevicePenaltyEntry::from));
        if entries.len() > i32::MAX as usize {
            return Err(too_many(entries.len()));
        }
        rows.push(PenaltyRow {
            offset,
            count,
            pending_index,
            reserved: 0,
        });
    }
    Ok(())
}

/// Byte offsets of the regions of the staging buffer; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    /// Token capacity.
    pub max_tokens: usize,
    /// Row capacity.
    pub max_rows: usize,
    /// Block-table stride (entries per row).
    pub max_blocks: usize,
    /// `[max_tokens]` u32 input ids; a pending entry is its ring index with [`PENDING_TAG`]
    /// set, replaced by the id on the device.
    pub ids: usize,
    /// `[max_tokens]` i32 positions.
    pub positions: usize,
    /// `[max_tokens]` i32 KV slots (`-1` = padding).
    pub slots: usize,
    /// `[max_rows + 1]` i32 prefix sums of row lengths.
    pub cu_seqlens: usize,
    /// `[max_rows]` i32 first position per row.
    pub start_pos: usize,
    /// `[max_rows]` i32 context length per row after this launch (0 = padding row).
    pub seq_lens: usize,
    /// `[max_rows]` i32 flattened index of each row's last token.
    pub last_index: usize,
    /// `[max_rows * max_blocks]` i32 block tables; the last region.
    pub block_tables: usize,
    /// `[max_rows]` u32 output index (RNG counter) per row.
    pub output_index: usize,
    /// `[max_rows]` 64-byte [`SamplingParams`] per row.
    pub params: usize,
    /// `[max_rows]` [`PenaltyRow`] per row.
    pub penalty_rows: usize,
    /// One u64: the device address of the launch's [`DevicePenaltyEntry`] array.
    pub penalty_table: usize,
    /// `[max_rows]` i32 per row: the index of the row's token mask among the launch's masks
    /// (its words start at `index * token_mask_words(vocab)` of the mask array), or `-1` for a
    /// row without one.
    pub mask_rows: usize,
    /// One u64: the device address of the launch's token-mask array (u32 words).
    pub mask_table: usize,
    /// Total bytes.
    pub total: usize,
}

fn align16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

/// One launch's host inputs, ready to be packed by [`StagingLayout::fill`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepInputs {
    /// Flattened plan (possibly padded to a graph bucket).
    pub plan: LaunchPlan,
    /// `[num_tokens]` input ids; entries that [`Self::pending`] overwrites hold 0.
    pub ids: Vec<u32>,
    /// `(token index, ring index)` of each id resolved on the device: the staged id is the
    /// ring index with [`PENDING_TAG`] set, which `baton_embedding_gather` replaces.
    pub pending: Vec<(u32, u32)>,
    /// `[num_rows]` output index per row.
    pub output_index: Vec<u32>,
    /// `[num_rows]` sampling parameters per row.
    pub params: Vec<SamplingParams>,
    /// `[num_rows]` penalty rows (see [`pack_penalties`]), or empty when no row is penalized.
    pub penalty_rows: Vec<PenaltyRow>,
    /// Device address of the entry array `penalty_rows` index into (0 when there is none).
    pub penalty_table: u64,
    /// `[num_rows]` token-mask index per row (`-1`: none; see [`StagingLayout::mask_rows`]),
    /// or empty when no row has a mask.
    pub mask_rows: Vec<i32>,
    /// Device address of the mask array `mask_rows` index into (0 when there is none).
    pub mask_table: u64,
}

/// Why a step does not fit the staging buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("launch does not fit the device buffers: {what} {have} > capacity {cap}")]
pub struct CapacityError {
    /// What overflowed (`tokens`, `rows`, `block-table entries per row`, `penalty entries`,
    /// `pending token index`, `pending ring index`).
    pub what: &'static str,
    /// Needed.
    pub have: usize,
    /// Available.
    pub cap: usize,
}

impl StagingLayout {
    /// The layout for `max_tokens` tokens, `max_rows` rows and `max_blocks` block-table entries
    /// per row (each at least 1).
    pub fn new(max_tokens: usize, max_rows: usize, max_blocks: usize) -> Self {
        let (t, r, b) = (max_tokens.max(1), max_rows.max(1), max_blocks.max(1));
        let mut off = 0;
        let mut take = |bytes: usize| {
            let o = off;
            off = align16(off + bytes);
            o
        };
        let ids = take(4 * t);
        let positions = take(4 * t);
        let slots = take(4 * t);
        let cu_seqlens = take(4 * (r + 1));
        let start_pos = take(4 * r);
        let seq_lens = take(4 * r);
        let last_index = take(4 * r);
        let output_index = take(4 * r);
        let params = take(std::mem::size_of::<SamplingParams>() * r);
        let penalty_rows = take(std::mem::size_of::<PenaltyRow>() * r);
        let penalty_table = take(8);
        let mask_rows = take(4 * r);
        let mask_table = take(8);
        // Last, so a launch uploads only the rows it uses (see `used_bytes`).
        let block_tables = take(4 * r * b);
        StagingLayout {
            max_tokens: t,
            max_rows: r,
            max_blocks: b,
            ids,
            positions,
            slots,
            cu_seqlens,
            start_pos,
            seq_lens,
            last_index,
            block_tables,
            output_index,
            params,
            penalty_rows,
            penalty_table,
            mask_rows,
            mask_table,
            total: off,
        }
    }

    /// Bytes from the start of the buffer that a launch of `num_rows` rows (after padding)
    /// reads: everything up to the end of row `num_rows - 1`'s block table. At serve sizes the
    /// full block tables dominate the buffer (256 rows of 8192 entries are 8 MiB), so the
    /// per-launch upload copies only this prefix.
    pub fn used_bytes(&self, num_rows: usize) -> usize {
        let rows = num_rows.clamp(1, self.max_rows);
        align16(self.block_tables + 4 * rows * self.max_blocks).min(self.total)
    }

    /// Checks `s` fits, then writes it into `buf` (`total` bytes). Unused entries keep whatever
    /// they held; the kernels only read the first `num_tokens` / `num_rows` entries.
    ///
    /// # Errors
    /// [`CapacityError`] when tokens, rows or block-table width exceed the layout, or a pending
    /// entry names a token past `ids` or a ring index that does not fit under [`PENDING_TAG`].
    pub fn fill(&self, buf: &mut [u8], s: &StepInputs) -> Result<(), CapacityError> {
        let p = &s.plan;
        let check = |what, have, cap| {
            if have > cap {
                Err(CapacityError { what, have, cap })
            } else {
                Ok(())
            }
        };
        check("tokens", p.num_tokens(), self.max_tokens)?;
        check("rows", p.num_rows(), self.max_rows)?;
        check(
            "block-table entries per row",
            p.max_blocks_per_row,
            self.max_blocks,
        )?;
        assert_eq!(buf.len(), self.total, "staging buffer size");
        assert_eq!(s.ids.len(), p.num_tokens());
        assert_eq!(s.output_index.len(), p.num_rows());
        assert_eq!(s.params.len(), p.num_rows());
        assert!(s.penalty_rows.is_empty() || s.penalty_rows.len() == p.num_rows());
        assert!(s.mask_rows.is_empty() || s.mask_rows.len() == p.num_rows());
        put(buf, self.ids, &s.ids);
        // Each pending id over its placeholder: its ring index, tagged.
        for &(dst, src) in &s.pending {
            if src >= PENDING_TAG {
                return Err(CapacityError {
                    what: "pending ring index",
                    have: src as usize,
                    cap: PENDING_TAG as usize,
                });
            }
            if dst as usize >= s.ids.len() {
                return Err(CapacityError {
                    what: "pending token index",
                    have: dst as usize,
                    cap: s.ids.len(),
                });
            }
            put(buf, self.ids + 4 * dst as usize, &[PENDING_TAG | src]);
        }
        put(buf, self.positions, &p.positions);
        put(buf, self.slots, &p.slot_mapping);
        put(buf, self.cu_seqlens, &p.cu_seqlens);
        put(buf, self.start_pos, &p.start_pos);
        put(buf, self.seq_lens, &p.seq_lens);
        put(buf, self.last_index, &p.last_token_index);
        let mb = p.max_blocks_per_row.max(1);
        for r in 0..p.num_rows() {
            let row = &p.block_tables[r * mb..(r + 1) * mb];
            put(buf, self.block_tables + 4 * r * self.max_blocks, row);
        }
        put(buf, self.output_index, &s.output_index);
        put(buf, self.params, bytemuck::cast_slice::<_, u8>(&s.params));
        if s.penalty_rows.is_empty() {
            let none = vec![PenaltyRow::NONE; p.num_rows()];
            put(buf, self.penalty_rows, &none);
        } else {
            put(buf, self.penalty_rows, &s.penalty_rows);
        }
        put(buf, self.penalty_table, &[s.penalty_table]);
        if s.mask_rows.is_empty() {
            put(buf, self.mask_rows, &vec![-1i32; p.num_rows()]);
        } else {
            put(buf, self.mask_rows, &s.mask_rows);
        }
        put(buf, self.mask_table, &[s.mask_table]);
        Ok(())
    }
}

fn put<T: bytemuck::Pod>(buf: &mut [u8], at: usize, v: &[T]) {
    let b: &[u8] = bytemuck::cast_slice(v);
    buf[at..at + b.len()].copy_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::plan_launch;

    #[test]
    fn regions_are_aligned_disjoint_and_sized() {
        let l = StagingLayout::new(100, 7, 3);
        let regions = [
            (l.ids, 400),
            (l.positions, 400),
            (l.slots, 400),
            (l.cu_seqlens, 32),
            (l.start_pos, 28),
            (l.seq_lens, 28),
            (l.last_index, 28),
            (l.output_index, 28),
            (l.params, 7 * 64),
            (l.penalty_rows, 7 * 16),
            (l.penalty_table, 8),
            (l.mask_rows, 28),
            (l.mask_table, 8),
            (l.block_tables, 84),
        ];
        for w in regions.windows(2) {
            assert_eq!(w[0].0 % 16, 0);
            assert!(w[0].0 + w[0].1 <= w[1].0, "{regions:?}");
        }
        let last = regions[regions.len() - 1];
        assert!(last.0 + last.1 <= l.total);
        assert_eq!(l.total % 16, 0);
        assert_eq!(StagingLayout::new(0, 0, 0).max_rows, 1);
        // A launch's upload covers every region and its rows' block tables, nothing more.
        assert_eq!(l.used_bytes(7), l.total);
        assert_eq!(l.used_bytes(2), l.block_tables + 2 * 3 * 4 + 8);
        assert!(l.used_bytes(2) >= l.penalty_table + 8);
        assert!(l.used_bytes(1) >= l.mask_table + 8);
        assert_eq!(l.used_bytes(0), l.used_bytes(1));
        assert_eq!(l.used_bytes(100), l.total);
    }

    #[test]
    fn fill_writes_every_region_and_restrides_block_tables() {
        let t0 = [7u32, 3];
        let t1 = [1u32, 2];
        let plan = plan_launch(&[(0, 5, &t0), (9, 1, &t1)], 8).unwrap();
        let l = StagingLayout::new(16, 4, 4);
        let mut buf = vec![0xffu8; l.total];
        let params = vec![SamplingParams::greedy(); 2];
        let s = StepInputs {
            ids: vec![1, 2, 3, 4, 5, 0],
            pending: vec![(5, 42)],
            output_index: vec![0, 9],
            params,
            plan,
            penalty_rows: vec![
                PenaltyRow::NONE,
                PenaltyRow {
                    offset: 3,
                    count: 2,
                    pending_index: 5,
                    reserved: 0,
                },
            ],
            penalty_table: 0x1234_5678_9abc,
            mask_rows: vec![-1, 0],
            mask_table: 0x2468_ace0_1357,
        };
        l.fill(&mut buf, &s).unwrap();
        let rd = |at: usize, n: usize| -> Vec<i32> {
            buf[at..at + 4 * n]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        // The pending id: its ring index, tagged.
        assert_eq!(rd(l.ids, 6), vec![1, 2, 3, 4, 5, (PENDING_TAG | 42) as i32]);
        assert_eq!(rd(l.positions, 6), vec![0, 1, 2, 3, 4, 9]);
        assert_eq!(rd(l.cu_seqlens, 3), vec![0, 5, 6]);
        assert_eq!(rd(l.seq_lens, 2), vec![5, 10]);
        assert_eq!(rd(l.last_index, 2), vec![4, 5]);
        // Row stride 4 in the staging buffer, 2 in the plan.
        assert_eq!(rd(l.block_tables, 2), vec![7, 3]);
        assert_eq!(rd(l.block_tables + 16, 2), vec![1, 2]);
        assert_eq!(rd(l.output_index, 2), vec![0, 9]);
        assert_eq!(
            &buf[l.params..l.params + std::mem::size_of::<SamplingParams>()],
            bytemuck::bytes_of(&SamplingParams::greedy())
        );
        assert_eq!(rd(l.penalty_rows, 8), vec![0, 0, -1, 0, 3, 2, 5, 0]);
        assert_eq!(
            buf[l.penalty_table..l.penalty_table + 8],
            0x1234_5678_9abcu64.to_le_bytes()
        );
        assert_eq!(rd(l.mask_rows, 2), vec![-1, 0]);
        assert_eq!(
            buf[l.mask_table..l.mask_table + 8],
            0x2468_ace0_1357u64.to_le_bytes()
        );
        // Without penalty or mask rows every row reads as not penalized and not masked.
        let s = StepInputs {
            penalty_rows: Vec::new(),
            mask_rows: Vec::new(),
            ..s
        };
        let mut again = buf.clone();
        l.fill(&mut again, &s).unwrap();
        let rows: Vec<i32> = again[l.penalty_rows..l.penalty_rows + 32]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(rows, vec![0, 0, -1, 0, 0, 0, -1, 0]);
        let masks: Vec<i32> = again[l.mask_rows..l.mask_rows + 8]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(masks, vec![-1, -1]);
    }

    #[test]
    fn penalty_lists_pack_into_rows_and_one_entry_array() {
        let e = |token, output_count, in_prompt| PenaltyEntry {
            token,
            output_count,
            in_prompt,
            bias: 0.0,
            listed: false,
        };
        let mut biased = e(9, 0, true);
        biased.bias = -2.5;
        biased.listed = true;
        let a = [e(3, 2, true), biased];
        let b = [e(1, 1, false)];
        let (mut rows, mut entries) = (vec![PenaltyRow::NONE; 9], Vec::new());
        pack_penalties(
            [
                (&a[..], None),
                (&[][..], None),
                (&b[..], Some(17)),
                (&[][..], Some(4)),
            ],
            &mut rows,
            &mut entries,
        )
        .unwrap();
        let row = |offset, count, pending_index| PenaltyRow {
            offset,
            count,
            pending_index,
            reserved: 0,
        };
        assert_eq!(
            rows,
            vec![row(0, 2, -1), row(2, 0, -1), row(2, 1, 17), row(3, 0, 4)]
        );
        let d = |token, output_count, flags, bias| DevicePenaltyEntry {
            token,
            output_count,
            flags,
            bias,
            saved: 0.0,
        };
        assert_eq!(
            entries,
            vec![d(3, 2, 1, 0.0), d(9, 0, 3, -2.5), d(1, 1, 0, 0.0)]
        );
        assert_eq!(
            rows[1],
            PenaltyRow {
                offset: 2,
                ..PenaltyRow::NONE
            }
        );
        // Reused buffers are cleared; a pending index past i32 is refused.
        let err = pack_penalties([(&b[..], Some(u32::MAX))], &mut rows, &mut entries).unwrap_err();
        assert_eq!(err.what, "penalty entries");
        pack_penalties([(&b[..], None)], &mut rows, &mut entries).unwrap();
        assert_eq!((rows.len(), entries.len()), (1, 1));
        assert_eq!(std::mem::size_of::<PenaltyRow>(), 16);
        assert_eq!(std::mem::size_of::<DevicePenaltyEntry>(), 20);
    }

    #[test]
    fn fill_rejects_what_does_not_fit() {
        let t = [0u32; 3];
        let plan = plan_launch(&[(0, 20, &t)], 8).unwrap();
        let l = StagingLayout::new(16, 4, 4);
        let mut buf = vec![0u8; l.total];
        let s = StepInputs {
            ids: vec![0; 20],
            pending: vec![],
            output_index: vec![0],
            params: vec![SamplingParams::greedy()],
            plan,
            ..StepInputs::default()
        };
        let e = l.fill(&mut buf, &s).unwrap_err();
        assert_eq!((e.what, e.have, e.cap), ("tokens", 20, 16));
        let l = StagingLayout::new(64, 4, 2);
        let mut buf = vec![0u8; l.total];
        assert_eq!(
            l.fill(&mut buf, &s).unwrap_err().what,
            "block-table entries per row"
        );
        // A pending entry past the ids, or a ring index the tag would corrupt.
        let t = [0u32; 1];
        let plan = plan_launch(&[(0, 2, &t)], 8).unwrap();
        let l = StagingLayout::new(16, 4, 4);
        let mut buf = vec![0u8; l.total];
        let mut s = StepInputs {
            ids: vec![0; 2],
            pending: vec![(2, 0)],
            output_index: vec![0],
            params: vec![SamplingParams::greedy()],
            plan,
            ..StepInputs::default()
        };
        let e = l.fill(&mut buf, &s).unwrap_err();
        assert_eq!((e.what, e.have, e.cap), ("pending token index", 2, 2));
        s.pending = vec![(1, PENDING_TAG)];
        assert_eq!(l.fill(&mut buf, &s).unwrap_err().what, "pending ring index");
        s.pending = vec![(1, PENDING_TAG - 1)];
        l.fill(&mut buf, &s).unwrap();
    }
}
