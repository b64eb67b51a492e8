#!/usr/bin/env bash
# Prepares a device run of scripts/gpu-check.sh, here (on a machine with the Rust toolchain):
#   - builds the release binary and strips a copy into .gpu/baton (a device run carries at
#     most 64 MiB, and the device machine has no Rust toolchain);
#   - copies the test model (BATON_TEST_MODEL, default ../shared/models/stories260K, about
#     1 MB) into .gpu/stories260K, because ../shared does not travel to the device machine.
# .gpu/ is ignored by git. Then, on the device: carry [".gpu"], run scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p baton
bin="${CARGO_TARGET_DIR:-target}/release/baton"
mkdir -p .gpu
rm -f .gpu/baton
if command -v objcopy >/dev/null; then
    objcopy --strip-debug "$bin" .gpu/baton
else
    cp "$bin" .gpu/baton && strip --strip-debug .gpu/baton
fi
model="${BATON_TEST_MODEL:-../shared/models/stories260K}"
[[ -f "$model/golden.json" ]] || { echo "error: no test model at $model" >&2; exit 1; }
rm -rf .gpu/stories260K
cp -r "$model" .gpu/stories260K
chmod -R u+w .gpu/stories260K
du -sh .gpu/baton .gpu/stories260K
echo "ready: carry [\".gpu\"] and run scripts/gpu-check.sh on the device machine"
