//! Harrier's front end: everything between an HTTP client and the engine core's token ids.
//!
//! Module map (dependencies point down):
//! - [`cli`]: the `harrier frontend` / `serve` / `bench serve` options and entry points.
//! - [`launcher`]: `harrier serve`: one engine core and N front ends as child processes.
//! - [`bench`]: `harrier bench serve`: the serving benchmark (HTTP or straight to the engine).
//! - [`server`]: the hyper server: accept loop (SO_REUSEPORT), routing, auth, drain.
//! - [`handlers`]: the endpoints; [`stream`] turns a generation into SSE chunks or a response.
//! - [`api`]: OpenAI request/response types and request validation.
//! - [`engine`]: the engine connection: liveness, reconnect, submit/abort.
//! - [`output`]: the output processor thread: detokenization, stop strings, logprobs, metrics.
//! - [`text`]: the tokenizer and chat template on a bounded blocking pool.
//! - [`detok`], [`stop`], [`template`]: the pure text state machines.
//! - [`metrics`]: Prometheus metrics. [`error`]: OpenAI error objects.
//! - [`http_client`]: a minimal HTTP/1.1 client (bench, tests, readiness probes).
//!
//! Rules: nothing CPU-heavy runs on the async reactor (tokenization and templates go to the
//! blocking pool, detokenization to the output thread); the engine is reached only through
//! [`engine::Engine`]; the pure modules (detok, stop, template, api) know no I/O.

pub mod api;
pub mod bench;
pub mod cli;
pub mod detok;
pub mod engine;
pub mod error;
pub mod handlers;
pub mod http_client;
pub mod launcher;
pub mod metrics;
pub mod output;
pub mod server;
pub mod stop;
pub mod stream;
pub mod template;
pub mod text;
pub mod tools;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
pub(crate) mod testutil;
