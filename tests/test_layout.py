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


# The packages from the bottom up (DESIGN.md): each may import only its own layer and those below it, at module level
# or inside a function alike; the package root (patching, the demo, the CLI, testing helpers) sits above them all.
LAYERS = ["ops", "models", "rollout", "distributed", "trainers"]


def slimrl_imports(tree: ast.AST):
    """(line, module) for every absolute import of a slimrl module in `tree`, `from slimrl import x` as slimrl.x."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names if alias.name.startswith("slimrl."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "slimrl":
                yield from ((node.lineno, f"slimrl.{alias.name}") for alias in node.names)
            elif node.module.startswith("slimrl."):
                yield node.lineno, node.module


def upward_imports(path: Path, root: Path = SRC) -> list[str]:
    layer = path.relative_to(root).parts[0]
    if layer not in LAYERS:
        return []
    found = []
    for line, module in sorted(slimrl_imports(ast.parse(path.read_text()))):
        if module == "slimrl.__version__":
            continue  # a constant the root defines before its (lazy) imports: reading it loads no higher layer
        target = module.split(".")[1]
        if target not in LAYERS or LAYERS.index(target) > LAYERS.index(layer):
            found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


def test_no_package_imports_from_a_higher_layer():
    found = [hit for path in python_files(SRC) for hit in upward_imports(path)]
    assert not found, "imports against the layering (ops < models < rollout < distributed < trainers):\n" + "\n".join(
        found
    )


def test_the_layering_check_sees_function_level_and_root_imports(tmp_path):
    # the two forms upward imports took before: inside a function (models/saving.py -> trainers/finite.py) and from
    # the package root; a same-layer and a lower-layer import pass
    (tmp_path / "models").mkdir()
    module = tmp_path / "models" / "example.py"
    module.write_text("from slimrl.ops.fused import x\nfrom slimrl.models import lora\n\n\ndef f():\n"
                      "    from slimrl.trainers.finite import NonFiniteError\n\n\nfrom slimrl import testing\n")
    assert upward_imports(module, root=tmp_path) == ["models/example.py:6 imports slimrl.trainers.finite",
                                                     "models/example.py:9 imports slimrl.testing"]


# Inside trainers/: common/ (the chunked step and what every family shares) < rollouts/ (trainer <-> engine glue) < one
# folder per algorithm, which imports only the two below it and itself, never another algorithm's folder.
TRAINER_SUBLAYERS = ["common", "rollouts"]
# The one declared exception: an algorithm that IS another one plus a term, as in TRL (XPO: online DPO with an
# exploration term against the reference) subclasses its trainer and may import that folder.
SUBCLASS_OF = {"xpo": "online_dpo"}


def cross_trainer_imports(path: Path, root: Path = SRC) -> list[str]:
    parts = path.relative_to(root).parts
    if parts[0] != "trainers" or len(parts) < 3:
        return []
    own = parts[1]
    found = []
    for line, module in sorted(slimrl_imports(ast.parse(path.read_text()))):
        names = module.split(".")
        if names[1] != "trainers" or len(names) < 3 or names[2] == own:
            continue
        target = names[2]
        allowed = TRAINER_SUBLAYERS[: TRAINER_SUBLAYERS.index(own)] if own in TRAINER_SUBLAYERS else TRAINER_SUBLAYERS
        if target not in allowed and SUBCLASS_OF.get(own) != target:
            found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


def test_trainer_folders_import_only_the_shared_folders_below_them():
    found = [hit for path in python_files(SRC / "trainers") for hit in cross_trainer_imports(path)]
    assert not found, "imports across trainer folders (common < rollouts < each algorithm):\n" + "\n".join(found)


def test_the_trainer_folder_check_sees_one_algorithm_importing_another(tmp_path):
    for folder in ("rloo", "common"):
        (tmp_path / "trainers" / folder).mkdir(parents=True)
    rloo = tmp_path / "trainers" / "rloo" / "trainer.py"
    rloo.write_text("from slimrl.trainers.grpo.inputs import is_multimodal\nfrom slimrl.trainers.common import base\n"
                    "from slimrl.trainers.rloo.config import RLOOConfig\n")
    common = tmp_path / "trainers" / "common" / "base.py"
    common.write_text("def f():\n    from slimrl.trainers.rollouts.generation import local_engine\n")
    expected = ["trainers/rloo/trainer.py:1 imports slimrl.trainers.grpo.inputs"]
    assert cross_trainer_imports(rloo, root=tmp_path) == expected
    assert cross_trainer_imports(common, root=tmp_path) == [
        "trainers/common/base.py:2 imports slimrl.trainers.rollouts.generation"
    ]


def module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """slimrl module -> the slimrl modules it imports (module level, function level and type-only imports alike)."""
    def name(path: Path) -> str:
        parts = path.relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(path): path for path in python_files(root)}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from slimrl.a import b` imports module slimrl.a, and module slimrl.a.b when b is one
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds an import cycle), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_between_slimrl_modules():
    assert import_cycles(module_graph()) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "slimrl" / "models"
    package.mkdir(parents=True)
    (package / "saving.py").write_text("def f():\n    from slimrl.models.gguf_export import save\n")
    (package / "gguf_export.py").write_text("from slimrl.models.saving import merged_state_dict\n")
    (package / "lora.py").write_text("from slimrl.models import saving\n")
    graph = module_graph(tmp_path / "slimrl")
    assert graph["slimrl.models.lora"] == {"slimrl.models.saving"}
    assert import_cycles(graph) == [["slimrl.models.gguf_export", "slimrl.models.saving"]]
