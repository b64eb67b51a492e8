//! The limits the scheduler publishes once in the segment header, so that the frontends and the
//! scheduler validate requests against the same values (DESIGN.md section 2).

use bytemuck::{Pod, Zeroable};

/// The limits the scheduler publishes once, in the header; the frontends and the scheduler
/// validate requests against the same values. `#[repr(C)]`, all `u64`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Limits {
    /// Tokens per KV page.
    pub block_size: u64,
    /// Longest sequence (prompt + output), in tokens.
    pub max_model_len: u64,
    /// Most sequences running at once.
    pub max_num_seqs: u64,
    /// Slots in each frontend-to-scheduler ring.
    pub frontend_in_capacity: u64,
    /// Slots in each scheduler-to-frontend ring.
    pub frontend_out_capacity: u64,
    /// Slots in each launch ring.
    pub launch_capacity: u64,
    /// Slots in each completion ring.
    pub completion_capacity: u64,
    /// Reserved for later limits; zero until used.
    pub spare: [u64; 16],
}
