"""GRPO with slimrl's rollout engine as the generation backend (its eager path runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.testing import tiny_tokenizer
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import build_trainer


def length_reward(completions, **kwargs):
    return [-abs(len(text) - 6) / 6 for text in completions]


def test_auto_backend_is_transformers_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this pins the CPU choice")
    assert build_trainer("slimrl")._generation_backend == "transformers"


def test_engine_backend_generates_the_rollouts_and_their_logprobs_match_the_training_forward(monkeypatch):
    calls = []
    original = RolloutEngine.generate

    def spy(self, prompts, params, max_new_tokens=None):
        calls.append((len(prompts), params.temperature, max_new_tokens))
        return original(self, prompts, params, max_new_tokens)

    monkeypatch.setattr(RolloutEngine, "generate", spy)
    trainer = build_trainer("slimrl", reward_funcs=length_reward, generation_backend="engine", max_steps=2,
                            logging_steps=1, max_completion_length=8, temperature=0.9, seed=3)  # fmt: skip
    assert trainer._generation_backend == "engine"
    trainer.train()
    assert calls and all(c == (8, 0.9, 8) for c in calls)
    assert trainer.rollout_engine.sessions.held_bytes() == 0, "the KV cache goes back to training"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # the engine's sampled-token log-probs (fp32, no filters) are the policy's own log-probs at that temperature:
    # a fresh rollout from the current weights, scored by the training forward
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trainer.model.eval()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].size(1)
        )
    valid = batch["completion_mask"].bool()
    assert valid.any()
    assert_close(batch["sampling_per_token_logps"][valid], logps[valid], "engine_logprobs", name="sampled logprobs")


def test_explicit_engine_refuses_what_it_cannot_serve():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=264, pad_token_id=0))
    with pytest.raises(ValueError, match="generation_backend='engine' cannot serve this run"):
        build_trainer("slimrl", model=gpt2, generation_backend="engine")
    with pytest.raises(ValueError, match=r"generation_kwargs \['sequence_bias'\] are transformers-only"):
        build_trainer("slimrl", generation_backend="engine", generation_kwargs={"sequence_bias": {(3,): 1.0}})


def test_unknown_backend_is_a_config_error():
    import slimrl

    with pytest.raises(ValueError, match="generation_backend must be one of"):
        slimrl.GRPOConfig(output_dir="/tmp/x", use_cpu=True, generation_backend="fast")


def test_tokenizer_is_passed_for_stop_strings():
    trainer = build_trainer("slimrl", generation_backend="engine", generation_kwargs={"stop": ["\n"]}, max_steps=1,
                            max_completion_length=6)  # fmt: skip
    trainer.train()
    assert trainer._rollout_engine.tokenizer.get_vocab() == tiny_tokenizer().get_vocab()


def test_engine_path_trains_exactly_as_the_transformers_path_on_cpu():
    """Off CUDA the engine draws as transformers' generate does, so the same seed gives the same completions, and
    with them the same logged curve (fp32)."""
    from tests.trainers.test_grpo_train_parity import NOT_COMPARED

    logs = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", reward_funcs=length_reward, generation_backend=backend, max_steps=3,
                                logging_steps=1, max_completion_length=8, temperature=0.9, seed=5,
                                learning_rate=5e-3)  # fmt: skip
        trainer.train()
        logs[backend] = trainer.state.log_history
    assert len(logs["engine"]) == len(logs["transformers"]) == 4
    for step, (ours, theirs) in enumerate(zip(logs["engine"], logs["transformers"], strict=True)):
        for name, value in theirs.items():
            if name not in NOT_COMPARED and isinstance(value, float):
                assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-7), f"step {step}: {name}"


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral"])
def test_grpo_on_the_engine_equals_the_transformers_path_for_the_newer_architectures(arch):
    """Phi-3 (fused projections sliced), Gemma 2/3 (their norms, soft-caps, windows) and the MoE models (routed
    experts): two GRPO steps with a live all-linear LoRA, the same logged curve from either backend (fp32)."""
    from tests.rollout.helpers import build, with_lora
    from tests.trainers.test_grpo_train_parity import NOT_COMPARED

    logs = {}
    for backend in ("transformers", "engine"):
        trainer = build_trainer("slimrl", model=with_lora(build(arch)), reward_funcs=length_reward,
                                generation_backend=backend, max_steps=2, logging_steps=1, max_completion_length=8,
                                temperature=0.9, seed=5, learning_rate=5e-3)  # fmt: skip
        trainer.train()
        logs[backend] = trainer.state.log_history
    assert len(logs["engine"]) == len(logs["transformers"]) == 3
    for step, (ours, theirs) in enumerate(zip(logs["engine"], logs["transformers"], strict=True)):
        compared = [name for name, value in theirs.items() if name not in NOT_COMPARED and isinstance(value, float)]
        assert "loss" in compared or step == 2
        for name in compared:
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-7), f"{arch}, step {step}: {name}"
