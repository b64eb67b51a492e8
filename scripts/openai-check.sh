#!/usr/bin/env bash
# Runs the official `openai` Python client against `baton serve` on the test model (issue 6):
# completions, chat and responses (client.responses, openai >= 1.66), streaming and not,
# include_usage, stop, n=2, logprobs, seed, the greedy goldens and a BadRequestError. Installs
# `openai` into a venv on first use. Then Anthropic's client against /v1/messages
# (crates/frontend/tests/anthropic_client.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export BATON_TEST_MODEL="${BATON_TEST_MODEL:-$(pwd)/../shared/models/stories260K}"
VENV="${BATON_OPENAI_VENV:-$HOME/.cache/baton/openai-venv}"
# `client.responses` needs openai >= 1.66: an older venv is upgraded.
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import openai.resources.responses" 2>/dev/null; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --upgrade "openai>=1.66"
fi
cargo build --quiet -p baton
BIN="${CARGO_TARGET_DIR:-target}/debug/baton"
PORT="${BATON_OPENAI_PORT:-18000}"
LOG="$(mktemp)"
"$BIN" serve --model "$BATON_TEST_MODEL" --port "$PORT" --instance "openai-check-$$" --max-num-seqs 32 \
  --chat-template scripts/chat-templates/llama2.jinja --responses-store-mib 16 2>"$LOG" &
SERVE=$!
cleanup() { kill -TERM "$SERVE" 2>/dev/null || true; wait "$SERVE" 2>/dev/null || true; rm -f "$LOG"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  if grep -q "ready on" "$LOG"; then break; fi
  if ! kill -0 "$SERVE" 2>/dev/null; then cat "$LOG" >&2; echo "baton serve died" >&2; exit 1; fi
  sleep 0.1
done
grep -q "ready on" "$LOG" || { cat "$LOG" >&2; echo "baton serve never became ready" >&2; exit 1; }
"$VENV/bin/python" crates/frontend/tests/openai_client.py "http://127.0.0.1:$PORT"
# Anthropic's client against /v1/messages. Installed on first use; where it cannot be installed
# (no package index), the check says so and is skipped.
if ! "$VENV/bin/python" -c "import anthropic" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "anthropic>=0.40" || true
fi
if "$VENV/bin/python" -c "import anthropic" 2>/dev/null; then
  "$VENV/bin/python" crates/frontend/tests/anthropic_client.py "http://127.0.0.1:$PORT"
else
  echo "SKIPPED anthropic_client.py: the anthropic package could not be installed" >&2
fi
