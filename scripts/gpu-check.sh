#!/usr/bin/env bash
# The GPU checks of issue 7, in one run, on an H200 with a prebuilt release binary:
#
#   scripts/gpu-prepare.sh                    # here: release build, stripped into .gpu/baton,
#                                             # and the test model copied into .gpu/ (ignored)
#   scripts/gpu-check.sh                      # on the GPU machine, from the repository root,
#                                             # with .gpu carried there
#
# Needs only the binary (.gpu/baton, else target/release/baton; override with BATON), the CUDA
# libraries under /usr/local/cuda/lib64 (libcuda comes with the driver) and cuda_bf16.h under
# /usr/local/cuda/include (BATON_CUDA_INCLUDE): bash and coreutils, no Rust or Python. The
# model is BATON_TEST_MODEL, else .gpu/stories260K, else ../shared/models/stories260K (which
# does not travel to a device machine). Each check prints PASS or FAIL and the script goes on
# after a failure. The whole run keeps within GPU_CHECK_BUDGET seconds (default 470): each
# check's own limit is clamped to what is left, a check that cannot start counts as FAIL, and
# the summary table is always printed last. GPU_CHECKS="1 3h 6c" runs only those checks (a
# name's part before its first '-'), for a short rerun of what failed or changed. Logs and
# JSON are packed into $OUT/gpu-check.tgz, beside $OUT/summary.txt (two files: a device run
# returns only a few).
# Exit status: 0 when every check passed.
#
# Checks:
#   1. stories260K in f32 reproduces every golden of golden.json exactly (greedy, alone and
#      batched, through the scheduler with asynchronous launches and CUDA graphs);
#   2. stories260K in bf16: first-step logits within 2e-2 relative error of the CPU reference;
#   3. a dummy Llama-1B-shaped model in bf16: every layer's output within 1e-2 of the CPU backend
#      on the same weights (rounded to bf16), each layer run by the CPU from the GPU's input to
#      it, for a batch mixing prefill chunks and decodes, then a decode-only batch (the drift
#      accumulated from the embedding is printed beside each; it grows with depth);
#  4c. stories260K f32 goldens through `serve --device cuda` (the worker daemon keeps two
#      launches in flight), concurrent and alone;
#  4d. the persistent decode kernel (BATON_PERSISTENT_DECODE=1) gives the per-kernel path's
#      greedy tokens on dummy Llama-1B and 8B widths; 4g the same for the shared-memory ring
#      GEMV entries (BATON_GEMV_ASYNC=1);
#   4. a seeded sampled request gives the same tokens alone and in a batch (bf16, graphs). cuBLAS
#      does not promise one row the same bits at batch 1 and 4, so if only this fails, rerun it
#      with --dtype f32 to tell GEMM variance from a sampler or pending-id bug;
#   5. baton bench decode, dummy Llama-1B (batches 1,32,128) and Llama-8B (batch 1) shapes,
#      prompt 128, gen 128, bf16, CUDA graphs, two launches in flight (the worker daemon's
#      pipelining; 5f repeats 1B batch 1 with one); after each batch size a kernel-by-kernel
#      breakdown of one eager step (--breakdown), to see what to optimize; 5c repeats 1B at
#      batch 1 with --no-fused-decode (cuBLAS and separate norm/SiLU kernels) to compare; 5d
#      1B at batches 1 and 32 with --device-time (the host's share of a step); 5e 1B batch 1
#      with sampled rows (temperature 0.8, top-p 0.95: the sampler's selection passes);
#  3b. (after the benchmarks) layers as in 3 for Llama-8B widths (head_dim 128) with 4 layers;
#      3c and 3d the same for Qwen3-0.6B and Qwen2.5-0.5B widths (q/k norms, q/k/v biases),
#      3e for Phi-4-mini widths (partial RoPE with LongRoPE's attention factor); 3f layers
#      at Mistral-7B widths with a 32-key sliding window over a 100-token prompt; 3g at
#      Gemma-3-1b widths (Gemma 3's norms, GELU, scaled embedding, local RoPE); 3h at
#      Qwen3-30B-A3B widths with 2 layers (the mixture-of-experts kernels);
#  5t. the launch trace of batch-1 1B and 8B steps replayed from their graphs (bench decode
#      --launch-trace): each launch's share of the step with PDL's overlap, per wait site;
#   6. diagnostic, when Nsight Compute is there: each kernel's GPU time in eager batch-1 steps
#      of dummy 1B (cold caches), then 6b of one eager batch-1 step of dummy 8B with warm caches
#      and DRAM bytes (CSV in the tarball; scripts/ncu-table.py turns it into a per-kernel
#      table with bandwidths); 6c the warp-stall and source-counter sections of the 8B qkv,
#      o and down GEMVs (baton_gemv_t1) of one warm layer.
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# BATON, the CUDA library and include paths, LLAMA_1B, LLAMA_8B
source "$repo_root/scripts/gpu-env.sh"
if [[ -n "${BATON_TEST_MODEL:-}" ]]; then MODEL="$BATON_TEST_MODEL"
elif [[ -d "$repo_root/.gpu/stories260K" ]]; then MODEL="$repo_root/.gpu/stories260K"
else MODEL="$repo_root/../shared/models/stories260K"; fi
RESULTS="${OUT:-$repo_root/gpu-check-out}"
OUT="$(mktemp -d /tmp/gpu-check.XXXXXX)" # every log and JSON; packed into $RESULTS at the end
BUDGET="${GPU_CHECK_BUDGET:-470}"
deadline=$((SECONDS + BUDGET - 15)) # keeps time for the summary and the tarball
mkdir -p "$RESULTS"

