#!/usr/bin/env bash
# Baton against llama.cpp's llama-server on the same tiny model (stories260K, f32), CPU only.
#
#   bench/vs-llamacpp.sh BATON_BIN
#
# 1. Builds llama-server (CPU, Release, -march=native) from the llama.cpp source vendored in
#    the PyPI sdist of llama-cpp-python (pip download; no GitHub access needed), under $WORK.
#    Skipped when $WORK/build/bin/llama-server exists or LLAMA_SERVER names a binary.
# 2. Checks both servers give the same greedy text for "Once upon a time" (64 tokens, T=0), and
#    that both honour `ignore_eos` (with EOS forced by logit_bias, a request still runs to
#    max_tokens).
# 3. Runs `baton bench serve` (the same client for both) at concurrency 1, 8 and 64, with the
#    parameters of bench/serve.sh: random prompts of INPUT_LEN tokens, OUTPUT_LEN output tokens,
#    ignore_eos, streamed /v1/completions, warmup = concurrency. Each server runs alone, started
#    fresh for each repeat, the two alternating (baton, llama.cpp, baton, llama.cpp, ...).
#    Server CPU time (its whole process tree, from /proc) is recorded over each run.
# 4. Prints a table (also $OUT/table.md) from the result JSONs in $OUT.
#
# Known artefact: llama-server (cpp-httplib) closes the connection after every streamed response
# although it answers `Keep-Alive: timeout=5, max=100`; the bench client's pooled connection then
# sometimes races the close and the request fails at once ("connection closed before message
# completed"). Such requests are counted under `failed` and left out of the latency figures; a
# bench run with failures exits non-zero, which this script logs and carries on from.
#
# Environment: MODEL (HF directory), GGUF (the same model as GGUF), BATON_MODEL (what Baton
# serves: default MODEL; give "$GGUF" to serve the very file llama.cpp does), WORK (llama.cpp build dir),
# LLAMA_SERVER (use this llama-server instead of building), LLAMA_CPP_PY_VERSION (sdist version;
# default 0.3.36, the one this was first run with), OUT, BATON_PORT, LLAMA_PORT, THREADS
# (compute threads of both servers; default nproc), INPUT_LEN, OUTPUT_LEN, NUM_C1, NUM_C8,
# NUM_C64, REPEATS, LLAMA_FLAGS / BATON_FLAGS (extra server flags), QUIET_TIMEOUT (seconds to
# wait for other compile jobs - cargo, rustc, cc1plus - to finish before measuring; 0 skips).
set -euo pipefail

