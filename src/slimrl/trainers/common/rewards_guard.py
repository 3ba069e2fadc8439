"""TRL's reward semantics, with a clear error wherever TRL would fail deep inside or train on a silent NaN or inf.

What TRL 1.16 does with a reward function's output (GRPO, RLOO and online DPO share it): it replaces each `None` by
NaN and builds a float32 column with `torch.tensor`, so a list, tuple, NumPy array or tensor of numbers works, and so
do numpy scalars, bools and one-element tensors as its items. A NaN, returned or converted from `None`, means "this
function abstains on this completion": a completion's reward is the weighted `nansum` over the functions that scored
it; GRPO and RLOO leave a completion no function scored out of the group's baseline (nanmean) and give it advantage 0.

What slimrl adds, each naming the function, the completion and the fix:
- `guard_reward_funcs` wraps every plain function (sync or async; reward models are left alone) so that a function
  that raises, returns something that is not one number per completion, or returns a non-number fails at once
  (TRL fails later with a bare TypeError or ValueError, or not at all).
- `check_reward_table` runs on the values of every source together, after TRL's reward calculation: an infinite
  reward (or one beyond float32's range) is an error, since TRL turns it into NaN advantages that it zeroes, or into
  -3.4e38 ones; and so is a batch in which no completion got any reward (nothing to learn from, reward logged NaN).
  A group in which every function abstains stays TRL's way of skipping a prompt (TRL's own `accuracy_reward` returns
  None when the reference answer cannot be parsed).
- `check_pairs_scored` (online DPO): a pair of which neither completion got any reward is an error, since online DPO
  cannot skip a pair (TRL ranks the 0-against-0 tie and trains on the first completion as chosen).
"""

from __future__ import annotations

import decimal
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

import numpy as np
import torch
from trl.trainer.utils import is_async_callable

__all__ = ["CheckedRewardsMixin", "RewardFunctionError", "RewardRecorder", "check_pairs_scored",
           "check_reward_table", "guard_reward_funcs"]  # fmt: skip

