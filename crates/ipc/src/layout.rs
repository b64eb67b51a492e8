//! Layouts: a description of the named regions of a control segment, and the offsets computed
//! from it.
//!
//! Contract: a [`Layout`] is a pure function of its [`LayoutSpec`] and [`LAYOUT_VERSION`].
//! Every region starts on a [`REGION_ALIGN`] boundary after the header page, and the layout hash
//! covers every name, kind, count and size in the description, so two processes that agree on
//! version, hash and size agree on every offset. Nothing in the segment holds a pointer.

use crate::{doorbell::Doorbell, participants, ring, sync::CachePadded};
use std::fmt;

/// Version of the segment format: header fields, ring, doorbell and participant slot layouts.
/// Bump it whenever any `#[repr(C)]` type placed in the segment changes.
pub const LAYOUT_VERSION: u32 = 3;

/// Bytes reserved at offset 0 for the segment header (one page). Regions start after it.
pub const HEADER_SIZE: usize = 4096;

/// Every region's offset is a multiple of this (bytes): cache-line pairs, see
/// [`crate::sync::CACHE_LINE`].
pub const REGION_ALIGN: usize = crate::sync::CACHE_LINE;

/// Longest region name, in bytes.
pub const MAX_REGION_NAME: usize = 64;

/// Errors from [`LayoutSpec::layout`]: the description itself is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Two regions share a name.
    #[error("layout: region name {name:?} is used twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A name is empty, longer than [`MAX_REGION_NAME`], or not printable ASCII.
    #[error(
        "layout: region name {name:?} is invalid (1..={MAX_REGION_NAME} printable ASCII bytes)"
    )]
    BadName {
        /// The offending name.
        name: String,
    },
    /// A ring's capacity is not a power of two >= 2, or exceeds 2^32.
    #[error("layout: ring {name:?} capacity {capacity} must be a power of two in 2..=2^32")]
    BadCapacity {
        /// The ring.
        name: String,
        /// The capacity given, in slots.
        capacity: usize,
    },
    /// A slot size of zero, or an array or participant table of length zero.
    #[error("layout: region {name:?} has a zero {what}")]
    Zero {
        /// The region.
        name: String,
        /// Which quantity was zero ("slot size", "length", ...).
        what: &'static str,
    },
    /// A ring names a doorbell that is not a doorbell region of this layout.
    #[error("layout: ring {ring:?} wakes doorbell {doorbell:?}, which is not a doorbell region")]
    UnknownDoorbell {
        /// The ring.
        ring: String,
        /// The doorbell name it gave.
        doorbell: String,
    },
    /// The total size does not fit in memory.
    #[error("layout: total size overflows")]
    Overflow,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum SpecKind {
    Ring {
        capacity: usize,
        slot_size: usize,
        doorbell: Option<String>,
    },
    Doorbell,
    AtomicsU32 {
        len: usize,
    },
    AtomicsU64 {
        len: usize,
    },
    Participants {
        slots: usize,
    },
}

/// A builder describing the named regions of a segment, in order. Build methods take and return
/// the spec by value; problems are reported once, by [`layout`](Self::layout).
///
/// ```
/// use baton_ipc::LayoutSpec;
/// let spec = LayoutSpec::new()
///     .participants("participants", 8)
///     .doorbell("scheduler")
///     .ring_waking("frontend.0.in", 1024, 64, "scheduler")
///     .ring("frontend.0.out", 1024, 64)
///     .atomics_u64("released", 4);
/// let layout = spec.layout().unwrap();
/// assert_eq!(layout.regions().len(), 5);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayoutSpec {
    regions: Vec<(String, SpecKind)>,
}

impl LayoutSpec {
    /// An empty description.
    pub fn new() -> LayoutSpec {
        LayoutSpec::default()
    }

    /// A single-producer single-consumer ring of `capacity` slots (a power of two) of
    /// `slot_size` bytes each, with its own doorbell for its consumer.
    pub fn ring(self, name: &str, capacity: usize, slot_size: usize) -> LayoutSpec {
        self.push(
            name,
            SpecKind::Ring {
                capacity,
                slot_size,
                doorbell: None,
            },
        )
    }

    /// Like [`ring`](Self::ring), with a slot the size of `T`.
    pub fn ring_of<T: bytemuck::Pod>(self, name: &str, capacity: usize) -> LayoutSpec {
        self.ring(name, capacity, std::mem::size_of::<T>())
    }

