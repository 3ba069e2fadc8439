"""scripts/ab_table.py: the two versions' W1, W4 and W2 figures side by side, and a missing run said as such."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_table", ROOT / "scripts" / "ab_table.py")
ab_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_table)


def test_the_table_sets_each_versions_figures_side_by_side(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, loss, tok_s in ((old, 0.5, 900), (new, 0.5, 910)):
        folder.mkdir()
        w1 = {"results": {"slimrl_L4096": {"loss": loss, "grad_norm": 1.25, "peak_GiB": 4.8, "s": 1.5}}}
        (folder / "grpo_memory.json").write_text(json.dumps(w1))
        (folder / "rollout.json").write_text(json.dumps({"engine": {"B64": {"tok_s": tok_s, "s": 2.0}}}))
    (new / "preference_memory.json").write_text(json.dumps({"results": {"slimrl_L4096": "OOM"}}))
    lines = ab_table.table(tmp_path, [str(old), str(new)]).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert lines[0].split() == ["figure", "old", "new"]
    assert rows["w1.peak_GiB"] == ["4.8", "4.8"] and rows["w1.grad_norm"] == ["1.25", "1.25"]
    assert rows["w2.tok_s"] == ["900", "910"]
    assert rows["w4"] == ["missing", "OOM"]  # the old run wrote nothing; the new one's result says OOM
