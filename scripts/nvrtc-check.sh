#!/usr/bin/env bash
# Compiles every CUDA kernel in kernels/ to PTX for sm_90 with NVRTC, on a machine with no GPU and
# no CUDA toolkit, and fails if any kernel does not compile or misses an entry point.
#
# Usage: scripts/nvrtc-check.sh [extra cargo test args...]
#
# What it does:
#   1. Creates (once) a Python venv at $BATON_NVRTC_VENV (default ~/.cache/baton/nvrtc-venv) and
#      pip-installs the CUDA 13.0 PyPI wheels (idempotent; quiet):
#        nvidia-cuda-nvrtc==13.0.*   -> nvidia/cu13/lib/libnvrtc.so.13 (+ libnvrtc-builtins)
#        nvidia-cuda-runtime==13.0.* -> nvidia/cu13/include/cuda_bf16.h, cuda_fp16.h, vector_types.h, ...
#      (<nv/target>, which cuda_bf16.h includes under nvcc, is built into NVRTC.)
#   2. Exports LD_LIBRARY_PATH with the lib dir (cudarc dlopen()s plain sonames such as
#      "libnvrtc.so.13", so the loader path is all it needs) and BATON_CUDA_INCLUDE with the
#      include dir.
#   3. Runs BATON_REQUIRE_NVRTC=1 cargo test -p baton-cuda --test kernels_compile, so a missing
#      NVRTC is a failure here, not a skip.
#
# Environment: BATON_NVRTC_VENV (venv path), PYTHON (interpreter, default python3),
# CARGO_TARGET_DIR (respected as usual). Needs network access to PyPI on first run only.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BATON_NVRTC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/baton/nvrtc-venv}"
python="${PYTHON:-python3}"
wheels=("nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*")

if [[ ! -x "$venv/bin/python" ]]; then
    echo "nvrtc-check: creating venv at $venv" >&2
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
# pip is a no-op when the pinned wheels are already installed.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${wheels[@]}"

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
nvrtc_so="$(find "$site/nvidia" -name 'libnvrtc.so*' -not -name '*builtins*' -not -name '*.alt.*' | sort | head -n 1)"
bf16_h="$(find "$site/nvidia" -name 'cuda_bf16.h' | sort | head -n 1)"
if [[ -z "$nvrtc_so" || -z "$bf16_h" ]]; then
    echo "nvrtc-check: could not find libnvrtc.so* or cuda_bf16.h under $site/nvidia" >&2
    exit 1
fi
lib_dir="$(dirname "$nvrtc_so")"
include_dir="$(dirname "$bf16_h")"
echo "nvrtc-check: libnvrtc = $nvrtc_so" >&2
echo "nvrtc-check: include  = $include_dir" >&2

export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BATON_CUDA_INCLUDE="$include_dir"
export BATON_REQUIRE_NVRTC=1

cd "$repo_root"
exec cargo test -p baton-cuda --test kernels_compile "$@" -- --nocapture
