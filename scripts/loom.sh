#!/usr/bin/env bash
# The loom models (DESIGN.md section 7): every tests/loom*.rs of baton-ipc (ring, doorbell,
# participant table) and baton-kv (fenced reclamation), built with `--cfg loom` in their own
# target directory so the normal build is not invalidated.
#
# Environment:
#   LOOM_MAX_PREEMPTIONS  preemption bound (each suite defaults to 3)
#   LOOM_TARGET_DIR       target directory for the loom build (default: $CARGO_TARGET_DIR/loom,
#                         or target/loom)
set -euo pipefail
cd "$(dirname "$0")/.."

export RUSTFLAGS="${RUSTFLAGS:-} --cfg loom"
export CARGO_TARGET_DIR="${LOOM_TARGET_DIR:-${CARGO_TARGET_DIR:-target}/loom}"

for krate in ipc kv; do
  found=0
  for f in crates/"$krate"/tests/loom*.rs; do
    [ -e "$f" ] || continue
    found=1
    name="$(basename "$f" .rs)"
    echo "--> baton-$krate --test $name"
    start=$SECONDS
    cargo test -p "baton-$krate" --release --test "$name"
    echo "    baton-$krate $name: $((SECONDS - start)) s"
  done
  if [ "$found" = 0 ]; then
    echo "--> baton-$krate: no tests/loom*.rs yet, skipped"
  fi
done
