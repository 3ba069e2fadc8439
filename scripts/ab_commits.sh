#!/usr/bin/env bash
# Two versions of slimrl side by side on one GPU, in one call: W1 GRPO at L=4096 (loss, peak, seconds), W4 DPO at
# 4096 (loss, peak, seconds) and W2 rollout at batch 64 (tokens/s), slimrl's side only, each version in turn; then a
# table of both. Issue 32's check that a restructure changed no figure beyond noise.
#   bash scripts/ab_commits.sh OUT_DIR OLD_TREE NEW_TREE
# A tree is a directory holding a version's src/ and bench/, made here (no git history reaches the GPU machine) by
#   mkdir -p .ab/OLD && git archive OLD src bench | tar -x -C .ab/OLD
# and carried (.ab is git-excluded). trl, datasets and the rest come from $GPU_CHECK_SITE (default /tmp/site), as
# scripts/gpu_check.sh installs them from .whl/.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$1"
shift
SITE="${GPU_CHECK_SITE:-/tmp/site}"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null && [ ! -d "$SITE/trl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$ROOT"/.whl/*.whl
fi
mkdir -p "$OUT"
status=0
for tree in "$@"; do
  tree=$(cd "$tree" && pwd)  # absolute: each benchmark runs from inside the tree
  name=$(basename "$tree")
  dir="$OUT/$name"
  mkdir -p "$dir"
  run() {  # label, command...: one benchmark of this tree, its log kept
    local label=$1
    shift
    (cd "$tree" && PYTHONPATH="$SITE:$tree/src" HF_HUB_OFFLINE=1 "$@") >"$dir/$label.log" 2>&1 || {
      echo "ab_commits: $name $label failed (see $dir/$label.log)"
      status=1
    }
  }
  run w1 python3 bench/grpo_memory.py 4096 --trainers slimrl --out "$dir"
  run w4 python3 bench/preference_memory.py "$dir/preference_memory.json" --algorithm dpo --lengths 4096 --sides slimrl
  run w2 python3 bench/rollout.py "$dir/rollout.json" --batches 64 \
    --skip roofline variants reuse prefill unfused greedy profile hf cb fp32
done
python3 "$ROOT/scripts/ab_table.py" "$OUT" "$@" | tee "$OUT/table.txt"
exit $status
