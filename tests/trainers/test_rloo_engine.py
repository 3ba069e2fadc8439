"""RLOO with slimrl's rollout engine as the generation backend (its eager path runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

import slimrl
from tests.trainers.rloo_harness import build_trainer, length_reward
from tests.trainers.run_settings import spy_on_engine_generate

# Logged values that measure time, not training results.
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def test_auto_backend_is_transformers_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this pins the CPU choice")
    assert build_trainer("slimrl").generation_backend == "transformers"


def test_auto_backend_is_the_engine_on_cuda_and_trains():
    """On CUDA "auto" picks the engine (its captured, race-sampled decode step), which generates every rollout of a
    run with the KL penalty on and hands its KV cache back after each."""
    if not torch.cuda.is_available():
        pytest.skip("the engine is auto's choice only on CUDA")
    trainer = build_trainer("slimrl", use_cpu=False, reward_funcs=length_reward, max_steps=2, logging_steps=1,
                            max_completion_length=8, learning_rate=5e-3, beta=0.04)  # fmt: skip
    assert trainer.generation_backend == "engine"
    trainer.train()
    assert trainer.rollout_engine is not None and trainer.rollout_engine.sessions.held_bytes() == 0
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_engine_gives_transformers_completions_for_the_same_seed():
    """Off CUDA the engine draws as transformers' generate does: with RLOO's single-turn signature (completion ids
    only), both backends complete the same prompts identically, and neither gives log-probs."""
    results = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", generation_backend=backend, max_completion_length=6, temperature=0.9)
        prompts = [[72, 105, 33], [5, 6, 7, 8, 9], [72, 105, 33], [40]]
        torch.manual_seed(11)
        results[backend] = trainer.generate_completion_ids(prompts)
    assert results["engine"] == results["transformers"]
    completion_ids, logprobs = results["engine"]
    assert logprobs is None and all(0 < len(ids) <= 6 for ids in completion_ids)


def test_engine_path_trains_exactly_as_the_transformers_path_on_cpu(monkeypatch):
    """The engine generates every rollout (with the live "default" adapter, not TRL's frozen "ref" copy beside it),
    frees its KV cache after each, and the same seed gives the same completions, so the logged curve equals the
    transformers backend's (fp32) with the KL penalty on."""
    calls = spy_on_engine_generate(monkeypatch)
    logs = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", reward_funcs=length_reward, generation_backend=backend, max_steps=3,
                                logging_steps=1, max_completion_length=8, temperature=0.9, seed=5, beta=0.04,
                                learning_rate=5e-3)  # fmt: skip
        trainer.train()
        logs[backend] = trainer.state.log_history
    assert calls == [(8, 0.9, "multinomial", False, 8)] * 3, "one engine rollout per step, no log-probs asked"
    assert trainer.rollout_engine.sessions.held_bytes() == 0, "the KV cache goes back to training"
    assert len(logs["engine"]) == len(logs["transformers"]) == 4
    assert any(entry.get("kl", 0.0) != 0 for entry in logs["engine"]), "the policy never moved off the reference"
    for step, (ours, theirs) in enumerate(zip(logs["engine"], logs["transformers"], strict=True)):
        for name, value in theirs.items():
            if name not in TIMINGS and isinstance(value, float):
                assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-7), f"step {step}: {name}"


def test_explicit_engine_refuses_what_it_cannot_serve():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=264, pad_token_id=0))
    with pytest.raises(ValueError, match="generation_backend='engine' cannot serve this run"):
        build_trainer("slimrl", model=gpt2, generation_backend="engine", beta=0.0)
    with pytest.raises(ValueError, match=r"generation_kwargs \['sequence_bias'\] are transformers-only"):
        build_trainer("slimrl", generation_backend="engine", generation_kwargs={"sequence_bias": {(3,): 1.0}})


def test_backend_setting_is_checked_and_vllm_means_trls_vllm():
    with pytest.raises(ValueError, match="generation_backend must be one of"):
        slimrl.RLOOConfig(output_dir="/tmp/x", use_cpu=True, generation_backend="fast")
    assert slimrl.RLOOConfig(output_dir="/tmp/x", use_cpu=True, generation_backend="vllm").use_vllm is True
