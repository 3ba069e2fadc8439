"""Builds TRL's and slimrl's RLOO trainers on identical tiny LoRA models, and batches to feed both."""

from __future__ import annotations

import warnings

import torch
import trl

import slimrl
from slimrl.testing import tiny_prompt_dataset, tiny_tokenizer
from tests.trainers import step_compare
from tests.trainers.grpo_harness import BATCH, COMPLETION_LEN, generated_batch, lora_tiny_model, zero_reward
from tests.trainers.run_settings import CPU_RUN

# A random tiny model almost never samples EOS; this logit bias makes about half the completions end early, so
# completion lengths (and length rewards) vary, and truncation masking has something to mask.
EOS_BIAS = {"sequence_bias": {(3,): 4.0}}


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 for text in completions]


def length_reward(completions, **kwargs):
    return [-abs(len(text) - 6) / 6 for text in completions]


def build_trainer(kind: str, arch: str = "llama", model=None, reward_funcs=zero_reward, dataset=None, **config):
    """kind: "trl" (unpatched TRL) or "slimrl". Extra keyword arguments go to the config."""
    trainer_cls, config_cls = (trl.RLOOTrainer, trl.RLOOConfig) if kind == "trl" else (slimrl.RLOOTrainer, None)
    config_cls = config_cls or slimrl.RLOOConfig
    settings = dict(
        output_dir=config.pop("output_dir", "/tmp/slimrl-test-rloo"),
        per_device_train_batch_size=BATCH,
        num_generations=4,
        max_completion_length=COMPLETION_LEN,
        **CPU_RUN,
        # TRL's default; off here because recomputing the forward changes no value and would only slow the tests
        gradient_checkpointing=False,
    )
    settings.update(config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=lora_tiny_model(arch) if model is None else model,
            reward_funcs=reward_funcs,
            args=config_cls(**settings),
            train_dataset=tiny_prompt_dataset() if dataset is None else dataset,
            processing_class=tiny_tokenizer(),
        )


def perturb_adapter(trainer, seed: int = 0, scale: float = 0.05) -> None:
    """Move the trained ("default") LoRA weights away from TRL's frozen "ref" copy of them, the same way in every
    trainer given the same seed, so the reference log-probs (and with beta > 0 the KL penalty) differ from the
    policy's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(trainer.model.named_parameters()):
            if ".default." in name:
                param.add_(scale * torch.randn(param.shape, generator=g))


def rloo_batch(trainer, seed: int = 0, ratio_spread: float = 0.3) -> dict:
    """A batch as RLOO's `_generate_and_score_completions` returns it: left-padded prompts, right-padded ragged
    completions (a full-length, a 1-token and an empty one), random advantages and `old_logps` [N] that are the
    model's own sequence log-probs offset by `ratio_spread` x N(0, 1), so ratios fall inside and on both sides of the
    clip range (0: on-policy, every ratio 1)."""
    base = generated_batch(seed)
    batch = {key: base[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():  # TRL's own scoring, on weights both trainers share
        per_token, _, _ = trl.RLOOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, batch["completion_ids"].size(1)
        )
    g = torch.Generator().manual_seed(seed + 1)
    logps = (per_token * batch["completion_mask"]).sum(1)  # [N]
    batch["old_logps"] = logps + ratio_spread * torch.randn(BATCH, generator=g)
    batch["advantages"] = torch.randn(BATCH, generator=g)
    return batch


def loss_grads_metrics(trainer, batch, accumulation: int = 1, train: bool = True):
    """One compute_loss and the backward HF Trainer runs after it. RLOO's loss is not scaled for gradient
    accumulation (`loss_is_scaled_for_ga = False`), so, as the Trainer does, the backward divides it."""
    divide = not trainer.loss_is_scaled_for_ga
    return step_compare.loss_grads_metrics(trainer, batch, accumulation, train, divide=divide)


def generate_and_score(trainer, seed: int = 0) -> tuple[dict, dict]:
    """TRL's `_generate_and_score_completions` on the first generation batch of the trainer's dataloader, from a
    fixed RNG state: (the batch, the metrics it logged)."""
    trainer.model.train()
    trainer._metrics["train"].clear()
    rows = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = trainer._generate_and_score_completions(rows)
    return batch, {name: values[-1] for name, values in trainer._metrics["train"].items()}
