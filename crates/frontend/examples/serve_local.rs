//! Serves a model directory over the in-process engine (CPU backend), for trying the API and
//! for `tests/openai_client.py`:
//!
//! ```text
//! cargo run -p baton-frontend --example serve_local -- MODEL_DIR [PORT] [CHAT_TEMPLATE]
//! ```
//!
//! PORT defaults to 8000 (0 picks a free one); the bound address is printed as
//! `listening on http://ADDR`. CHAT_TEMPLATE is a file or the template text.

use baton_frontend::{LocalEngineClient, ServerConfig};
use baton_scheduler::SchedulerConfig;
use baton_worker::CpuBackend;
use std::sync::Arc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: serve_local MODEL_DIR [PORT] [CHAT_TEMPLATE]"))?;
    let port: u16 = args.next().map(|p| p.parse()).transpose()?.unwrap_or(8000);
    let chat_template = args
        .next()
        .map(|t| baton_frontend::chat::load_template_arg(&t))
        .transpose()?;
    let loaded = baton_model::load_model_dir(&dir)?;
    let eos = loaded.eos_token_ids();
    let max_model_len = loaded.config.max_position_embeddings;
    let cfg = SchedulerConfig {
        max_num_seqs: 32,
        max_num_batched_tokens: 2048,
        block_size: 16,
        num_blocks: 32 * max_model_len.div_ceil(16),
        max_model_len,
        max_inflight: 2,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    };
    let (model, tokenizer) = loaded.into_cpu_model();
    let tokenizer = tokenizer.ok_or_else(|| anyhow::anyhow!("{dir} has no tokenizer.json"))?;
    let backend = CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
    let engine = Arc::new(LocalEngineClient::start(
        cfg,
        Box::new(backend),
        eos.clone(),
    )?);
    let name = std::path::Path::new(&dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.clone());
    let config = ServerConfig {
        port,
        api_key: std::env::var("BATON_API_KEY").ok(),
        chat_template,
        ..ServerConfig::new(name)
    };
    let (listener, addr) = baton_frontend::bind(&config.host, config.port).await?;
    println!("listening on http://{addr}");
    baton_frontend::serve_on(listener, config, tokenizer, engine, eos).await
}
