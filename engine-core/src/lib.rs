//! Harrier's engine core: everything that turns token ids into more token ids.
//!
//! Module map (dependencies point down; nothing points up):
//! - [`server`]: the engine-core process: sockets, routing outputs to front ends, heartbeats, signals.
//! - [`engine`]: the engine loop (reference 000 §4.6): drain inputs, schedule, launch, finalize, commit.
//! - [`scheduler`]: a pure selector over [`request`] state and the [`kv`] block manager; knows no backend.
//! - [`pipeline`]: the in-flight state machine (batch queue, ping-pong slots); pure logic, no backend.
//! - [`executor`]: the backend-agnostic seam (launch forward / finalize sampling / wait) and its
//!   backends: [`executor::cpu`] (a compute thread playing the CUDA stream).
//! - [`model`]: Hugging Face model directories, weights, and the CPU forward pass.
//! - [`sampling`]: logits processing and seeded sampling (counter-based Philox RNG).
//! - [`gen_model`]: writes Hugging Face model directories with deterministic random weights.
//! - [`default_model`]: the embedded default model (`harrier-cpu`), written out on first use.
//! - [`hub`]: models by Hugging Face Hub id, fetched into the Hugging Face cache.
//! - [`progress`]: start-up progress (bars on a terminal, log lines otherwise).
//!
//! Rules: the scheduler, pipeline and request modules know no backend; only executors touch
//! model math; only a CUDA executor (later) touches CUDA.

pub mod batch;
pub mod bench;
pub mod cli;
pub mod config;
pub mod default_model;
pub mod engine;
pub mod executor;
pub mod gen_model;
pub mod hub;
pub mod kv;
pub mod model;
pub mod pipeline;
pub mod progress;
pub mod quantize;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod spec;
pub mod splitmix;
pub mod structured;
