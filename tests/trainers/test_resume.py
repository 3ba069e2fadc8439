"""Resume loses nothing: 6 steps straight == 3 steps, checkpoint, resume for 3 more (same logs, same final adapter).

Unpatched TRL 1.16 loses the data order of later epochs (RepeatSampler's own generator restarts at epoch 0) and its
generation buffer (`_buffered_inputs`, `_step`); slimrl's `ResumableTrainerMixin` saves both with the checkpoint. The
tests on unpatched TRL pin what it does today, so that a TRL release that fixes it shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from slimrl.testing import tiny_prompt_dataset
from slimrl.trainers.common.resume import RESUME_STATE_NAME
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import build_trainer, lora_tiny_model
from tests.trainers.test_grpo_train_parity import NOT_COMPARED, digit_reward, length_reward

# One prompt per step (4 completions of it); the logit bias on EOS makes completion lengths, and so rewards, vary.
# No gradient checkpointing: resuming does not touch it, and the recompute would only slow the test.
SETTINGS = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=5e-3, seed=7,
                max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1, gradient_checkpointing=False,
                generation_kwargs={"sequence_bias": {(3,): 4.0}})  # fmt: skip
# train_loss is the mean loss of one train() call: 6 steps straight, the last 3 resumed, by design
NOT_COMPARED_HERE = NOT_COMPARED | {"train_loss"}


@dataclass
class Run:
    log: list[dict]
    adapter: dict[str, torch.Tensor]
    prompts: list[tuple[str, ...]]  # the prompts of each generation batch, in order


def train_run(kind: str, output_dir, resume_from: str | None = None, **config) -> Run:
    generated: list[tuple[str, ...]] = []

    def digit_reward_recording_prompts(prompts, completions, **kwargs):
        generated.append(tuple(prompts))
        return digit_reward(completions)

    digit_reward_recording_prompts.__name__ = "digit_reward"
    settings = {**SETTINGS, **config}
    settings["dataset"] = tiny_prompt_dataset(settings.pop("prompts"))
    trainer = build_trainer(kind, reward_funcs=[digit_reward_recording_prompts, length_reward],
                            output_dir=str(output_dir), **settings)  # fmt: skip
    trainer.train(resume_from_checkpoint=resume_from)
    adapter = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
    return Run(trainer.state.log_history, adapter, generated)


def straight_and_resumed(kind: str, tmp_path, **config) -> tuple[Run, Run]:
    straight = train_run(kind, tmp_path / "straight", **config)
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    resumed = train_run(kind, tmp_path / "resumed", resume_from=str(checkpoint), **config)
    return straight, resumed


def step_logs(run: Run) -> dict[int, dict]:
    return {entry["step"]: entry for entry in run.log if "loss" in entry}


def assert_resume_loses_nothing(straight: Run, resumed: Run, kind: str = "fp32") -> None:
    expected, actual = step_logs(straight), step_logs(resumed)
    assert sorted(expected) == sorted(actual) == [1, 2, 3, 4, 5, 6]
    for step, entry in expected.items():
        assert set(entry) - NOT_COMPARED_HERE == set(actual[step]) - NOT_COMPARED_HERE, f"step {step}: other metrics"
        for name, value in entry.items():
            if name in NOT_COMPARED_HERE or not isinstance(value, (int, float)):
                continue
            assert_close(actual[step][name], value, kind, name=f"step {step}: {name}")  # NaN matches NaN
    # the resumed run generated only its own steps' batches, for the same prompts in the same order
    assert 0 < len(resumed.prompts) < len(straight.prompts)
    assert resumed.prompts == straight.prompts[-len(resumed.prompts) :]
    assert straight.adapter.keys() == resumed.adapter.keys() and straight.adapter
    for name, weight in straight.adapter.items():
        assert_close(resumed.adapter[name].cpu(), weight.cpu(), kind, name=name)
    initial = {name: p for name, p in lora_tiny_model().named_parameters() if "lora_" in name}
    assert any(not torch.equal(initial[name], weight.cpu()) for name, weight in straight.adapter.items()), "no training"


def test_resume_in_a_later_epoch_matches_the_straight_run(tmp_path):
    """Two prompts: three epochs of two steps; the checkpoint falls inside epoch 1, whose shuffle must be epoch 1's."""
    straight, resumed = straight_and_resumed("slimrl", tmp_path, prompts=2)
    assert straight.prompts[2:4] != straight.prompts[0:2], "epochs 0 and 1 shuffle alike: the test would not see it"
    assert (tmp_path / "straight" / "checkpoint-3" / f"{RESUME_STATE_NAME}.pt").is_file()
    assert_resume_loses_nothing(straight, resumed)


