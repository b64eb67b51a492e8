//! 64-bit fingerprints that processes of one deployment compare at attach: the model config's
//! ([`crate::ModelConfig::fingerprint`]), the weights' ([`weights_fingerprint`],
//! [`dummy_weights_fingerprint`]) and the tokenizer's ([`tokenizer_fingerprint`]).
//!
//! FNV-1a (Fowler, Noll, Vo; 64-bit offset basis and prime): not collision-resistant against an
//! adversary, which nothing here needs; it catches an operator starting two processes on
//! different models. A fingerprint is never 0, which the control segment uses for "unknown".

use crate::weights::WeightSource;
use crate::ModelError;

/// Incremental 64-bit FNV-1a.
#[derive(Clone, Copy, Debug)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv64 {
    /// Mixes in `bytes`.
    pub fn eat(&mut self, bytes: &[u8]) {
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
    }

    /// Mixes in `n` as 8 little-endian bytes.
    pub fn eat_u64(&mut self, n: u64) {
        self.eat(&n.to_le_bytes());
    }

    /// The hash, mapped away from 0.
    pub fn finish(self) -> u64 {
        self.0.max(1)
    }
}

/// Bytes sampled from each stored tensor by [`weights_fingerprint`]: this many windows...
const SAMPLE_WINDOWS: usize = 3;
/// ...of this many bytes each, spread evenly over the tensor (the first at its start, the last
/// ending at its end).
const SAMPLE_BYTES: usize = 64;

/// A 64-bit fingerprint of a checkpoint's stored weights: per tensor, in name order, its name,
/// dtype, shape and `3 × 64` bytes sampled from its data (its start, middle and end; all of it
/// when smaller). Every stored tensor counts, whatever its dtype (one the model skips, such
/// as a saved RoPE table, may be of a dtype the loader does not read).
///
/// Cheap (one page read per window through the memory map: under 900 for an 8B checkpoint of
/// 291 tensors, well under a second even from network storage), so the scheduler, which never
/// loads weights, can publish it. Two copies
/// of one checkpoint agree; a different checkpoint of the same shape (another fine-tune, a
/// dtype conversion, random weights) differs unless it matches in every sampled byte, which a
/// dense weight update does not.
///
/// # Errors
/// A tensor whose data lies outside its file ([`ModelError::Safetensors`]).
pub fn weights_fingerprint(src: &WeightSource) -> Result<u64, ModelError> {
    let mut h = Fnv64::default();
    h.eat(b"safetensors");
    for name in src.tensor_names() {
        let (dtype, shape, b) = src.get_any_dtype(name)?;
        h.eat(name.as_bytes());
        h.eat(&[0xff]);
        h.eat(dtype.as_bytes());
        h.eat_u64(shape.len() as u64);
        for &d in shape {
            h.eat_u64(d as u64);
        }
        if b.len() <= SAMPLE_WINDOWS * SAMPLE_BYTES {
            h.eat(b);
        } else {
            let last = b.len() - SAMPLE_BYTES;
            for i in 0..SAMPLE_WINDOWS {
                let at = last * i / (SAMPLE_WINDOWS - 1);
                h.eat(&b[at..at + SAMPLE_BYTES]);
            }
        }
    }
    Ok(h.finish())
}

/// The fingerprint of `--load-format dummy` weights drawn with `seed`
/// ([`crate::LlamaWeights::dummy`]); never equal to a checkpoint's except by a 2^-64 chance.
pub fn dummy_weights_fingerprint(seed: u64) -> u64 {
    let mut h = Fnv64::default();
    h.eat(b"dummy");
    h.eat_u64(seed);
    h.finish()
}

/// The fingerprint of a tokenizer file (`tokenizer.json`): FNV-1a over its bytes. Two
/// processes whose files differ in any byte (another vocabulary, merges, added or special
/// tokens, normalizer) get different fingerprints; the same file copied anywhere gets the
/// same one. Whitespace-only differences count as differences (cheap, and a deployment copies
/// one file rather than rewriting it).
///
/// # Errors
/// [`ModelError::Io`] when the file cannot be read.
pub fn tokenizer_fingerprint(path: &std::path::Path) -> Result<u64, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, &e))?;
    let mut h = Fnv64::default();
    h.eat(b"tokenizer.json");
    h.eat(&bytes);
    Ok(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_its_published_test_vectors() {
        // From the FNV reference test suite (http://www.isthe.com/chongo/tech/comp/fnv/).
        let h = |s: &str| {
            let mut f = Fnv64::default();
            f.eat(s.as_bytes());
            f.finish()
        };
        assert_eq!(h(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(h("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(h("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn dummy_seeds_differ() {
        assert_ne!(dummy_weights_fingerprint(0), dummy_weights_fingerprint(1));
        assert_eq!(dummy_weights_fingerprint(7), dummy_weights_fingerprint(7));
    }
}
