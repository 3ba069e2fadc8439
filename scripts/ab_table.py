"""The figures scripts/ab_commits.sh wrote for each version, side by side: python scripts/ab_table.py OUT TREE..."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(folder: Path) -> dict[str, float | str]:
    """name -> value of the W1, W4 and W2 figures a version's run wrote into `folder` ("missing" where a run wrote
    nothing)."""
    found: dict[str, float | str] = {}
    sources = {
        "w1": (folder / "grpo_memory.json", lambda r: r["results"].get("slimrl_L4096", {})),
        "w4": (folder / "preference_memory.json", lambda r: r["results"].get("slimrl_L4096", {})),
        "w2": (folder / "rollout.json", lambda r: r.get("engine", {}).get("B64", {})),
    }
    for label, (path, pick) in sources.items():
        if not path.exists():
            found[label] = "missing"
            continue
        result = pick(json.loads(path.read_text()))
        if not isinstance(result, dict):
            found[label] = str(result)
            continue
        for key in ("loss", "grad_norm", "peak_GiB", "s", "tok_s"):
            if key in result:
                found[f"{label}.{key}"] = result[key]
    return found


def table(out: Path, trees: list[str]) -> str:
    columns = [Path(tree).name for tree in trees]
    rows = [figures(out / name) for name in columns]
    names = sorted({key for row in rows for key in row})
    lines = ["figure " + " ".join(f"{c:>14}" for c in columns)]
    for key in names:
        lines.append(f"{key} " + " ".join(f"{str(row.get(key, '-')):>14}" for row in rows))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]), sys.argv[2:]))