if [ $# -lt 1 ] || [ ! -x "$1" ]; then
  echo "usage: $0 BATON_BIN   (a release build of baton)" >&2
  exit 2
fi
BATON=$(realpath "$1")
REPO=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${MODEL:-$REPO/../shared/models/stories260K}
GGUF=${GGUF:-$REPO/../shared/models/stories260K-gguf/stories260K-f32.gguf}
WORK=${WORK:-${TMPDIR:-/tmp}/vs-llamacpp-build}
OUT=${OUT:-$REPO/bench/out/vs-llamacpp}
LLAMA_CPP_PY_VERSION=${LLAMA_CPP_PY_VERSION:-0.3.36}
BATON_PORT=${BATON_PORT:-8312}
LLAMA_PORT=${LLAMA_PORT:-8313}
THREADS=${THREADS:-$(nproc)}
INPUT_LEN=${INPUT_LEN:-32}
OUTPUT_LEN=${OUTPUT_LEN:-64}
NUM_C1=${NUM_C1:-100}
NUM_C8=${NUM_C8:-400}
NUM_C64=${NUM_C64:-1000}
REPEATS=${REPEATS:-2}
QUIET_TIMEOUT=${QUIET_TIMEOUT:-900}
CONCURRENCIES=(1 8 64)
MAXC=64
MODEL=$(realpath "$MODEL")
BATON_MODEL=$(realpath "${BATON_MODEL:-$MODEL}")
GGUF=$(realpath "$GGUF")
mkdir -p "$OUT" "$WORK"
OUT=$(realpath "$OUT")
WORK=$(realpath "$WORK")

log() { echo "[vs-llamacpp $(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------- servers and cleanup
SERVER_PID=
INSTANCE="vs-llamacpp-$$"
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}
cleanup() {
  stop_server
  rm -f "/dev/shm/baton-$INSTANCE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_health() { # PORT NAME LOG
  for _ in $(seq 1 600); do
    if curl -fsS "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "$2 exited; see $3" >&2
      tail -20 "$3" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "$2 not healthy after 120 s; see $3" >&2
  exit 1
}

start_server() { # baton|llama TAG
  local log="$OUT/$1-$2.log"
  if [ "$1" = baton ]; then
    # shellcheck disable=SC2086
    "$BATON" serve --model "$BATON_MODEL" --port "$BATON_PORT" --instance "$INSTANCE" \
      --cpu-threads "$THREADS" ${BATON_FLAGS:-} >"$log" 2>&1 &
    SERVER_PID=$!
    wait_health "$BATON_PORT" "baton serve" "$log"
  else
    # -np: one slot per concurrent request; -c: every slot holds INPUT_LEN+OUTPUT_LEN (llama.cpp
    # splits -c over the slots and pads each to a multiple of 256). Continuous batching is on
    # by default.
    # shellcheck disable=SC2086
    "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" -t "$THREADS" \
      -np "$MAXC" -c $((MAXC * (INPUT_LEN + OUTPUT_LEN + 16))) -cb --no-webui \
      ${LLAMA_FLAGS:-} >"$log" 2>&1 &
    SERVER_PID=$!
    wait_health "$LLAMA_PORT" "llama-server" "$log"
  fi
}

port_of() { if [ "$1" = baton ]; then echo "$BATON_PORT"; else echo "$LLAMA_PORT"; fi; }

# utime+stime (clock ticks) of a process and all its descendants
tree_ticks() {
  local pids=("$1") i=0 total=0 p
  while [ $i -lt ${#pids[@]} ]; do
    for p in $(pgrep -P "${pids[$i]}" 2>/dev/null || true); do pids+=("$p"); done
    i=$((i + 1))
  done
  for p in "${pids[@]}"; do
    if [ -r "/proc/$p/stat" ]; then
      # fields after the ")" of comm: utime is the 12th, stime the 13th
      total=$((total + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')))
    fi
  done
  echo "$total"
}
machine_busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }

wait_quiet() {
  [ "$QUIET_TIMEOUT" = 0 ] && return 0
  local waited=0
  while pgrep -x cargo >/dev/null || pgrep -x rustc >/dev/null || pgrep -x cc1plus >/dev/null; do
    if [ "$waited" -ge "$QUIET_TIMEOUT" ]; then
      log "WARNING: other compile jobs still running after ${QUIET_TIMEOUT}s; measuring anyway"
      echo "noisy: compile jobs running ($(uptime))" >>"$OUT/quiet.txt"
      return 0
    fi
    [ "$waited" = 0 ] && log "other compile jobs running ($(uptime | sed 's/.*load/load/')); waiting"
    sleep 30
    waited=$((waited + 30))
  done
  echo "$(date +%T) quiet after ${waited}s wait; $(uptime | sed 's/.*load/load/')" >>"$OUT/quiet.txt"
}

# ---------------------------------------------------------------- 1. build llama-server
build_llama_server() {
  local src
  if [ ! -d "$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION" ]; then
    log "downloading llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist"
    python3 -m pip download "llama-cpp-python==$LLAMA_CPP_PY_VERSION" --no-deps \
      --no-binary :all: -d "$WORK/dl" >"$WORK/pip.log" 2>&1
    tar xzf "$WORK/dl/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$WORK"
  fi
  src="$WORK/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
  command -v cmake >/dev/null || { echo "cmake needed (apt-get install -y cmake)" >&2; exit 1; }
  log "building llama-server (cmake, Release, CPU, GGML_NATIVE) in $WORK/build"
  cmake -S "$src" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
    >"$WORK/cmake.log" 2>&1
  cmake --build "$WORK/build" --target llama-server -j"$(nproc)" >"$WORK/build.log" 2>&1
}
if [ -z "${LLAMA_SERVER:-}" ]; then
  LLAMA_SERVER="$WORK/build/bin/llama-server"
  [ -x "$LLAMA_SERVER" ] || build_llama_server
fi
"$LLAMA_SERVER" --version >"$OUT/llama-version.txt" 2>&1 || true
"$BATON" --version >"$OUT/baton-version.txt" 2>&1 || true
log "llama-server: $(grep -m1 -i version "$OUT/llama-version.txt" || echo '?')"

# ---------------------------------------------------------------- 2. correctness checks
completion() { # PORT JSON_BODY
  curl -fsS "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d "$2"
}
EOS_ID=$(python3 -c 'import json, sys; e = json.load(open(sys.argv[1]))["eos_token_id"]; print(e[0] if isinstance(e, list) else e)' "$MODEL/config.json")
for S in baton llama; do
  wait_quiet
  start_server "$S" check
  P=$(port_of "$S")
  completion "$P" '{"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}' \
    >"$OUT/greedy-$S.json"
  # ignore_eos: EOS pushed to the top by logit_bias; without ignore_eos the first token ends
  # the request, with it the request must run to max_tokens.
  for E in false true; do
    completion "$P" "{\"prompt\": \"Once upon a time\", \"max_tokens\": 32, \"temperature\": 0, \"logit_bias\": {\"$EOS_ID\": 100}, \"ignore_eos\": $E}" \
      >"$OUT/eos-$S-$E.json"
  done
  stop_server
done
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
t = {s: json.load(open(f"{out}/greedy-{s}.json"))["choices"][0]["text"] for s in ("baton", "llama")}
same = t["baton"] == t["llama"]
print(f"greedy 'Once upon a time' x64: {'IDENTICAL' if same else 'DIFFERENT'}")
if not same:
    print("  baton:", repr(t["baton"])); print("  llama:", repr(t["llama"]))
for s in ("baton", "llama"):
    for e in ("false", "true"):
        r = json.load(open(f"{out}/eos-{s}-{e}.json"))
        print(f"{s:5} EOS logit_bias +100, ignore_eos={e:5}: finish_reason "
              f"{r['choices'][0]['finish_reason']}, completion_tokens {r['usage']['completion_tokens']}")
EOF

# ---------------------------------------------------------------- 3. benchmarks
run_bench() { # SERVER REP C
  local S=$1 R=$2 C=$3 N_VAR="NUM_C$3" t0 t1 s0 s1 m0 m1
  local N=${!N_VAR} P
  P=$(port_of "$S")
  log "$S rep $R: concurrency $C, $N requests"
  t0=$(date +%s.%N); s0=$(tree_ticks "$SERVER_PID"); m0=$(machine_busy_ticks)
  "$BATON" bench serve --base-url "http://127.0.0.1:$P" --endpoint /v1/completions \
    --tokenizer "$MODEL" --dataset random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --ignore-eos --max-concurrency "$C" --num-prompts "$N" --warmup "$C" --seed 0 \
    --result-json "$OUT/$S-r$R-c$C.json" >"$OUT/$S-r$R-c$C.txt" 2>&1 || {
    log "bench failed (see $OUT/$S-r$R-c$C.txt)"; tail -5 "$OUT/$S-r$R-c$C.txt" >&2; }
  t1=$(date +%s.%N); s1=$(tree_ticks "$SERVER_PID"); m1=$(machine_busy_ticks)
  echo "{\"wall_s\": $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.3f", b - a}'), \"server_ticks\": $((s1 - s0)), \"machine_ticks\": $((m1 - m0)), \"hz\": $(getconf CLK_TCK), \"ncpu\": $(nproc)}" \
    >"$OUT/$S-r$R-c$C.cpu.json"
}
for R in $(seq 1 "$REPEATS"); do
  for S in baton llama; do
    wait_quiet
    start_server "$S" "r$R"
    for C in "${CONCURRENCIES[@]}"; do run_bench "$S" "$R" "$C"; done
    stop_server
  done
done

# ---------------------------------------------------------------- 4. table
python3 - "$OUT" "$REPEATS" "$OUTPUT_LEN" "${CONCURRENCIES[@]}" <<'EOF' | tee "$OUT/table.md"
import json, os, sys, statistics as st
out, reps, olen, cs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(c) for c in sys.argv[4:]]
name = {"baton": "Baton", "llama": "llama.cpp"}
cols = ["req/s", "out tok/s", "TTFT mean", "TTFT med", "TTFT p99", "ITL mean", "ITL p99",
        "TPOT mean", "server CPU %", "failed", "full len"]
print("| server | conc | run | " + " | ".join(cols) + " |")
print("|" + "---|" * (len(cols) + 3))
spread = []
for c in cs:
    for s in ("baton", "llama"):
        vals = []
        for r in range(1, reps + 1):
            f = f"{out}/{s}-r{r}-c{c}.json"
            if not os.path.exists(f):
                continue
            d = json.load(open(f))
            cpu = json.load(open(f"{out}/{s}-r{r}-c{c}.cpu.json"))
            cpu_pct = 100 * cpu["server_ticks"] / cpu["hz"] / cpu["wall_s"]
            full = sum(1 for q in d["requests"] if q["ok"] and q.get("usage_completion_tokens") == olen)
            row = [d["request_throughput"], d["output_throughput"], d["ttft_ms"]["mean"],
                   d["ttft_ms"]["median"], d["ttft_ms"]["p99"], d["itl_ms"]["mean"],
                   d["itl_ms"]["p99"], d["tpot_ms"]["mean"], cpu_pct]
            vals.append(row)
            print(f"| {name[s]} | {c} | {r} | " + " | ".join(f"{v:.2f}" for v in row)
                  + f" | {d['failed']} | {full}/{d['completed']} |")
        if len(vals) > 1:
            tp = [v[1] for v in vals]
            spread.append(f"{name[s]} c={c}: out tok/s {min(tp):.0f}..{max(tp):.0f} "
                          f"({100 * (max(tp) - min(tp)) / st.mean(tp):.1f}% of mean); "
                          f"TTFT p99 {min(v[4] for v in vals):.2f}..{max(v[4] for v in vals):.2f} ms; "
                          f"ITL p99 {min(v[6] for v in vals):.2f}..{max(v[6] for v in vals):.2f} ms")
print()
print("Times in ms. server CPU % = the server's process tree CPU time over the bench run's wall")
print(f"time (warmup included), out of {os.cpu_count() * 100}%.")
if spread:
    print("\nRun-to-run spread:")
    for l in spread:
        print("- " + l)
EOF
