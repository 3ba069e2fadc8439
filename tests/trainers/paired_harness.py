"""Builds TRL's and slimrl's ORPO/CPO trainers on identical tiny LoRA models, and a collated batch of pairs to feed
both."""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


from slimrl.testing import tiny_tokenizer  # noqa: E402
from tests.trainers import step_compare  # noqa: E402
from tests.trainers.grpo_harness import lora_tiny_model  # noqa: E402
from tests.trainers.run_settings import CPU_RUN  # noqa: E402

PAIRS = 6  # pairs per micro-batch in the parity tests

# Prompts, chosen and rejected answers of different byte lengths (the tiny tokenizer is byte-level): the chosen
# answer is sometimes the longer one, sometimes the shorter, and one pair's answers are a single byte each.
_ROWS = [
    ("What is 2+3?", "5", "It is 6, I think."),
    ("Name a colour of the sky on a clear day, please.", "Blue, on a clear day.", "Green"),
    ("Hi", "Hello! How can I help?", "Go away."),
    ("Spell cat backwards.", "tac", "act"),
    ("Is ice cold? Answer yes or no and explain why in a few words.", "Yes: it is frozen water.", "No"),
    ("Say A.", "A", "B"),
    ("Count to five.", "1 2 3 4 5", "1 2 3"),
    ("Capital of France?", "Paris", "Lyon, the largest city of France by far."),
]


def preference_rows(n: int = 8, conversational: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        prompt, chosen, rejected = _ROWS[i % len(_ROWS)]
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def preference_dataset(n: int = 8, conversational: bool = False):
    from datasets import Dataset

    return Dataset.from_list(preference_rows(n, conversational))


def trainer_classes(algorithm: str, kind: str):
    """(trainer class, config class) of "orpo" or "cpo", from unpatched TRL ("trl") or slimrl ("slimrl")."""
    if kind == "trl":
        from trl.experimental import cpo, orpo

        module = orpo if algorithm == "orpo" else cpo
    else:
        from slimrl.trainers.cpo import trainer as cpo
        from slimrl.trainers.orpo import trainer as orpo

        module = orpo if algorithm == "orpo" else cpo
    prefix = algorithm.upper()
    return getattr(module, f"{prefix}Trainer"), getattr(module, f"{prefix}Config")


def build_trainer(algorithm: str, kind: str, model=None, dataset=None, arch: str = "llama", **config):
    """algorithm: "orpo" or "cpo"; kind: "trl" (unpatched TRL) or "slimrl". Keyword arguments go to the config."""
    if kind == "trl":
        config.pop("num_chunks", None)
        config.pop("drop_chunk_padding", None)
    return build_with_classes(*trainer_classes(algorithm, kind), algorithm, model, dataset, arch, **config)


def build_with_classes(trainer_cls, config_cls, algorithm: str, model=None, dataset=None, arch: str = "llama",
                       eval_dataset=None, **config):  # fmt: skip
    """A trainer of these classes with the harness's settings (`config` overrides them)."""
    settings = dict(
        output_dir=config.pop("output_dir", f"/tmp/slimrl-test-{algorithm}"),
        per_device_train_batch_size=PAIRS,
        max_length=128,
        **CPU_RUN,
        gradient_checkpointing=False,
        beta=0.2,
    )
    settings.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=lora_tiny_model(arch) if model is None else model,
            args=config_cls(**settings),
            train_dataset=preference_dataset() if dataset is None else dataset,
            eval_dataset=eval_dataset,
            processing_class=tiny_tokenizer(),
        )


def collated_batch(trainer, pairs: int = PAIRS) -> dict:
    """The trainer's own collation of its first `pairs` tokenized rows (what the dataloader would yield)."""
    rows = [trainer.train_dataset[i] for i in range(pairs)]
    return trainer.data_collator(rows)


def loss_grads_metrics(trainer, batch: dict, accumulation: int = 1, train: bool = True):
    """One compute_loss (+ backward in train mode), or in eval one prediction_step: the loss value, each trainable
    parameter's grad, the metrics TRL stored for the call (the latest value of each)."""
    mode = step_compare.begin_step(trainer, accumulation, train, store="_stored_metrics")
    inputs = step_compare.cloned(batch)
    if train:
        loss = trainer.compute_loss(trainer.model, inputs)
        (loss / accumulation).backward()  # what HF Trainer's training_step does with ORPO's and CPO's loss
    else:
        loss, _, _ = trainer.prediction_step(trainer.model, inputs, prediction_loss_only=True)
    grads = step_compare.trainable_grads(trainer.model)
    return loss.detach(), grads, step_compare.latest_metrics(trainer, mode, "_stored_metrics")


assert_same_step = step_compare.assert_same_step


# Logged values that measure time, not training.
NOT_COMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}


def assert_same_curves(reference: list[dict], ours: list[dict]) -> None:
    assert len(ours) == len(reference)
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        assert set(expected) == set(actual), f"step {step}: logged {sorted(actual)}, TRL {sorted(expected)}"
    step_compare.assert_logged_values_close(reference, ours, NOT_COMPARED)
    losses = [entry["loss"] for entry in reference if "loss" in entry]
    assert len(losses) >= 2 and losses[0] != losses[-1], f"the weights did not move: losses {losses}"


def train_log(algorithm: str, patched: bool, **config) -> list[dict]:
    """trainer.train() through trl's public names, after PatchFastRL(algorithm) when `patched`: the log history."""
    import importlib

    from slimrl.patching import PatchFastRL, unpatch

    if patched:
        PatchFastRL(algorithm)
    try:
        module = importlib.import_module(f"trl.experimental.{algorithm}")
        trainer_cls = getattr(module, f"{algorithm.upper()}Trainer")
        ours = trainer_classes(algorithm, "slimrl")[0]
        assert (trainer_cls is ours) == patched, f"{trainer_cls} after PatchFastRL={patched}"
        if not patched:
            config.pop("num_chunks", None)
        settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
                        learning_rate=5e-3, seed=3)  # fmt: skip
        settings.update(config)
        trainer = build_with_classes(trainer_cls, getattr(module, f"{algorithm.upper()}Config"), algorithm, **settings)
        trainer.train()
    finally:
        if patched:
            unpatch(algorithm)
    return trainer.state.log_history
