//! The Responses API's response store: finished responses kept in this frontend's memory, so
//! that `previous_response_id`, `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
//! and `DELETE /v1/responses/{id}` work (vLLM keeps one too, behind
//! `VLLM_ENABLE_RESPONSES_API_STORE`). On with `--responses-store-mib N` (N > 0).
//!
//! Invariant: the entries' sizes (their JSON bytes) add up to at most the budget; inserting
//! evicts the least recently used entries (an entry is used when it is stored or read) until
//! the new one fits, and an entry larger than the whole budget is not stored. Each frontend
//! process has its own store: a response stored by one is unknown to another, and a restart
//! empties it.

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// One stored response: the input items it was made from (the whole conversation, earlier
/// responses' items included, without `instructions`) and the response object.
#[derive(Clone, Debug)]
pub struct StoredResponse {
    /// The conversation's input items, as `input` takes them.
    pub input: Vec<Value>,
    /// The response object, as returned.
    pub response: Value,
}

/// A size-bounded LRU map of response ids to [`StoredResponse`]s.
#[derive(Debug)]
pub struct ResponseStore {
    budget: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// id -> (use stamp, size in bytes, entry).
    entries: HashMap<String, (u64, usize, StoredResponse)>,
    /// Use stamp -> id, oldest first.
    order: BTreeMap<u64, String>,
    /// The next use stamp.
    clock: u64,
    /// The sum of the entries' sizes.
    bytes: usize,
}

impl Inner {
    /// Marks `id` used now.
    fn touch(&mut self, id: &str) {
        let stamp = self.clock;
        self.clock += 1;
        if let Some((used, _, _)) = self.entries.get_mut(id) {
            self.order.remove(used);
            *used = stamp;
            self.order.insert(stamp, id.to_owned());
        }
    }

    fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some((used, size, _)) => {
                self.order.remove(&used);
                self.bytes -= size;
                true
            }
            None => false,
        }
    }
}

impl ResponseStore {
    /// A store of at most `budget` bytes of JSON.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every method finishes its
        // bookkeeping before anything that could panic), so a poisoned lock is taken over.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `entry` under `id` (replacing an entry of that id), evicting the least recently
    /// used entries until it fits. Returns whether it was stored (false when it alone is larger
    /// than the budget).
    pub fn insert(&self, id: &str, entry: StoredResponse) -> bool {
        let size = json_size(&entry.input) + json_size(&entry.response) + id.len();
        let mut inner = self.lock();
        inner.remove(id);
        if size > self.budget {
            return false;
        }
        while inner.bytes + size > self.budget {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some((_, s, _)) = inner.entries.remove(&oldest) {
                inner.bytes -= s;
            }
        }
        let stamp = inner.clock;
        inner.clock += 1;
        inner.order.insert(stamp, id.to_owned());
        inner.entries.insert(id.to_owned(), (stamp, size, entry));
        inner.bytes += size;
        true
    }

    /// The entry stored under `id`, if any (marking it used).
    pub fn get(&self, id: &str) -> Option<StoredResponse> {
        let mut inner = self.lock();
        inner.touch(id);
        inner.entries.get(id).map(|(_, _, e)| e.clone())
    }

    /// Removes the entry stored under `id`; returns whether there was one.
    pub fn delete(&self, id: &str) -> bool {
        self.lock().remove(id)
    }

    /// The bytes stored now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// The size of `v` as compact JSON, in bytes.
fn json_size<T: serde::Serialize>(v: &T) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(text: &str) -> StoredResponse {
        StoredResponse {
            input: vec![json!({"role": "user", "content": text})],
            response: json!({"id": "r", "output": []}),
        }
    }

    #[test]
    fn the_store_stays_within_its_budget_evicting_the_least_recently_used() {
        let one = json_size(&entry("x").input) + json_size(&entry("x").response) + 2;
        let store = ResponseStore::new(3 * one);
        for id in ["r1", "r2", "r3"] {
            assert!(store.insert(id, entry("x")));
        }
        assert_eq!(store.bytes(), 3 * one);
        // r1 read: r2 is now the least recently used and goes first.
        assert!(store.get("r1").is_some());
        assert!(store.insert("r4", entry("x")));
        assert!(store.get("r2").is_none());
        for id in ["r1", "r3", "r4"] {
            assert!(store.get(id).is_some(), "{id}");
        }
        assert!(store.bytes() <= 3 * one);
        // Replacing an id does not count it twice; deleting frees its bytes.
        assert!(store.insert("r4", entry("x")));
        assert_eq!(store.bytes(), 3 * one);
        assert!(store.delete("r4"));
        assert!(!store.delete("r4"));
        assert_eq!(store.bytes(), 2 * one);
        // An entry larger than the whole budget is not stored, and evicts nothing.
        assert!(!store.insert("big", entry(&"y".repeat(4 * one))));
        assert!(store.get("big").is_none());
        assert_eq!(store.bytes(), 2 * one);
    }
}
