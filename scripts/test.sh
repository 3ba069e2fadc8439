#!/usr/bin/env bash
# The test suite: lint, then pytest (CPU only; tiny models built from configs). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" -m ruff check src tests bench examples scripts
"$PY" -m pytest tests "$@"
