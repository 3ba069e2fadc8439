#!/usr/bin/env bash
# The test suite: lint, then pytest (CPU only; tiny models built from configs). Extra arguments go to pytest.
# One pytest worker per core (pytest-xdist; SLIMRL_TEST_WORKERS=0 runs in one process): each test process keeps torch
# to one thread (tests/conftest.py), so two workers fill the 2-core CI machine instead of spinning against each other.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" -m ruff check src tests bench examples scripts
"$PY" -m pytest -n "${SLIMRL_TEST_WORKERS:-2}" --dist worksteal tests "$@"
