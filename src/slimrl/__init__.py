"""slimrl: TRL's RL trainers with far less GPU memory and time. See README.md.

Names are resolved lazily so that `import slimrl` imports neither trl's trainers nor anything GPU-only.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "FastLanguageModel": "slimrl.models.loader",
    "PatchFastRL": "slimrl.patching",
    "unpatch": "slimrl.patching",
    "GRPOTrainer": "slimrl.trainers.grpo",
    "GRPOConfig": "slimrl.trainers.grpo_config",
    "RLOOTrainer": "slimrl.trainers.rloo",
    "RLOOConfig": "slimrl.trainers.rloo",
    "PPOTrainer": "slimrl.trainers.ppo",
    "PPOConfig": "slimrl.trainers.ppo",
    "SFTTrainer": "slimrl.trainers.sft",
    "SFTConfig": "slimrl.trainers.sft",
    "DPOTrainer": "slimrl.trainers.dpo",
    "DPOConfig": "slimrl.trainers.dpo",
    "KTOTrainer": "slimrl.trainers.kto",
    "KTOConfig": "slimrl.trainers.kto",
    "ORPOTrainer": "slimrl.trainers.orpo",
    "ORPOConfig": "slimrl.trainers.orpo",
    "CPOTrainer": "slimrl.trainers.cpo",
    "CPOConfig": "slimrl.trainers.cpo",
    "OnlineDPOTrainer": "slimrl.trainers.online_dpo",
    "OnlineDPOConfig": "slimrl.trainers.online_dpo",
    "RewardTrainer": "slimrl.trainers.reward",
    "RewardConfig": "slimrl.trainers.reward",
    "NonFiniteError": "slimrl.ops.finite",
    "EngineOutputError": "slimrl.rollout.engine",
    "RewardFunctionError": "slimrl.trainers.rewards_guard",
    "save_pretrained_gguf": "slimrl.models.gguf_export",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slimrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
