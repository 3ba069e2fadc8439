"""Builds TRL's and slimrl's KTO trainers on identical tiny models, and a collated batch to feed both."""

from __future__ import annotations

import warnings

import torch
import trl
from datasets import Dataset
from peft import LoraConfig

import slimrl
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.trainers import step_compare
from tests.trainers.grpo_harness import lora_tiny_model

BATCH = 8
# Labels of the first micro-batch: 5 desirable, 3 undesirable, not alternating.
LABELS = [True, False, True, True, False, True, False, True]


def kto_rows(n: int = 16, labels: list[bool] | None = None) -> list[dict]:
    """Unpaired rows with prompts of 4 to 10 bytes and completions of 3 to 27 (EOS added by TRL)."""
    labels = labels or LABELS
    rows = []
    for i in range(n):
        prompt = f"Q{i % 10}:" + "x" * ((5 * i) % 7)
        completion = " " + "ab" * (1 + (3 * i) % 13)
        rows.append({"prompt": prompt, "completion": completion, "label": labels[i % len(labels)]})
    return rows


def kto_dataset(n: int = 16, labels: list[bool] | None = None) -> Dataset:
    return Dataset.from_list(kto_rows(n, labels))


def lora_config() -> LoraConfig:
    # init_lora_weights=False makes B non-zero, so every LoRA matrix gets a gradient and the policy differs from the
    # base model (the reference when the adapter is disabled)
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def shift_reference_adapter(model, scale: float = 0.5, seed: int = 3) -> None:
    """Move the "ref" adapter (TRL's frozen copy of the policy's) by seeded noise, so that policy and reference
    differ and the KL reference point is positive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".ref." in name:
                param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=g))


def build_trainer(kind: str, model=None, dataset=None, trainer_kwargs: dict | None = None, reference: str = "adapter",
                  **config):  # fmt: skip
    """kind: "trl" (unpatched TRL) or "slimrl". reference: "adapter" (a LoRA model: TRL copies its adapter as the
    reference, shifted here), "disabled" (TRL wraps the base model with a peft_config: the reference is the adapter
    disabled) or "model" (a full fine-tune with a separate reference model). Keyword arguments go to the config."""
    trainer_cls, config_cls = (trl.KTOTrainer, trl.KTOConfig) if kind == "trl" else (slimrl.KTOTrainer, None)
    config_cls = config_cls or slimrl.KTOConfig
    settings = dict(output_dir=config.pop("output_dir", "/tmp/slimrl-test-kto"), per_device_train_batch_size=BATCH,
                    report_to="none", save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True,
                    gradient_checkpointing=False, logging_steps=1, beta=0.5)  # fmt: skip
    settings.update(config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    kwargs = dict(trainer_kwargs or {})
    if model is None:
        model = {"adapter": lora_tiny_model, "disabled": tiny_model, "model": tiny_model}[reference]()
    if reference == "disabled":
        kwargs.setdefault("peft_config", lora_config())
    if reference == "model":
        kwargs.setdefault("ref_model", tiny_model(seed=5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renamed gradient-checkpointing methods
        trainer = trainer_cls(model=model, args=config_cls(**settings),
                              train_dataset=kto_dataset() if dataset is None else dataset,
                              processing_class=tiny_tokenizer(), **kwargs)  # fmt: skip
    if reference == "adapter" and not settings.get("precompute_ref_log_probs"):
        shift_reference_adapter(trainer.model)
    return trainer


def first_batch(trainer) -> dict:
    """The trainer's first training micro-batch, as its dataloader collates it."""
    return next(iter(trainer.get_train_dataloader()))


loss_grads_metrics = step_compare.loss_grads_metrics  # divided for accumulation, as HF Trainer divides
