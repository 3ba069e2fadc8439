"""The demo's algorithms: which trainer and config each one runs, the config's settings taken from the demo's
(`settings` below is a slimrl.cli.demo.DemoSettings), how many training problems a step samples, and distillation's
teacher.

Every algorithm sees as many completions per step: GRPO and RLOO sample `num_generations` completions of
`prompts_per_step` problems; PPO and distillation sample one completion of each of `num_generations x
prompts_per_step` problems (PPO's value head is its baseline, and distillation compares a completion with the
teacher's distribution, not with other completions).

Distillation's teacher is SmolLM2 made better at the task, then frozen: by default the base model after a few steps
of SFT on correct answers to training problems (`--teacher-steps`), or the base with a trained adapter merged into it
(`--teacher-adapter`, e.g. the `adapter` folder a GRPO demo run saved). The student is the base with a fresh LoRA.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from slimrl.data import INSTRUCTION, arithmetic_rows, split_size

ALGORITHMS = ("grpo", "rloo", "ppo", "distillation")
PPO_EPOCHS = 2  # optimizer steps per PPO rollout: --steps 50 is 25 rollouts
TEACHER_BATCH = 8  # SFT rows per teacher step: 12 steps took the 135M model from 42% to 79% (examples/offline_*)
TEACHER_LEARNING_RATE = 2e-4
# TRL's DistillationTrainer reads only `_generate_single_turn` of the step timer's phases: it has no reward phase
DISTILLATION_PHASES = {"generation": "_generate_single_turn"}


def common_config_kwargs(settings, output_dir: Path, device: str) -> dict:
    """The settings every algorithm's config shares: one optimizer step per logged line, no checkpoints."""
    return dict(
        output_dir=str(output_dir),
        max_steps=settings.steps,
        gradient_accumulation_steps=1,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        use_cpu=device == "cpu",
        bf16=device == "cuda" and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=settings.gradient_checkpointing,
        disable_tqdm=True,
        num_chunks="auto",
        generation_backend=settings.generation_backend,
        on_nonfinite=settings.on_nonfinite,
        **({} if settings.keep_attention_tokens is None else {"keep_attention_tokens": settings.keep_attention_tokens}),
        layer_cuda_graphs=settings.layer_cuda_graphs,
    )


def grpo_config_kwargs(settings, output_dir: Path, device: str) -> dict:
    """The demo's GRPOConfig settings (RLOO's are the same without GRPO's loss_type)."""
    return dict(
        common_config_kwargs(settings, output_dir, device),
        per_device_train_batch_size=settings.num_generations * settings.prompts_per_step,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        beta=0.0,  # no reference model: half the forward passes, and LoRA keeps the policy near the base anyway
        loss_type="dapo",
        temperature=1.0,
        generation_device=settings.generation_device,
        async_generation=settings.async_generation,
    )


def ppo_config_kwargs(settings, output_dir: Path, device: str) -> dict:
    """The demo's PPOConfig settings: a rollout of num_generations x prompts_per_step problems (as many completions
    as a GRPO step), trained on for PPO_EPOCHS optimizer steps; value head on the policy, KL to the base model."""
    return dict(
        common_config_kwargs(settings, output_dir, device),
        per_device_train_batch_size=settings.num_generations * settings.prompts_per_step,
        num_mini_batches=1,
        num_ppo_epochs=PPO_EPOCHS,
        response_length=settings.max_completion_length,
        # at 1.0 the 135M model samples a correct answer to few problems; one completion each leaves little to learn
        temperature=0.7,
        kl_coef=0.02,
        vf_coef=0.1,
    )


def distillation_config_kwargs(settings, output_dir: Path, device: str) -> dict:
    """The demo's DistillationConfig settings: one completion of each of num_generations x prompts_per_step problems
    per step, sampled by the student; the loss is the reverse KL to the teacher (beta 1, TRL's default)."""
    return dict(
        common_config_kwargs(settings, output_dir, device),
        per_device_train_batch_size=settings.num_generations * settings.prompts_per_step,
        max_completion_length=settings.max_completion_length,
        beta=1.0,
        temperature=1.0,
    )


