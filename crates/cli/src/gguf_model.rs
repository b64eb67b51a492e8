//! `--model FILE.gguf`: serving a llama.cpp GGUF file.
//!
//! Every command that takes `--model` accepts a GGUF file as well as a Hugging Face
//! directory. The file is turned (once per file version) into a Hugging Face layout
//! directory in Baton's cache ([`baton_model::gguf::prepare_dir`]): config.json from its
//! metadata, tokenizer.json and tokenizer_config.json (with the chat template) from its
//! tokenizer, and a link to the file, whose tensors the worker reads directly (quantized ones
//! kept in their blocks by the CPU backend, dequantized to 16 bits at load by CUDA). The processes of one deployment, given the same file, find the same
//! directory. The cache is `$BATON_CACHE_DIR`, else `$XDG_CACHE_HOME/baton`, else
//! `~/.cache/baton`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A GGUF `--model` file and the directory serving it.
#[derive(Debug, Clone)]
pub struct GgufModel {
    /// The Hugging Face layout directory (what the processes read as `--model`).
    pub dir: PathBuf,
}

/// Baton's cache directory ([`crate::gguf_model`]).
pub fn cache_root() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("BATON_CACHE_DIR") {
        return d;
    }
    if let Some(d) = env("XDG_CACHE_HOME") {
        return d.join("baton");
    }
    match env("HOME") {
        Some(h) => h.join(".cache").join("baton"),
        None => std::env::temp_dir().join("baton-cache"),
    }
}

/// Whether `path` is a file that starts with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == baton_model::gguf::GGUF_MAGIC
}

/// When `model` is a GGUF file, prepares its directory and returns it (`None` for a
/// directory or a missing path, left to the caller's own checks). A command that reads the tokenizer
/// (`needs_tokenizer`) and has no `--tokenizer` fails when the file's tokenizer does not
/// convert.
///
/// # Errors
/// A file that is not GGUF, a missing `*.gguf` path, a malformed or unsupported GGUF file,
/// an unwritable cache, an unconverted tokenizer as above.
pub fn resolve(
    model: &Path,
    tokenizer: Option<&Path>,
    needs_tokenizer: bool,
) -> Result<Option<GgufModel>> {
    let named_gguf = model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !model.exists() && named_gguf {
        bail!("--model {}: no such file", model.display());
    }
    if model.is_file() && !is_gguf(model) {
        bail!(
            "--model {}: a file that is neither a Hugging Face model directory nor a GGUF file",
            model.display()
        );
    }
    if !is_gguf(model) {
        return Ok(None);
    }
    let cache = cache_root();
    let p = baton_model::gguf::prepare_dir(model, &cache.join("gguf"))
        .map_err(|e| match e {
            e @ baton_model::ModelError::Io { .. } => anyhow::Error::new(e).context(format!(
                "preparing the GGUF file's directory in {} (set BATON_CACHE_DIR to another \
                 directory)",
                cache.display()
            )),
            e => e.into(),
        })
        .with_context(|| format!("--model {}", model.display()))?;
    if let (Some(why), None, true) = (&p.tokenizer_error, tokenizer, needs_tokenizer) {
        bail!(
            "--model {}: its tokenizer is not converted: {why}",
            model.display()
        );
    }
    tracing::info!(
        "GGUF file {} is served from {}",
        model.display(),
        p.dir.display()
    );
    Ok(Some(GgufModel { dir: p.dir }))
}

/// The GGUF file a prepared directory serves (its `model.gguf` link's target), for
/// `/v1/models`' `root` and the worker's ready line; `None` for any other directory.
pub fn served_file(dir: &Path) -> Option<PathBuf> {
    std::fs::read_link(dir.join(baton_model::gguf::GGUF_WEIGHTS)).ok()
}
