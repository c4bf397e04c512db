//! `harrier`: the one user-facing binary.

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
    /// Run the engine core: scheduler, KV cache and model, serving front ends over ZeroMQ.
    EngineCore(harrier_engine::cli::EngineCoreArgs),
    /// Write a Hugging Face model directory with deterministic random weights.
    GenModel(harrier_engine::gen_model::GenModelArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::EngineCore(args) => harrier_engine::cli::run_engine_core(args),
        Command::GenModel(args) => harrier_engine::gen_model::run(&args),
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
