#!/usr/bin/env bash
# The project's test command: formatting, lints, unit and integration tests, documentation links,
# loom models and the kernel compile check. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

export BATON_TEST_MODEL="${BATON_TEST_MODEL:-$(pwd)/../shared/models/stories260K}"
if [ ! -f "$BATON_TEST_MODEL/config.json" ]; then
  echo "error: test model not found at $BATON_TEST_MODEL (set BATON_TEST_MODEL)" >&2
  exit 1
fi

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test"
cargo test --workspace

step "cargo doc (warnings are errors: broken or private links in the docs)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

if [ -x scripts/loom.sh ]; then
  step "loom models"
  scripts/loom.sh
fi

step "official OpenAI and Anthropic clients against baton serve"
scripts/openai-check.sh

if [ -x scripts/nvrtc-check.sh ]; then
  step "kernel compile check (NVRTC, sm_90)"
  scripts/nvrtc-check.sh
fi