    /// A ring whose producer rings the shared doorbell region `doorbell` (declared anywhere in
    /// this spec with [`doorbell`](Self::doorbell)) instead of a doorbell of its own, so one
    /// consumer can sleep on many rings at once.
    pub fn ring_waking(
        self,
        name: &str,
        capacity: usize,
        slot_size: usize,
        doorbell: &str,
    ) -> LayoutSpec {
        self.push(
            name,
            SpecKind::Ring {
                capacity,
                slot_size,
                doorbell: Some(doorbell.to_owned()),
            },
        )
    }

    /// A standalone doorbell (futex word) that several rings can wake.
    pub fn doorbell(self, name: &str) -> LayoutSpec {
        self.push(name, SpecKind::Doorbell)
    }

    /// An array of `len` `AtomicU32`, zero-initialised.
    pub fn atomics_u32(self, name: &str, len: usize) -> LayoutSpec {
        self.push(name, SpecKind::AtomicsU32 { len })
    }

    /// An array of `len` `AtomicU64`, zero-initialised.
    pub fn atomics_u64(self, name: &str, len: usize) -> LayoutSpec {
        self.push(name, SpecKind::AtomicsU64 { len })
    }

    /// A participant table of `slots` slots (see [`crate::participants`]).
    pub fn participants(self, name: &str, slots: usize) -> LayoutSpec {
        self.push(name, SpecKind::Participants { slots })
    }

    fn push(mut self, name: &str, kind: SpecKind) -> LayoutSpec {
        self.regions.push((name.to_owned(), kind));
        self
    }

    /// Compute offsets, sizes and the layout hash, or say what is wrong with the description.
    pub fn layout(&self) -> Result<Layout, LayoutError> {
        Layout::compute(self)
    }
}

/// What a region holds, with its resolved parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// An SPSC ring: `capacity` slots of `slot_size` bytes; its producer rings the doorbell at
    /// absolute byte offset `doorbell_offset`.
    Ring {
        /// Slots (a power of two).
        capacity: usize,
        /// Bytes per slot.
        slot_size: usize,
        /// Absolute offset of the doorbell the producer rings.
        doorbell_offset: usize,
    },
    /// A standalone doorbell.
    Doorbell,
    /// `len` `AtomicU32`.
    AtomicsU32 {
        /// Elements.
        len: usize,
    },
    /// `len` `AtomicU64`.
    AtomicsU64 {
        /// Elements.
        len: usize,
    },
    /// A participant table of `slots` slots whose liveness locks are numbered
    /// `lock_base..lock_base + slots`.
    Participants {
        /// Slots.
        slots: usize,
        /// Index of slot 0's liveness lock (lock 0 is the segment creator's).
        lock_base: usize,
    },
}

impl RegionKind {
    /// A short name for error messages: "ring", "doorbell", ...
    pub fn label(&self) -> &'static str {
        match self {
            RegionKind::Ring { .. } => "ring",
            RegionKind::Doorbell => "doorbell",
            RegionKind::AtomicsU32 { .. } => "atomics_u32",
            RegionKind::AtomicsU64 { .. } => "atomics_u64",
            RegionKind::Participants { .. } => "participants",
        }
    }
}

/// One named region: where it is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// Its name in the spec.
    pub name: String,
    /// Byte offset from the start of the segment; a multiple of [`REGION_ALIGN`].
    pub offset: usize,
    /// Bytes it spans (a multiple of [`REGION_ALIGN`]).
    pub size: usize,
    /// What it holds.
    pub kind: RegionKind,
}

/// A computed layout: regions at offsets, the total size and the hash that attach checks.
#[derive(Clone, PartialEq, Eq)]
pub struct Layout {
    regions: Vec<Region>,
    size: usize,
    hash: u64,
    locks: usize,
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Layout")
            .field("size", &self.size)
            .field("hash", &format_args!("{:#018x}", self.hash))
            .field("regions", &self.regions)
            .finish()
    }
}

fn align_up(x: usize, a: usize) -> Option<usize> {
    Some(x.checked_add(a - 1)? & !(a - 1))
}

/// FNV-1a, 64 bit: small, stable across Rust versions (unlike `DefaultHasher`).
struct Fnv(u64);

