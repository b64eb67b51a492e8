//! Per-sequence stream state: engine events in, text deltas out.
//!
//! Contract: a [`Seq`] turns one engine request's events into [`Delta`]s through the
//! incremental detokenizer and the stop-string matcher; streamed and non-streamed responses are
//! both built from these deltas, so their texts are equal by construction. On a stop-string
//! match it cancels the engine request. The last delta says what stopped the sequence
//! (`stop_reason`): the engine ends a request with `Stop` for an EOS and for a stop token id
//! alike, so the sequence tells them apart by its last token. Dropping a `Seq` whose engine
//! request has not reported its last event (client disconnect, an error elsewhere, a stop
//! match) cancels it and keeps its receiver in a task until the engine acknowledges
//! (DESIGN.md section 5).

use crate::detok::IncrementalDetokenizer;
use crate::engine::{EngineClient, EngineEvent};
use crate::metrics::{Finished, Metrics};
use crate::openai::StopReason;
use crate::stop::StopMatcher;
use baton_model::Tokenizer;
use baton_proto::FirstTokenTimes;
use baton_scheduler::FinishReason;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// One sampled token with its log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    /// Token id.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// Its rank in the vocabulary (1: the most likely) where the engine reported it (prompt
    /// tokens, [`Delta::prompt`]); `None` for sampled tokens.
    pub rank: Option<u32>,
    /// Most likely alternatives.
    pub top: Vec<(u32, f32)>,
}

/// What one step of a sequence produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// Choice index.
    pub index: usize,
    /// New text.
    pub text: String,
    /// Tokens consumed by this step (with log-probabilities when asked).
    pub tokens: Vec<TokenInfo>,
    /// Set on the last delta of the sequence: `stop`, `length` or `abort`.
    pub finish: Option<&'static str>,
    /// With `finish == Some("stop")`: the stop string or stop token id that ended the
    /// sequence (`None` for an EOS).
    pub stop_reason: Option<StopReason>,
    /// Set when the engine failed the request (the last delta).
    pub error: Option<String>,
    /// Prompt tokens whose KV came from the prefix cache, on every token's delta and on the
    /// last one.
    pub cached_tokens: usize,
    /// Prompt log-probabilities by prompt position (OpenAI `echo` with `logprobs`, vLLM's
    /// `prompt_logprobs`), on the first delta of a sequence that asked for them
    /// ([`SeqContext::prompt_logprobs`]) and on no other: that delta comes once every position
    /// has arrived, or with the first output token, the end or the error, whichever is first.
    /// Entry 0 is always `None` (the first token has no log-probability), and so is any
    /// position the engine did not report (a request that ended early). `id` is the token the
    /// engine scored, `rank` its rank.
    pub prompt: Option<Vec<Option<TokenInfo>>>,
}

/// The finish reason reported to the client.
pub fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort | FinishReason::Cancelled => "abort",
    }
}

/// One engine request as the HTTP layer streams it.
pub struct Seq {
    /// Choice index.
    pub index: usize,
    id: u64,
    rx: Option<UnboundedReceiver<EngineEvent>>,
    engine: Arc<dyn EngineClient>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    /// See [`SeqContext::stop_reason_ids`].
    stop_reason_ids: Vec<u32>,
    /// See [`SeqContext::stop_text_ids`].
    stop_text_ids: Vec<u32>,
    /// See [`SeqContext::min_tokens`].
    min_tokens: usize,
    /// The last output token.
    last_id: Option<u32>,
    /// Prompt log-probabilities gathered so far, by position, until a delta carries them
    /// (`None` when not asked for, or already delivered).
    prompt_lp: Option<Vec<Option<TokenInfo>>>,
    /// Positions of `prompt_lp` filled.
    prompt_lp_seen: usize,
    /// Output tokens consumed (up to and including a stop-string match).
    pub output_tokens: usize,
    done: bool,
    arrived: Instant,
    last_token: Option<Instant>,
    first_token: Option<Instant>,
    /// The scheduler's queue and prefill times, from the first token.
    first_times: Option<FirstTokenTimes>,
    prompt_tokens: usize,
    draining: tokio::sync::watch::Receiver<bool>,
}

/// The error of a request still running when a shutdown's grace period ended (a 503).
pub const SHUTTING_DOWN: &str = "the server is shutting down";

impl std::fmt::Debug for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seq")
            .field("index", &self.index)
            .field("id", &self.id)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// Everything a [`Seq`] needs besides its engine request.
