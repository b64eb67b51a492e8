#!/usr/bin/env bash
# Issue 8: `baton bench serve` against `baton serve` on stories260K, CPU, release build.
# Concurrency 1, 8 and 64; 64 output tokens per request with ignore_eos; random prompts of
# INPUT_LEN tokens drawn from the model's tokenizer. Writes bench/out/serve-c{1,8,64}.{json,png}
# and the server's log. Environment: MODEL, PORT, INPUT_LEN, NUM_C1, NUM_C8, NUM_C64,
# SERVE_FLAGS (extra flags for `baton serve`), CARGO_TARGET_DIR, PERF=1 (perf record -a -g for 5 s
# during the concurrency-64 run, into bench/out/perf-c64.data).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/models/stories260K}
PORT=${PORT:-8311}
INPUT_LEN=${INPUT_LEN:-32}
NUM_C1=${NUM_C1:-100}
NUM_C8=${NUM_C8:-400}
NUM_C64=${NUM_C64:-1000}
OUT=bench/out
mkdir -p "$OUT"

cargo build --release -p baton
BIN=${CARGO_TARGET_DIR:-target}/release/baton

# shellcheck disable=SC2086
"$BIN" serve --model "$MODEL" --port "$PORT" --instance "bench-serve-$$" ${SERVE_FLAGS:-} \
  >"$OUT/serve.log" 2>&1 &
SERVER=$!
cleanup() {
  kill -TERM "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
}
trap cleanup EXIT

for _ in $(seq 1 300); do
  if curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "baton serve exited; see $OUT/serve.log" >&2
    tail -20 "$OUT/serve.log" >&2
    exit 1
  fi
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null

for C in 1 8 64; do
  N_VAR="NUM_C$C"
  N=${!N_VAR}
  echo "== concurrency $C, $N requests" >&2
  if [ "$C" = 64 ]; then
    # Per-thread CPU over 3 s in the middle of the run (the second sample is the interval's).
    (sleep 3; top -b -H -n 2 -d 3 -w 160 >"$OUT/top-c64.txt" 2>&1) &
    if [ -n "${PERF:-}" ] && command -v perf >/dev/null; then
      (sleep 3; perf record -F 499 -g -a -o "$OUT/perf-c64.data" -- sleep 5 >/dev/null 2>&1) &
    fi
  fi
  "$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
    --tokenizer "$MODEL" --dataset random --input-len "$INPUT_LEN" --output-len 64 \
    --ignore-eos --max-concurrency "$C" --num-prompts "$N" --warmup "$C" --seed 0 \
    --result-json "$OUT/serve-c$C.json" --plot "$OUT/serve-c$C.png" | tee "$OUT/serve-c$C.txt"
  curl -fsS "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics-after-c$C.txt" || true
done
wait_jobs=$(jobs -p | grep -v "^$SERVER\$" || true)
for j in $wait_jobs; do wait "$j" 2>/dev/null || true; done
