"""The demo: GRPO with slimrl's trainer teaches SmolLM2-135M-Instruct to answer arithmetic in a fixed format.

It measures held-out accuracy before and after, prints a line of metrics per step, and saves the adapter, a metrics
JSON and a plot of reward and accuracy over steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from slimrl.data import arithmetic_dataset
from slimrl.rewards import completion_text, exact_answer_reward, extract_answer, format_reward, is_bare_answer

TINY_MODEL = "tiny"  # a 2-layer model built from a config, for the CLI's own tests


@dataclass
class DemoSettings:
    model: str = "SmolLM2-135M-Instruct"
    steps: int = 50
    output_dir: str = "outputs/demo"
    num_generations: int = 8
    prompts_per_step: int = 2
    max_completion_length: int = 32
    learning_rate: float = 1e-4
    lora_rank: int = 16
    seed: int = 0
    eval_size: int = 48
    device: str = "auto"  # "auto" | "cpu" | "cuda"


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu.")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    return requested


def load_model(settings: DemoSettings, device: str):
    from slimrl import FastLanguageModel

    if settings.model == TINY_MODEL:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    else:
        dtype = None if device == "cuda" else torch.float32
        model, tokenizer = FastLanguageModel.from_pretrained(
            settings.model, max_seq_length=512, dtype=dtype, device_map={"": device}
        )
    model = FastLanguageModel.get_peft_model(
        model,
        r=settings.lora_rank,
        lora_alpha=2 * settings.lora_rank,
        # checkpointing trades compute for memory: worth it on a GPU at scale, not for a 135M model on a CPU
        use_gradient_checkpointing=False,
        random_state=settings.seed,
    )
    return model, tokenizer


@torch.no_grad()
def evaluate(model, tokenizer, dataset, max_new_tokens: int, batch_size: int = 16) -> dict:
    """Greedy answers to held-out problems: accuracy (the reply's final answer is correct) and the share of replies
    that are a bare correct number, as the prompt asks."""
    from slimrl import FastLanguageModel

    FastLanguageModel.for_inference(model)
    correct_count = bare_count = 0
    device = next(model.parameters()).device
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        outputs = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        completions = tokenizer.batch_decode(outputs[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for completion, answer in zip(completions, rows["answer"], strict=True):
            correct = extract_answer(completion) == answer
            correct_count += correct
            bare_count += correct and is_bare_answer(completion)
    FastLanguageModel.for_training(model)
    return {"accuracy": correct_count / len(dataset), "bare_correct": bare_count / len(dataset)}


def _progress_callback(total_steps: int, history: list[dict]):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        """A progress bar and one line of metrics per optimizer step."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total_steps, desc="GRPO", unit="step", leave=False)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            entry = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            history.append(entry)
            self.bar.write(
                f"step {state.global_step:3d}  reward {logs['reward']:.3f}  "
                f"correct {logs.get('rewards/exact_answer_reward/mean', float('nan')):.3f}  "
                f"format {logs.get('rewards/format_reward/mean', float('nan')):.3f}  "
                f"len {logs.get('completions/mean_length', float('nan')):.1f}  "
                f"loss {logs.get('loss', float('nan')):+.4f}  step_time {logs.get('step_time', float('nan')):.1f}s"
            )

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return DemoProgress()


def run_demo(settings: DemoSettings) -> dict:
    from slimrl import FastLanguageModel, GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    device = resolve_device(settings.device)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    print(f"slimrl demo: GRPO on {settings.model} ({device}), {settings.steps} steps -> {out}")

    model, tokenizer = load_model(settings, device)
    train_set = arithmetic_dataset(settings.steps * settings.prompts_per_step, seed=settings.seed, split="train")
    eval_set = arithmetic_dataset(settings.eval_size, seed=settings.seed, split="eval")
    before = evaluate(model, tokenizer, eval_set, settings.max_completion_length)
    print(f"held-out accuracy before: {before['accuracy']:.1%} (bare correct number: {before['bare_correct']:.1%})")

    history: list[dict] = []
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.num_generations * settings.prompts_per_step,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        use_cpu=device == "cpu",
        bf16=device == "cuda" and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=False,
        disable_tqdm=True,
        num_chunks="auto",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer_reward, format_reward],
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[_progress_callback(settings.steps, history)],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # our callback prints a compact line per step instead of the raw dict
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started

    after = evaluate(model, tokenizer, eval_set, settings.max_completion_length)
    print(f"held-out accuracy after:  {after['accuracy']:.1%} (bare correct number: {after['bare_correct']:.1%})")
    adapter_dir = FastLanguageModel.save_lora(model, tokenizer, out / "adapter", overwrite=True)
    summary = {
        "settings": asdict(settings),
        "device": device,
        "accuracy_before": before,
        "accuracy_after": after,
        "history": history,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    metrics_path = out / "metrics.json"
    metrics_path.write_text(json.dumps(summary, indent=2))
    plot_path = plot_history(summary, out / "reward.png")
    print(f"adapter: {adapter_dir}\nmetrics: {metrics_path}\nplot:    {plot_path}")
    print(f"total time {summary['total_seconds']:.0f}s (training {summary['train_seconds']:.0f}s)")
    return summary


def plot_history(summary: dict, path: Path) -> Path:
    """Reward (and its correct/format parts) per step, with the held-out accuracy before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = summary["history"]
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward", "total reward"), ("rewards/exact_answer_reward/mean", "correct answer"),
                       ("rewards/format_reward/mean", "answer format")):  # fmt: skip
        ax.plot(steps, [h.get(key, float("nan")) for h in history], marker=".", label=label)
    last = steps[-1] if steps else 1
    ax.scatter([0, last], [summary["accuracy_before"]["accuracy"], summary["accuracy_after"]["accuracy"]],
               marker="*", s=160, color="black", zorder=5, label="held-out accuracy (before, after)")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(f"slimrl GRPO on {summary['settings']['model']} ({summary['device']})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["DemoSettings", "completion_text", "run_demo"]
