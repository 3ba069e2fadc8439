"""slimrl's distillation trainer against unpatched TRL: same loss, gradient on every LoRA weight and metrics for a
fixed generated batch at beta 0 (forward KL), 0.5 (JSD) and 1 (reverse KL) and 1, 2 and 8 chunks; the chunks really
split the micro-batch; the same logged curve over a short train() whose rollouts come from slimrl's engine.

Both trainers get identical tiny models: a LoRA student (Llama, hidden 64) and a teacher of another architecture and
width (Qwen2, hidden 96) over the same vocabulary, so the two LM heads differ in shape as in real distillation."""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest
import torch
import trl

from slimrl.models.checkpointing import offload_state
from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from slimrl.trainers.distillation.trainer import DistillationConfig, DistillationTrainer
from tests.tolerances import assert_close
from tests.trainers import step_compare
from tests.trainers.grpo_harness import generated_batch, lora_tiny_model
from tests.trainers.run_settings import CPU_RUN, spy_on_engine_generate
from tests.trainers.step_compare import assert_logged_values_close, assert_same_step
from tests.trainers.trainer_cache import TrainerCache

BETAS = [0.0, 0.5, 1.0]


def teacher():
    return tiny_model("qwen2", seed=5, hidden_size=96)


def build_trainer(kind: str, **config):
    """kind: "trl" (unpatched TRL) or "slimrl"; keyword arguments go to the config."""
    trainer_cls, config_cls = ((trl.DistillationTrainer, trl.DistillationConfig) if kind == "trl"
                               else (DistillationTrainer, DistillationConfig))  # fmt: skip
    settings = dict(output_dir="/tmp/slimrl-test-distillation", per_device_train_batch_size=8,
                    max_completion_length=12, gradient_checkpointing=False, **CPU_RUN)  # fmt: skip
    settings.update(config)
    if kind == "trl":
        settings.pop("num_chunks", None)
        settings.pop("generation_backend", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(model=lora_tiny_model(), teacher_model=teacher(), args=config_cls(**settings),
                           train_dataset=tiny_prompt_dataset(), processing_class=tiny_tokenizer())  # fmt: skip


def distillation_batch(seed: int = 0, tools: bool = False) -> dict:
    """A micro-batch as TRL's `_generate_and_score_completions` returns it: left-padded prompts, right-padded ragged
    completions (full-length, 1-token and empty ones), and the generation batch's loss-token count (it spans two
    micro-batches). `tools`: a tool_mask whose zeros (tool results) sit inside completions."""
    base = generated_batch(seed)
    batch = {key: base[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    mask = batch["completion_mask"]
    if tools:
        tool_mask = torch.ones_like(mask)
        tool_mask[0, 3:6] = 0
        tool_mask[2, 1:3] = 0
        batch["tool_mask"] = tool_mask
        mask = mask * tool_mask
    batch["num_items_in_batch"] = mask.sum() * 2
    return batch


_trainers = TrainerCache()
_expected = TrainerCache()


def trainers(beta: float, temperature: float = 1.0):
    """TRL's and slimrl's trainers, built once per temperature; beta is what TRL's loss reads off the trainer
    (`self.beta`, copied from the config at construction), so each test sets it on both."""
    if temperature not in _trainers:
        _trainers[temperature] = tuple(build_trainer(kind, temperature=temperature) for kind in ("trl", "slimrl"))
    for trainer in _trainers[temperature]:
        trainer.beta = trainer.args.beta = beta
    return _trainers[temperature]


def step(trainer, batch, train: bool = True):
    # TRL's loss is already scaled for accumulation (`loss_is_scaled_for_ga`): the Trainer does not divide it
    return step_compare.loss_grads_metrics(trainer, batch, train=train, divide=False)


def expected_step(key, trainer, batch, train: bool = True):
    """TRL's step for a case, computed once (it does not depend on slimrl's num_chunks)."""
    if key not in _expected:
        _expected[key] = step(trainer, batch, train)
    return _expected[key]


def spy_on_chunks(monkeypatch) -> list[tuple[int, int]]:
    """(rows, completion columns) of every batch TRL's `_compute_loss` (one backbone pass of student and teacher, and
    the divergence over their heads) is given."""
    calls = []
    original = trl.DistillationTrainer._compute_loss

    def spy(self, unwrapped_student, inputs, num_items_in_batch):
        calls.append(tuple(inputs["completion_ids"].shape))
        return original(self, unwrapped_student, inputs, num_items_in_batch)

    monkeypatch.setattr(trl.DistillationTrainer, "_compute_loss", spy)
    return calls


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_loss_matches_trl(beta, num_chunks, monkeypatch):
    reference, ours = trainers(beta)
    batch = distillation_batch()
    expected = expected_step(("train", beta), reference, batch)
    ours.args.num_chunks = num_chunks
    calls = spy_on_chunks(monkeypatch)
    assert_same_step(expected, step(ours, batch), f"beta={beta}, num_chunks={num_chunks}", nonzero_reference=True)
    # the micro-batch of 8 really ran as `num_chunks` passes, each cut to its longest completion
    assert len(calls) == num_chunks and sum(rows for rows, _ in calls) == 8
    assert num_chunks == 1 or min(width for _, width in calls) < batch["completion_ids"].size(1)
    assert expected[0] > 0 and expected[2]["entropy"] > 0


def test_betas_select_different_divergences():
    """Forward KL, JSD and reverse KL give three different losses on the batch above (so each parity case pins its
    own branch of TRL's divergence), related as the math says: KL is convex in its second argument, so with the
    mixture m = (p_s + p_t) / 2, KL(p_t || m) <= KL(p_t || p_s) / 2 and KL(p_s || m) <= KL(p_s || p_t) / 2, hence per
    token JSD <= (forward KL + reverse KL) / 4, and the three losses share one normaliser."""
    losses = {beta: expected_step(("train", beta), trainers(beta)[0], distillation_batch())[0].item()
              for beta in BETAS}  # fmt: skip
    assert len(set(losses.values())) == 3
    assert 0 < losses[0.5] <= (losses[0.0] + losses[1.0]) / 4


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_temperature_and_tool_mask_match_trl(beta, monkeypatch):
    """A softened distribution (temperature 0.7) and tool-result tokens left out of the loss (tool_mask), in 3
    chunks: TRL's loss, gradients and metrics."""
    reference, ours = trainers(beta, temperature=0.7)
    batch = distillation_batch(seed=1, tools=True)
    expected = expected_step(("tools", beta), reference, batch)
    ours.args.num_chunks = 3
    calls = spy_on_chunks(monkeypatch)
    assert_same_step(expected, step(ours, batch), f"temperature 0.7, tool mask, beta={beta}", nonzero_reference=True)
    assert len(calls) == 3


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_eval_loss_and_metrics_match_trl(num_chunks):
    """In eval (no grad) TRL divides by the micro-batch's own loss tokens, not the generation batch's count."""
    reference, ours = trainers(0.5)
    batch = distillation_batch(seed=2)
    expected = expected_step(("eval", 0.5), reference, batch, train=False)
    ours.args.num_chunks = num_chunks
    assert_same_step(expected, step(ours, batch, train=False), f"eval, {num_chunks} chunks", train=False)


def test_return_outputs_falls_back_to_trl(caplog):
    reference, ours = trainers(1.0)
    batch = distillation_batch()
    ours.args.num_chunks = 4
    results = []
    for trainer in (reference, ours):
        trainer.model.eval()
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
            results.append(trainer.compute_loss(trainer.model, dict(batch), return_outputs=True))
    assert "because return_outputs=True asks for the outputs" in caplog.text
    assert results[1][1] is None
    assert_close(results[1][0], results[0][0], name="loss")


# Logged values that measure time, not training results.
NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def test_train_curve_on_the_engine_matches_trl(monkeypatch):
    """Three optimizer steps of 2 accumulated micro-batches with gradient checkpointing (TRL's default) and the JSD:
    slimrl with its engine generating the student's rollouts (its eager path on the CPU, drawing as transformers'
    generate does), 3 chunks per micro-batch and its offloaded checkpoints (plain copies on the CPU) logs TRL's
    curve, completion lengths included."""
    config = dict(beta=0.5, max_steps=3, logging_steps=1, learning_rate=5e-3, seed=7, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, gradient_checkpointing=True, max_completion_length=6,
                  temperature=0.9)  # fmt: skip
    calls = spy_on_engine_generate(monkeypatch)
    logs = {}
    ours = dict(num_chunks=3, generation_backend="engine", offload_checkpoints=True)
    for kind, extra in (("trl", {}), ("slimrl", ours)):
        trainer = build_trainer(kind, **config, **extra)
        trainer.train()
        logs[kind] = trainer.state.log_history
    assert trainer.generation_backend == "engine"
    assert offload_state(trainer.model).split_recomputes > 0, "the student's layers ran through slimrl's checkpoints"
    assert calls == [(8, 0.9, "multinomial", False, 6)] * 3, "one engine rollout of the generation batch per step"
    assert_logged_values_close(logs["trl"], logs["slimrl"], NOT_COMPARED)
    assert all(set(theirs) <= set(ours) for theirs, ours in zip(logs["trl"], logs["slimrl"], strict=True))
    losses = [entry["loss"] for entry in logs["trl"] if "loss" in entry]
    assert len(losses) == 3 and len(set(losses)) == 3, f"the curve is trivial: losses {losses}"


def test_constructor_takes_trls_arguments_and_config():
    """TRL's signature, and a plain trl.DistillationConfig gains slimrl's fields at their defaults."""
    ours, theirs = inspect.signature(DistillationTrainer.__init__), inspect.signature(trl.DistillationTrainer.__init__)
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
        (p.name, p.default, p.kind) for p in theirs.parameters.values()
    ]
    args = trl.DistillationConfig(output_dir="/tmp/slimrl-test-distillation", **CPU_RUN)
    trainer = DistillationTrainer(lora_tiny_model(), teacher(), args, tiny_prompt_dataset(),
                                  processing_class=tiny_tokenizer())  # fmt: skip
    assert (trainer.args.num_chunks, trainer.args.generation_backend) == ("auto", "auto")
    assert trainer.generation_backend == "transformers" or torch.cuda.is_available()
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        DistillationTrainer(lora_tiny_model(), teacher(), args, tiny_prompt_dataset().rename_column("prompt", "q"),
                            processing_class=tiny_tokenizer())  # fmt: skip