def trainer_and_config(settings, output_dir: Path, device: str) -> tuple[type, type, dict]:
    """The trainer class, its config class and the config's settings for `settings.algorithm`."""
    if settings.algorithm == "ppo":
        from slimrl.trainers.ppo.trainer import PPOConfig, PPOTrainer

        return PPOTrainer, PPOConfig, ppo_config_kwargs(settings, output_dir, device)
    if settings.algorithm == "distillation":
        from slimrl.trainers.distillation.trainer import DistillationConfig, DistillationTrainer

        return DistillationTrainer, DistillationConfig, distillation_config_kwargs(settings, output_dir, device)
    kwargs = grpo_config_kwargs(settings, output_dir, device)
    if settings.algorithm == "rloo":
        from slimrl.trainers.rloo.trainer import RLOOConfig, RLOOTrainer

        del kwargs["loss_type"]  # RLOO has one loss
        return RLOOTrainer, RLOOConfig, kwargs
    from slimrl.trainers.grpo.config import GRPOConfig
    from slimrl.trainers.grpo.trainer import GRPOTrainer

    return GRPOTrainer, GRPOConfig, kwargs


def problems_per_step(settings) -> float:
    """Distinct training problems an optimizer step samples (a PPO rollout's spread over its PPO_EPOCHS steps)."""
    if settings.algorithm == "ppo":
        return settings.num_generations * settings.prompts_per_step / PPO_EPOCHS
    if settings.algorithm == "distillation":
        return settings.num_generations * settings.prompts_per_step
    return settings.prompts_per_step


def correct_replies(n: int, seed: int = 0, difficulty: str = "medium"):
    """`n` training problems as SFT rows: the demo's prompt (a user turn) and a correct reply in the requested format
    ('7 + 9 = 16'). From the train split, so the held-out problems stay unseen."""
    from datasets import Dataset

    rows = []
    for row in arithmetic_rows(n, seed=seed, difficulty=difficulty, split="train"):
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        rows.append({"prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
                     "completion": [{"role": "assistant", "content": f"{expression} = {row['answer']}"}]})  # fmt: skip
    return Dataset.from_list(rows)


def distillation_teacher(base, tokenizer, output_dir: Path, device: str, *, adapter: str | None = None,
                         steps: int = 12, lora_rank: int = 16, seed: int = 0, difficulty: str = "medium"):  # fmt: skip
    """The teacher, from `base` (the student's base model, loaded a second time; it is changed in place): with
    `adapter`, that LoRA adapter merged into it; else `steps` SFT steps of TEACHER_BATCH correct replies on a fresh
    LoRA, merged. Returned frozen, in eval mode: a plain model, no adapter left to switch."""
    from peft import PeftModel

    if adapter is not None:
        teacher = PeftModel.from_pretrained(base, adapter)
    else:
        teacher = _sft_teacher(base, tokenizer, output_dir, device, steps, lora_rank, seed, difficulty)
    teacher = teacher.merge_and_unload()
    teacher.requires_grad_(False)
    return teacher.eval()


def _sft_teacher(base, tokenizer, output_dir: Path, device: str, steps: int, lora_rank: int, seed: int,
                 difficulty: str):  # fmt: skip
    from transformers.trainer_callback import PrinterCallback

    from slimrl import FastLanguageModel
    from slimrl.trainers.sft.trainer import SFTConfig, SFTTrainer

    model = FastLanguageModel.get_peft_model(base, r=lora_rank, lora_alpha=2 * lora_rank,
                                             use_gradient_checkpointing=False, random_state=seed)  # fmt: skip
    config = SFTConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=TEACHER_BATCH,
                       learning_rate=TEACHER_LEARNING_RATE, logging_steps=steps, save_strategy="no", report_to="none",
                       seed=seed, use_cpu=device == "cpu", bf16=device == "cuda" and torch.cuda.is_bf16_supported(),
                       gradient_checkpointing=False, disable_tqdm=True)  # fmt: skip
    # past the train split's size the trainer goes round it again
    rows = min(steps * TEACHER_BATCH, split_size(difficulty, "train"))
    data = correct_replies(rows, seed=seed, difficulty=difficulty)
    with _no_dataset_progress_bars():  # TRL's tokenising bars would break up the demo's output
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # the SFT log is not the demo's to print
    trainer.train()
    return model


@contextlib.contextmanager
def _no_dataset_progress_bars():
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


__all__ = ["ALGORITHMS", "DISTILLATION_PHASES", "PPO_EPOCHS", "common_config_kwargs",
           "correct_replies", "distillation_config_kwargs", "distillation_teacher", "grpo_config_kwargs",
           "ppo_config_kwargs", "problems_per_step", "trainer_and_config"]  # fmt: skip
