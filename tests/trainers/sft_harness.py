"""Builds TRL's and slimrl's SFT and reward trainers on identical tiny LoRA models and datasets, collates one batch
from the prepared data for both, and runs one training step on each."""

from __future__ import annotations

import math
import random
import string
import warnings

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig, get_peft_model

import slimrl
from slimrl.testing import tiny_config, tiny_tokenizer
from tests.tolerances import assert_close
from tests.trainers import step_compare
from tests.trainers.grpo_harness import lora_tiny_model

BATCH = 8

# slimrl.testing's ChatML template with the assistant turns (their end-of-turn token included) inside
# {% generation %} markers: what TRL's assistant_only_loss needs to build the assistant mask
GENERATION_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def words(rng: random.Random, low: int, high: int) -> str:
    """Lowercase text of low..high characters (one token each under the byte tokenizer)."""
    return "".join(rng.choice(string.ascii_lowercase + "  ") for _ in range(rng.randint(low, high))).strip() or "a"


def sft_dataset(kind: str, n: int = 12, seed: int = 0) -> Dataset:
    """kind: "text" (language modeling), "short_text" (the same, 2 to 12 characters: several fit a packed row),
    "prompt_completion", or "messages" (multi-turn chat). Ragged lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if kind == "text":
            rows.append({"text": words(rng, 3, 30)})
        elif kind == "short_text":
            rows.append({"text": words(rng, 2, 12)})
        elif kind == "prompt_completion":
            rows.append({"prompt": words(rng, 2, 12), "completion": words(rng, 1, 14)})
        elif kind == "messages":
            turns = [("user", 2, 10), ("assistant", 1, 8), ("user", 1, 6), ("assistant", 2, 9)]
            rows.append({"messages": [{"role": role, "content": words(rng, lo, hi)} for role, lo, hi in turns]})
        else:
            raise ValueError(kind)
    return Dataset.from_list(rows)


def preference_dataset(n: int = 12, seed: int = 0, margin: bool = False) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = {"prompt": words(rng, 2, 10), "chosen": words(rng, 1, 16), "rejected": words(rng, 1, 16)}
        if margin:
            row["margin"] = rng.uniform(-1.0, 1.0)
        rows.append(row)
    return Dataset.from_list(rows)


def lora_reward_model():
    """A tiny LlamaForSequenceClassification (one label) with LoRA on every linear layer and a trainable score head;
    init_lora_weights=False makes B non-zero, so every LoRA matrix gets a gradient."""
    from transformers import LlamaForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(tiny_config(num_labels=1, pad_token_id=0))
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                            task_type="SEQ_CLS")  # fmt: skip
        return get_peft_model(model, config)


def common_settings(**config) -> dict:
    settings = dict(output_dir="/tmp/slimrl-test-sft", per_device_train_batch_size=BATCH, report_to="none",
                    save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True)  # fmt: skip
    settings.update(config)
    return settings


def classes(kind: str, name: str) -> tuple[type, type]:
    """kind: "trl" (unpatched TRL), "slimrl", or "patched" (whatever trl's names point to now)."""
    source = slimrl if kind == "slimrl" else trl
    return getattr(source, f"{name}Trainer"), getattr(source, f"{name}Config")


def build_sft(kind: str, dataset=None, model=None, tokenizer=None, trainer_kwargs: dict | None = None, args=None,
              **config):  # fmt: skip
    """kind: see `classes`. Keyword arguments go to the config (or `args` is the trainer's args), `trainer_kwargs`
    to the trainer."""
    trainer_cls, config_cls = classes(kind, "SFT")
    settings = common_settings(**config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL's deprecations (label smoothing, ...)
        return trainer_cls(
            model=lora_tiny_model() if model is None else model,
            args=config_cls(**settings) if args is None else args,
            train_dataset=sft_dataset("text") if dataset is None else dataset,
            processing_class=tiny_tokenizer() if tokenizer is None else tokenizer,
            **(trainer_kwargs or {}),
        )


def build_reward(kind: str, dataset=None, model=None, **config):
    trainer_cls, config_cls = classes(kind, "Reward")
    settings = common_settings(output_dir="/tmp/slimrl-test-reward", **config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL's deprecations (label smoothing, ...)
        return trainer_cls(
            model=lora_reward_model() if model is None else model,
            args=config_cls(**settings),
            train_dataset=preference_dataset() if dataset is None else dataset,
            processing_class=tiny_tokenizer(),
        )


def collated_batch(trainer, size: int = BATCH) -> dict:
    """A batch of the trainer's prepared train dataset, through its own collator."""
    return trainer.data_collator([trainer.train_dataset[i] for i in range(size)])


def one_step(trainer, batch, accumulation: int = 1, num_items_in_batch=None, train: bool = True):
    """One training_step (the Trainer's: compute_loss, accumulation scaling, backward) or one evaluation
    prediction_step: the loss, each trainable parameter's grad, the metrics logged, and the eval logits (or None)."""
    model = trainer.model
    mode = step_compare.begin_step(trainer, accumulation, train)
    inputs = step_compare.cloned(batch)
    logits = None
    if train:
        loss = trainer.training_step(model, inputs, num_items_in_batch)
    else:
        loss, logits, _ = trainer.prediction_step(model, inputs, prediction_loss_only=logits_wanted(trainer))
    return loss.detach(), step_compare.trainable_grads(model), step_compare.latest_metrics(trainer, mode), logits


def logits_wanted(trainer) -> bool:
    """prediction_loss_only for the trainer's evaluation: a reward model's evaluation always returns its rewards."""
    return not isinstance(trainer, trl.RewardTrainer)


def assert_same_step(expected, actual, label: str) -> None:
    """Loss, gradients (none of TRL's zero) and metrics as every parity test compares them, then the eval logits."""
    step_compare.assert_same_step(expected[:3], actual[:3], label, train=None, nonzero_reference=True)
    logits_e, logits_a = expected[3], actual[3]
    assert (logits_a is None) == (logits_e is None), f"{label}: logits returned by one side only"
    if logits_e is not None:
        first = lambda logits: logits[0] if isinstance(logits, tuple) else logits  # noqa: E731
        assert_close(first(logits_a), first(logits_e), name=f"{label}: eval logits")


TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def assert_same_curves(reference: list[dict], ours: list[dict]) -> None:
    """Two trainer.train() log histories: the same entries, the same values at rel 1e-4, and a curve that moves."""
    assert len(ours) == len(reference)
    losses = [entry["loss"] for entry in reference if "loss" in entry]
    assert len(losses) == 3 and len(set(losses)) == 3, f"the curve does not move: {losses}"
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        assert set(actual) == set(expected), f"step {step}: keys {sorted(actual)} != {sorted(expected)}"
        for name, value in expected.items():
            if name in TIMING or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            # three Adam steps carry the first step's fp32 summation-order difference forward
            assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step}: {name}"
