"""Agents on the engine's CUDA path: a tool-calling run and an environment-owned reward train with slimrl's rollout
engine on the GPU (its kernels and CUDA graphs), bf16 autocast. On the CPU, test_grpo_agents.py runs the same
agents on the engine and on TRL's transformers path and compares their logs; on the GPU the two sample with
different kernels, so this checks the run itself: the engine generated every turn after the scripted first one,
the tool results reached the model, the reward came from the environment, and every loss is finite."""

from __future__ import annotations

import math

import pytest

from tests.trainers import test_grpo_agents as agents

pytestmark = pytest.mark.cuda  # the engine's CUDA path needs a GPU


@pytest.fixture(autouse=True)
def tool_aware_tokenizer(monkeypatch):
    monkeypatch.setattr("tests.trainers.grpo_harness.tiny_tokenizer", agents.tool_tokenizer)


def cuda_trainer(**kwargs):
    return agents.agent_trainer("engine", config={"use_cpu": False, "bf16": True}, **kwargs)


def assert_trained_on_the_gpus_engine(trainer) -> list[dict]:
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    assert trainer._generation_backend == "engine" and trainer.rollout_engine is not None
    assert trainer.rollout_engine.device.type == "cuda"
    return steps


def test_a_tool_calling_run_trains_with_the_engine_on_the_gpu():
    trainer = cuda_trainer(reward_funcs=agents.mentions_twelve, dataset=agents.questions(), tools=[agents.mul])
    calls = agents.scripted_first_turn(trainer)
    trainer.train()
    steps = assert_trained_on_the_gpus_engine(trainer)
    assert calls == [True, False, True, False], "each step: a first turn, then the engine's turn after the tool"
    assert all(entry["tools/call_frequency"] == 1.0 for entry in steps)


def test_an_environment_owned_reward_trains_with_the_engine_on_the_gpu():
    trainer = cuda_trainer(reward_funcs=None, dataset=agents.questions(),
                           environment_factory=agents.Counter)
    trainer.train()
    steps = assert_trained_on_the_gpus_engine(trainer)
    assert trainer.reward_func_names == ["Counter"]
    assert all(math.isfinite(entry["rewards/Counter/mean"]) for entry in steps)