#[derive(Clone)]
pub struct SeqContext {
    /// The engine.
    pub engine: Arc<dyn EngineClient>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The request's stop strings, matched per sequence by a clone of this (built once per
    /// request: its automaton is shared, not rebuilt for each of `n` choices).
    pub stop: StopMatcher,
    /// The token ids reported as `stop_reason` when the engine stops on them: the request's
    /// `stop_token_ids` and, unless `ignore_eos`, the model's stop ids, less the tokenizer's
    /// EOS unless `ignore_eos` (vLLM checks that one first and reports no stop reason for it;
    /// the generation config's further EOS ids are stop token ids there).
    pub stop_reason_ids: Vec<u32>,
    /// Token ids that end the sequence and whose text is left out of the output (vLLM's
    /// detokenizer does the same unless `include_stop_str_in_output`): `stop_token_ids`, and the
    /// model's EOS ids unless `ignore_eos`. Empty with `include_stop_str_in_output`.
    pub stop_text_ids: Vec<u32>,
    /// Drop special tokens from the text.
    pub skip_special: bool,
    /// vLLM's `min_tokens`: stop strings are not matched in the text of the first this many
    /// output tokens (the engine masks stop ids itself).
    pub min_tokens: u32,
    /// The engine request asks for prompt log-probabilities (`params.prompt_logprobs > 0`):
    /// the sequence gathers them and delivers them on its first delta ([`Delta::prompt`]).
    pub prompt_logprobs: bool,
    /// When the HTTP request arrived.
    pub arrived: Instant,
    /// Becomes true when the server stops waiting for live requests at shutdown.
    pub draining: tokio::sync::watch::Receiver<bool>,
}

impl Seq {
    /// Wraps engine request `id` whose events arrive on `rx`.
    pub fn new(
        ctx: &SeqContext,
        index: usize,
        id: u64,
        rx: UnboundedReceiver<EngineEvent>,
        prompt: &[u32],
    ) -> Self {
        Self {
            index,
            id,
            rx: Some(rx),
            engine: Arc::clone(&ctx.engine),
            tokenizer: Arc::clone(&ctx.tokenizer),
            metrics: Arc::clone(&ctx.metrics),
            detok: IncrementalDetokenizer::new(prompt, ctx.skip_special),
            stop: ctx.stop.clone(),
            stop_reason_ids: ctx.stop_reason_ids.clone(),
            stop_text_ids: ctx.stop_text_ids.clone(),
            min_tokens: ctx.min_tokens as usize,
            last_id: None,
            prompt_lp: ctx.prompt_logprobs.then(|| vec![None; prompt.len()]),
            prompt_lp_seen: 0,
            output_tokens: 0,
            done: false,
            arrived: ctx.arrived,
            last_token: None,
            first_token: None,
            first_times: None,
            prompt_tokens: prompt.len(),
            draining: ctx.draining.clone(),
        }
    }

