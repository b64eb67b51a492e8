#!/usr/bin/env bash
# A/B of decode tuning knobs on a GPU machine, with one prebuilt binary: `baton bench decode`
# at batch 1 on the dummy Llama-1B and Llama-8B shapes (prompt 128, gen 128, bf16, CUDA
# graphs), once per variant. Variants differ only in their environment:
#   BATON_ATTN_TARGET_BLOCKS  thread blocks a decode attention launch aims for (default 512;
#                             crates/cuda/src/plan.rs, Tuning);
#   BATON_ATTN_MIN_PARTITION  fewest keys per split-K partition of decode attention (default
#                             64; a multiple of 64): at or below it a sequence is one block
#                             per kv head with no combine;
#   BATON_GEMV1_BLOCKS_PER_SM blocks per SM of a batch-of-one GEMV grid (default 2; 1 leaves
#                             register room for the next kernel's blocks to start their
#                             weight loads before their PDL wait);
#   BATON_PERSISTENT_DECODE   1: every layer of a batch-of-one decode step in one cooperative
#                             launch (baton_decode_layers_hdD, grid barriers between phases)
#                             instead of five launches per layer;
#   BATON_PERSISTENT_BLOCKS_PER_SM  blocks per SM of the persistent kernel's grid (default 3,
#                             the most that fit; fewer make each grid barrier cheaper);
#   BATON_KERNEL_DEFINES      kernel constants as NVRTC -D, NAME=VALUE[,NAME=VALUE...], for
#                             the constants kernels/ guards with #ifndef (BATON_GEMV_T1_U,
#                             BATON_GEMV_PREWAIT_L2, BATON_SAMPLE_BIN_CACHE, ...);
#   AB_ARGS                   not an environment variable: extra `bench decode` flags for this
#                             variant, comma-separated (--temperature=0.8,--top-p=0.95 for a
#                             sampled row instead of greedy).
# The base variant runs first and again near the end, so drift between runs shows; the list is
# in priority order, since the budget cuts it short. Prints a table of ms per
# decode step last, and writes it to $OUT/ab.txt, with every run's log and JSON packed into
# $OUT/gpu-ab.tgz (a device run returns only a few files).
#
# Usage, on the device machine from the repository root with .gpu carried (as gpu-check.sh):
#   GPU_AB_BUDGET=240 bash scripts/gpu-ab.sh
#   GPU_AB_VARIANTS=$'base|\nl2-64k|BATON_KERNEL_DEFINES=BATON_GEMV_PREWAIT_L2=65536' \
#       GPU_AB_SHAPES=8b bash scripts/gpu-ab.sh
# A variant is NAME|VAR=VALUE VAR=VALUE ... (nothing after | = the defaults). GPU_AB_SHAPES is
# "1b 8b" unless set. The budget (default 300 s) cuts the list short rather than overrun; runs
# not made show as "-". Exit status 0 unless the binary is missing.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# BATON, the CUDA library and include paths, LLAMA_1B, LLAMA_8B
source "$repo_root/scripts/gpu-env.sh"
[[ -x "$BATON" ]] || { echo "FAIL: no binary at $BATON (scripts/gpu-prepare.sh)"; exit 2; }
RESULTS="${OUT:-$repo_root/gpu-ab-out}"
mkdir -p "$RESULTS"
RUNS="$(mktemp -d /tmp/gpu-ab.XXXXXX)" # every log and JSON; packed into $RESULTS at the end
BUDGET="${GPU_AB_BUDGET:-300}"
deadline=$((SECONDS + BUDGET - 5))

