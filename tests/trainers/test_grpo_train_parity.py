"""trainer.train() for a few steps: slimrl and unpatched TRL, same seed, same generations -> the same logged curve."""

from __future__ import annotations

from slimrl.testing import tiny_model, tiny_tokenizer
from tests.trainers.grpo_harness import build_trainer
from tests.trainers.step_compare import assert_logged_values_close

# Logged values that measure time or are slimrl's own additions, not training results.
NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                "train_tokens_per_second", "peak_gpu_memory_GiB"}  # fmt: skip


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 for text in completions]


def length_reward(completions, **kwargs):
    return [-abs(len(text) - 6) / 6 for text in completions]


def train_log(kind: str, **config) -> list[dict]:
    trainer = build_trainer(
        kind,
        reward_funcs=[digit_reward, length_reward],
        max_steps=3,
        logging_steps=1,
        learning_rate=5e-3,
        seed=7,
        max_completion_length=8,
        # a random tiny model almost never samples EOS; a logit bias makes about half the completions terminate,
        # so truncation masking leaves real tokens to train on
        generation_kwargs={"sequence_bias": {(3,): 4.0}},
        **config,
    )
    trainer.train()
    return trainer.state.log_history


def assert_same_curves(reference: list[dict], ours: list[dict]) -> None:
    assert len(ours) == len(reference)
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        assert set(expected) - NOT_COMPARED <= set(actual), f"step {step}: missing {set(expected) - set(actual)}"
    assert_logged_values_close(reference, ours, NOT_COMPARED)
    losses = [entry["loss"] for entry in reference if "loss" in entry]
    assert losses and any(loss != 0.0 for loss in losses), f"the curve is trivial: losses {losses}"
    assert any(entry.get("entropy", 0.0) > 0 for entry in reference), "no token was trained on"


def test_train_curve_matches_trl_with_every_option():
    """LoRA policy, reference by disabled adapter (beta > 0), 2 iterations per generation, gradient accumulation,
    truncated-completion masking, top-entropy tokens, entropy bonus and two weighted reward functions."""
    config = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.04,
        mask_truncated_completions=True,
        top_entropy_quantile=0.8,
        entropy_coef=0.01,
        reward_weights=[1.0, 0.5],
        loss_type="dapo",
    )
    reference = train_log("trl", **config)
    ours = train_log("slimrl", num_chunks=3, **config)
    assert_same_curves(reference, ours)


def test_train_curve_matches_trl_with_separate_reference_model(tmp_path):
    """A full fine-tune from a saved checkpoint: TRL loads a separate reference model from the same path."""
    path = tmp_path / "tiny"
    tiny_model("qwen2").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    config = dict(beta=0.1, loss_type="grpo", steps_per_generation=2, importance_sampling_level="sequence")
    reference = train_log("trl", model=str(path), **config)
    ours = train_log("slimrl", model=str(path), num_chunks=8, **config)
    assert_same_curves(reference, ours)
