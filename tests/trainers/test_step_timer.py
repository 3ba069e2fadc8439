"""StepTimer splits each optimizer step into generation, reward and training, for TRL's and slimrl's GRPOTrainer."""

import time

import pytest

from slimrl.trainers.common.step_timer import StepTimer
from tests.trainers.grpo_harness import build_trainer

REWARD_SLEEP_S = 0.05


def slow_reward(completions, **kwargs):
    time.sleep(REWARD_SLEEP_S)  # a reward phase long enough to tell from clock noise
    return [float(len(str(c))) for c in completions]


@pytest.mark.parametrize("kind", ["slimrl", "trl"])
def test_the_three_phases_add_up_to_each_step(kind, tmp_path):
    trainer = build_trainer(kind, reward_funcs=slow_reward, output_dir=str(tmp_path), max_steps=2, logging_steps=1)
    seen: list[int] = []
    timer = StepTimer(on_step=lambda record: seen.append(record["step"])).attach(trainer)
    trainer.train()
    assert [r["step"] for r in timer.steps] == [1, 2] and seen == [1, 2]
    for record in timer.steps:
        phases = record["generation_s"] + record["reward_s"] + record["training_s"]
        assert abs(phases - record["step_s"]) < 1e-6, record
        assert record["generation_s"] > 0 and record["training_s"] > 0, record
        assert record["reward_s"] >= REWARD_SLEEP_S, record
        assert record["step_s"] < 60 and "loss" in record["logs"]  # the step's training logs are merged
    assert not timer.cuda and "engine_stats" not in timer.steps[0]  # CPU: TRL's generate path, no sync


def test_detach_gives_the_trainer_its_methods_back(tmp_path):
    trainer = build_trainer("slimrl", output_dir=str(tmp_path), max_steps=1)
    timer = StepTimer().attach(trainer)
    assert "_generate_single_turn" in vars(trainer) and timer in trainer.callback_handler.callbacks
    with pytest.raises(ValueError, match="already attached"):
        timer.attach(trainer)
    timer.detach()
    assert "_generate_single_turn" not in vars(trainer) and "_calculate_rewards" not in vars(trainer)
    assert timer not in trainer.callback_handler.callbacks


def test_engine_rollouts_record_the_engines_stats(tmp_path):
    trainer = build_trainer("slimrl", output_dir=str(tmp_path), max_steps=1, logging_steps=1,
                            generation_backend="engine")  # fmt: skip
    timer = StepTimer().attach(trainer)
    trainer.train()
    (record,) = timer.steps
    assert record["engine_stats"]["decode_steps"] > 0 and record["generation_s"] > 0