[[ -x "$BATON" ]] || { echo "FAIL: no binary at $BATON (scripts/gpu-prepare.sh)"; exit 2; }
[[ -f "$MODEL/golden.json" ]] || echo "WARN: no test model at $MODEL (checks 0, 1, 2 and 4 need it)"
echo "binary $BATON, model $MODEL, budget ${BUDGET}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
ls /usr/local/cuda/lib64 2>/dev/null | grep -E '^lib(nvrtc|cublas|cublasLt)\.so' | tr '\n' ' '; echo

declare -a results=()
# GPU_CHECKS="1 3h 6c": run only the checks whose names start with one of these words (each
# matched up to its first '-': "3" runs 3 but not 3b); unset runs every check.
read -r -a only <<<"${GPU_CHECKS:-}"
selected() {
    ((${#only[@]} == 0)) && return 0
    local w
    for w in "${only[@]}"; do [[ "${1%%-*}" == "$w" ]] && return 0; done
    return 1
}
run_check() { # name, per-check timeout (s), command...
    local name="$1" limit="$2"; shift 2
    selected "$name" || return 0
    local log="$OUT/$name.log" t0=$SECONDS
    local left=$((deadline - SECONDS))
    if ((left < 15)); then
        echo "FAIL $name (not run: the budget is spent)"
        results+=("FAIL $name (not run: the budget is spent)")
        return
    fi
    ((limit > left - 5)) && limit=$((left - 5)) # --kill-after adds up to 5 s
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 25 "$log"
    local verdict=PASS
    [[ $rc != 0 ]] && verdict=FAIL
    echo "$verdict $name (exit $rc, $((SECONDS - t0)) s, log $log)"
    results+=("$verdict $name ($((SECONDS - t0)) s)")
}

# 0. Without CUDA in the environment the binary must fail cleanly (no panic).
run_check 0-clean-error-without-libs 30 bash -c \
    "out=\$(LD_LIBRARY_PATH=/nonexistent BATON_CUDA_INCLUDE=/nonexistent '$BATON' generate --model '$MODEL' --prompt hi --device cuda --max-tokens 2 2>&1); rc=\$?; echo \"\$out\"; [[ \$rc != 0 ]] && ! grep -q panicked <<<\"\$out\""

# 1. f32 goldens, exact.
run_check 1-golden-f32 90 "$BATON" debug golden --model "$MODEL" --dtype f32

# 2. bf16 first-step logits vs CPU.
run_check 2-logits-bf16 60 "$BATON" debug logits --model "$MODEL" --dtype bf16 --tol 2e-2 \
    --dump "$OUT/logits-bf16.json"

# 3. dummy 1B: every layer vs CPU, mixed prefill chunks and decodes.
run_check 3-layers-1b-bf16 150 "$BATON" debug layers --load-format dummy --config "$LLAMA_1B" \
    --dtype bf16 --tol 1e-2

# 4. seeded sampling: alone == in a batch.
run_check 4-seeded-alone-vs-batch 60 bash -c "
    set -e
    common=(generate --model '$MODEL' --device cuda --temperature 0.8 --top-p 0.95 --seed 1234 --max-tokens 48 --json --ignore-eos)
    '$BATON' \"\${common[@]}\" --prompt 'Once upon a time' > '$OUT/seeded-alone.jsonl'
    '$BATON' \"\${common[@]}\" --prompt 'Once upon a time' --prompt 'The cat sat' --prompt 'Lily wanted' --prompt 'Tom and' > '$OUT/seeded-batch.jsonl'
    head -n 1 '$OUT/seeded-alone.jsonl'
    head -n 1 '$OUT/seeded-batch.jsonl'
    diff <(head -n 1 '$OUT/seeded-alone.jsonl') <(head -n 1 '$OUT/seeded-batch.jsonl')"

# 4b. prompt log-probabilities (echo + logprobs): the CUDA worker (LM head over every prompt
# position after the fence, scored on the host) against the CPU worker, f32, through serve.
run_check 4b-prompt-logprobs-cuda-vs-cpu 60 bash -c "
    set -e
    body='{\"prompt\":\"Once upon a time, there was a little girl named Lily\",\"echo\":true,\"logprobs\":3,\"max_tokens\":2,\"temperature\":0}'
    for dev in cpu cuda; do
        port=\$([[ \$dev == cpu ]] && echo 18391 || echo 18392)
        '$BATON' serve --model '$MODEL' --device \$dev --dtype f32 --port \$port --instance gpucheck-\$dev > '$OUT'/serve-\$dev.log 2>&1 &
        pid=\$!
        for _ in \$(seq 100); do curl -sf localhost:\$port/health > /dev/null && break; sleep 0.2; done
        curl -sf localhost:\$port/v1/completions -H 'content-type: application/json' -d \"\$body\" > '$OUT'/echo-\$dev.json
        kill \$pid; wait \$pid || true
    done
    python3 - '$OUT/echo-cpu.json' '$OUT/echo-cuda.json' <<'PY'
import json, sys
a, b = (json.load(open(f))['choices'][0]['logprobs'] for f in sys.argv[1:3])
assert a['tokens'] == b['tokens'], (a['tokens'], b['tokens'])
assert a['token_logprobs'][0] is None and b['token_logprobs'][0] is None
d = max(abs(x - y) for x, y in zip(a['token_logprobs'][1:], b['token_logprobs'][1:]))
print(len(a['tokens']), 'positions, max |cpu - cuda| =', d)
assert d < 1e-4
PY"

# 4c. the worker daemon with two launches in flight (session 19, never run on a GPU before):
# stories260K in f32 through serve reproduces the goldens, 9 requests at once and 3 alone
# (scripts/serve-goldens.py; the same script passes against the CPU worker).
run_check 4c-goldens-through-serve-in-flight 60 bash -c "
    set -e
    '$BATON' serve --model '$MODEL' --device cuda --dtype f32 --port 18393 --instance gpucheck-inflight > '$OUT'/serve-inflight.log 2>&1 &
    pid=\$!
    for _ in \$(seq 100); do curl -sf localhost:18393/health > /dev/null && break; sleep 0.2; done
    rc=0; python3 scripts/serve-goldens.py 18393 '$MODEL' 3 || rc=\$?
    kill \$pid; wait \$pid || true
    exit \$rc"

# 4e. LoRA adapters (session 33, never run on a GPU before): greedy ids of two prompts with a
# seeded adapter (every projection, rank 4) on CUDA in f32 equal the CPU worker's
# (kernels/lora.cu; a launch with an adapter row runs eagerly on the per-kernel path).
run_check 4e-lora-cuda-vs-cpu 60 bash -c "
    set -e
    '$BATON' debug lora-adapter --model '$MODEL' --out '$OUT/lora-a' --rank 4 --alpha 8 --amplitude 0.08 --seed 1
    common=(generate --model '$MODEL' --temperature 0 --max-tokens 32 --json --ignore-eos --enable-lora --lora-modules a='$OUT/lora-a' --lora a --prompt 'Once upon a time' --prompt 'The cat sat')
    '$BATON' \"\${common[@]}\" --device cpu > '$OUT/lora-cpu.jsonl'
    '$BATON' \"\${common[@]}\" --device cuda --dtype f32 > '$OUT/lora-cuda.jsonl'
    head -n 1 '$OUT/lora-cuda.jsonl'
    diff '$OUT/lora-cpu.jsonl' '$OUT/lora-cuda.jsonl'"

# 4d. the persistent decode kernel (BATON_PERSISTENT_DECODE=1, session 20): greedy tokens of one
#     request (batch-of-one decode steps: one cooperative launch per step) equal the per-kernel
#     path's; 4g. the shared-memory ring GEMV entries (BATON_GEMV_ASYNC=1, session 38, never run
#     on a GPU) equal the register entries'. Both bf16 with graphs, on dummy weights of Llama-1B
#     widths (16 layers, head dim 64) and Llama-8B widths (4 layers, head dim 128), with
#     stories260K's tokenizer (vocab 512). Each variant computes the default path's sums, so
#     the ids must be identical (the emulator checks the log-probabilities bit for bit too).
# Usage: same_ids_with VAR=VALUE TAG.
same_ids_with() {
    set -e
    local var="$1" tag="$2" shape d cfg
    for shape in 1b 8b; do
        d=$(mktemp -d "/tmp/$tag-$shape.XXXXXX")
        cp "$MODEL/tokenizer.json" "$MODEL/tokenizer_config.json" "$d/"
        if [[ $shape == 1b ]]; then cfg="$LLAMA_1B"; else cfg="$LLAMA_8B"; fi
        cfg="${cfg/\"vocab_size\":128256/\"vocab_size\":512}"
        cfg="${cfg/\"num_hidden_layers\":32/\"num_hidden_layers\":4}"
        cfg="${cfg/\"bos_token_id\":128000,\"eos_token_id\":128001/\"bos_token_id\":1,\"eos_token_id\":2}"
        printf '%s' "$cfg" >"$d/config.json"
        local common=(generate --model "$d" --load-format dummy --device cuda --dtype bf16
            --temperature 0 --max-tokens 96 --json --ignore-eos --max-model-len 512
            --prompt 'Once upon a time there was a little girl')
        "$BATON" "${common[@]}" >"$OUT/$tag-off-$shape.jsonl"
        env "$var" "$BATON" "${common[@]}" >"$OUT/$tag-on-$shape.jsonl"
        head -c 300 "$OUT/$tag-on-$shape.jsonl"
        echo
        diff "$OUT/$tag-off-$shape.jsonl" "$OUT/$tag-on-$shape.jsonl"
        echo "$shape: identical"
    done
}
export -f same_ids_with
export BATON MODEL OUT LLAMA_1B LLAMA_8B
run_check 4d-persistent-decode-vs-per-kernel 120 bash -c 'same_ids_with BATON_PERSISTENT_DECODE=1 persistent'
run_check 4g-ring-gemv-vs-register 120 bash -c 'same_ids_with BATON_GEMV_ASYNC=1 ring-gemv'

# 5. decode benchmark: dummy 1B (1, 32, 128) and 8B (1), bf16, graphs.
run_check 5a-bench-decode-1b 150 "$BATON" bench decode --device cuda --load-format dummy \
    --config "$LLAMA_1B" --batch 1,32,128 --prompt-len 128 --gen-len 128 --dtype bf16 --breakdown \
    --out "$OUT/bench-decode-1b.json"
run_check 5b-bench-decode-8b 200 "$BATON" bench decode --device cuda --load-format dummy \
    --config "$LLAMA_8B" --batch 1 --prompt-len 128 --gen-len 128 --dtype bf16 --breakdown \
    --out "$OUT/bench-decode-8b.json"
# 3b. the same for head_dim 128 (Llama-8B widths, 4 layers): the hd128 attention kernels. Not
# in the issue; its tolerance is 1.5e-2 because layer 0 sits at 0.8e-2 to 1.03e-2 on an H200
# (session 7): the input is the embedding (standard deviation 0.02), so the layer's output is
# almost all attention and MLP output, whose bf16 roundings the max-over-max measure sees
# whole; layers 1-3 sit at 4e-3 to 6e-3.
run_check 3b-layers-8b-widths-bf16 120 "$BATON" debug layers --load-format dummy \
    --config "${LLAMA_8B/\"num_hidden_layers\":32/\"num_hidden_layers\":4}" --dtype bf16 --tol 1.5e-2

# 3c. Qwen3 (q/k RMSNorm per head before RoPE: baton_qkv_post) and 3d. Qwen2 (q/k/v biases), as
# in 3b: Qwen3-0.6B and Qwen2.5-0.5B widths with 4 layers, bf16, tolerance as 3b's (never run
# on a GPU before; the emulator passes them at 1e-2 on tiny shapes).
QWEN3_06B='{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":1024,
"intermediate_size":3072,"num_hidden_layers":4,"num_attention_heads":16,"num_key_value_heads":8,
"head_dim":128,"vocab_size":151936,"max_position_embeddings":40960,"rms_norm_eps":1e-06,
"rope_theta":1000000,"tie_word_embeddings":true}'
QWEN2_05B='{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":896,
"intermediate_size":4864,"num_hidden_layers":4,"num_attention_heads":14,"num_key_value_heads":2,
"vocab_size":151936,"max_position_embeddings":32768,"rms_norm_eps":1e-06,
"rope_theta":1000000.0,"tie_word_embeddings":true}'
run_check 3c-layers-qwen3-bf16 60 "$BATON" debug layers --load-format dummy \
    --config "$QWEN3_06B" --dtype bf16 --tol 1.5e-2
run_check 3d-layers-qwen2-bf16 60 "$BATON" debug layers --load-format dummy \
    --config "$QWEN2_05B" --dtype bf16 --tol 1.5e-2

# 3e. Phi-4-mini widths with 4 layers: partial RoPE (96 of 128 dims; the frequency-0 pairs of
# the permuted layout) and LongRoPE's attention factor, which CUDA puts into the rotated q rows
# (never run on a GPU; the emulator passes it at 1e-2 on tiny shapes).
PHI4_MINI_SF=$(awk 'BEGIN { for (i = 0; i < 48; i++) printf "%s%.2f", (i ? "," : ""), 1 + 0.1 * i }')
PHI4_MINI='{"architectures":["Phi3ForCausalLM"],"model_type":"phi3","hidden_size":3072,
"intermediate_size":8192,"num_hidden_layers":4,"num_attention_heads":24,"num_key_value_heads":8,
"vocab_size":200064,"max_position_embeddings":131072,"original_max_position_embeddings":4096,
"partial_rotary_factor":0.75,"rms_norm_eps":1e-05,"rope_theta":10000.0,
"tie_word_embeddings":true,"rope_scaling":{"type":"longrope","short_factor":['"$PHI4_MINI_SF"'],
"long_factor":['"$PHI4_MINI_SF"']}}'
run_check 3e-layers-phi4-mini-bf16 60 "$BATON" debug layers --load-format dummy \
    --config "$PHI4_MINI" --dtype bf16 --tol 1.5e-2