def test_resume_at_an_epoch_boundary_with_unlogged_steps_matches_the_straight_run(tmp_path):
    """Three prompts: the checkpoint is epoch 0's last step, and logging every 2 steps leaves step 3 unlogged."""
    straight, resumed = straight_and_resumed("slimrl", tmp_path, prompts=3, logging_steps=2)
    expected, actual = step_logs(straight), step_logs(resumed)
    assert sorted(expected) == sorted(actual) == [2, 4, 6]
    for step, entry in expected.items():
        for name in ("loss", "reward", "entropy", "grad_norm", "completions/mean_length"):
            assert_close(actual[step][name], entry[name], "fp32", name=f"step {step}: {name}")
    assert resumed.prompts == straight.prompts[3:]
    for name, weight in straight.adapter.items():
        assert_close(resumed.adapter[name], weight, "fp32", name=name)


def test_resume_inside_a_generation_buffer_matches_the_straight_run(tmp_path):
    """One generation serves 4 micro-batches x 2 iterations = 4 optimizer steps (accumulation 2); the checkpoint at
    step 3 falls inside that span, and the next generation (step 5) starts epoch 1."""
    config = dict(prompts=4, gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2)
    straight, resumed = straight_and_resumed("slimrl", tmp_path, **config)
    logs = step_logs(straight)
    assert "reward" in logs[5] and "reward" not in logs[4], "steps 4 and 5 are not inside and after one buffer"
    assert_resume_loses_nothing(straight, resumed)


@pytest.mark.cuda  # the engine's captured, fused path runs on CUDA
def test_resume_on_the_gpu_engine_path_matches_the_straight_run(tmp_path):
    """The engine (deterministic rollouts, seeded from the restored RNG streams) regenerates nothing after resume and
    samples what the straight run sampled; training on the GPU sums in a run-dependent order (the attention
    backward), so values agree to the engine's log-prob tolerance rather than to fp32's."""
    config = dict(prompts=2, use_cpu=False, generation_backend="engine", generation_kwargs=None,
                  steps_per_generation=2)  # fmt: skip
    straight, resumed = straight_and_resumed("slimrl", tmp_path, **config)
    assert_resume_loses_nothing(straight, resumed, kind="engine_logprobs")


# -- unpatched TRL 1.16 (documents its behaviour; a failure here means TRL changed it: revisit resume.py) -------------


def test_unpatched_trl_replays_the_first_epoch_order_after_resume(tmp_path):
    """RepeatSampler's generator starts over in a fresh trainer, so the resumed epoch 1 (steps 3-4) is shuffled
    like epoch 0 and epoch 2 like epoch 1: the resumed run trains steps 4-6 on the prompts of steps 2-4."""
    straight, resumed = straight_and_resumed("trl", tmp_path, prompts=2)
    assert straight.prompts[3:6] != straight.prompts[1:4]
    assert resumed.prompts == straight.prompts[1:4]
    assert not (tmp_path / "straight" / "checkpoint-3" / f"{RESUME_STATE_NAME}.pt").exists()


def test_unpatched_trl_regenerates_inside_a_generation_buffer_after_resume(tmp_path):
    """steps_per_generation=2: the straight run generates at steps 1, 3, 5 and trains step 4 on step 3's buffer;
    the resumed run has no buffer and a zero micro-step counter, so it generates again at steps 4 and 6."""
    straight, resumed = straight_and_resumed("trl", tmp_path, prompts=16, steps_per_generation=2)
    expected, actual = step_logs(straight), step_logs(resumed)
    assert [step for step in (4, 5, 6) if "reward" in expected[step]] == [5]
    assert [step for step in (4, 5, 6) if "reward" in actual[step]] == [4, 6]
    assert resumed.prompts[0] == straight.prompts[1]  # step 4 regenerates for the buffered batch's prompt
    assert any(not torch.equal(resumed.adapter[name], w) for name, w in straight.adapter.items())
