"""PatchFastRL / unpatch: point trl's public trainer names at slimrl's subclasses, and back.

Only names are rebound; TRL's source is never edited. After `PatchFastRL("grpo")`, `from trl import GRPOTrainer`
gives `slimrl.GRPOTrainer`. The original classes are kept and `unpatch()` restores them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from dataclasses import dataclass

from slimrl.trainers.common.trl_originals import ABSENT, ORIGINALS

TESTED_TRL = ("1.16.0", "1.17.0")  # [lowest tested, first untested)


@dataclass(frozen=True)
class _Binding:
    """One trl name that slimrl replaces, and where slimrl's replacement lives."""

    name: str  # e.g. "GRPOTrainer"
    trl_modules: tuple[str, ...]  # every trl module that exposes the name
    slimrl_module: str


def _trl_pair(key: str, trainer: str, config: str) -> tuple[_Binding, ...]:
    """A trainer and its config exposed by `trl`, `trl.trainer` and their own modules (trl/trainer/<key>_*.py)."""
    where = ("trl", "trl.trainer")
    module = f"slimrl.trainers.{key}.trainer"
    return (
        _Binding(trainer, (*where, f"trl.trainer.{key}_trainer"), module),
        _Binding(config, (*where, f"trl.trainer.{key}_config"), module),
    )


def _experimental_pair(key: str, trainer: str, config: str) -> tuple[_Binding, ...]:
    """A trainer and its config under trl.experimental.<key> (ORPO, CPO, online DPO in TRL 1.16)."""
    package = f"trl.experimental.{key}"
    module = f"slimrl.trainers.{key}.trainer"
    return (
        _Binding(trainer, (package, f"{package}.{key}_trainer"), module),
        _Binding(config, (package, f"{package}.{key}_config"), module),
    )


def _slimrl_own(key: str, trainer: str, config: str) -> tuple[_Binding, ...]:
    """A trainer TRL 1.16 does not ship, added to `trl` and `trl.trainer` where TRL's older versions had it."""
    module = f"slimrl.trainers.{key}.trainer"
    return (_Binding(trainer, ("trl", "trl.trainer"), module), _Binding(config, ("trl", "trl.trainer"), module))


_ALGORITHMS: dict[str, tuple[_Binding, ...]] = {
    "grpo": (
        _Binding("GRPOTrainer", ("trl", "trl.trainer", "trl.trainer.grpo_trainer"), "slimrl.trainers.grpo.trainer"),
        _Binding("GRPOConfig", ("trl", "trl.trainer", "trl.trainer.grpo_config"), "slimrl.trainers.grpo.config"),
    ),
    "rloo": _trl_pair("rloo", "RLOOTrainer", "RLOOConfig"),
    "sft": _trl_pair("sft", "SFTTrainer", "SFTConfig"),
    "dpo": _trl_pair("dpo", "DPOTrainer", "DPOConfig"),
    "kto": _trl_pair("kto", "KTOTrainer", "KTOConfig"),
    "reward": _trl_pair("reward", "RewardTrainer", "RewardConfig"),
    "orpo": _experimental_pair("orpo", "ORPOTrainer", "ORPOConfig"),
    "cpo": _experimental_pair("cpo", "CPOTrainer", "CPOConfig"),
    "online_dpo": _experimental_pair("online_dpo", "OnlineDPOTrainer", "OnlineDPOConfig"),
    "distillation": _trl_pair("distillation", "DistillationTrainer", "DistillationConfig"),
    # TRL 1.16 has no PPO, BCO, PRM or XPO: patching adds trl.<X>Trainer / trl.<X>Config (slimrl's own) to `trl` and
    # `trl.trainer`, unpatch removes them
    "ppo": _slimrl_own("ppo", "PPOTrainer", "PPOConfig"),
    "bco": _slimrl_own("bco", "BCOTrainer", "BCOConfig"),
    "prm": _slimrl_own("prm", "PRMTrainer", "PRMConfig"),
    "xpo": _slimrl_own("xpo", "XPOTrainer", "XPOConfig"),
}
_ALL = "all"  # PatchFastRL("all") is PatchFastRL(None)

_warned_early_imports: set[str] = set()


def supported_algorithms() -> list[str]:
    return sorted(_ALGORITHMS)


