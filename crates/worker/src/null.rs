//! The null backend: returns a fixed token for every sampling row without computing anything.
//! It measures the control plane and the scheduler alone.

use crate::{Backend, KvCapacity, TableReader, WorkerError};
use baton_proto::{Completion, Launch};

/// A backend that samples `token` everywhere.
#[derive(Debug)]
pub struct NullBackend {
    capacity: KvCapacity,
    vocab_size: usize,
    token: u32,
}

impl NullBackend {
    /// A null backend offering `capacity`, with `vocab_size` ids, always sampling `token`.
    pub fn new(capacity: KvCapacity, vocab_size: usize, token: u32) -> Self {
        Self {
            capacity,
            vocab_size,
            token,
        }
    }
}

impl Backend for NullBackend {
    fn execute(
        &mut self,
        launch: &Launch,
        _tables: &dyn TableReader,
    ) -> Result<Completion, WorkerError> {
        Ok(Completion::sampling(launch, |_| self.token))
    }

    fn kv_capacity(&self) -> KvCapacity {
        self.capacity
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn model_fingerprint(&self) -> u64 {
        0
    }

    fn name(&self) -> &'static str {
        "null"
    }
}