# 3f. Mistral-7B-v0.1 widths with 4 layers and a 32-key sliding window: layers as in 3 over a
# 100-token prompt, a 20-token chunk after it and decodes (prefill chunks and decode partitions
# start at the window's first key; never run on a GPU, the emulator passes 530-token prompts in
# f32 at 1e-4).
MISTRAL_7B='{"architectures":["MistralForCausalLM"],"model_type":"mistral","hidden_size":4096,
"intermediate_size":14336,"num_hidden_layers":4,"num_attention_heads":32,"num_key_value_heads":8,
"vocab_size":32000,"max_position_embeddings":32768,"rms_norm_eps":1e-05,"rope_theta":10000.0,
"sliding_window":32}'
MISTRAL_IDS=$(awk 'BEGIN { for (i = 0; i < 100; i++) printf "%s%d", (i ? "," : ""), (3 + 41 * i) % 32000 }')
run_check 3f-layers-mistral-sliding-bf16 90 "$BATON" debug layers --load-format dummy \
    --config "$MISTRAL_7B" --dtype bf16 --tol 1.5e-2 --prompt-ids "$MISTRAL_IDS"

# 3g. Gemma-3-1b widths with 4 layers (every second full: sliding_window_pattern 2) and a
# 32-key window: (1 + w) norms folded at upload, the output norms, GELU(tanh), the scaled
# embedding, local RoPE (never run on a GPU; the emulator passes it in f32 at 1e-4, bf16 at
# 1.5e-2).
GEMMA3_1B='{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","hidden_size":1152,
"intermediate_size":6912,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":1,
"head_dim":256,"vocab_size":262144,"max_position_embeddings":32768,"query_pre_attn_scalar":256,
"rope_theta":1000000,"rope_local_base_freq":10000,"sliding_window":32,"sliding_window_pattern":2,
"torch_dtype":"bfloat16"}'
run_check 3g-layers-gemma3-1b-bf16 90 "$BATON" debug layers --load-format dummy \
    --config "$GEMMA3_1B" --dtype bf16 --tol 1.5e-2 --prompt-ids "$MISTRAL_IDS"

