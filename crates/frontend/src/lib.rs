//! baton-frontend: the OpenAI-compatible HTTP layer (DESIGN.md section 1).
//!
//! It owns HTTP, tokenization, chat templates, per-request stream state, incremental
//! detokenization and stop strings, and talks to the engine only through the
//! [`EngineClient`] trait: [`LocalEngineClient`] runs the scheduler and a worker backend in
//! this process; the shared-memory ring client implements the same trait.

#![warn(missing_docs)]

pub mod chat;
pub mod cors;
pub mod detok;
pub mod engine;
pub mod local;
pub mod messages;
pub mod metrics;
pub mod openai;
pub mod reasoning;
pub mod responses;
pub mod ring;
pub mod seq;
pub mod server;
pub mod stop;
pub mod store;
pub mod tools;
pub mod validate;

pub use cors::CorsConfig;
pub use engine::{
    EngineClient, EngineEvent, EngineLimits, EngineRequest, EngineStats, SubmitError,
};
pub use local::LocalEngineClient;
pub use ring::RingEngineClient;
pub use server::{
    bind, router, serve, serve_on, serve_state, shutdown_signal, AppState, ServerConfig,
    DEFAULT_HEADER_READ_TIMEOUT,
};
