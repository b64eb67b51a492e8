//! `baton frontend`: the OpenAI API over the shared-memory control plane.

use anyhow::{bail, Context, Result};
use baton_frontend::reasoning::ReasoningParser;
use baton_frontend::tools::ToolParser;
use baton_frontend::{RingEngineClient, ServerConfig};
use baton_model::{ModelDir, Tokenizer, TokenizerConfig};
use baton_proto::link::{FrontendLink, LinkError};
use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// HTTP flags shared by `baton frontend` and `baton serve` (which passes them on).
#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on /v1/* and
    /// /invocations (or set BATON_API_KEY, which, unlike the flag, `ps` does not show).
    #[arg(long, env = API_KEY_ENV, hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model names clients use, one or more as in vLLM (`--served-model-name a b`): a
    /// request may give any, responses report the first, /v1/models lists each (default: the
    /// model directory's name, and requests may also give the --model string).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// A chat template: a file, or the template text (default: tokenizer_config.json's).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Seconds requests may wait while no worker is attached (a worker restarting, or none
    /// started) before they fail with 503; new requests then get 503 until one attaches.
    /// 0 waits forever.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub worker_timeout: f64,
    /// Browser origins allowed to call the API (CORS), as a JSON list as in vLLM
    /// ('["http://localhost:3000"]') or comma-separated; "*" allows any.
    #[arg(long, default_value = ALL, value_parser = origins)]
    pub allowed_origins: ListArg,
    /// HTTP methods a CORS preflight allows (a JSON list or comma-separated; "*": all).
    #[arg(long, default_value = ALL, value_parser = methods)]
    pub allowed_methods: ListArg,
    /// Request headers a CORS preflight allows (a JSON list or comma-separated; "*": any).
    #[arg(long, default_value = ALL, value_parser = headers)]
    pub allowed_headers: ListArg,
    /// Allow credentials (cookies, HTTP authentication) on cross-origin requests.
    #[arg(long)]
    pub allow_credentials: bool,
    /// Parse chat outputs for tool calls when a request sends `tools` with `tool_choice`
    /// "auto" (the default with tools), as vLLM's flag; needs --tool-call-parser.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Name the tokens of log-probability entries as `token_id:{id}` instead of their text
    /// (vLLM's flag; a request's `return_tokens_as_token_ids` overrides it).
    #[arg(long)]
    pub return_tokens_as_token_ids: bool,
    /// Keep finished `/v1/responses` responses in up to this many MiB of memory (least
    /// recently used go first), so that `previous_response_id`, `GET /v1/responses/{id}` and
    /// `DELETE /v1/responses/{id}` work (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`). 0 (the
    /// default) keeps none. Each frontend process has its own store.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub responses_store_mib: u64,
    /// vLLM's `--enable-force-include-usage`: streamed completions and chat responses end with
    /// a usage chunk even when the request's `stream_options` do not ask for it.
    #[arg(long)]
    pub enable_force_include_usage: bool,
    /// How the model writes tool calls (vLLM's names): llama3_json, hermes, mistral, pythonic,
    /// qwen3_coder or phi4_mini_json (llama4_json, llama4_pythonic and qwen3_xml are taken as
    /// llama3_json, pythonic and qwen3_coder).
    #[arg(long, value_parser = tool_parser)]
    pub tool_call_parser: Option<ToolParser>,
    /// Split chat and Responses outputs into reasoning and content (vLLM's names): qwen3 or
    /// deepseek_r1.
    #[arg(long, value_parser = reasoning_parser)]
    pub reasoning_parser: Option<ReasoningParser>,
    /// Where default sampling values come from (vLLM's flag): "auto" takes temperature,
    /// top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) from the
    /// model's generation_config.json for requests that leave them out; "vllm" uses the
    /// OpenAI defaults; anything else is a directory holding a generation_config.json.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// A JSON object of those defaults that overrides the generation config's, e.g.
    /// '{"temperature": 0.5}' (vLLM's flag).
    #[arg(long)]
    pub override_generation_config: Option<String>,
    /// A directory with the tokenizer.json (and optionally tokenizer_config.json, whose chat
    /// template then applies) to use instead of the model directory's (vLLM's `--tokenizer`).
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
}

