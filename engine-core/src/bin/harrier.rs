//! `harrier`: the one user-facing binary.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "harrier", version, about = "Harrier LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a Hugging Face model directory with deterministic random weights.
    GenModel(harrier_engine::gen_model::GenModelArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::GenModel(args) => harrier_engine::gen_model::run(&args),
    }
}
