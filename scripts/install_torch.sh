#!/usr/bin/env bash
# Install torch into a Python that cannot import one (scripts/env.sh runs this for ./.venv).
#
#   bash scripts/install_torch.sh PYTHON [REQUIREMENT] [--dry-run]
#
# REQUIREMENT: what pip should install, `torch` (the newest, as scripts/test_newest.sh asks) unless given (env.sh
# gives the pinned version). --dry-run prints the pip commands it would run, one a line ("try:" first, then "else:"
# where there is a fallback), and runs none.
#
# Which build:
# - an NVIDIA GPU (nvidia-smi on PATH): torch from the default index, which on Linux is PyPI's CUDA build;
# - otherwise the CPU build from PyTorch's CPU wheel index, as pytorch.org documents (a bare PyPI torch on Linux would
#   pull GBs of CUDA libraries a CPU never uses). One try with a short timeout and no retries, so an index that can't
#   be reached fails in seconds; then, where it failed (a machine that reaches only a PyPI mirror, as this project's
#   do), the same requirement from the default index. pip's own configuration (extra indexes, find-links,
#   constraints) applies to both tries: `--index-url` only replaces the default index.
# SLIMRL_TORCH_CPU_INDEX replaces the CPU index's address.
set -euo pipefail

PY="" REQUIREMENT="torch" DRY_RUN=0
positional=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -*) echo "install_torch.sh: unknown option $arg; usage: install_torch.sh PYTHON [REQUIREMENT] [--dry-run]" >&2
        exit 2 ;;
    *) positional=$((positional + 1))
       if [ "$positional" -eq 1 ]; then PY="$arg"; else REQUIREMENT="$arg"; fi ;;
  esac
done
if [ -z "$PY" ] || [ "$positional" -gt 2 ]; then
  echo "usage: install_torch.sh PYTHON [REQUIREMENT] [--dry-run] (PYTHON: the interpreter to install into)" >&2
  exit 2
fi
CPU_INDEX="${SLIMRL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
# --no-compile: torch's modules are byte-compiled at their first import (scripts/env.sh says why)
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-compile)
# 5 s a connection or read: a dead or blackholed index fails fast, a working one stalls for less between packets
CPU_TRY=("${PIP[@]}" --index-url "$CPU_INDEX" --timeout 5 --retries 0 "$REQUIREMENT")
DEFAULT=("${PIP[@]}" "$REQUIREMENT")

if "$PY" -c "import torch" 2>/dev/null; then
  echo "install_torch.sh: $PY already imports torch; nothing to install." >&2
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  if [ "$DRY_RUN" = 1 ]; then echo "try: ${DEFAULT[*]}"; exit 0; fi
  "${DEFAULT[@]}"
  exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "try: ${CPU_TRY[*]}"
  echo "else: ${DEFAULT[*]}"
  exit 0
fi
if ! "${CPU_TRY[@]}"; then
  echo "install_torch.sh: PyTorch's CPU index ($CPU_INDEX) failed (above); installing $REQUIREMENT from the" \
       "default index instead." >&2
  "${DEFAULT[@]}"
fi