SIGNATURE = (
    "{name}(prompts=..., completions=..., completion_ids=..., **dataset_columns) must return one reward "
    "per completion: a list (or NumPy array, or 1-D tensor) of numbers, None or NaN where it abstains"
)


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something the trainer cannot use."""


def guard_reward_funcs(reward_funcs: Sequence, names: Sequence[str], trainer: str = "GRPO",
                       supports_async: bool = True) -> list:  # fmt: skip
    """The reward functions with every plain one (sync or async) wrapped by the guard; reward models (nn.Module) as
    they are. With `supports_async=False` (the trainer calls its functions synchronously) an async one is an error."""
    guarded = []
    for func, name in zip(reward_funcs, names, strict=True):
        if isinstance(func, torch.nn.Module) or not callable(func) or getattr(func, "_slimrl_guarded", False):
            guarded.append(func)
        elif is_async_callable(func):
            if not supports_async:
                raise RewardFunctionError(
                    f"Reward function '{name}' is async, but {trainer} calls its reward functions synchronously. "
                    f"Pass a synchronous wrapper, e.g. def {name}_sync(**kwargs): return asyncio.run({name}(**kwargs))."
                )
            guarded.append(_guard_async(func, name))
        else:
            guarded.append(_guard(func, name))
    return guarded


def _guard(func: Callable, name: str) -> Callable:
    @functools.wraps(func)
    def guarded(*args, **kwargs):
        try:
            output = func(*args, **kwargs)
        except Exception as error:
            raise _raised(name, error) from error
        output, guarded.last_rewards = checked_output(name, output, _expected_count(kwargs))
        return output

    guarded._slimrl_guarded, guarded.last_rewards = True, None
    return guarded


def _guard_async(func: Callable, name: str) -> Callable:
    @functools.wraps(func)
    async def guarded(*args, **kwargs):  # async itself, so TRL still runs it on its event loop with the others
        try:
            output = await func(*args, **kwargs)
        except Exception as error:
            raise _raised(name, error) from error
        output, guarded.last_rewards = checked_output(name, output, _expected_count(kwargs))
        return output

    guarded._slimrl_guarded, guarded.last_rewards = True, None
    return guarded


def _raised(name: str, error: Exception) -> RewardFunctionError:
    return RewardFunctionError(
        f"Reward function '{name}' raised {type(error).__name__}: {error}. {SIGNATURE.format(name=name)}; fix the "
        "function or the dataset columns it reads."
    )


def _expected_count(kwargs: dict) -> int | None:
    """How many rewards TRL expects: one per prompt-completion pair (TRL checks the count against `prompts`)."""
    for key in ("prompts", "completions"):
        if isinstance(kwargs.get(key), Sequence):
            return len(kwargs[key])
    return None


# -- one function's output --------------------------------------------------------------------------------------------


def checked_output(name: str, output, expected: int | None) -> tuple[object, torch.Tensor]:
    """(what to hand TRL: `output` itself, or the items of a one-shot iterator; the float32 values [N] TRL will read,
    NaN where the function abstains). Raises RewardFunctionError for what TRL cannot read as one number per
    completion."""
    if isinstance(output, (str, bytes, Mapping, Set)) or not isinstance(output, Iterable) or _is_scalar(output):
        raise RewardFunctionError(f"Reward function '{name}' returned {_short(output)} ({type(output).__name__}); "
                                  f"{SIGNATURE.format(name=name)}.")  # fmt: skip
    if not isinstance(output, (Sequence, np.ndarray, torch.Tensor)):
        output = list(output)  # a generator: TRL would read it once, so it gets the items
    if expected is not None and len(output) != expected:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(output)} rewards for {expected} completions; return exactly one "
            "value per completion, in order (None to abstain on one)."
        )
    values = _numeric_array(output)
    return output, values if values is not None else _item_values(name, output)


def _is_scalar(output) -> bool:
    return isinstance(output, (torch.Tensor, np.ndarray)) and output.ndim == 0


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _numeric_array(output) -> torch.Tensor | None:
    """A numeric tensor ([N], or [N, 1] as TRL reads it too) or 1-D NumPy array as float32 [N], else None (then each
    item is read on its own)."""
    if isinstance(output, torch.Tensor) and not output.is_complex():
        values = output.detach()
    elif isinstance(output, np.ndarray) and output.dtype.kind in "biuf" and output.ndim == 1:
        values = torch.from_numpy(np.asarray(output, dtype=np.float64))
    else:
        return None
    if values.numel() != len(values):
        return None  # the item-by-item path names the first item that is not one number
    return values.reshape(-1).to("cpu", torch.float64).float()


def _item_values(name: str, output) -> torch.Tensor:
    """float32 [N], NaN where abstaining: what TRL's `torch.tensor(..., dtype=torch.float32)` makes of the items."""
    values = []
    for index, value in enumerate(output):
        number = _number(value)
        if number is None:
            kind = type(value).__name__ + (f" of shape {list(value.shape)}" if hasattr(value, "shape") else "")
            raise RewardFunctionError(
                f"Reward function '{name}' returned {_short(value)} ({kind}) for completion {index}; each reward must "
                "be one number (float, int, bool, a NumPy number or a one-element tensor), or None/NaN to abstain."
            )
        values.append(number)
    return torch.tensor(values, dtype=torch.float64).float()  # float32 as TRL stores it: 1e39 is inf there too


