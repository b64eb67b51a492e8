//! A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as Hugging Face `tokenizer.json` and
//! `tokenizer_config.json`.
