//! The sampled ids a worker keeps so that `PendingFrom` rows resolve without a host round trip
//! through the scheduler.
//!
//! Contract: the ids of the last `depth` launches are kept; a lookup of an older or unknown
//! launch fails loudly instead of feeding a wrong token.

use baton_proto::LaunchSeq;
use std::collections::VecDeque;

/// Ids sampled by recent launches, per row (`u32::MAX` for rows that did not sample).
#[derive(Debug)]
pub struct KeptIds {
    depth: usize,
    launches: VecDeque<(LaunchSeq, Vec<u32>)>,
}

impl KeptIds {
    /// Keeps the last `depth` launches (at least the number of launches in flight).
    pub fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            launches: VecDeque::new(),
        }
    }

    /// Records the ids of launch `seq` (indexed by row).
    pub fn push(&mut self, seq: LaunchSeq, ids: Vec<u32>) {
        if self.launches.len() == self.depth {
            self.launches.pop_front();
        }
        self.launches.push_back((seq, ids));
    }

    /// The id row `row` of launch `seq` sampled, if kept.
    pub fn get(&self, seq: LaunchSeq, row: u32) -> Option<u32> {
        let (_, ids) = self.launches.iter().find(|(s, _)| *s == seq)?;
        ids.get(row as usize).copied().filter(|&t| t != u32::MAX)
    }

    /// Forgets everything (after a restart nothing in flight is trusted).
    pub fn clear(&mut self) {
        self.launches.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_recent_sampling_rows_resolve() {
        let mut k = KeptIds::new(2);
        k.push(1, vec![5, u32::MAX]);
        k.push(2, vec![6]);
        assert_eq!(k.get(1, 0), Some(5));
        assert_eq!(k.get(1, 1), None, "a row that did not sample has no id");
        k.push(3, vec![7]);
        assert_eq!(k.get(1, 0), None, "launch 1 fell out of the window");
        assert_eq!(k.get(3, 0), Some(7));
    }
}