impl Fnv {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn u64(&mut self, x: u64) {
        self.bytes(&x.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes(s.as_bytes());
    }
}

impl Layout {
    fn compute(spec: &LayoutSpec) -> Result<Layout, LayoutError> {
        let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
        hash.str("baton-ipc layout");
        let mut seen = std::collections::HashSet::new();
        for (name, _) in &spec.regions {
            let ok = !name.is_empty()
                && name.len() <= MAX_REGION_NAME
                && name.bytes().all(|b| b.is_ascii_graphic());
            if !ok {
                return Err(LayoutError::BadName { name: name.clone() });
            }
            if !seen.insert(name.as_str()) {
                return Err(LayoutError::DuplicateName { name: name.clone() });
            }
        }

        // First pass: sizes and offsets. Rings' shared doorbells are resolved in a second pass.
        let mut regions = Vec::with_capacity(spec.regions.len());
        let mut offset = HEADER_SIZE;
        let mut locks = 1; // lock 0: the segment creator
        for (name, kind) in &spec.regions {
            hash.str(name);
            let zero = |what| LayoutError::Zero {
                name: name.clone(),
                what,
            };
            let (size, kind) = match kind {
                SpecKind::Ring {
                    capacity,
                    slot_size,
                    doorbell,
                } => {
                    if !capacity.is_power_of_two() || *capacity < 2 || *capacity > 1 << 32 {
                        return Err(LayoutError::BadCapacity {
                            name: name.clone(),
                            capacity: *capacity,
                        });
                    }
                    if *slot_size == 0 {
                        return Err(zero("slot size"));
                    }
                    hash.u64(1);
                    hash.u64(*capacity as u64);
                    hash.u64(*slot_size as u64);
                    match doorbell {
                        None => hash.u64(0),
                        Some(d) => {
                            hash.u64(1);
                            hash.str(d);
                        }
                    }
                    let size =
                        ring::region_size(*capacity, *slot_size).ok_or(LayoutError::Overflow)?;
                    let doorbell_offset = offset + ring::OWN_DOORBELL_OFFSET;
                    (
                        size,
                        RegionKind::Ring {
                            capacity: *capacity,
                            slot_size: *slot_size,
                            doorbell_offset,
                        },
                    )
                }
                SpecKind::Doorbell => {
                    hash.u64(2);
                    (
                        std::mem::size_of::<CachePadded<Doorbell>>(),
                        RegionKind::Doorbell,
                    )
                }
                SpecKind::AtomicsU32 { len } => {
                    if *len == 0 {
                        return Err(zero("length"));
                    }
                    hash.u64(3);
                    hash.u64(*len as u64);
                    let size = len.checked_mul(4).ok_or(LayoutError::Overflow)?;
                    (size, RegionKind::AtomicsU32 { len: *len })
                }
                SpecKind::AtomicsU64 { len } => {
                    if *len == 0 {
                        return Err(zero("length"));
                    }
                    hash.u64(4);
                    hash.u64(*len as u64);
                    let size = len.checked_mul(8).ok_or(LayoutError::Overflow)?;
                    (size, RegionKind::AtomicsU64 { len: *len })
                }
                SpecKind::Participants { slots } => {
                    if *slots == 0 {
                        return Err(zero("slot count"));
                    }
                    hash.u64(5);
                    hash.u64(*slots as u64);
                    let size = participants::region_size(*slots).ok_or(LayoutError::Overflow)?;
                    let kind = RegionKind::Participants {
                        slots: *slots,
                        lock_base: locks,
                    };
                    locks = locks.checked_add(*slots).ok_or(LayoutError::Overflow)?;
                    (size, kind)
                }
            };
            // Under loom the in-place types are bigger than `std`'s; sizes come from the types.
            let size = align_up(size, REGION_ALIGN).ok_or(LayoutError::Overflow)?;
            regions.push(Region {
                name: name.clone(),
                offset,
                size,
                kind,
            });
            offset = offset.checked_add(size).ok_or(LayoutError::Overflow)?;
        }

        for (i, (name, kind)) in spec.regions.iter().enumerate() {
            if let SpecKind::Ring {
                doorbell: Some(d), ..
            } = kind
            {
                let target = regions
                    .iter()
                    .find(|r| r.name == *d && r.kind == RegionKind::Doorbell)
                    .map(|r| r.offset)
                    .ok_or_else(|| LayoutError::UnknownDoorbell {
                        ring: name.clone(),
                        doorbell: d.clone(),
                    })?;
                if let RegionKind::Ring {
                    doorbell_offset, ..
                } = &mut regions[i].kind
                {
                    *doorbell_offset = target;
                }
            }
        }

        let size = align_up(offset, HEADER_SIZE).ok_or(LayoutError::Overflow)?;
        hash.u64(size as u64);
        Ok(Layout {
            regions,
            size,
            hash: hash.0,
            locks,
        })
    }