impl HttpArgs {
    /// The sampling defaults these flags give for the model in `model_dir`
    /// ([`baton_frontend::validate::SamplingDefaults`]), checked as a request's values are.
    ///
    /// # Errors
    /// An unreadable or malformed generation config, a malformed override, or a value a
    /// request could not send.
    pub fn sampling_defaults(
        &self,
        model_dir: &Path,
    ) -> Result<baton_frontend::validate::SamplingDefaults> {
        use baton_frontend::validate::SamplingDefaults;
        let source: baton_model::GenerationConfigSource = self
            .generation_config
            .parse()
            .map_err(|e| anyhow::anyhow!("--generation-config: {e}"))?;
        // Under `vllm` only the stop ids are read (no sampling defaults), and a file that does
        // not load is left for the stop ids' warning.
        let (mut g, _) = ModelDir::new(model_dir)
            .generation_config_from(&source)
            .with_context(|| format!("--generation-config {}", self.generation_config))?;
        if let Some(text) = &self.override_generation_config {
            let o =
                baton_model::GenerationConfig::from_json_str(text, "--override-generation-config")?;
            g.temperature = o.temperature.or(g.temperature);
            g.top_p = o.top_p.or(g.top_p);
            g.top_k = o.top_k.or(g.top_k);
            g.min_p = o.min_p.or(g.min_p);
            g.repetition_penalty = o.repetition_penalty.or(g.repetition_penalty);
            g.max_new_tokens = o.max_new_tokens.or(g.max_new_tokens);
        }
        let d = SamplingDefaults {
            temperature: g.temperature.map(f64::from),
            top_p: g.top_p.map(f64::from),
            top_k: g.top_k,
            min_p: g.min_p.map(f64::from),
            repetition_penalty: g.repetition_penalty.map(f64::from),
            max_tokens: g.max_new_tokens,
        };
        baton_frontend::validate::check_sampling_defaults(&d).map_err(|e| {
            anyhow::anyhow!(
                "default sampling parameters (--generation-config {}{}): {}",
                self.generation_config,
                if self.override_generation_config.is_some() {
                    " with --override-generation-config"
                } else {
                    ""
                },
                e.message
            )
        })?;
        Ok(d)
    }
}

fn reasoning_parser(s: &str) -> Result<ReasoningParser, String> {
    s.parse()
}

fn tool_parser(s: &str) -> Result<ToolParser, String> {
    s.parse()
}

/// The value of a list flag (`--allowed-origins` and the like), parsed by
/// [`baton_frontend::cors::parse_list`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListArg(pub Vec<String>);

impl ListArg {
    /// The flag value that parses back to this list: a JSON list.
    pub fn to_flag(&self) -> String {
        serde_json::Value::from(self.0.clone()).to_string()
    }
}

/// The default of the CORS list flags (vLLM's): everything.
const ALL: &str = r#"["*"]"#;

fn origins(s: &str) -> Result<ListArg, String> {
    baton_frontend::cors::parse_origins(s).map(ListArg)
}

fn methods(s: &str) -> Result<ListArg, String> {
    baton_frontend::cors::parse_methods(s).map(ListArg)
}

fn headers(s: &str) -> Result<ListArg, String> {
    baton_frontend::cors::parse_headers(s).map(ListArg)
}

/// The environment variable that holds the API key (the frontend child of `baton serve` gets
/// the key this way, never on its command line).
pub const API_KEY_ENV: &str = "BATON_API_KEY";

/// Parses a number of seconds (finite, >= 0) for a flag.
///
/// # Errors
/// A message for anything else.
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a number of seconds >= 0")),
    }
}

