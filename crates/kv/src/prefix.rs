//! Block keys for the prefix cache: a hash chain over full blocks of token ids.
//!
//! The key of block `i` hashes the key of block `i - 1` with the block's own token ids, so two
//! blocks share a key only when every token from position 0 to the end of the block is the same
//! (vLLM's automatic prefix caching keys blocks the same way). A key is 128 bits from two
//! SipHash-1-3 hashers with independent random keys drawn at start-up (`RandomState`): a client
//! that does not know those keys cannot aim for a collision, and an accidental one needs about
//! 2^64 distinct blocks.

use crate::pool::BlockKey;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// Computes block keys. One per scheduler: keys from different hashers never compare equal in
/// practice, so they must not be mixed.
#[derive(Debug, Clone, Default)]
pub struct PrefixHasher {
    lo: RandomState,
    hi: RandomState,
}

impl PrefixHasher {
    /// A hasher with fresh random keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of a full block holding `tokens`, following the block whose key is `parent`
    /// (`None` for the first block of a sequence). `salt` (vLLM's `cache_salt`, hashed; 0 for
    /// none) enters the first block's key, and so every later one: requests with different
    /// salts never share a block.
    pub fn block_key(&self, parent: Option<BlockKey>, salt: u64, tokens: &[u32]) -> BlockKey {
        let half = |s: &RandomState| {
            let mut h = s.build_hasher();
            match parent {
                Some(p) => {
                    h.write_u8(1);
                    h.write_u128(p);
                }
                None => {
                    h.write_u8(0);
                    h.write_u64(salt);
                }
            }
            h.write_usize(tokens.len());
            for &t in tokens {
                h.write_u32(t);
            }
            h.finish()
        };
        (u128::from(half(&self.hi)) << 64) | u128::from(half(&self.lo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_the_whole_prefix() {
        let h = PrefixHasher::new();
        let a0 = h.block_key(None, 0, &[1, 2, 3, 4]);
        let b0 = h.block_key(None, 0, &[1, 2, 3, 5]);
        assert_ne!(a0, b0);
        assert_eq!(a0, h.block_key(None, 0, &[1, 2, 3, 4]));
        // The same second block after different first blocks has different keys.
        let a1 = h.block_key(Some(a0), 0, &[7, 7, 7, 7]);
        let b1 = h.block_key(Some(b0), 0, &[7, 7, 7, 7]);
        assert_ne!(a1, b1);
        assert_ne!(a1, h.block_key(None, 0, &[7, 7, 7, 7]));
        assert_eq!(a1, h.block_key(Some(a0), 0, &[7, 7, 7, 7]));
        // A salt changes the first block's key, hence the chain.
        let s0 = h.block_key(None, 99, &[1, 2, 3, 4]);
        assert_ne!(s0, a0);
        assert_ne!(s0, h.block_key(None, 98, &[1, 2, 3, 4]));
        assert_ne!(h.block_key(Some(s0), 0, &[7, 7, 7, 7]), a1);
    }
}