# 3h. Qwen3-30B-A3B widths with 2 layers (128 experts, top 8, renormalized; q/k norms):
# kernels/moe.cu's routing, grouping and grouped GEMMs beside cuBLAS. Each sparse layer is
# compared a half at a time (its attention half, then its MLP block from the GPU's MLP input;
# tokens still routed apart are counted and left out): compared whole, layer 0 failed at
# 2.5e-2 on the H200 in session 35 because the dummy router magnifies the attention half's
# bf16 rounding (the emulator reproduces 2.1e-2 whole and 6.8e-3 a half at a time).
QWEN3_30B_A3B='{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
"hidden_size":2048,"intermediate_size":6144,"num_hidden_layers":2,"num_attention_heads":32,
"num_key_value_heads":4,"head_dim":128,"vocab_size":151936,"max_position_embeddings":40960,
"rope_theta":1000000.0,"num_experts":128,"num_experts_per_tok":8,"moe_intermediate_size":768,
"norm_topk_prob":true,"torch_dtype":"bfloat16"}'
run_check 3h-layers-qwen3-30b-a3b-bf16 90 "$BATON" debug layers --load-format dummy \
    --config "$QWEN3_30B_A3B" --dtype bf16 --tol 1.5e-2 --prompt-ids "$MISTRAL_IDS"

