"""Never train on, or save, non-finite numbers: on_nonfinite="raise" stops before the optimizer step with the
weights untouched, "skip" drops the step and goes on, and saves refuse NaN weights."""

from __future__ import annotations

import math

import pytest
import torch

import slimrl
from slimrl.ops.finite import StepFiniteness, nonfinite_tensors
from tests.trainers.grpo_harness import build_trainer

POISONED_STEP = 2  # the 0-based optimizer step whose loss or gradient is made NaN


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 for text in completions]


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


class WeightsPerStep:
    """A callback keeping a copy of the trainable weights after every optimizer step (index = steps done)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        history = self.history = [trainable(trainer)]

        class Keep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                history.append(trainable(trainer))

        trainer.add_callback(Keep())


def poisoned_trainer(where: str, **config):
    """A tiny GRPO trainer whose loss ("loss") or one LoRA gradient ("grad") is NaN at POISONED_STEP."""
    trainer = build_trainer(
        "slimrl", reward_funcs=digit_reward, max_steps=4, logging_steps=1, learning_rate=1e-2, seed=3,
        max_completion_length=6, **config,
    )  # fmt: skip
    poisoned = lambda: trainer.state.global_step == POISONED_STEP  # noqa: E731
    if where == "loss":
        compute_loss = trainer.compute_loss

        def nan_loss(*args, **kwargs):
            loss = compute_loss(*args, **kwargs)
            return loss * math.nan if poisoned() else loss

        trainer.compute_loss = nan_loss
    else:
        name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad and "lora_B" in n)
        param.register_hook(lambda grad: grad * math.nan if poisoned() else grad)
    return trainer


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_raise_stops_before_the_optimizer_step_with_weights_unchanged(where):
    trainer = poisoned_trainer(where)
    weights = WeightsPerStep(trainer)
    with pytest.raises(slimrl.NonFiniteError, match=f"Optimizer step {POISONED_STEP + 1}: "):
        trainer.train()
    assert len(weights.history) == POISONED_STEP + 1, "training went past the poisoned step"
    after = trainable(trainer)
    for name, value in weights.history[-1].items():
        assert torch.equal(after[name], value), f"{name} changed although the step raised"
    assert any(not torch.equal(weights.history[0][n], after[n]) for n in after), "the finite steps trained nothing"
    # the optimizer made exactly POISONED_STEP steps: Adam's step counters say so
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {POISONED_STEP}, steps


def test_raise_names_what_was_not_finite():
    trainer = poisoned_trainer("grad")
    with pytest.raises(slimrl.NonFiniteError, match="the gradient"):
        trainer.train()


def test_skip_drops_the_step_logs_it_and_trains_on():
    trainer = poisoned_trainer("loss", on_nonfinite="skip")
    weights = WeightsPerStep(trainer)
    trainer.train()
    assert trainer.state.global_step == 4
    skipped = [entry["nonfinite_skipped"] for entry in trainer.state.log_history if "nonfinite_skipped" in entry]
    assert skipped == [0.0, 0.0, 1.0, 0.0]
    before, after = weights.history[POISONED_STEP], weights.history[POISONED_STEP + 1]
    assert all(torch.equal(before[n], after[n]) for n in before), "the skipped step changed the weights"
    changed = [n for n in after if not torch.equal(after[n], weights.history[-1][n])]
    assert changed, "training did not go on after the skipped step"
    assert not nonfinite_tensors(weights.history[-1])


def test_finite_steps_log_no_skips_and_train_normally():
    trainer = build_trainer("slimrl", reward_funcs=digit_reward, max_steps=2, logging_steps=1, on_nonfinite="skip",
                            max_completion_length=6)  # fmt: skip
    trainer.train()
    assert [e["nonfinite_skipped"] for e in trainer.state.log_history if "nonfinite_skipped" in e] == [0.0, 0.0]


def test_step_finiteness_checks_every_micro_batch_loss():
    """A NaN in the first of several micro-batches is not forgotten when the last one is finite."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    check = StepFiniteness()
    check.add_loss(torch.tensor(math.nan))
    check.add_loss(torch.tensor(1.0))
    finite, what = check.verdict([param])
    assert not finite and what == "the loss"
    check.add_loss(torch.tensor(1.0))
    assert check.verdict([param]) == (True, ""), "the verdict must reset after each step"
    param.grad = torch.tensor([1.0, math.inf, 0.0])
    finite, what = check.verdict([param])
    assert not finite and what.startswith("the gradient (norm inf")


def test_config_rejects_unknown_on_nonfinite():
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise'"):
        slimrl.GRPOConfig(output_dir="/tmp/x", on_nonfinite="ignore", use_cpu=True)


def test_trainer_refuses_to_save_nan_weights(tmp_path):
    trainer = build_trainer("slimrl", reward_funcs=digit_reward, output_dir=str(tmp_path / "run"))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param[0] = math.nan
    with pytest.raises(slimrl.NonFiniteError, match=name.replace(".", r"\.")):
        trainer.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "saved").exists()
