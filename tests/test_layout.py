"""The codebase's shape, as rules: small modules, functions that fit on a screen, the engine's internals private."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "slimrl"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def python_files(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files(SRC) if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


@pytest.mark.parametrize("folder", ["src", "bench"])
def test_no_function_is_over_60_lines(folder):
    long = {}
    for path in python_files(ROOT / folder):
        for node in functions(ast.parse(path.read_text())):
            # the body, from the def line to the last line (a decorator or docstring counts as code)
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long[f"{path.relative_to(ROOT)}:{node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_nothing_outside_the_rollout_package_reads_the_engines_private_attributes():
    rollout = SRC / "rollout"
    found = []
    for path in python_files(SRC, ROOT / "bench"):
        if rollout in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if "engine" in owner.lower():
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    assert not found, "the engine's private attributes read outside slimrl/rollout:\n" + "\n".join(found)