run_check 5c-bench-decode-1b-unfused 90 "$BATON" bench decode --device cuda --load-format dummy \
    --config "$LLAMA_1B" --batch 1 --prompt-len 128 --gen-len 128 --dtype bf16 --no-fused-decode \
    --out "$OUT/bench-decode-1b-unfused.json"

# 5d. (diagnostic) the device's share of a step: 1B batch 1 and 32 with --device-time (timing
#     events from each step's upload to its fence); wall minus device is host time per step,
#     what pipelined launches could hide.
run_check 5d-bench-decode-1b-device-time 60 "$BATON" bench decode --device cuda \
    --load-format dummy --config "$LLAMA_1B" --batch 1,32 --prompt-len 128 --gen-len 64 \
    --dtype bf16 --device-time --in-flight 1 --out "$OUT/bench-decode-1b-device-time.json"

# 5e. (diagnostic) the sampler's cost: 1B batch 1 with sampled rows (temperature 0.8, top-p
#     0.95): the selection passes run over the whole 128256-token row in one block.
run_check 5e-bench-decode-1b-sampled 60 "$BATON" bench decode --device cuda \
    --load-format dummy --config "$LLAMA_1B" --batch 1 --prompt-len 128 --gen-len 64 \
    --dtype bf16 --temperature 0.8 --top-p 0.95 --device-time --in-flight 1 \
    --out "$OUT/bench-decode-1b-sampled.json"