impl HttpArgs {
    /// The same flags as command-line arguments, for a child `baton frontend`.
    pub fn to_flags(&self) -> Vec<String> {
        // The API key is not among them: it goes through API_KEY_ENV. Free-form values are
        // passed as `--flag=value`, so that one starting with `-` is not taken for a flag.
        let mut v = vec![
            format!("--host={}", self.host),
            "--port".into(),
            self.port.to_string(),
            "--worker-timeout".into(),
            self.worker_timeout.to_string(),
            "--allowed-origins".into(),
            self.allowed_origins.to_flag(),
            "--allowed-methods".into(),
            self.allowed_methods.to_flag(),
            "--allowed-headers".into(),
            self.allowed_headers.to_flag(),
        ];
        if self.allow_credentials {
            v.push("--allow-credentials".into());
        }
        if self.enable_auto_tool_choice {
            v.push("--enable-auto-tool-choice".into());
        }
        if self.return_tokens_as_token_ids {
            v.push("--return-tokens-as-token-ids".into());
        }
        if self.enable_force_include_usage {
            v.push("--enable-force-include-usage".into());
        }
        if self.responses_store_mib > 0 {
            v.extend([
                "--responses-store-mib".to_owned(),
                self.responses_store_mib.to_string(),
            ]);
        }
        if let Some(p) = self.tool_call_parser {
            v.extend(["--tool-call-parser".to_owned(), p.name().to_owned()]);
        }
        if let Some(p) = self.reasoning_parser {
            v.extend(["--reasoning-parser".to_owned(), p.name().to_owned()]);
        }
        v.push(format!("--generation-config={}", self.generation_config));
        if let Some(o) = &self.override_generation_config {
            v.push(format!("--override-generation-config={o}"));
        }
        // One flag per name (the flag appends).
        for name in &self.served_model_name {
            v.push(format!("--served-model-name={name}"));
        }
        if let Some(x) = &self.chat_template {
            v.push(format!("--chat-template={x}"));
        }
        if let Some(t) = &self.tokenizer {
            v.push(format!("--tokenizer={}", t.display()));
        }
        v
    }

    /// Checks the flags that depend on each other, as vLLM does at startup.
    ///
    /// # Errors
    /// `--enable-auto-tool-choice` without `--tool-call-parser`; an empty
    /// `--served-model-name`.
    pub fn check(&self) -> Result<()> {
        crate::args::check_tokenizer_dir(self.tokenizer.as_deref())?;
        if self.served_model_name.iter().any(|n| n.trim().is_empty()) {
            bail!("--served-model-name: a served model name must not be empty or blank");
        }
        if self.enable_auto_tool_choice && self.tool_call_parser.is_none() {
            bail!(
                "--enable-auto-tool-choice requires --tool-call-parser (one of: {})",
                baton_frontend::tools::TOOL_PARSER_NAMES.join(", ")
            );
        }
        Ok(())
    }

    /// The CORS settings of these flags.
    pub fn cors(&self) -> baton_frontend::CorsConfig {
        baton_frontend::CorsConfig {
            allowed_origins: self.allowed_origins.0.clone(),
            allowed_methods: self.allowed_methods.0.clone(),
            allowed_headers: self.allowed_headers.0.clone(),
            allow_credentials: self.allow_credentials,
        }
    }
}

/// Flags of `baton frontend`.
#[derive(Args, Clone, Debug)]
pub struct FrontendArgs {
    /// Instance name of the scheduler to attach to.
    #[arg(long, default_value = "default")]
    pub instance: String,
    /// The model directory (its tokenizer.json, tokenizer_config.json, generation_config.json)
    /// or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// HTTP flags.
    #[command(flatten)]
    pub http: HttpArgs,
    /// How long to wait for the scheduler's segment, in seconds.
    #[arg(long, default_value_t = 30.0, value_parser = crate::frontend_cmd::parse_seconds)]
    pub attach_timeout: f64,
    /// vLLM's `--seed`: the seed of the random streams of requests that give no `seed` (the
    /// `k`-th such sequence samples with a seed derived from it, `k` and this frontend's slot,
    /// so frontends of one instance differ; default: a random seed per sequence).
    #[arg(long)]
    pub seed: Option<u64>,
    /// LoRA adapters: a request whose `model` names one runs with it (the scheduler's list).
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
}