# Session 35 measured the persistent kernel (all its variants), BATON_GEMV1_BLOCKS_PER_SM=1,
# BATON_ATTN_MIN_PARTITION=256/512, BATON_ATTN_TARGET_BLOCKS=128, BATON_GEMV_T1_U=2 and
# BATON_SAMPLE_BIN_CACHE=0: none beats the defaults (bench/RESULTS.md). The list times session
# 38's shared-memory ring GEMV entries first (BATON_GEMV_ASYNC=1: 64 registers, so the next
# kernel's blocks can be resident beside a GEMV's; the greedy ratio is what #7 still misses),
# then the sampled row: session 37's histogram selection against the radix select alone
# (BATON_SAMPLE_HIST=0), for top-p, plain temperature and 20 top log-probabilities (greedy);
# then session 35's batched selection loads against one load at a time, and the LoRA path.
default_variants='base|
gemv-async|BATON_GEMV_ASYNC=1
topp|AB_ARGS=--temperature=0.8,--top-p=0.95
topp-hist-off|AB_ARGS=--temperature=0.8,--top-p=0.95 BATON_KERNEL_DEFINES=BATON_SAMPLE_HIST=0
temp|AB_ARGS=--temperature=0.8
temp-hist-off|AB_ARGS=--temperature=0.8 BATON_KERNEL_DEFINES=BATON_SAMPLE_HIST=0
logprobs-20|AB_ARGS=--top-logprobs=20
logprobs-20-hist-off|AB_ARGS=--top-logprobs=20 BATON_KERNEL_DEFINES=BATON_SAMPLE_HIST=0
topp-select-u-1|AB_ARGS=--temperature=0.8,--top-p=0.95 BATON_KERNEL_DEFINES=BATON_SELECT_U=1
topp-select-u-8|AB_ARGS=--temperature=0.8,--top-p=0.95 BATON_KERNEL_DEFINES=BATON_SELECT_U=8
topk-50|AB_ARGS=--temperature=0.8,--top-k=50
lora-16|AB_ARGS=--lora-rank=16
persistent|BATON_PERSISTENT_DECODE=1
base-again|
in-flight-1|AB_ARGS=--in-flight=1
l2-64k|BATON_KERNEL_DEFINES=BATON_GEMV_PREWAIT_L2=65536'
VARIANTS="${GPU_AB_VARIANTS:-$default_variants}"
read -r -a SHAPES <<<"${GPU_AB_SHAPES:-1b 8b}"

declare -A ms=()
declare -a names=()
while IFS= read -r line; do
    [[ -z "$line" ]] && continue
    name="${line%%|*}"
    vars="${line#*|}"
    [[ "$line" == *"|"* ]] || vars=""
    names+=("$name")
    # AB_ARGS=a,b,... -> extra bench flags; every other word stays an environment setting.
    extra=()
    envs=()
    for word in $vars; do
        if [[ "$word" == AB_ARGS=* ]]; then
            IFS=',' read -r -a extra <<<"${word#AB_ARGS=}"
        else
            envs+=("$word")
        fi
    done
    for shape in "${SHAPES[@]}"; do
        case "$shape" in
        1b) cfg="$LLAMA_1B" ;;
        8b) cfg="$LLAMA_8B" ;;
        *) echo "unknown shape $shape (1b or 8b)"; continue ;;
        esac
        left=$((deadline - SECONDS))
        if ((left < 20)); then
            echo "skip $name $shape: budget spent"
            continue
        fi
        json="$RUNS/ab-$name-$shape.json"
        echo "== $name $shape: ${vars:-defaults}"
        timeout -k 5 "$left" env "${envs[@]}" "$BATON" bench decode --device cuda \
            --load-format dummy --config "$cfg" --batch 1 --prompt-len 128 --gen-len 128 \
            --dtype bf16 "${extra[@]}" --out "$json" >"$RUNS/ab-$name-$shape.log" 2>&1
        rc=$?
        v=$(grep -o '"ms_per_step": *[0-9.e+-]*' "$json" 2>/dev/null | head -1 | sed 's/.*: *//')
        if [[ $rc != 0 || -z "$v" ]]; then
            echo "   failed (exit $rc):"
            tail -3 "$RUNS/ab-$name-$shape.log"
            v="fail"
        else
            echo "   $v ms/step"
        fi
        ms["$name/$shape"]="$v"
    done
done <<<"$VARIANTS"

{
    printf '%-14s' "variant"
    for shape in "${SHAPES[@]}"; do printf ' %12s' "$shape ms/step"; done
    printf '\n'
    for name in "${names[@]}"; do
        printf '%-14s' "$name"
        for shape in "${SHAPES[@]}"; do printf ' %12s' "${ms[$name/$shape]:--}"; done
        printf '\n'
    done
} | tee "$RESULTS/ab.txt"
tar czf "$RESULTS/gpu-ab.tgz" -C "$RUNS" . && echo "logs and JSON: $RESULTS/gpu-ab.tgz"
