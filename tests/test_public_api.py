"""The public import paths: what users write stays valid whatever moves inside the package (issue 32)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import slimrl

PUBLIC = [
    "FastLanguageModel", "PatchFastRL", "unpatch", "save_pretrained_gguf",
    "GRPOTrainer", "GRPOConfig", "RLOOTrainer", "RLOOConfig", "PPOTrainer", "PPOConfig", "OnlineDPOTrainer",
    "OnlineDPOConfig", "SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "KTOTrainer", "KTOConfig", "ORPOTrainer",
    "ORPOConfig", "CPOTrainer", "CPOConfig", "RewardTrainer", "RewardConfig", "DistillationTrainer",
    "DistillationConfig", "BCOTrainer", "BCOConfig", "PRMTrainer", "PRMConfig", "XPOTrainer", "XPOConfig",
    "NonFiniteError", "EngineOutputError", "RewardFunctionError",
]  # fmt: skip


def test_every_public_name_is_listed_and_resolves():
    assert sorted(slimrl.__all__) == sorted(["__version__", *PUBLIC])
    for name in PUBLIC:
        value = getattr(slimrl, name)
        assert value.__name__ == name, name


def test_trainers_and_configs_are_subclasses_of_trls_own():
    import trl

    for name in PUBLIC:
        if name.endswith(("Trainer", "Config")) and hasattr(trl, name):  # TRL 1.16 lacks PPO, BCO, PRM, XPO
            assert issubclass(getattr(slimrl, name), getattr(trl, name)), name


def test_the_command_and_the_demo_keep_their_paths():
    assert callable(importlib.import_module("slimrl.cli").main)
    assert callable(importlib.import_module("slimrl.cli.demo").run_demo)
    result = subprocess.run([sys.executable, "-m", "slimrl.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "demo" in result.stdout