def _number(value) -> float | None:
    """One reward as the float TRL reads (NaN for None), or None where `torch.tensor` would fail on it."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    elif isinstance(value, np.ndarray):  # torch.tensor reads a one-element tensor as a number, not such an array
        if value.ndim != 0 or value.dtype.kind not in "biuf":
            return None
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float64's range: TRL's float32 column holds it as inf
        return math.inf if value > 0 else -math.inf
    except ValueError:  # a signalling-NaN Decimal, which torch.tensor refuses too
        return None


# -- every source's values together ------------------------------------------------------------------------------------


def check_reward_table(rewards: torch.Tensor, names: Sequence[str]) -> None:
    """`rewards` [N, F]: every reward source's value for each completion, NaN where it abstained. An error for an
    infinite value, and for a batch in which no completion got any reward."""
    _check_finite(rewards, names)
    if rewards.numel() and torch.isnan(rewards).all():
        raise RewardFunctionError(
            f"Every reward function ({', '.join(names)}) abstained (returned None or NaN) on all {len(rewards)} "
            "completions of this batch: no completion has a reward, so the step would learn nothing and log reward "
            "NaN. Check when the functions return None (the dataset columns they read, the answer format they "
            "parse), or return a number (e.g. 0.0) where a completion cannot be scored."
        )


def check_pairs_scored(rewards: torch.Tensor, names: Sequence[str]) -> None:
    """`rewards` [2B, F] in online DPO's block layout (completions i and B + i answer prompt i): an error for an
    infinite value, and for a pair of which neither completion got any reward."""
    _check_finite(rewards, names)
    pairs = len(rewards) // 2
    unscored = torch.isnan(rewards).all(dim=1)  # [2B] bool
    both = (unscored[:pairs] & unscored[pairs:]).nonzero()
    if len(both):
        i = int(both[0])
        raise RewardFunctionError(
            f"Every reward function ({', '.join(names)}) abstained (returned None or NaN) on both completions of "
            f"prompt {i} of the batch (completions {i} and {i + pairs}). Online DPO ranks each pair by its rewards "
            f"and cannot skip one: TRL would rank the tie (0 against 0) and train on completion {i} as chosen. Return "
            "a number (e.g. 0.0) for a completion that cannot be scored, or drop such prompts from the dataset."
        )


def _check_finite(rewards: torch.Tensor, names: Sequence[str]) -> None:
    infinite = torch.isinf(rewards).nonzero()
    if len(infinite):
        row, column = (int(i) for i in infinite[0])
        raise RewardFunctionError(
            f"Reward function '{names[column]}' gave completion {row} the reward {rewards[row, column].item()}. An "
            "infinite reward (or one beyond float32's range, about 3.4e38, which TRL stores as inf) makes its group's "
            "mean infinite, and the advantages turn into NaN that TRL zeroes, or saturate, without a word. Return a "
            "finite number (clip or rescale it), or None to abstain on this completion."
        )


class CheckedRewardsMixin:
    """GRPO's and RLOO's `_calculate_rewards` followed by `check_reward_table` on the values TRL gathered from every
    process, so that every process raises together (not one while the others wait in the next collective)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # contract: TRL's [N x processes, F] float32 values, NaN where a source abstained, unchanged
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        check_reward_table(rewards, self.reward_func_names)
        return rewards


class RewardRecorder:
    """The values [N, F] of every reward source during one reward calculation by TRL's code (online DPO's returns
    only their weighted sum): a guarded function's from its guard, a reward model's (TRL reads `logits[:, 0]`)
    through a forward hook held for that calculation only."""

    def __init__(self, reward_funcs: Sequence):
        self.reward_funcs = list(reward_funcs)
        self._model_values: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def __enter__(self) -> RewardRecorder:
        for index, func in enumerate(self.reward_funcs):
            if isinstance(func, torch.nn.Module):
                self._hooks.append(func.register_forward_hook(functools.partial(self._record, index)))
            elif getattr(func, "_slimrl_guarded", False):
                func.last_rewards = None
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _record(self, index: int, module, args, output) -> None:
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            self._model_values[index] = logits[:, 0].detach().float().cpu()

    def table(self, rows: int) -> torch.Tensor:
        """[rows, F] float32; a source whose values were not seen (not guarded) counts as scoring 0 everywhere."""
        columns = []
        for index, func in enumerate(self.reward_funcs):
            seen = self._model_values.get(index) if isinstance(func, torch.nn.Module) else getattr(
                func, "last_rewards", None)  # fmt: skip
            columns.append(seen if seen is not None and len(seen) == rows else torch.zeros(rows))
        return torch.stack(columns, 1)
