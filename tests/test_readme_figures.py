"""README.md's figures are what scripts/readme_figures.py renders from the committed benchmark JSON, and the check
that says so fails when a figure is typed by hand, a JSON changes without re-rendering, or the mapping
(docs/bench/figures.json) contradicts what a JSON records."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
figures = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(figures)


def mapping(root: Path = ROOT) -> dict:
    return json.loads((root / figures.MAPPING).read_text())


def sources(root: Path = ROOT) -> list[dict]:
    return [entry for block in mapping(root)["blocks"].values() for entry in block["sources"].values()]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of what the renderer reads: README.md, the mapping and every JSON it names."""
    for relative in {"README.md", figures.MAPPING, *(entry["json"] for entry in sources())}:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, tmp_path / relative)
    return tmp_path


def edit_json(root: Path, relative: str, change) -> None:
    data = json.loads((root / relative).read_text())
    change(data)
    (root / relative).write_text(json.dumps(data))


def test_the_committed_readme_is_the_rendering_of_the_committed_json(capsys):
    assert figures.main(["--check"]) == 0, capsys.readouterr().out


def test_a_changed_json_value_changes_the_readme_and_fails_the_check_until_rendered(repo, capsys):
    edit_json(repo, "docs/bench/w2_rollout_latest.json", lambda d: d["engine"]["B64"].update(tok_s=12345))
    edit_json(repo, "docs/demo_metrics.json", lambda d: d["accuracy_after"].update(accuracy=0.81))
    before = (repo / "README.md").read_text()
    assert figures.main(["--check", "--root", str(repo)]) == 1
    diff = capsys.readouterr().out
    assert "+| 64 | 565 | 384 | 12,345 |" in diff and "-| 64 | 565 | 384 | 20,482 |" in diff
    assert (repo / "README.md").read_text() == before  # --check writes nothing

    assert figures.main(["--root", str(repo)]) == 0
    after = (repo / "README.md").read_text()
    assert "12,345" in after and "from 43% to 81%" in after
    assert figures.main(["--check", "--root", str(repo)]) == 0


def test_a_figure_typed_into_a_block_by_hand_fails_the_check(repo, capsys):
    readme = (repo / "README.md").read_text()
    (repo / "README.md").write_text(readme.replace("| 1,097 | 40,513 |", "| 1,097 | 41,000 |"))
    assert figures.main(["--check", "--root", str(repo)]) == 1
    assert "+| 256 | 1,980 | 1,097 | 40,513 |" in capsys.readouterr().out


def test_text_outside_the_blocks_is_left_as_it_is(repo):
    readme = (repo / "README.md").read_text().replace("## Layout", "## Layout of the code")
    (repo / "README.md").write_text(readme)
    assert figures.main(["--root", str(repo)]) == 0
    assert (repo / "README.md").read_text() == readme


def test_every_table_says_its_machine_commit_and_kernel_mode():
    rendered = figures.render_blocks(ROOT)
    commits = {entry["commit"] for entry in sources()}
    for name, text in rendered.items():
        tables_with_columns = "| machine | commit | kernels |" in text
        assert tables_with_columns or "_Measured on " in text, name
    every = "\n".join(rendered.values())
    assert all(commit in every for commit in commits)
    assert all(label in every for label in {mapping()["kernel_modes"][entry["kernels"]] for entry in sources()})


def test_each_commit_in_the_mapping_exists():
    for entry in sources():
        found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", entry["commit"] + "^{commit}"], cwd=ROOT,
                               capture_output=True)  # fmt: skip
        assert found.returncode == 0, f"{entry['json']}: commit {entry['commit']} is not in this repository"


def test_a_kernel_mode_the_json_contradicts_is_refused(repo, capsys):
    data = mapping(repo)
    data["blocks"]["status"]["sources"]["rloo"]["kernels"] = "non-deterministic"  # w3_rloo.json recorded True
    (repo / figures.MAPPING).write_text(json.dumps(data))
    assert figures.main(["--check", "--root", str(repo)]) == 2
    assert "records deterministic engine kernels" in capsys.readouterr().err


def test_a_machine_the_json_contradicts_is_refused(repo, capsys):
    data = mapping(repo)
    data["blocks"]["w2"]["sources"]["latest"]["machine"] = "H200"
    (repo / figures.MAPPING).write_text(json.dumps(data))
    assert figures.main(["--root", str(repo)]) == 2
    assert "ran on 'NVIDIA H100 80GB HBM3'" in capsys.readouterr().err


def test_fields_are_read_only_when_declared_and_declared_only_when_read(repo, capsys):
    data = mapping(repo)
    data["blocks"]["w2"]["sources"]["latest"]["fields"].append("copy_bandwidth_GBps")
    (repo / figures.MAPPING).write_text(json.dumps(data))
    assert figures.main(["--root", str(repo)]) == 2
    assert "lists fields no figure reads" in capsys.readouterr().err

    entry = {"json": "docs/demo_metrics.json", "commit": "5dae78d", "machine": "CPU", "kernels": "cpu-generate",
             "fields": ["settings.{steps,seed}"]}  # fmt: skip
    source = figures.Source("demo", entry, ROOT, mapping()["kernel_modes"])
    assert source.get("settings.seed") == 0
    with pytest.raises(figures.FiguresError, match="not listed in docs/bench/figures.json"):
        source.get("total_seconds")


def test_a_block_without_its_markers_names_the_fix(repo, capsys):
    readme = (repo / "README.md").read_text().replace("<!-- /figures:w1 -->", "")
    (repo / "README.md").write_text(readme)
    assert figures.main(["--check", "--root", str(repo)]) == 2
    assert "needs one `<!-- /figures:NAME -->`" in capsys.readouterr().err


def test_prose_is_wrapped_without_starting_a_markdown_list():
    text = "word " * 24 + "-26% and more words"
    wrapped = figures.wrap(text, width=120)
    assert all(len(line) <= 120 for line in wrapped.splitlines())
    assert not any(line.startswith("-") for line in wrapped.splitlines())
    assert wrapped.replace("\n", " ") == text