# 5f. one launch in flight (each step waited for before the next is staged): what the
#     pipelining of 5a/5b gains, at batch 1 where the host's share weighs most.
run_check 5f-bench-decode-in-flight-1 90 "$BATON" bench decode --device cuda \
    --load-format dummy --config "$LLAMA_1B" --batch 1 --prompt-len 128 --gen-len 128 \
    --dtype bf16 --in-flight 1 --out "$OUT/bench-decode-1b-in-flight-1.json"

# 5t. (diagnostic) the launch trace: kernels compiled with BATON_TRACE=1 record, per thread
#     block, %globaltimer around each PDL wait; per launch of a graph-replayed batch-1 step,
#     its share (its release to the next launch's release, overlap included), how early its
#     blocks were resident, and per wait site the sum (baton_cuda::trace). 1B, then 8B.
run_check 5t-launch-trace-1b 60 "$BATON" bench decode --device cuda --load-format dummy \
    --config "$LLAMA_1B" --batch 1 --prompt-len 128 --gen-len 64 --dtype bf16 --in-flight 1 \
    --launch-trace --out "$OUT/launch-trace-1b.json"
run_check 5t-launch-trace-8b 90 "$BATON" bench decode --device cuda --load-format dummy \
    --config "$LLAMA_8B" --batch 1 --prompt-len 128 --gen-len 64 --dtype bf16 --in-flight 1 \
    --launch-trace --out "$OUT/launch-trace-8b.json"