    /// Prompt tokens of the sequence's request.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The next delta, or `None` once the last one was returned.
    pub async fn next(&mut self) -> Option<Delta> {
        if self.done {
            return None;
        }
        let mut d = Delta {
            index: self.index,
            ..Delta::default()
        };
        let ev = loop {
            let ev = self.recv().await;
            if let Some(Some(EngineEvent::PromptLogprob {
                pos,
                token,
                logprob,
                rank,
                top,
            })) = ev
            {
                let t = TokenInfo {
                    id: token,
                    logprob,
                    rank: Some(rank),
                    top,
                };
                if self.gather_prompt_logprob(pos, t) {
                    // Every position arrived: deliver them now, before any output token.
                    d.prompt = self.prompt_lp.take();
                    return Some(d);
                }
                continue;
            }
            break ev;
        };
        // The first delta carries the prompt log-probabilities gathered so far.
        d.prompt = self.prompt_lp.take();
        let Some(ev) = ev else {
            self.abandon();
            d.error = Some(SHUTTING_DOWN.into());
            self.finish(&mut d, "abort");
            return Some(d);
        };
        match ev {
            Some(EngineEvent::Token {
                token,
                cached_tokens,
                logprob,
                top,
                first,
            }) => {
                if first.is_some() {
                    self.first_times = first;
                }
                let now = Instant::now();
                let since = now.duration_since(self.last_token.unwrap_or(self.arrived));
                self.metrics
                    .on_token(self.last_token.is_none(), since.as_secs_f64());
                self.last_token = Some(now);
                self.first_token.get_or_insert(now);
                self.output_tokens += 1;
                self.last_id = Some(token);
                // The prefix-cache count is known from the first token on.
                d.cached_tokens = cached_tokens;
                d.tokens.push(TokenInfo {
                    id: token,
                    logprob,
                    rank: None,
                    top,
                });
                // A stop token is the last one (the scheduler ends the request on it), and its
                // text is not part of the output.
                let text = if self.stop_text_ids.contains(&token) {
                    String::new()
                } else {
                    self.detok.push(&self.tokenizer, token)
                };
                let out = if self.output_tokens > self.min_tokens {
                    self.stop.push(&text)
                } else {
                    self.stop.pass(&text)
                };
                d.text = out.text;
                if let Some(s) = out.matched {
                    // The engine's `Finished` will not be read (the cached count came with the
                    // token).
                    self.abandon();
                    d.stop_reason = Some(StopReason::Text(s));
                    self.finish(&mut d, "stop");
                }
            }
            Some(EngineEvent::Finished {
                reason,
                cached_tokens,
                ..
            }) => {
                self.rx = None;
                d.cached_tokens = cached_tokens;
                let tail = self.detok.finish(&self.tokenizer);
                // The last token's leftover text: searched as that token's text was.
                let out = if self.output_tokens > self.min_tokens {
                    self.stop.push(&tail)
                } else {
                    self.stop.pass(&tail)
                };
                d.text = out.text;
                let reason = if let Some(s) = out.matched {
                    d.stop_reason = Some(StopReason::Text(s));
                    "stop"
                } else {
                    d.text.push_str(&self.stop.flush());
                    if reason == FinishReason::Stop {
                        d.stop_reason = self
                            .last_id
                            .filter(|id| self.stop_reason_ids.contains(id))
                            .map(StopReason::Token);
                    }
                    finish_str(reason)
                };
                self.finish(&mut d, reason);
            }
            Some(EngineEvent::Error(msg)) => {
                self.rx = None;
                d.error = Some(msg);
                self.finish(&mut d, "abort");
            }
            // Gathered by the loop above.
            Some(EngineEvent::PromptLogprob { .. }) => {}
            None => {
                self.rx = None;
                d.error = Some("the engine dropped the request without finishing it".into());
                self.finish(&mut d, "abort");
            }
        }
        Some(d)
    }

    /// The next engine event: `Some(None)` when the channel closed, `None` when the server
    /// stopped waiting for live requests (shutdown).
    async fn recv(&mut self) -> Option<Option<EngineEvent>> {
        match self.rx.as_mut() {
            Some(rx) => {
                let draining = &mut self.draining;
                tokio::select! {
                    biased;
                    ev = rx.recv() => Some(ev),
                    // A closed channel (the server state is gone) disables this branch.
                    Ok(_) = draining.wait_for(|&d| d) => None,
                }
            }
            None => Some(None),
        }
    }

    /// Records one prompt log-probability; returns true when it completed the set (every
    /// position from 1 to the prompt's end). Events the sequence did not ask for, positions
    /// out of range and repeats are ignored.
    fn gather_prompt_logprob(&mut self, pos: u32, t: TokenInfo) -> bool {
        let Some(lp) = self.prompt_lp.as_mut() else {
            return false;
        };
        let pos = pos as usize;
        if pos == 0 {
            return false;
        }
        if let Some(slot @ None) = lp.get_mut(pos) {
            *slot = Some(t);
            self.prompt_lp_seen += 1;
        }
        self.prompt_lp_seen + 1 >= lp.len()
    }

    fn finish(&mut self, d: &mut Delta, reason: &'static str) {
        self.done = true;
        d.finish = Some(reason);
        self.report_finished(reason);
    }

    fn report_finished(&self, reason: &str) {
        self.metrics.on_finished(Finished {
            reason,
            e2e: self.arrived.elapsed().as_secs_f64(),
            ttft: self
                .first_token
                .map(|t| t.duration_since(self.arrived).as_secs_f64()),
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            first_times: self.first_times,
            decode: self
                .first_token
                .zip(self.last_token)
                .map(|(f, l)| l.duration_since(f).as_secs_f64()),
        });
    }

    /// Cancels the engine request if it has not ended and keeps its receiver until the engine
    /// acknowledges.
    fn abandon(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        self.engine.cancel(self.id);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                while let Some(ev) = rx.recv().await {
                    if matches!(ev, EngineEvent::Finished { .. } | EngineEvent::Error(_)) {
                        break;
                    }
                }
            });
        }
    }
}

impl Drop for Seq {
    fn drop(&mut self) {
        if !self.done {
            // Dropped before its last delta: the client went away (or the handler gave up).
            // Count it as aborted, as vLLM's `request_success_total{finished_reason="abort"}`.
            self.done = true;
            self.report_finished("abort");
        }
        self.abandon();
    }
}
