#!/usr/bin/env bash
# Sets up a fresh machine and runs every test. This is the command README.md gives and
# .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

# NVRTC and the CUDA headers installed by setup.sh: the kernels crate compiles every kernel.
export HARRIER_CUDA_DIR="${HARRIER_CUDA_DIR:-${HARRIER_HOME:-$HOME/.cache/harrier}/cuda}"

echo "== deployment files (systemd units, compose, Dockerfile)"
scripts/check_deploy.sh --static

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo test (workspace)"
cargo test --workspace --no-fail-fast

echo "== the official openai Python client against a real harrier serve"
scripts/test_openai_client.sh