    /// The regions, in spec order.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// The region called `name`, if any.
    pub fn region(&self, name: &str) -> Option<&Region> {
        self.regions.iter().find(|r| r.name == name)
    }

    /// Total bytes, header page included, rounded up to a whole page.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The layout hash: FNV-1a over every name, kind, count and size in the description.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// Number of liveness locks: 1 (the creator) plus every participant slot.
    pub fn lock_count(&self) -> usize {
        self.locks
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn base() -> LayoutSpec {
        LayoutSpec::new()
            .participants("participants", 4)
            .doorbell("bell")
            .ring_waking("a", 8, 64, "bell")
            .ring("b", 16, 24)
            .atomics_u32("u32s", 3)
            .atomics_u64("u64s", 5)
    }

    #[test]
    fn every_region_is_aligned_and_disjoint() {
        let l = base().layout().unwrap();
        let mut end = HEADER_SIZE;
        for r in l.regions() {
            assert_eq!(r.offset % REGION_ALIGN, 0, "{r:?}");
            assert!(r.offset >= end, "{r:?} overlaps");
            end = r.offset + r.size;
        }
        assert!(end <= l.size());
        assert_eq!(l.size() % HEADER_SIZE, 0);
    }

    #[test]
    fn a_shared_doorbell_resolves_to_the_doorbell_region() {
        let l = base().layout().unwrap();
        let bell = l.region("bell").unwrap().offset;
        match l.region("a").unwrap().kind {
            RegionKind::Ring {
                doorbell_offset, ..
            } => assert_eq!(doorbell_offset, bell),
            ref k => panic!("{k:?}"),
        }
        let b = l.region("b").unwrap();
        match b.kind {
            RegionKind::Ring {
                doorbell_offset, ..
            } => assert_eq!(doorbell_offset, b.offset + ring::OWN_DOORBELL_OFFSET),
            ref k => panic!("{k:?}"),
        }
    }

    #[test]
    fn layout_hash_changes_with_slot_size_capacity_name_and_kind() {
        let h = |s: LayoutSpec| s.layout().unwrap().hash();
        let h0 = h(LayoutSpec::new().ring("r", 8, 64));
        assert_eq!(h0, h(LayoutSpec::new().ring("r", 8, 64)), "deterministic");
        assert_ne!(h0, h(LayoutSpec::new().ring("r", 8, 72)), "slot size");
        assert_ne!(h0, h(LayoutSpec::new().ring("r", 16, 64)), "capacity");
        assert_ne!(h0, h(LayoutSpec::new().ring("q", 8, 64)), "name");
        assert_ne!(
            h0,
            h(LayoutSpec::new().doorbell("d").ring_waking("r", 8, 64, "d")),
            "doorbell"
        );
        assert_ne!(
            h(LayoutSpec::new().atomics_u32("x", 4)),
            h(LayoutSpec::new().atomics_u64("x", 4)),
            "kind"
        );
    }

    #[test]
    fn bad_descriptions_are_rejected_with_the_region_named() {
        let e = |s: LayoutSpec| s.layout().unwrap_err();
        assert!(matches!(
            e(LayoutSpec::new().ring("r", 6, 8)),
            LayoutError::BadCapacity { capacity: 6, .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().ring("r", 1, 8)),
            LayoutError::BadCapacity { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().ring("r", 8, 0)),
            LayoutError::Zero { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().ring("r", 8, 8).ring("r", 8, 8)),
            LayoutError::DuplicateName { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().ring_waking("r", 8, 8, "nope")),
            LayoutError::UnknownDoorbell { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new()
                .ring("r", 8, 8)
                .ring_waking("s", 8, 8, "r")),
            LayoutError::UnknownDoorbell { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().atomics_u64("has space", 1)),
            LayoutError::BadName { .. }
        ));
        assert!(matches!(
            e(LayoutSpec::new().ring("r", 1 << 32, usize::MAX / 2)),
            LayoutError::Overflow
        ));
    }

    #[test]
    fn participant_tables_get_disjoint_lock_ranges_after_the_creator_lock() {
        let l = LayoutSpec::new()
            .participants("p", 3)
            .participants("q", 2)
            .layout()
            .unwrap();
        let bases: Vec<_> = l
            .regions()
            .iter()
            .map(|r| match r.kind {
                RegionKind::Participants { lock_base, .. } => lock_base,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(bases, vec![1, 4]);
        assert_eq!(l.lock_count(), 6);
    }
}
