"""The demo: slimrl's GRPO (or RLOO, or PPO) teaches SmolLM2-135M-Instruct to answer arithmetic in a fixed format;
or, with distillation, SmolLM2 learns it from a teacher built from SmolLM2 (demo_algorithms.py says how).

It measures held-out accuracy before and after, prints a line of metrics per step, and saves the adapter, a metrics
JSON and a plot of reward (distillation: divergence to the teacher) and accuracy over steps. Every algorithm sees the
same problems and as many completions per step (demo_algorithms.py: each algorithm's trainer and settings).
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

from slimrl.cli.demo_algorithms import (
    ALGORITHMS,
    DISTILLATION_PHASES,
    distillation_teacher,
    grpo_config_kwargs,
    ppo_config_kwargs,
    problems_per_step,
    trainer_and_config,
)
from slimrl.cli.demo_report import accuracy_line, plot_history, print_summary, progress_callback, quiet, record_run
from slimrl.data import DIFFICULTIES, arithmetic_dataset, split_size
from slimrl.rewards import exact_answer_reward, extract_answer, format_reward, is_in_format, normalise_number

TINY_MODEL = "tiny"  # a 2-layer model built from a config, for the CLI's own tests
DEVICES = ("auto", "cpu", "cuda")
GENERATION_BACKENDS = ("auto", "engine", "transformers")  # GRPOConfig.generation_backend, without vLLM
ON_NONFINITE = ("raise", "skip")  # GRPOConfig.on_nonfinite


@dataclass
class DemoSettings:
    """The demo's settings; the defaults finish in about 15 minutes on 2 CPU cores (872 s measured). `slimrl demo
    --help` says what each one means."""

    algorithm: str = "grpo"  # "grpo" | "rloo" | "ppo" | "distillation"
    model: str = "SmolLM2-135M-Instruct"
    steps: int = 50
    output_dir: str = "outputs/demo"
    num_generations: int = 8
    prompts_per_step: int = 2
    max_completion_length: int = 32
    learning_rate: float = 1e-4  # 2e-4 collapses the samples of a prompt to one reply within ~15 steps
    lora_rank: int = 16
    seed: int = 0
    eval_size: int = 100
    difficulty: str = "medium"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    generation_backend: str = "auto"  # "auto" (slimrl's engine on CUDA) | "engine" | "transformers"
    on_nonfinite: str = "raise"  # a non-finite loss or gradient norm: "raise" NonFiniteError | "skip" the step
    load_in_4bit: bool = False  # the base in NF4 (bitsandbytes), LoRA over it
    generation_device: str | None = None  # GRPO/RLOO: the engine in a process of its own there, fed the LoRA
    async_generation: bool = False  # GRPO with generation_device: the next step generated while this one trains
    # the trainer's gradient checkpointing (on CUDA: slimrl's offloaded checkpoints, MLP in tiles); a 135M model does
    # not need it, but it runs the training step as a long-context run would
    gradient_checkpointing: bool = False
    keep_attention_tokens: int | None = None  # GRPOConfig.keep_attention_tokens (None: the config's default)
    layer_cuda_graphs: bool = True  # GRPOConfig.layer_cuda_graphs (repeated layer passes replayed as CUDA graphs)
    # distillation's teacher: the base with this LoRA adapter merged (a folder a demo run saved), else the base after
    # teacher_steps SFT steps on correct answers to training problems
    teacher_adapter: str | None = None
    teacher_steps: int = 12

    def validate(self) -> None:
        """A ValueError naming the first bad setting and what to use instead."""
        positive = ("steps", "prompts_per_step", "max_completion_length", "lora_rank", "eval_size", "teacher_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}.")
        if self.num_generations < 2:
            raise ValueError(f"--num-generations must be at least 2 (GRPO and RLOO compare completions of a prompt "
                             f"with each other; PPO and distillation take this many times the prompts), got "
                             f"{self.num_generations}.")  # fmt: skip
        if not self.learning_rate > 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}.")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"--difficulty must be one of {', '.join(DIFFICULTIES)}, got {self.difficulty!r}.")
        for name, choices in (("device", DEVICES), ("generation_backend", GENERATION_BACKENDS),
                              ("on_nonfinite", ON_NONFINITE)):  # fmt: skip
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got "
                                 f"{getattr(self, name)!r}.")  # fmt: skip
        if self.load_in_4bit and self.model == TINY_MODEL:
            raise ValueError("--load-in-4bit loads a real model's weights in 4 bits; the tiny model is built from a "
                             "config in full precision. Drop --load-in-4bit, or name a model.")  # fmt: skip
        if self.generation_device is not None and self.algorithm not in ("grpo", "rloo"):
            raise ValueError(f"--generation-device is for grpo and rloo (the demo's {self.algorithm} generates in the "
                             "training process); drop it or use --algorithm grpo.")  # fmt: skip
        if self.async_generation and (self.generation_device is None or self.algorithm != "grpo"):
            raise ValueError("--async-generation overlaps GRPO's next rollout with this step's training on a rollout "
                             "device: use it with --algorithm grpo and --generation-device (e.g. cuda:1).")  # fmt: skip
        self._validate_teacher()
        held_out = split_size(self.difficulty, "eval")
        if self.eval_size > held_out:
            raise ValueError(f"--eval-size {self.eval_size} is more than the {held_out} held-out {self.difficulty} "
                             f"problems; use at most {held_out} or --difficulty hard.")  # fmt: skip

    def _validate_teacher(self) -> None:
        if self.teacher_adapter is None:
            return
        if self.algorithm != "distillation":
            raise ValueError(f"--teacher-adapter is distillation's teacher; use it with --algorithm distillation, or "
                             f"drop it for {self.algorithm}.")  # fmt: skip
        if not (Path(self.teacher_adapter) / "adapter_config.json").is_file():
            raise ValueError(f"--teacher-adapter {self.teacher_adapter!r} holds no adapter_config.json; pass the "
                             "folder of a saved LoRA adapter (a demo run saves one in <output-dir>/adapter), or drop "
                             "it to build the teacher with --teacher-steps of SFT.")  # fmt: skip


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu.")
    if requested not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}.")
    return requested


def load_model(settings: DemoSettings, device: str, lora: bool = True):
    """(model, tokenizer) of `settings.model` on `device`, with a fresh LoRA adapter unless `lora` is False."""
    from slimrl import FastLanguageModel

    if settings.model == TINY_MODEL:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama").to(device), tiny_tokenizer()
    else:
        dtype = None if device == "cuda" else torch.float32
        model, tokenizer = FastLanguageModel.from_pretrained(
            settings.model, max_seq_length=512, dtype=dtype, device_map={"": device}, load_in_4bit=settings.load_in_4bit
        )
    if not lora:
        return model, tokenizer
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
    """Greedy replies to held-out problems: `accuracy` (the reply's final answer is correct) and `in_format` (the
    reply is one short line ending with a number, as the prompt asks)."""
    from slimrl import FastLanguageModel

    FastLanguageModel.for_inference(model)
    correct_count = format_count = 0
    device = next(model.parameters()).device
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        outputs = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        replies = tokenizer.batch_decode(outputs[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for reply, answer in zip(replies, rows["answer"], strict=True):
            correct_count += extract_answer(reply) == normalise_number(answer)
            format_count += is_in_format(reply)
    FastLanguageModel.for_training(model)
    return {"accuracy": correct_count / len(dataset), "in_format": format_count / len(dataset)}


def set_cpu_threads() -> int:
    """All cores for torch's CPU kernels unless OMP_NUM_THREADS says otherwise (the user knows the machine is
    shared). Returns the thread count."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return torch.get_num_threads()


def write_json(path: str | Path, data, indent: int = 2) -> None:
    """Write `data` as JSON through a temporary file and a rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=indent))
    os.replace(partial, path)


def nonfinite_skipped_steps(history: list[dict]) -> list[int]:
    """The steps whose update was dropped for a non-finite loss or gradient (GRPOConfig on_nonfinite="skip")."""
    return [entry["step"] for entry in history if entry.get("nonfinite_skipped", 0) > 0]


def _train(trainer, summary: dict) -> float:
    """Train; a NonFiniteError ends training early and is recorded in `summary` instead of raised. Returns seconds."""
    from slimrl import NonFiniteError

    started = time.perf_counter()
    try:
        trainer.train()
    except NonFiniteError as error:
        step = trainer.state.global_step + 1
        summary["nonfinite_error"] = {"during": "training", "step": step, "message": str(error)}
        print(f"training stopped at step {step}: NonFiniteError: {error}")
    return time.perf_counter() - started


def _save_adapter(model, tokenizer, out: Path, summary: dict) -> str | None:
    """Save the adapter; non-finite weights are refused (NonFiniteError), recorded in `summary` and not saved."""
    from slimrl import FastLanguageModel, NonFiniteError

    try:
        return FastLanguageModel.save_lora(model, tokenizer, out / "adapter", overwrite=True)
    except NonFiniteError as error:
        summary["nonfinite_error"] = summary["nonfinite_error"] or {"during": "saving", "step": None,
                                                                    "message": str(error)}  # fmt: skip
        print(f"adapter not saved: NonFiniteError: {error}")
        return None


def _build_trainer(settings: DemoSettings, model, tokenizer, train_set, out: Path, device: str, summary: dict,
                   save, show: bool = True, teacher=None) -> tuple:  # fmt: skip
    from transformers.trainer_callback import PrinterCallback

    from slimrl.trainers.common.step_timer import StepTimer

    timer = StepTimer()
    trainer_class, config_class, kwargs = trainer_and_config(settings, out / "trainer", device)
    # distillation learns the teacher's next-token distribution; the other algorithms the arithmetic rewards
    task = {"teacher_model": teacher} if teacher is not None else {"reward_funcs": [exact_answer_reward, format_reward]}
    trainer = trainer_class(
        model=model,
        args=config_class(**kwargs),
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[progress_callback(settings.algorithm, settings.steps, summary["history"], timer, save, show)],
        **task,
    )
    if teacher is not None:
        trainer.timed_phases = DISTILLATION_PHASES  # the step timer's phases (no reward phase)
    timer.attach(trainer)
    trainer.remove_callback(PrinterCallback)  # our callback prints a compact line per step instead of the raw dict
    return trainer, timer


def _teacher(settings: DemoSettings, device: str, eval_set, summary: dict, say):
    """Distillation's teacher (demo_algorithms.distillation_teacher), its held-out scores recorded and printed."""
    base, tokenizer = load_model(settings, device, lora=False)
    made = f"adapter {settings.teacher_adapter} merged" if settings.teacher_adapter else \
        f"{settings.teacher_steps} SFT steps on correct answers"  # fmt: skip
    say(f"teacher: {settings.model} + {made}")
    teacher = distillation_teacher(base, tokenizer, Path(settings.output_dir) / "trainer", device,
                                   adapter=settings.teacher_adapter, steps=settings.teacher_steps,
                                   lora_rank=settings.lora_rank, seed=settings.seed,
                                   difficulty=settings.difficulty)  # fmt: skip
    summary["teacher_accuracy"] = evaluate(teacher, tokenizer, eval_set, settings.max_completion_length)
    say(accuracy_line("teacher:", summary["teacher_accuracy"]))
    return teacher.eval()  # evaluate hands a model back in training mode


def demo_datasets(settings: DemoSettings) -> tuple:
    """(train set, held-out set) of the run's arithmetic problems."""
    # the trainer cycles through the train split when the run asks for more problems than it holds
    one_batch = settings.num_generations * settings.prompts_per_step  # PPO's rollout needs this many problems
    wanted = max(round(settings.steps * problems_per_step(settings)), one_batch)
    train_size = min(wanted, split_size(settings.difficulty, "train"))
    train_set = arithmetic_dataset(train_size, seed=settings.seed, difficulty=settings.difficulty, split="train")
    eval_set = arithmetic_dataset(settings.eval_size, seed=settings.seed, difficulty=settings.difficulty, split="eval")
    return train_set, eval_set


def run_demo(settings: DemoSettings) -> dict:
    """Evaluate, train (GRPO, RLOO, PPO or distillation), evaluate again; save the adapter, metrics JSON and plot.
    Returns the metrics (distillation's also hold the teacher's held-out scores, `teacher_accuracy`).

    metrics.json is rewritten after every step (`status` "training"), so a run cut short keeps its curve. A
    NonFiniteError during training (GRPOConfig on_nonfinite="raise") ends training early: it is recorded
    (`raised_nonfinite_error`, `nonfinite_error`), and the model is still evaluated and saved (the check runs
    before the optimizer step, so the weights are the last good ones; non-finite weights are not saved).

    Under a launcher (`accelerate launch --num_processes N -m slimrl.cli demo`) every process evaluates and trains;
    only the main one prints and writes files, and the metrics record whether all ranks ended with the same adapter."""
    from accelerate import PartialState

    settings.validate()
    started = time.perf_counter()
    device = resolve_device(settings.device)
    main_process = PartialState(cpu=device == "cpu").is_main_process  # as the trainer will set it up
    say = print if main_process else quiet
    write = write_json if main_process else quiet
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = set_cpu_threads() if device == "cpu" else None
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    where = f"{device}, {threads} threads" if threads else device
    say(f"slimrl demo: {settings.algorithm.upper()} on {settings.model} ({where}), {settings.steps} steps -> {out}")

    model, tokenizer = load_model(settings, device)
    train_set, eval_set = demo_datasets(settings)
    say(f"example prompt: {eval_set[0]['prompt'][-1]['content']!r} (answer {eval_set[0]['answer']})")
    before = evaluate(model, tokenizer, eval_set, settings.max_completion_length)
    say(accuracy_line("before:", before))

    metrics_path = out / "metrics.json"
    summary = {"settings": asdict(settings), "device": device, "torch_threads": threads, "accuracy_before": before,
               "history": [], "status": "training", "nonfinite_error": None}  # fmt: skip
    teacher = _teacher(settings, device, eval_set, summary, say) if settings.algorithm == "distillation" else None
    write(metrics_path, summary)  # rewritten after every step
    trainer, timer = _build_trainer(settings, model, tokenizer, train_set, out, device, summary,
                                    save=lambda: write(metrics_path, summary), show=main_process,
                                    teacher=teacher)  # fmt: skip
    train_seconds = _train(trainer, summary)
    record_run(trainer, timer, summary)
    if main_process and (out / "trainer").is_dir() and not any((out / "trainer").iterdir()):
        (out / "trainer").rmdir()  # TRL makes its output_dir; with save_strategy="no" it stays empty

    after = evaluate(model, tokenizer, eval_set, settings.max_completion_length)
    say(accuracy_line("after: ", after))
    adapter_dir = _save_adapter(model, tokenizer, out, summary) if main_process else None
    summary.update(accuracy_after=after, adapter_saved=adapter_dir is not None, train_seconds=round(train_seconds, 1),
                   total_seconds=round(time.perf_counter() - started, 1),
                   raised_nonfinite_error=summary["nonfinite_error"] is not None,
                   nonfinite_skipped_steps=nonfinite_skipped_steps(summary["history"]),
                   status="nonfinite_error" if summary["nonfinite_error"] else "finished")  # fmt: skip
    write(metrics_path, summary)
    if main_process:
        print_summary(summary, adapter_dir, metrics_path, plot_history(summary, out / "reward.png"))
    return summary


__all__ = [
    "ALGORITHMS",
    "demo_datasets",
    "load_model",
    "DemoSettings",
    "evaluate",
    "grpo_config_kwargs",
    "nonfinite_skipped_steps",
    "ppo_config_kwargs",
    "run_demo",
    "write_json",
]
