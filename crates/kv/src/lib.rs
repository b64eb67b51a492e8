//! KV-cache page bookkeeping and fenced reclamation (DESIGN.md section 4).
//!
//! The reclamation invariant, stated once: a page (or a request slot) that a launch `s` referred
//! to is *retired after* `s_last`, the last launch that referred to it, and goes back to the free
//! list only when every live consumer has released it, i.e. when
//! `min over live consumers c of released[c] >= s_last`. A consumer's `released` counter only
//! advances at its completion fence (the end of the device work of that launch), so a page is
//! never handed to a new request while a launch that may still read or write it is unreleased.
//!
//! The scheduler is the only allocator, so the free lists here are scheduler-private. The
//! `released` counters are shared: [`fence`] reads them (in one process from [`Consumers`],
//! across processes from the participant table of `baton-ipc`), and [`fence::passed`] is the one
//! check that lets a retired page or slot back. The loom models in `tests/loom.rs` run this code
//! with the worker and the scheduler as threads.

pub mod fence;
pub mod pool;
pub mod prefix;
pub mod slots;

pub use fence::{Consumers, Fence, Workers};
pub use pool::{BlockKey, PagePool, PoolStats, Reclaimed};
pub use prefix::PrefixHasher;
pub use slots::SlotAllocator;

/// A launch sequence number (see `baton_proto::LaunchSeq`).
pub type LaunchSeq = u64;

/// Minimum of the `released` counters of the live consumers, or `None` when there is no live
/// consumer. With no live consumer nothing can still touch a page, so everything retired is
/// reclaimable; the caller decides that case explicitly (a dead worker took its device memory
/// with it).
pub fn min_released(released: impl IntoIterator<Item = LaunchSeq>) -> Option<LaunchSeq> {
    released.into_iter().min()
}
