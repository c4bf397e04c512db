//! `harrier`: the one user-facing binary (engine core, front end, launcher, tools).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "harrier", version, about = "Harrier LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model: one engine core and N front ends on one port (OpenAI-compatible API).
    Serve(harrier_frontend::launcher::ServeArgs),
    /// Run the engine core: scheduler, KV cache and model, serving front ends over ZeroMQ.
    EngineCore(harrier_engine::cli::EngineCoreArgs),
    /// Run one front end: the HTTP API in front of a running engine core.
    Frontend(harrier_frontend::cli::FrontendArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a Hugging Face model directory with deterministic random weights.
    GenModel(harrier_engine::gen_model::GenModelArgs),
    /// Write an FP8 copy of a model directory (compressed-tensors format, per-channel scales).
    Quantize(harrier_engine::quantize::QuantizeArgs),
    /// Write the embedded default model (`harrier-cpu`) under $HARRIER_HOME/models unless it is
    /// there already, and print its directory (container images run this at build time).
    DefaultModel,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Load a running server (or an engine core) with streaming requests and report latencies.
    Serve(harrier_frontend::bench::BenchServeArgs),
    /// The same load run long against a `harrier serve` whose processes' memory is sampled
    /// and checked (scripts/soak.sh, docs/soak.md).
    Soak(harrier_frontend::bench::soak::SoakArgs),
    /// The engine's own benchmark: CPU decode throughput and host time per step.
    Engine(harrier_engine::bench::EngineBenchArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let raw: Vec<String> = std::env::args().collect();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => harrier_frontend::launcher::run_serve(args, &raw[2..]),
        Command::EngineCore(args) => harrier_engine::cli::run_engine_core(args),
        Command::Frontend(args) => harrier_frontend::cli::run_frontend(args),
        Command::Bench(BenchCommand::Serve(args)) => harrier_frontend::bench::run_bench_serve(args),
        Command::Bench(BenchCommand::Soak(args)) => harrier_frontend::bench::soak::run_soak(args),
        Command::Bench(BenchCommand::Engine(args)) => harrier_engine::bench::run(&args),
        Command::GenModel(args) => harrier_engine::gen_model::run(&args),
        Command::Quantize(args) => harrier_engine::quantize::run(&args),
        Command::DefaultModel => {
            harrier_engine::cli::ensure_default_model().map(|dir| println!("{}", dir.display()))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
