"""Online DPO with slimrl's rollout engine as the generation backend (its eager path runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from slimrl.testing import tiny_model
from tests.trainers.online_dpo_harness import PAIRS, build_trainer, prompt_batch
from tests.trainers.run_settings import spy_on_engine_generate

# Logged values that measure time, not training results.
TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}


def ragged_model():
    """The tiny model with 40 byte tokens declared as end-of-sequence ids besides EOS: a random model samples one of
    them often enough that completions end at different lengths."""
    model = tiny_model()
    model.generation_config.eos_token_id = [3, *range(100, 140)]
    return model


def test_engine_gives_transformers_generation_for_the_same_seed():
    """Off CUDA the engine draws as transformers' generate does: both backends return TRL's generation layout (every
    prompt, then every prompt again, left-padded; completions padded after their first end id) with the same ids."""
    results = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", model=ragged_model(), generation_backend=backend, max_new_tokens=8,
                                temperature=0.9)  # fmt: skip
        assert trainer.generation_backend == backend
        torch.manual_seed(11)
        results[backend] = trainer._generate(trainer.model, prompt_batch()["prompt"])
    assert results["engine"][4] is None
    for name, engine, transformers in zip(("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"),
                                          results["engine"][:4], results["transformers"][:4], strict=True):  # fmt: skip
        assert torch.equal(engine, transformers), f"{name}: {engine} != {transformers}"
    lengths = results["engine"][3].sum(1)
    assert lengths.size(0) == 2 * PAIRS and 0 < lengths.min() < lengths.max() <= 8, f"not ragged: {lengths}"


def test_engine_path_trains_exactly_as_the_transformers_path_on_cpu(monkeypatch):
    """The engine generates each micro-batch's pairs (with the live adapter: the policy drifts off its reference),
    frees its KV cache after each, and the same seed gives the same completions, so the logged curve equals the
    transformers backend's."""
    calls = spy_on_engine_generate(monkeypatch)
    logs = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", model=ragged_model(), generation_backend=backend, max_steps=3,
                                logging_steps=1, max_new_tokens=8, temperature=0.9, seed=5, learning_rate=5e-3,
                                num_chunks=2)  # fmt: skip
        trainer.train()
        logs[backend] = trainer.state.log_history
    assert calls == [(2 * PAIRS, 0.9, "multinomial", False, 8)] * 3, "one engine rollout per step, no log-probs"
    assert trainer.rollout_engine.sessions.held_bytes() == 0, "the KV cache goes back to training"
    assert len(logs["engine"]) == len(logs["transformers"]) == 4
    assert len({entry["objective/kl"] for entry in logs["engine"][:3]}) == 3, "the policy did not move"
    for index, (ours, theirs) in enumerate(zip(logs["engine"], logs["transformers"], strict=True)):
        for name, value in theirs.items():
            if name not in TIMINGS and isinstance(value, float):
                assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-7), f"entry {index}: {name}"


def test_explicit_engine_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"generation_kwargs \['sequence_bias'\] are transformers-only"):
        build_trainer("slimrl", generation_backend="engine", generation_kwargs={"sequence_bias": {(3,): 1.0}})
