"""TRL's reward semantics in every slimrl trainer that takes reward functions (GRPO, RLOO, online DPO, PPO): None and
NaN abstain exactly as in unpatched TRL, NumPy arrays and tensors are read as TRL reads them, and what TRL would turn
into a silent NaN/inf or a crash deep inside fails with slimrl's error naming the function, the completion and the
fix (trainers/common/rewards_guard.py)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from slimrl.testing import tiny_prompt_dataset, tiny_tokenizer
from slimrl.trainers.common.rewards_guard import RewardFunctionError, RewardRecorder, guard_reward_funcs
from tests.tolerances import assert_close
from tests.trainers import grpo_harness, online_dpo_harness, rloo_harness
from tests.trainers.step_compare import assert_same_step

TRAINERS = ("grpo", "rloo", "online_dpo", "ppo")
N = 8  # completions per reward call in every trainer below: 2 prompts x 4 generations, 4 pairs, 8 PPO prompts

# -- parity with unpatched TRL on abstaining rewards -------------------------------------------------------------------

# completions 0..3 answer the first prompt, 4..7 the second: completion 0 is scored by no function (TRL leaves it out
# of its group's baseline, advantage 0), and the second prompt's whole group abstains (TRL's skip of a prompt)
NONE_ROWS, NAN_ROWS = {0, 3, 4, 5, 6, 7}, {0, 2, 4, 5, 6, 7}


def none_reward(completions, **kwargs):  # abstains with None
    return [None if i in NONE_ROWS else len(text) / 8 for i, text in enumerate(completions)]


def nan_reward(completions, **kwargs):  # abstains with NaN, in a NumPy array
    return np.array([np.nan if i in NAN_ROWS else 1.0 - len(text.split()) / 4 for i, text in enumerate(completions)])


@pytest.mark.parametrize("harness", [grpo_harness, rloo_harness], ids=["grpo", "rloo"])
def test_abstaining_rewards_score_and_train_as_in_trl(harness):
    settings = dict(reward_funcs=[none_reward, nan_reward], generation_kwargs=rloo_harness.EOS_BIAS,
                    max_completion_length=8, reward_weights=[1.0, 0.5])  # fmt: skip
    reference, ours = harness.build_trainer("trl", **settings), harness.build_trainer("slimrl", **settings)
    expected_batch, expected_metrics = rloo_harness.generate_and_score(reference)
    actual_batch, actual_metrics = rloo_harness.generate_and_score(ours)
    advantages = expected_batch["advantages"]
    assert_close(actual_batch["advantages"], advantages, name="advantages")
    assert actual_metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        assert_close(torch.tensor(actual_metrics[name]), torch.tensor(value), name=f"metric {name}")
    # the abstentions did what TRL does with them: no advantage for the unscored rows, a finite logged reward
    assert advantages[[0, 4, 5, 6, 7]].abs().sum() == 0 and advantages[1:4].abs().sum() > 0
    assert math.isfinite(expected_metrics["reward"])
    expected = harness.loss_grads_metrics(reference, expected_batch)
    assert_same_step(expected, harness.loss_grads_metrics(ours, expected_batch), "loss on the abstaining batch")


# -- one trainer of each kind, whose reward function does what the test asks -----------------------------------------

BEHAVIOUR = {"now": "numbers"}


def scripted_reward(completions, **kwargs):
    """Returns (or raises) what BEHAVIOUR["now"] names, for as many completions as it is given."""
    count, now = len(completions), BEHAVIOUR["now"]
    if now == "raises":
        raise KeyError("answer")
    return {
        "numbers": [float(i) for i in range(count)],
        "numpy": np.array([np.nan if i == 1 else i / 2 for i in range(count)], dtype=np.float32),
        "tensor": torch.arange(count, dtype=torch.float64).unsqueeze(1) / 4,  # [N, 1], which TRL reads as [N]
        "inf": [math.inf if i == 2 else 1.0 for i in range(count)],
        "overflow": [1e39 if i == 2 else 1.0 for i in range(count)],  # inf in TRL's float32 column
        "short": [1.0],
        "text": ["good"] * count,
        "vector": [torch.ones(2)] * count,
        "none": [None] * count,
        "nan": np.full(count, np.nan),
    }[now]


def build(kind: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind in ("grpo", "rloo"):
            harness = grpo_harness if kind == "grpo" else rloo_harness
            return harness.build_trainer("slimrl", reward_funcs=scripted_reward, max_steps=1, max_completion_length=4)
        if kind == "online_dpo":
            return online_dpo_harness.build_trainer("slimrl", reward_funcs=[scripted_reward], max_steps=1,
                                                    max_new_tokens=4)  # fmt: skip
        from tests.trainers.test_ppo_trainer import build as build_ppo

        return build_ppo(reward_funcs=[scripted_reward], max_steps=1, response_length=4)


@pytest.fixture(scope="module")
def trainers():
    return {kind: build(kind) for kind in TRAINERS}


def score(trainer, kind: str, behaviour: str) -> torch.Tensor:
    """The trainer's reward values for N scripted completions, through its own reward code: [N] for the function."""
    BEHAVIOUR["now"] = behaviour
    tokenizer = tiny_tokenizer()
    completions = ["7", "It is 9", "8 8", "x", "", "no", "3+4=7", "ten"]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in completions]
    if kind in ("grpo", "rloo"):  # 2 prompts x 4 generations, each row repeated as TRL's sampler repeats it
        rows = [tiny_prompt_dataset(2)[i // 4] for i in range(N)]
        return trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions, ids)[:, 0]
    if kind == "online_dpo":  # block layout: completions i and 4 + i answer prompt i
        rows = online_dpo_harness.prompt_batch()
        return trainer._calculate_rewards_from_functions(
            prompts=rows["prompt"] * 2, completions=completions, completion_ids_list=ids, answer=rows["answer"] * 2
        )
    rows = [tiny_prompt_dataset(N)[i] for i in range(N)]
    return trainer._scores(rows, [r["prompt"] for r in rows], ids)[0]


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("behaviour", ["numbers", "numpy", "tensor"])
def test_lists_arrays_and_tensors_are_read_as_trl_reads_them(trainers, kind, behaviour):
    expected = {"numbers": torch.arange(N, dtype=torch.float32),
                "numpy": torch.tensor([0.0, math.nan, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]),  # NaN: abstains on completion 1
                "tensor": torch.arange(N, dtype=torch.float32) / 4}[behaviour]  # fmt: skip
    if kind != "grpo" and kind != "rloo":
        expected = expected.nan_to_num(0.0)  # online DPO and PPO rank and train on the nansum over functions
    assert_close(score(trainers[kind], kind, behaviour), expected, "exact", name=f"{kind} rewards")


ERRORS = {
    "inf": r"'scripted_reward' gave completion 2 the reward inf\. An infinite reward .* Return a finite number",
    "overflow": r"'scripted_reward' gave completion 2 the reward inf\. .*beyond float32's range",
    "short": r"'scripted_reward' returned 1 rewards for 8 completions; return exactly one value per completion",
    "text": r"'scripted_reward' returned 'good' \(str\) for completion 0; each reward must be one number",
    "vector": r"'scripted_reward' returned tensor\(\[1\., 1\.\]\) \(Tensor of shape \[2\]\) for completion 0",
    "raises": r"Reward function 'scripted_reward' raised KeyError: 'answer'\..*fix the function or the dataset columns",
    "none": r"\(scripted_reward\) abstained \(returned None or NaN\) on (all 8 completions of this batch|both "
    r"completions of prompt 0 of the batch \(completions 0 and 4\)).*[rR]eturn a number",
    "nan": r"\(scripted_reward\) abstained \(returned None or NaN\) on (all 8|both completions of prompt 0)",
}


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("behaviour", list(ERRORS))
def test_bad_rewards_fail_with_the_function_the_completion_and_the_fix(trainers, kind, behaviour):
    with pytest.raises(RewardFunctionError, match=ERRORS[behaviour]):
        score(trainers[kind], kind, behaviour)


@pytest.mark.parametrize("kind", TRAINERS)
def test_an_infinite_reward_stops_the_first_training_step(trainers, kind):
    """Through train() as a user runs it: TRL would log reward inf and train on zeroed or saturated advantages."""
    trainer = trainers[kind]
    BEHAVIOUR["now"] = "inf"
    with warnings.catch_warnings(), pytest.raises(RewardFunctionError, match=ERRORS["inf"]):
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == 0


def test_async_functions_stay_async_and_are_checked():
    """GRPO and RLOO run async reward functions on TRL's event loop: the guard keeps them async."""
    import asyncio

    from trl.trainer.utils import is_async_callable

    async def judge(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    (guarded,) = guard_reward_funcs([judge], ["judge"])
    assert is_async_callable(guarded)
    with pytest.raises(RewardFunctionError, match=r"'judge' returned 1 rewards for 2 completions"):
        asyncio.run(guarded(prompts=["a", "b"], completions=["x", "y"]))
    with pytest.raises(RewardFunctionError, match=r"'judge' is async, but PPO calls its reward functions synchron"):
        guard_reward_funcs([judge], ["judge"], "PPO", supports_async=False)


def test_the_recorder_reads_reward_models_through_a_hook_held_for_the_call_only():
    model = online_dpo_harness.tiny_reward_model()
    model_, guarded = guard_reward_funcs([model, scripted_reward], ["model", "scripted_reward"])
    assert model_ is model  # reward models are not wrapped: TRL tells them apart by isinstance(nn.Module)
    inputs = tiny_tokenizer()(["a b", "c"], return_tensors="pt", padding=True)
    BEHAVIOUR["now"] = "numpy"
    with RewardRecorder([model, guarded]) as recorder:
        logits = model(**inputs).logits[:, 0]
        guarded(prompts=["p", "q"], completions=["a b", "c"])
    assert not model._forward_hooks
    assert_close(recorder.table(2), torch.stack([logits.detach(), torch.tensor([0.0, math.nan])], 1), "exact")
