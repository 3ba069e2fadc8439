"""Builds TRL's and slimrl's GRPO trainers on identical tiny models, and a fixed generated batch to feed both."""

from __future__ import annotations

import warnings

import torch
import trl
from peft import LoraConfig, get_peft_model

import slimrl
from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from tests.trainers import step_compare
from tests.trainers.run_settings import CPU_RUN

BATCH, PROMPT_LEN, COMPLETION_LEN = 8, 5, 12
COMPLETION_LENGTHS = [12, 3, 7, 12, 1, 9, 5, 0]  # ragged, with a full-length, a 1-token and an empty completion


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def lora_tiny_model(arch: str = "llama"):
    # init_lora_weights=False makes B non-zero, so every LoRA matrix gets a gradient
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(tiny_model(arch), config)


def build_trainer(kind: str, arch: str = "llama", model=None, reward_funcs=zero_reward, dataset=None,
                  trainer_kwargs: dict | None = None, **config):  # fmt: skip
    """kind: "trl" (unpatched TRL) or "slimrl". Extra keyword arguments go to the config, `trainer_kwargs` to the
    trainer (tools, environment_factory, rollout_func, ...)."""
    trainer_cls, config_cls = (trl.GRPOTrainer, trl.GRPOConfig) if kind == "trl" else (slimrl.GRPOTrainer, None)
    config_cls = config_cls or slimrl.GRPOConfig
    settings = dict(
        output_dir=config.pop("output_dir", "/tmp/slimrl-test-grpo"),
        per_device_train_batch_size=BATCH,
        num_generations=4,
        max_completion_length=COMPLETION_LEN,
        **CPU_RUN,
    )
    settings.update(config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config_cls(**settings)
        return trainer_cls(
            model=lora_tiny_model(arch) if model is None else model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=tiny_prompt_dataset() if dataset is None else dataset,
            processing_class=tiny_tokenizer(),
            **(trainer_kwargs or {}),
        )


def generated_batch(seed: int = 0, old_logps: bool = False, ref_logps: bool = False, token_advantages: bool = False):
    """A batch as `_generate_and_score_completions` returns it: left-padded prompts, right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(BATCH, PROMPT_LEN, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[3, :1] = 0
    completion_mask = torch.zeros(BATCH, COMPLETION_LEN, dtype=torch.long)
    for row, length in enumerate(COMPLETION_LENGTHS):
        completion_mask[row, :length] = 1
    batch = {
        "prompt_ids": torch.randint(4, 260, (BATCH, PROMPT_LEN), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, 260, (BATCH, COMPLETION_LEN), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(BATCH, COMPLETION_LEN, generator=g)
        if token_advantages
        else torch.randn(BATCH, generator=g),
        "num_items_in_batch": completion_mask.sum().float() * 2,  # the generation batch spans 2 micro-batches
        "old_per_token_logps": None,
    }
    # Log-probs of a random tiny model over 264 tokens are around -5.6; offsets of +-0.4 put ratios on both sides
    # of every clipping bound.
    if old_logps:
        batch["old_per_token_logps"] = -5.6 + 0.4 * torch.randn(BATCH, COMPLETION_LEN, generator=g)
    if ref_logps:
        batch["ref_per_token_logps"] = -5.6 + 0.4 * torch.randn(BATCH, COMPLETION_LEN, generator=g)
    return batch


def loss_grads_metrics(trainer, batch, accumulation: int = 1, train: bool = True):
    """One compute_loss (+ backward in train mode; GRPO's loss is already divided for accumulation)."""
    return step_compare.loss_grads_metrics(trainer, batch, accumulation, train, divide=False)
