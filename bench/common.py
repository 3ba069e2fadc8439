"""Helpers shared by the benchmark scripts: offline settings, the environment record, a JSON report that is rewritten
as results arrive (a run cut off by a time limit keeps what it measured), summary statistics and markdown tables.

Scripts import it as `from common import ...` after putting this folder on sys.path (a script run as
`python bench/x.py` has it there already; a test that loads a script by path does not).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")  # there is no hub on the GPU machine: fail fast instead of retrying
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def environment(cuda: bool) -> dict:
    """The GPU's name (or "cpu") and the versions of everything the numbers depend on."""
    import peft
    import torch
    import transformers

    import slimrl

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                "peft": peft.__version__, "slimrl": slimrl.__version__, "python": sys.version.split()[0]}  # fmt: skip
    for name in ("trl", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions}


def write_json(path: str | Path, data) -> None:
    """Write `data` as JSON through a temporary file and a rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


class Report(dict):
    """A benchmark's JSON report: a dict with a `problems` list, saved to `path` by `save()`.

    `recording_failure()` turns an exception into a saved traceback (`error`) and a problem, so the script can exit
    non-zero with what it measured so far on disk."""

    def __init__(self, path: str | Path, **fields):
        super().__init__(**fields)
        self.path = Path(path)
        self.setdefault("problems", [])

    def save(self) -> None:
        write_json(self.path, self)

    @contextlib.contextmanager
    def recording_failure(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # noqa: BLE001 - recorded in the report; the exit status says it failed
            traceback.print_exc()
            self["error"] = traceback.format_exc()
            self["problems"].append(f"raised {type(error).__name__}: {error}".splitlines()[0])
        finally:
            self.save()

    def exit_status(self) -> int:
        return 1 if self["problems"] else 0


def finite(values: Iterable) -> list[float]:
    """The numeric, finite entries of `values`."""
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def mean(values: Iterable) -> float | None:
    kept = finite(values)
    return sum(kept) / len(kept) if kept else None


def quantile(values: Iterable, q: float) -> float | None:
    """The q-quantile (0..1) of the finite values, interpolating linearly between neighbours (numpy's default)."""
    kept = sorted(finite(values))
    if not kept:
        return None
    position = q * (len(kept) - 1)
    low = math.floor(position)
    high = min(low + 1, len(kept) - 1)
    return kept[low] + (kept[high] - kept[low]) * (position - low)


def median(values: Iterable) -> float | None:
    return quantile(values, 0.5)


def rounded(value, digits: int = 4):
    """`value` with every float in it rounded (dicts and lists recursively)."""
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def markdown_table(header: list[str], rows: Iterable[Iterable]) -> str:
    """A GitHub markdown table; None prints as a dash."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join("-" if cell is None else str(cell) for cell in row) + " |")
    return "\n".join(lines)


def default_output(name: str) -> str:
    """`$OUT/name` where the GPU machine sets $OUT, else `./name`."""
    return os.path.join(os.environ.get("OUT", "."), name)
