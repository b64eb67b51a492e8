//! Text <-> token ids, from `tokenizer.json` (HF `tokenizers`) plus `tokenizer_config.json`.
//!
//! Contract: `encode(text, true)` produces what transformers' fast tokenizer produces with
//! `add_special_tokens=True`: BOS/EOS are added exactly once, per `add_bos_token` /
//! `add_eos_token` when tokenizer_config.json sets them (tokenizer.json's post-processor is then
//! bypassed so nothing is added twice), else per tokenizer.json's post-processor.

use crate::config::TokenizerConfig;
use crate::error::ModelError;
use std::path::Path;

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    file: String,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("file", &self.file)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` with the given config (use `TokenizerConfig::default()` when
    /// `tokenizer_config.json` is absent).
    ///
    /// BOS/EOS ids are looked up from the config's `bos_token`/`eos_token` text.
    ///
    /// # Errors
    /// [`ModelError::Io`] when the file is missing, [`ModelError::Tokenizer`] when the
    /// tokenizers crate rejects it, [`ModelError::InvalidField`] when `bos_token`/`eos_token`
    /// is not in the vocabulary.
    pub fn from_file(path: &Path, config: TokenizerConfig) -> Result<Self, ModelError> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, &e))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| ModelError::Tokenizer {
                file: file.clone(),
                reason: e.to_string(),
            })?;
        let lookup = |field: &str, tok: &Option<String>| -> Result<Option<u32>, ModelError> {
            match tok {
                None => Ok(None),
                Some(t) => inner
                    .token_to_id(t)
                    .map(Some)
                    .ok_or_else(|| ModelError::InvalidField {
                        file: "tokenizer_config.json".into(),
                        field: field.into(),
                        reason: format!("token {t:?} is not in {file}"),
                    }),
            }
        };
        let bos_id = lookup("bos_token", &config.bos_token)?;
        let eos_id = lookup("eos_token", &config.eos_token)?;
        Ok(Tokenizer {
            inner,
            config,
            file,
            bos_id,
            eos_id,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tokenizer {
            file: self.file.clone(),
            reason: e.to_string(),
        }
    }

    /// Encodes `text`. With `add_special`, BOS/EOS are added as described in the module doc.
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if the tokenizers crate fails, or [`ModelError::InvalidField`]
    /// if `add_bos_token`/`add_eos_token` is set but the token is unknown.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ModelError> {
        let explicit = self.config.add_bos_token.is_some() || self.config.add_eos_token.is_some();
        let use_post_processor = add_special && !explicit;
        let enc = self
            .inner
            .encode(text, use_post_processor)
            .map_err(|e| self.err(e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special && explicit {
            let missing = |field: &str| ModelError::InvalidField {
                file: "tokenizer_config.json".into(),
                field: field.into(),
                reason: "is true but bos_token/eos_token is not set".into(),
            };
            if self.config.add_bos_token == Some(true) {
                let bos = self.bos_id.ok_or_else(|| missing("add_bos_token"))?;
                ids.insert(0, bos);
            }
            if self.config.add_eos_token == Some(true) {
                ids.push(self.eos_id.ok_or_else(|| missing("add_eos_token"))?);
            }
        }
        Ok(ids)
    }

    /// Decodes ids to text (tokenizer.json's decoder; for Llama/SentencePiece the leading space
    /// of the first piece is stripped). Unknown ids are skipped by the tokenizers crate.
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if decoding fails (e.g. invalid byte-fallback sequence handling).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ModelError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.err(e))
    }

    /// The vocabulary piece of `id` (e.g. `"▁time"`, `"<0x0A>"`), `None` if out of range.
    pub fn id_to_piece(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a piece, if present.
    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.inner.token_to_id(piece)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// BOS id (from `bos_token` in tokenizer_config.json).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// EOS id (from `eos_token` in tokenizer_config.json).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The chat template, if tokenizer_config.json has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.config.chat_template.as_deref()
    }

    /// The parsed tokenizer_config.json.
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The underlying `tokenizers` tokenizer (e.g. for incremental decoding).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