def check_trl_version() -> None:
    """Fail loudly when trl is outside the range slimrl's overrides were tested against."""
    import trl
    from packaging.version import Version

    if os.environ.get("SLIMRL_SKIP_TRL_VERSION_CHECK") == "1":
        return
    version = Version(trl.__version__)
    low, high = (Version(v) for v in TESTED_TRL)
    if not (low <= version < high):
        raise ImportError(
            f"slimrl was tested with trl >= {TESTED_TRL[0]}, < {TESTED_TRL[1]}, but trl {trl.__version__} is "
            f"installed. Install a tested version (pip install 'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}'), or set "
            "SLIMRL_SKIP_TRL_VERSION_CHECK=1 to try anyway at your own risk."
        )


def PatchFastRL(algorithm: str | None = None, FastLanguageModel=None) -> None:  # noqa: N802, N803 (Unsloth's API)
    """Make trl's trainer names resolve to slimrl's fast subclasses.

    Args:
        algorithm: one trainer to patch ("grpo", "rloo", "ppo", "sft", "dpo", "kto", "orpo", "cpo", "online_dpo",
            "reward"; case-insensitive), or "all" / None for every trainer slimrl supports. TRL 1.16 has no PPO trainer:
            "ppo" adds `trl.PPOTrainer` / `trl.PPOConfig` (slimrl's own), and unpatch() removes them again.
        FastLanguageModel: accepted for compatibility with Unsloth's signature; slimrl's trainers switch the model
            between inference and training themselves.
    """
    check_trl_version()
    bindings = _bindings_for(algorithm)
    # every slimrl class first, then the rebinding: a slimrl module imported while trl's names are half rebound would
    # build its class on slimrl's subclass of another trainer (BCO is KTO's)
    replacements = [getattr(importlib.import_module(binding.slimrl_module), binding.name) for binding in bindings]
    for binding, replacement in zip(bindings, replacements, strict=True):
        _warn_if_imported_early(binding, inspect.currentframe().f_back)
        for module_name in binding.trl_modules:
            module = importlib.import_module(module_name)
            key = (module_name, binding.name)
            if key not in ORIGINALS:
                ORIGINALS[key] = getattr(module, binding.name, ABSENT)
            setattr(module, binding.name, replacement)


def unpatch(algorithm: str | None = None) -> None:
    """Restore TRL's original classes for `algorithm` (all when None). Harmless when nothing is patched."""
    for binding in _bindings_for(algorithm):
        for module_name in binding.trl_modules:
            original = ORIGINALS.pop((module_name, binding.name), None)
            if original is ABSENT:
                delattr(sys.modules[module_name], binding.name)
            elif original is not None:
                setattr(sys.modules[module_name], binding.name, original)


def is_patched(algorithm: str) -> bool:
    return all((m, b.name) in ORIGINALS for b in _bindings_for(algorithm) for m in b.trl_modules)


def _bindings_for(algorithm: str | None) -> list[_Binding]:
    if algorithm is None or str(algorithm).strip().lower() == _ALL:
        return [binding for bindings in _ALGORITHMS.values() for binding in bindings]
    key = str(algorithm).strip().lower()
    if key not in _ALGORITHMS:
        raise ValueError(
            f"PatchFastRL does not know the algorithm {algorithm!r}. Supported: {', '.join(supported_algorithms())} "
            "(or 'all' / None for all of them)."
        )
    return list(_ALGORITHMS[key])


def _warn_if_imported_early(binding: _Binding, caller_frame) -> None:
    """Warn once when the caller (its locals or module) or __main__ already holds TRL's original class."""
    if binding.name in _warned_early_imports or any((m, binding.name) in ORIGINALS for m in binding.trl_modules):
        return
    defining = sys.modules.get(binding.trl_modules[-1])
    original = getattr(defining, binding.name, None) if defining is not None else None
    if original is None:
        return
    namespaces = [getattr(sys.modules.get("__main__"), "__dict__", {})]
    if caller_frame is not None:
        namespaces += [caller_frame.f_globals, caller_frame.f_locals]
    holders = sorted({var for ns in namespaces for var, value in list(ns.items()) if value is original})
    if holders:
        _warned_early_imports.add(binding.name)
        warnings.warn(
            f"{binding.name} was imported from trl before PatchFastRL; the name(s) {', '.join(holders)} bound then "
            f"still point to TRL's original class. Call PatchFastRL before `from trl import {binding.name}`, or "
            f"import it again afterwards (or use slimrl.{binding.name} directly).",
            UserWarning,
            stacklevel=3,
        )
