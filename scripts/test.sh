#!/usr/bin/env bash
# Sets up a fresh machine and runs every test. This is the command README.md gives and
# .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo test (workspace)"
cargo test --workspace --no-fail-fast