/// The model name clients use for `dir` unless `--served-model-name` is given.
pub fn default_model_name(dir: &std::path::Path) -> String {
    dir.canonicalize()
        .ok()
        .as_deref()
        .unwrap_or(dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

/// Runs `baton frontend` until SIGTERM/SIGINT.
///
/// # Errors
/// No scheduler within the attach timeout, a tokenizer that fails to load, a port in use.
pub fn run(mut a: FrontendArgs) -> Result<()> {
    // The --model string names the model (its last component by default, and requests may
    // give it whole) and is `/v1/models`' `root`; a GGUF file is read from its prepared
    // directory.
    let model_arg = a.model.clone();
    if let Some(g) = crate::gguf_model::resolve(&a.model, a.http.tokenizer.as_deref(), true)? {
        a.model = g.dir;
    }
    let model_root = model_arg.display().to_string();
    a.http.check()?;
    let (lora_modules, lora_fingerprint) = a.lora.fingerprinted()?;
    check_lora_names(&lora_modules, &a.http, &model_arg)?;
    let sampling_defaults = a.http.sampling_defaults(&a.model)?;
    let dir = ModelDir::new(&a.model).with_tokenizer(a.http.tokenizer.as_ref());
    let tc_path = dir.tokenizer_config_path();
    let tc = if tc_path.exists() {
        TokenizerConfig::from_file(&tc_path)?
    } else {
        TokenizerConfig::default()
    };
    let tokenizer = Tokenizer::from_file(&dir.tokenizer_path(), tc)?;
    // Stop ids: those of the generation config the flag names (vLLM's): the model
    // directory's file under `auto` and `vllm`, DIR's under DIR. Under `vllm` a file that does
    // not load is ignored with a warning and config.json's ids are used, so that the server
    // starts (vLLM falls back to config.json for a file that is not valid JSON); under `auto`
    // and DIR it was refused above.
    let source: baton_model::GenerationConfigSource = a
        .http
        .generation_config
        .parse()
        .map_err(|e| anyhow::anyhow!("--generation-config: {e}"))?;
    let generation_ids = {
        let (g, skipped) = dir.generation_config_from(&source)?;
        if let Some(e) = skipped {
            tracing::warn!(
                "ignoring {e} (--generation-config {}); the stop ids come from config.json",
                a.http.generation_config
            );
        }
        g.eos_token_ids
    };
    // config.json is optional for a frontend (a tokenizer directory is enough); when present it
    // gives the EOS ids if generation_config.json does not, and the fingerprint to check. The
    // tokenizer's EOS always stops too (vLLM's).
    let mut model_cfg = baton_model::ModelConfig::from_file(&dir.config_path()).ok();
    let eos = baton_model::model_stop_ids(
        tokenizer.eos_id(),
        &generation_ids,
        model_cfg.as_ref().map_or(&[][..], |c| &c.eos_token_ids[..]),
    );
    let chat_template = a
        .http
        .chat_template
        .as_deref()
        .map(baton_frontend::chat::load_template_arg)
        .transpose()?;
    if let Some(c) = &model_cfg {
        let tokens = tokenizer.vocab_size();
        crate::args::check_tokenizer_fits(a.http.tokenizer.as_deref(), tokens, c.vocab_size)?;
    }
    let deadline = Instant::now() + Duration::from_secs_f64(a.attach_timeout.max(0.0));
    // Since when every slot has been taken, and whether that was said.
    let mut full_since: Option<Instant> = None;
    let mut told_full = false;
    let link = loop {
        match FrontendLink::connect(&a.instance) {
            Ok(l) => break l,
            // (Not chained to the error: its slot ranges are the segment's internals.)
            Err(LinkError::Register(_)) if Instant::now() >= deadline => anyhow::bail!(
                "connecting to the scheduler of instance {}: every frontend slot stayed taken \
                 for {} s (the scheduler's --frontends sets how many)",
                a.instance,
                a.attach_timeout
            ),
            Err(e) if Instant::now() >= deadline => {
                return Err(e).context("connecting to the scheduler")
            }
            Err(LinkError::Register(_)) => {
                // A slot frees when a dead frontend's is reclaimed, so keep trying, but say why
                // this start is slow once it is (a restart after a frontend's death usually
                // finds its slot reclaimed within a few hundred ms).
                let since = *full_since.get_or_insert_with(Instant::now);
                if !told_full && since.elapsed() >= Duration::from_secs(1) {
                    told_full = true;
                    say!(
                        "baton frontend: every frontend slot of instance {} is taken; waiting up \
                         to {} s for one to free",
                        a.instance,
                        a.attach_timeout
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    crate::daemons::check_lora_fingerprint(
        &link.limits(),
        lora_fingerprint,
        "frontend",
        &a.instance,
    )?;
    let theirs = link.limits().tokenizer_fingerprint;
    if theirs != 0 {
        let mine = baton_model::tokenizer_fingerprint(&dir.tokenizer_path())?;
        if mine != theirs {
            bail!(
                "the scheduler of instance {} was started with another tokenizer.json than {} \
                 (fingerprint {theirs:016x}, this one {mine:016x}): the same text may become \
                 other token ids; start the frontend with the scheduler's --model and \
                 --tokenizer",
                a.instance,
                dir.tokenizer_path().display()
            );
        }
    }
    let theirs = link.limits().model_fingerprint;
    if let Some(c) = &mut model_cfg {
        // The RoPE factors of the scheduler's served length (its fingerprint covers them).
        c.set_max_model_len(link.limits().max_model_len);
        if theirs != 0 && theirs != c.fingerprint() {
            bail!(
                "the scheduler of instance {} serves another model than {} (config fingerprint \
                 {theirs:016x}, this one {:016x}); start the frontend with the scheduler's --model",
                a.instance,
                model_arg.display(),
                c.fingerprint()
            );
        }
    }
    if sampling_defaults != baton_frontend::validate::SamplingDefaults::NONE {
        // As vLLM says it: requests that leave these out get them.
        tracing::info!(
            "default sampling parameters from the generation config: {} (--generation-config \
             vllm for the OpenAI defaults)",
            serde_json::Value::Object(sampling_defaults.to_json())
        );
    }
    let vocab = tokenizer.vocab_size();
    let worker_timeout =
        (a.http.worker_timeout > 0.0).then(|| Duration::from_secs_f64(a.http.worker_timeout));
    let engine = Arc::new(RingEngineClient::new(
        link,
        eos.clone(),
        vocab,
        worker_timeout,
    ));
    let config = ServerConfig {
        host: a.http.host.clone(),
        port: a.http.port,
        api_key: a.http.api_key.clone(),
        served_model_name: a
            .http
            .served_model_name
            .first()
            .cloned()
            .unwrap_or_else(|| default_model_name(&model_arg)),
        more_served_model_names: a.http.served_model_name.iter().skip(1).cloned().collect(),
        // As vLLM, which serves under the `--model` string: requests may name the model by it.
        model_aliases: if a.http.served_model_name.is_empty() {
            vec![model_arg.display().to_string()]
        } else {
            Vec::new()
        },
        chat_template,
        header_read_timeout: baton_frontend::DEFAULT_HEADER_READ_TIMEOUT,
        cors: a.http.cors(),
        enable_auto_tool_choice: a.http.enable_auto_tool_choice,
        tool_call_parser: a.http.tool_call_parser,
        reasoning_parser: a.http.reasoning_parser,
        sampling_defaults,
        return_tokens_as_token_ids: a.http.return_tokens_as_token_ids,
        responses_store_bytes: usize::try_from(a.http.responses_store_mib << 20)
            .unwrap_or(usize::MAX),
        force_include_usage: a.http.enable_force_include_usage,
        lora_modules: lora_modules
            .iter()
            .map(|m| (m.name.clone(), m.path.display().to_string()))
            .collect(),
        // Frontends of one instance take distinct streams: the slot moves the start by 2^40.
        seed: a
            .seed
            .map(|s| s.wrapping_add((engine.index() as u64) << 40)),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let (listener, addr) = baton_frontend::bind(&config.host, config.port).await?;
        // One line on stdout, which `baton serve` reads for the bound port; the slot goes to
        // the log.
        outln!("listening on http://{addr}");
        say!(
            "baton frontend: attached to instance {} as frontend slot {}",
            a.instance,
            engine.index()
        );
        let client: Arc<dyn baton_frontend::EngineClient> = engine.clone();
        let state = Arc::new(
            baton_frontend::AppState::new(config, tokenizer, client, eos)?
                .with_model_root(model_root.clone()),
        );
        // Stop on SIGTERM/SIGINT, or when the scheduler exits: a restarted scheduler makes a
        // new segment this process cannot reach, so exit and let a supervisor restart us.
        let gone = Arc::new(AtomicBool::new(false));
        let shutdown = {
            let gone = gone.clone();
            async move {
                let watch = async {
                    while !engine.scheduler_exited() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                };
                tokio::select! {
                    () = baton_frontend::shutdown_signal() => {}
                    () = watch => gone.store(true, Ordering::Relaxed),
                }
            }
        };
        baton_frontend::serve_state(listener, state, shutdown).await?;
        if gone.load(Ordering::Relaxed) {
            anyhow::bail!(
                "the scheduler of instance {} exited; restart the frontend with it",
                a.instance
            );
        }
        Ok(())
    })
}

/// A LoRA adapter's name must not be one the base model is served under (the request
/// would be ambiguous; vLLM refuses it too).
///
/// # Errors
/// A name taken by `--served-model-name` or the `--model` string.
pub fn check_lora_names(
    modules: &[baton_model::LoraModule],
    http: &HttpArgs,
    model: &std::path::Path,
) -> Result<()> {
    let base: Vec<String> = if http.served_model_name.is_empty() {
        vec![default_model_name(model), model.display().to_string()]
    } else {
        http.served_model_name.clone()
    };
    if let Some(m) = modules.iter().find(|m| base.contains(&m.name)) {
        bail!(
            "--lora-modules {}: the name is the base model's served name; give the adapter \
             another name",
            m.name
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        http: HttpArgs,
    }

    fn parse(args: &[&str]) -> Result<HttpArgs, clap::Error> {
        P::try_parse_from(std::iter::once("x").chain(args.iter().copied())).map(|p| p.http)
    }

    #[test]
    fn generation_config_flags_give_the_sampling_defaults_and_reach_serves_child() {
        use baton_frontend::validate::SamplingDefaults;
        let model = std::env::temp_dir().join(format!("baton-gencfg-{}", std::process::id()));
        let other = model.join("other");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(
            model.join("generation_config.json"),
            r#"{"eos_token_id": [1, 2], "do_sample": true, "temperature": 0.6, "top_p": 0.95,
                "top_k": 20, "max_new_tokens": 300}"#,
        )
        .unwrap();
        std::fs::write(
            other.join("generation_config.json"),
            r#"{"repetition_penalty": 1.05}"#,
        )
        .unwrap();
        let auto = parse(&[]).unwrap().sampling_defaults(&model).unwrap();
        assert_eq!(
            auto,
            SamplingDefaults {
                temperature: Some(0.6f32.into()),
                top_p: Some(0.95f32.into()),
                top_k: Some(20),
                max_tokens: Some(300),
                ..SamplingDefaults::NONE
            }
        );
        let vllm = parse(&["--generation-config", "vllm"]).unwrap();
        assert_eq!(
            vllm.sampling_defaults(&model).unwrap(),
            SamplingDefaults::NONE
        );
        let dir = parse(&["--generation-config", other.to_str().unwrap()]).unwrap();
        assert_eq!(
            dir.sampling_defaults(&model).unwrap(),
            SamplingDefaults {
                repetition_penalty: Some(1.05f32.into()),
                ..SamplingDefaults::NONE
            }
        );
        let over = parse(&[
            "--override-generation-config",
            r#"{"temperature": 0.2, "min_p": 0.1}"#,
        ])
        .unwrap();
        let d = over.sampling_defaults(&model).unwrap();
        assert_eq!(d.temperature, Some(0.2f32.into()));
        assert_eq!(d.min_p, Some(0.1f32.into()));
        assert_eq!(d.top_k, Some(20));
        // The child frontend of `serve` gets the same flags.
        let back = parse(
            &over
                .to_flags()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(back.sampling_defaults(&model).unwrap(), d);
        // Errors: a value no request could send, a malformed override, a missing directory.
        for (args, needle) in [
            (
                vec!["--override-generation-config", r#"{"top_p": 0}"#],
                "top_p",
            ),
            (
                vec!["--override-generation-config", "{"],
                "--override-generation-config",
            ),
            (
                vec!["--generation-config", "/nonexistent/dir"],
                "/nonexistent/dir",
            ),
        ] {
            let e = parse(&args).unwrap().sampling_defaults(&model).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{args:?}: {e:#}");
        }
        let _ = std::fs::remove_dir_all(&model);
    }

    #[test]
    fn cors_flags_default_to_vllms_and_reach_serves_frontend_child() {
        let d = parse(&[]).unwrap();
        assert_eq!(d.cors(), baton_frontend::CorsConfig::default());
        let given = parse(&[
            "--allowed-origins",
            r#"["http://a.example", "http://b.example:8080"]"#,
            "--allowed-methods",
            "GET,POST",
            "--allowed-headers",
            r#"["authorization"]"#,
            "--allow-credentials",
        ])
        .unwrap();
        assert_eq!(
            given.allowed_origins.0,
            ["http://a.example", "http://b.example:8080"]
        );
        assert_eq!(given.allowed_methods.0, ["GET", "POST"]);
        // What `baton serve` passes its frontend parses back to the same settings.
        for a in [d, given] {
            let flags = a.to_flags();
            let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            assert_eq!(back.cors(), a.cors(), "{flags:?}");
        }
    }

    #[test]
    fn served_model_name_takes_several_names_and_reaches_serves_frontend_child() {
        let a = parse(&["--served-model-name", "a", "b", "c", "--port", "9"]).unwrap();
        assert_eq!(a.served_model_name, ["a", "b", "c"]);
        assert_eq!(a.port, 9);
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.served_model_name, ["a", "b", "c"], "{flags:?}");
        // A name or template that starts with `-` reaches the child as a value.
        let a = parse(&[
            "--served-model-name=-weird",
            "--served-model-name",
            "b",
            "--chat-template=-{{ x }}",
            "--generation-config=-dir",
        ])
        .unwrap();
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.served_model_name, ["-weird", "b"], "{flags:?}");
        assert_eq!(back.chat_template.as_deref(), Some("-{{ x }}"));
        assert_eq!(back.generation_config, "-dir");
        let d = parse(&[]).unwrap();
        assert!(d.served_model_name.is_empty());
        assert!(!d
            .to_flags()
            .iter()
            .any(|f| f.starts_with("--served-model-name")));
        assert!(parse(&["--served-model-name"]).is_err());
        // An empty name stops start-up (of `serve` too, before it spawns children).
        for blank in ["", " "] {
            let e = parse(&["--served-model-name", "a", blank]).unwrap().check();
            assert!(e.unwrap_err().to_string().contains("--served-model-name"));
        }
        assert!(parse(&["--served-model-name", "a"])
            .unwrap()
            .check()
            .is_ok());
    }

    #[test]
    fn tool_flags_reach_serves_frontend_child_and_need_each_other() {
        let a = parse(&["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).unwrap();
        a.check().unwrap();
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(back.enable_auto_tool_choice);
        assert_eq!(back.tool_call_parser, Some(ToolParser::Hermes));
        let a = parse(&["--reasoning-parser", "deepseek_r1"]).unwrap();
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.reasoning_parser, Some(ReasoningParser::DeepSeekR1));
        assert!(parse(&["--reasoning-parser", "granite"]).is_err());
        let d = parse(&[]).unwrap();
        assert!(!d.to_flags().iter().any(|f| f.contains("tool")));
        let e = parse(&["--enable-auto-tool-choice"]).unwrap().check();
        assert!(e.unwrap_err().to_string().contains("--tool-call-parser"));
        let only = parse(&["--tool-call-parser", "llama3_json"]).unwrap();
        only.check().unwrap();
        let e = parse(&["--tool-call-parser", "granite"]).expect_err("unknown parser");
        let names = "llama3_json, hermes, mistral, pythonic, qwen3_coder, phi4_mini_json";
        assert!(e.to_string().contains(names), "{e}");
    }

    #[test]
    fn return_tokens_as_token_ids_reaches_serves_frontend_child() {
        let a = parse(&["--return-tokens-as-token-ids"]).unwrap();
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(back.return_tokens_as_token_ids, "{flags:?}");
        let d = parse(&[]).unwrap();
        assert!(!d.return_tokens_as_token_ids);
        assert!(!d.to_flags().iter().any(|f| f.contains("token-ids")));
    }

    #[test]
    fn responses_store_size_reaches_serves_frontend_child() {
        let a = parse(&["--responses-store-mib", "64"]).unwrap();
        let flags = a.to_flags();
        let back = parse(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.responses_store_mib, 64, "{flags:?}");
        let d = parse(&[]).unwrap();
        assert_eq!(d.responses_store_mib, 0);
        assert!(!d.to_flags().iter().any(|f| f.contains("store")));
        assert!(parse(&["--responses-store-mib", "-1"]).is_err());
        let f = parse(&["--enable-force-include-usage"]).unwrap().to_flags();
        let back = parse(&f.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(back.enable_force_include_usage, "{f:?}");
        assert!(parse(&["--responses-store-mib", "2000000"]).is_err());
    }

    #[test]
    fn bad_cors_flags_are_refused_with_the_flag_named() {
        for (flag, value) in [
            ("--allowed-origins", r#"["http://a.example", 3]"#),
            ("--allowed-methods", "GET,P OST"),
            ("--allowed-headers", "bad:header"),
        ] {
            let e = parse(&[flag, value]).expect_err("refused").to_string();
            assert!(e.contains(flag), "{e}");
        }
    }
}