# 6. (diagnostic, when ncu is there and time is left) each kernel's own GPU time in eager
#    batch-1 decode steps of dummy 1B, from Nsight Compute: the --breakdown figures above
#    include each launch's host-side cost.
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)"
if [[ -n "$NCU" ]]; then
    run_check 6-ncu-kernel-times-1b 60 "$NCU" --clock-control none --metrics gpu__time_duration.sum \
        --kernel-name regex:baton_ --launch-skip 400 --launch-count 100 --csv \
        "$BATON" bench decode --device cuda --load-format dummy --config "$LLAMA_1B" --batch 1 \
        --prompt-len 128 --gen-len 16 --dtype bf16 --enforce-eager
fi

if [[ -n "$NCU" ]]; then
    run_check 6b-ncu-kernel-times-8b-warm 90 bash -c "'$NCU' --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --kernel-name regex:baton_ \
        --launch-skip 500 --launch-count 170 --csv '$BATON' bench decode --device cuda \
        --load-format dummy --config '$LLAMA_8B' --batch 1 --prompt-len 128 --gen-len 8 \
        --dtype bf16 --enforce-eager > '$OUT/ncu-8b-warm.csv'"
fi

# 6c. (diagnostic) what the batch-of-one GEMVs' warps stall on: Nsight Compute's warp-state
#     and source-counter sections for the qkv, o and down GEMVs (baton_gemv_t1) of one warm
#     8B layer; the stall table and the hottest SASS lines land in the log.
if [[ -n "$NCU" ]]; then
    run_check 6c-ncu-gemv-stalls-8b 90 "$NCU" --cache-control none --clock-control none \
        --section WarpStateStats --section SourceCounters --kernel-name baton_gemv_t1 \
        --launch-skip 300 --launch-count 3 "$BATON" bench decode --device cuda \
        --load-format dummy --config "$LLAMA_8B" --batch 1 --prompt-len 128 --gen-len 8 \
        --dtype bf16 --enforce-eager
fi

echo
echo "== summary"
failed=0
for r in "${results[@]}"; do
    echo "$r"
    [[ $r == FAIL* ]] && failed=$((failed + 1))
done
echo "== decode benchmark (ms per step vs HBM floor)"
grep -h -A6 '^decode on' "$OUT/5a-bench-decode-1b.log" "$OUT/5c-bench-decode-1b-unfused.log" \
    "$OUT/5b-bench-decode-8b.log" "$OUT/5d-bench-decode-1b-device-time.log" \
    "$OUT/5e-bench-decode-1b-sampled.log" "$OUT/5f-bench-decode-in-flight-1.log" 2>/dev/null
echo "== launch traces (per wait site; the JSON in the tarball has every launch)"
for f in "$OUT/5t-launch-trace-1b.log" "$OUT/5t-launch-trace-8b.log"; do
    [[ -f $f ]] && sed -n '/launch trace over/,/^ *# /p' "$f"
done
printf '%s\n' "${results[@]}" >"$RESULTS/summary.txt"
tar czf "$RESULTS/gpu-check.tgz" -C "$OUT" . && echo "logs and JSON: $RESULTS/gpu-check.tgz"
exit $((failed > 0))
