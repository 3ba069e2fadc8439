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
    "GRPOTrainer": "slimrl.trainers.grpo.trainer",
    "GRPOConfig": "slimrl.trainers.grpo.config",
    "RLOOTrainer": "slimrl.trainers.rloo.trainer",
    "RLOOConfig": "slimrl.trainers.rloo.trainer",
    "PPOTrainer": "slimrl.trainers.ppo.trainer",
    "PPOConfig": "slimrl.trainers.ppo.trainer",
    "SFTTrainer": "slimrl.trainers.sft.trainer",
    "SFTConfig": "slimrl.trainers.sft.trainer",
    "DPOTrainer": "slimrl.trainers.dpo.trainer",
    "DPOConfig": "slimrl.trainers.dpo.trainer",
    "KTOTrainer": "slimrl.trainers.kto.trainer",
    "KTOConfig": "slimrl.trainers.kto.trainer",
    "ORPOTrainer": "slimrl.trainers.orpo.trainer",
    "ORPOConfig": "slimrl.trainers.orpo.trainer",
    "CPOTrainer": "slimrl.trainers.cpo.trainer",
    "CPOConfig": "slimrl.trainers.cpo.trainer",
    "OnlineDPOTrainer": "slimrl.trainers.online_dpo.trainer",
    "OnlineDPOConfig": "slimrl.trainers.online_dpo.trainer",
    "RewardTrainer": "slimrl.trainers.reward.trainer",
    "RewardConfig": "slimrl.trainers.reward.trainer",
    "DistillationTrainer": "slimrl.trainers.distillation.trainer",
    "DistillationConfig": "slimrl.trainers.distillation.trainer",
    "BCOTrainer": "slimrl.trainers.bco.trainer",
    "BCOConfig": "slimrl.trainers.bco.trainer",
    "PRMTrainer": "slimrl.trainers.prm.trainer",
    "PRMConfig": "slimrl.trainers.prm.trainer",
    "XPOTrainer": "slimrl.trainers.xpo.trainer",
    "XPOConfig": "slimrl.trainers.xpo.trainer",
    "NonFiniteError": "slimrl.ops.finite",
    "EngineOutputError": "slimrl.rollout.engine",
    "RewardFunctionError": "slimrl.trainers.common.rewards_guard",
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
