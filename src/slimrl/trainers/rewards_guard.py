"""Reward functions wrapped so that a bad one fails with its name and the fix, not deep inside TRL."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sequence

import torch


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something GRPO cannot use."""


def guard_reward_funcs(reward_funcs: Sequence, names: Sequence[str]) -> list:
    """Wrap plain Python reward functions; reward models (nn.Module) and async functions are left as they are."""
    guarded = []
    for func, name in zip(reward_funcs, names, strict=True):
        plain = callable(func) and not isinstance(func, torch.nn.Module) and not inspect.iscoroutinefunction(func)
        guarded.append(_guard(func, name) if plain and not getattr(func, "_slimrl_guarded", False) else func)
    return guarded


def _guard(func: Callable, name: str) -> Callable:
    @functools.wraps(func)
    def guarded(*args, **kwargs):
        try:
            rewards = func(*args, **kwargs)
        except Exception as error:
            raise RewardFunctionError(
                f"Reward function '{name}' raised {type(error).__name__}: {error}. It is called as "
                f"{name}(prompts=..., completions=..., completion_ids=..., **dataset_columns) and must return one "
                "float (or None, to abstain) per completion; fix the function or the dataset columns it reads."
            ) from error
        _check_rewards(name, rewards, kwargs.get("completions"))
        return rewards

    guarded._slimrl_guarded = True
    return guarded


def _check_rewards(name: str, rewards, completions) -> None:
    if isinstance(rewards, torch.Tensor):
        rewards = rewards.tolist()
    if not isinstance(rewards, (list, tuple)):
        raise RewardFunctionError(
            f"Reward function '{name}' returned {type(rewards).__name__}; it must return a list with one float (or "
            "None) per completion."
        )
    if completions is not None and len(rewards) != len(completions):
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(rewards)} rewards for {len(completions)} completions; return "
            "exactly one value per completion, in order."
        )
    for index, value in enumerate(rewards):
        if value is None:
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for completion {index}; "
                "rewards must be numbers, or None to abstain."
            )
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value} for completion {index}. A NaN or infinite reward would "
                "poison the advantages of the whole group; return None to abstain on a completion, or a finite number."
            )
