"""scripts/install_torch.sh picks the torch build for the machine (CPU index first, then the default one; plain PyPI
where nvidia-smi is) and scripts/env.sh re-installs only when pyproject.toml or a set-up script changes.

Nothing here installs anything: a stand-in `python` records the commands it is given and fails or succeeds as each
test asks, and PATH holds only the stand-ins (with or without an `nvidia-smi`).
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TORCH = ROOT / "scripts" / "install_torch.sh"
BASH = shutil.which("bash")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Exit codes come from the environment: IMPORT_RC for `-c import torch` (1: no torch), CPU_RC for a pip command naming
# an index (PyTorch's CPU index), DEFAULT_RC for any other command (pip on the default index).
STAND_IN_PYTHON = """#!/bin/sh
echo "$*" >> "$LOG"
case "$*" in
  "-c import torch") exit "${IMPORT_RC:-1}" ;;
  *--index-url*) exit "${CPU_RC:-0}" ;;
  *) exit "${DEFAULT_RC:-0}" ;;
esac
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path):
    """A bin folder with the stand-in python; `gpu=True` adds an nvidia-smi. Returns run(*args, gpu, **rcs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = executable(bin_dir / "python", STAND_IN_PYTHON)
    log = tmp_path / "calls.log"

    def run(*args: str, gpu: bool = False, **rcs: int):
        if gpu:
            executable(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 0\n")
        else:
            (bin_dir / "nvidia-smi").unlink(missing_ok=True)
        env = {"PATH": str(bin_dir), "LOG": str(log), **{key.upper(): str(rc) for key, rc in rcs.items()}}
        result = subprocess.run([BASH, str(INSTALL_TORCH), str(python), *args], env=env, capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return result, calls

    return run, str(python)


def test_dry_run_without_a_gpu_tries_the_cpu_index_fast_then_the_default_index(machine):
    run, python = machine
    result, calls = run("torch==2.13.0", "--dry-run")
    assert result.returncode == 0, result.stderr
    try_line, else_line = result.stdout.splitlines()
    assert try_line.startswith(f"try: {python} -m pip install") and try_line.endswith(" torch==2.13.0")
    options = try_line.split()
    assert options[options.index("--index-url") + 1] == CPU_INDEX
    assert options[options.index("--retries") + 1] == "0" and int(options[options.index("--timeout") + 1]) <= 10
    assert else_line.startswith(f"else: {python} -m pip install") and else_line.endswith(" torch==2.13.0")
    assert "--index-url" not in else_line
    assert calls == ["-c import torch"]  # a dry run asks whether torch imports, and installs nothing


def test_dry_run_with_nvidia_smi_installs_plain_pypi_torch(machine):
    run, python = machine
    result, _ = run("torch==2.13.0", "--dry-run", gpu=True)
    assert result.returncode == 0, result.stderr
    expected = f"try: {python} -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0"
    assert result.stdout.splitlines() == [expected]


def test_an_unreachable_cpu_index_falls_back_to_the_default_index(machine):
    run, _ = machine
    result, calls = run("torch==2.13.0", cpu_rc=1)
    assert result.returncode == 0, result.stderr
    assert len(calls) == 3 and CPU_INDEX in calls[1] and "--index-url" not in calls[2]
    assert calls[2].endswith("install -q --disable-pip-version-check --no-compile torch==2.13.0")
    assert "installing torch==2.13.0 from the default index" in result.stderr


def test_a_reachable_cpu_index_is_the_only_install(machine):
    run, _ = machine
    result, calls = run("torch==2.13.0")
    assert result.returncode == 0 and len(calls) == 2 and CPU_INDEX in calls[1], (calls, result.stderr)


def test_a_gpu_machine_never_asks_the_cpu_index_and_a_failed_install_fails_the_script(machine):
    run, _ = machine
    result, calls = run("torch==2.13.0", gpu=True, default_rc=3)
    assert result.returncode == 3 and len(calls) == 2 and "--index-url" not in calls[1]
    result, calls = run("torch==2.13.0", cpu_rc=1, default_rc=4)  # no GPU, both indexes fail
    assert result.returncode == 4 and len(calls) == 3


def test_a_python_that_imports_torch_installs_nothing_and_bad_arguments_say_the_usage(machine):
    run, _ = machine
    result, calls = run("torch==2.13.0", import_rc=0)
    assert result.returncode == 0 and calls == ["-c import torch"] and "nothing to install" in result.stderr
    result, _ = run("torch==2.13.0", "--dryrun")
    assert result.returncode == 2 and "unknown option --dryrun" in result.stderr and "usage:" in result.stderr


def test_env_sh_installs_once_and_again_when_pyproject_or_a_set_up_script_changes(tmp_path):
    """A copy of the repository's set-up files around a stand-in .venv: count the pip commands of each sourcing."""
    for name in ("pyproject.toml", "scripts/env.sh", "scripts/install_torch.sh"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    executable(tmp_path / ".venv" / "bin" / "python", STAND_IN_PYTHON)
    log = tmp_path / "calls.log"
    env = {"PATH": os.environ["PATH"], "LOG": str(log), "IMPORT_RC": "1"}

    def source_env() -> list[str]:
        result = subprocess.run([BASH, "-c", f"source {tmp_path}/scripts/env.sh"], env=env, capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0, result.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [call for call in calls if call.startswith("-m pip install")]

    first = source_env()
    assert any("torch==2.13.0" in call for call in first) and any("-e " in call for call in first)
    assert source_env() == []  # installed: nothing to do
    for name in ("pyproject.toml", "scripts/install_torch.sh", "scripts/env.sh"):
        with open(tmp_path / name, "a") as f:
            f.write("\n# changed\n")
        assert len(source_env()) == len(first), name
        assert source_env() == [], name
