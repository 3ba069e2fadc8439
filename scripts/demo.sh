#!/usr/bin/env bash
# The demo: GRPO teaches SmolLM2-135M-Instruct arithmetic (CPU or GPU). Extra arguments go to `slimrl demo`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$VENV/bin/slimrl" demo "$@"
