//! baton-ipc: Baton's shared-memory control plane (DESIGN.md sections 6 and 7).
//!
//! This crate moves bytes between processes and knows nothing about requests. It provides, in
//! layers:
//!
//! - [`sync`]: the atomics facade (std, or loom under `cfg(loom)`), used by everything below.
//! - [`LayoutSpec`] / [`Layout`]: named regions (rings, doorbells, atomic arrays, participant
//!   tables) at cache-line-aligned offsets, with a hash of the description.
//! - `Segment`: `/dev/shm/baton-<instance>`, created exclusively with mode 0600, header
//!   written last, attach checks every header field (`Segment::peek_limits` reads the published
//!   [`Limits`] first when the layout depends on them). Derefs to an [`Arena`], which is also
//!   available on the heap ([`Arena::heap`]) for the in-process path and loom models.
//!   Liveness is kernel evidence: OFD locks on the segment file, dropped when a process dies.
//! - [`RingProducer`] / [`RingConsumer`]: SPSC rings of fixed-size [`bytemuck::Pod`] slots;
//!   idle readers sleep on a futex [`Doorbell`].
//! - [`ParticipantTable`]: registration, kernel-evidence liveness, heartbeats, generations,
//!   and each participant's `released` counter.
//! - [`topology`]: the control plane's rings and participant slots by name.
//!
//! ```
//! use baton_ipc::{Arena, LayoutSpec, Role};
//! use std::time::Duration;
//!
//! let spec = LayoutSpec::new().participants("participants", 4).ring_of::<[u64; 8]>("r", 64);
//! // Across processes: `Segment::create("prod", &spec, limits)?` in the scheduler and
//! // `Segment::attach("prod", &spec)?` elsewhere; both deref to an `Arena`.
//! let arena = Arena::heap(&spec).unwrap();
//! let me = arena.participants("participants").unwrap().register(Role::Worker).unwrap();
//! let mut tx = arena.producer::<[u64; 8]>("r").unwrap();
//! let mut rx = arena.consumer::<[u64; 8]>("r").unwrap();
//! tx.try_push([me.generation(); 8]).unwrap();
//! assert_eq!(rx.wait_pop(Duration::from_millis(10)), Some([1; 8]));
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod sync;

mod arena;
mod doorbell;
mod layout;
mod limits;
#[cfg(not(loom))]
mod liveness;
pub mod participants;
pub mod process;
mod ring;
#[cfg(not(loom))]
mod segment;
pub mod topology;

pub use arena::{Arena, AtomicArray, DoorbellRef, RegionError};
pub use doorbell::Doorbell;
pub use layout::{
    Layout, LayoutError, LayoutSpec, Region, RegionKind, HEADER_SIZE, LAYOUT_VERSION,
    MAX_REGION_NAME, REGION_ALIGN,
};
pub use limits::Limits;
pub use participants::{
    DeadParticipant, ParticipantInfo, ParticipantTable, ReclaimError, RegisterError, Registration,
    Role, SlotState,
};
pub use ring::{Full, RingConsumer, RingProducer, Side};
#[cfg(not(loom))]
pub use segment::{
    check_instance, segment_path, Segment, SegmentError, SegmentInfo, MAGIC, MAX_INSTANCE_LEN,
    SHM_DIR,
};
pub use topology::{ControlPlaneSpec, RingShape};
