"""What the demo shows while and after it trains: a line of metrics per step (the same names for GRPO, RLOO and
PPO; distillation, which has no reward, shows its divergence to the teacher), a progress bar, the closing summary and
the plot of reward (or divergence) and accuracy over the steps."""

from __future__ import annotations

from pathlib import Path

TIMINGS = ("generation_s", "reward_s", "training_s")  # the step timer's parts of each step, kept in the history


def step_line(step: int, total_steps: int, logs: dict) -> str:
    """One line of a step's metrics from the trainer's logs: total reward, each reward function's mean, the share of
    correct answers in the batch, completion length (tokens), loss and step time. Logs without a reward
    (distillation's, whose loss is the divergence to the teacher) show the student's entropy in place of the rewards."""
    nan = float("nan")
    parts = [f"step {step:3d}/{total_steps}"]
    if "reward" not in logs and "entropy" in logs:
        parts.append(f"entropy {logs['entropy']:.3f}")
    else:
        parts.append(f"reward {logs.get('reward', nan):.3f}")
        for key, value in logs.items():
            if key.startswith("rewards/") and key.endswith("/mean"):
                name = key.removeprefix("rewards/").removesuffix("/mean").removesuffix("_reward")
                parts.append(f"{name} {value:.3f}")
        parts.append(f"batch acc {logs.get('rewards/exact_answer_reward/mean', nan):4.0%}")
    parts.append(f"len {logs.get('completions/mean_length', nan):4.1f}")
    parts.append(f"loss {logs.get('loss', nan):+.4f}")
    parts.append(f"{logs.get('step_time', nan):.1f}s")
    return "  ".join(parts)



def demo_logs(logs: dict) -> dict:
    """A step's logs under the names GRPO and RLOO use: PPO's `objective/scores` becomes `reward` and its reward
    means `rewards/<f>` become `rewards/<f>/mean` (other entries as they are)."""
    if "objective/scores" not in logs:
        return logs
    renamed = {f"{key}/mean" if key.startswith("rewards/") and key.count("/") == 1 else key: value
               for key, value in logs.items()}  # fmt: skip
    renamed.setdefault("reward", logs["objective/scores"])
    return renamed



def progress_callback(algorithm: str, total_steps: int, history: list[dict], timer, on_entry, show: bool = True):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        """A progress bar and one line of metrics per optimizer step; keeps each step's numeric logs, with the step
        timer's split of its time, in `history`, and calls `on_entry()` after each. show=False: no bar, no lines (the
        processes other than the main one of a multi-process run)."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total_steps, desc=algorithm.upper(), unit="step", leave=False, disable=not show)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = demo_logs(logs or {})
            if "loss" not in logs:
                return  # the end-of-training summary (its `train_loss`), not a step
            entry = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            timed = timer.step(state.global_step) or {}
            if "step_time" not in logs and "step_s" in timed:  # PPO logs no step time: the timer's
                logs = {**logs, "step_time": timed["step_s"]}
            entry.update({key: round(timed[key], 4) for key in TIMINGS if key in timed})
            history.append(entry)
            if show:
                self.bar.write(step_line(state.global_step, total_steps, logs))
            on_entry()

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return DemoProgress()



def print_summary(summary: dict, adapter_dir, metrics_path: Path, plot_path: Path) -> None:
    history = summary["history"]
    key, name = headline(summary)
    first, last = _mean(history[:5], key), _mean(history[-5:], key)
    print(f"mean {name}, first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
    if summary["nonfinite_skipped_steps"]:
        print(f"optimizer steps skipped for a non-finite loss or gradient: {summary['nonfinite_skipped_steps']}")
    print(f"adapter: {adapter_dir or 'not saved (non-finite weights)'}\nmetrics: {metrics_path}\nplot:    {plot_path}")
    print(f"total time {summary['total_seconds']:.0f}s (training {summary['train_seconds']:.0f}s)")



def headline(summary: dict) -> tuple[str, str]:
    """(history key, name) of the run's main per-step figure: the reward, or distillation's loss (its divergence)."""
    if summary["settings"].get("algorithm") == "distillation":
        return "loss", "divergence to the teacher (loss)"
    return "reward", "reward"


def _mean(entries: list[dict], key: str) -> float:
    return sum(e[key] for e in entries) / len(entries) if entries else float("nan")



PLOTTED = (("reward", "total reward"), ("rewards/exact_answer_reward/mean", "correct answer (batch accuracy)"),
           ("rewards/format_reward/mean", "requested format"))  # fmt: skip
# distillation's samples are not scored: its divergence to the teacher, and the student's entropy
DISTILLATION_PLOTTED = (("loss", "divergence to the teacher (loss)"), ("entropy", "student entropy"))



def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` before it (a step's reward averages only a few prompts)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]



def plot_history(summary: dict, path: Path, window: int = 5) -> Path:
    """Reward and its correct/format parts per step (faint) with their moving average over `window` steps (solid),
    and the held-out accuracy before and after training as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = summary["history"]
    steps = [h["step"] for h in history]
    algorithm = summary["settings"].get("algorithm", "grpo")
    plotted = DISTILLATION_PLOTTED if algorithm == "distillation" else PLOTTED
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (key, label), color in zip(plotted, ("tab:blue", "tab:green", "tab:orange"), strict=False):
        values = [h.get(key, float("nan")) for h in history]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
        ax.plot(steps, moving_average(values, window), color=color, linewidth=2, label=f"{label}, {window}-step mean")
    before, after = summary["accuracy_before"]["accuracy"], summary["accuracy_after"]["accuracy"]
    last = steps[-1] if steps else 1
    ax.scatter([0, last], [before, after], marker="*", s=180, color="black", zorder=5,
               label=f"held-out accuracy: {before:.0%} before, {after:.0%} after")  # fmt: skip
    algorithm = algorithm.upper()
    ax.set_xlabel(f"{algorithm} step")
    ax.set_ylabel("divergence / entropy / accuracy" if plotted is DISTILLATION_PLOTTED else "reward / accuracy")
    minutes = summary.get("total_seconds", 0) / 60
    ax.set_title(f"slimrl demo: {algorithm} on {summary['settings']['model']} ({summary['device']}, {minutes:.1f} min)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_line(label: str, scores: dict) -> str:
    """The printed line of held-out scores (`label` "before:" or "after: ")."""
    return f"held-out accuracy {label} {scores['accuracy']:.1%} (in the requested format: {scores['in_format']:.1%})"


def record_run(trainer, timer, summary: dict) -> None:
    """What the metrics say of how training ran: the engine, the process count, the ranks' adapters, and with
    offloaded checkpoints how many layer passes were captured and replayed as CUDA graphs (None: no graphs made)."""
    from slimrl.models.checkpointing import offload_state

    summary["rollout_engine_used"] = any("engine_stats" in step for step in timer.steps)
    summary["processes"] = trainer.accelerator.num_processes
    if summary["processes"] > 1:
        summary["ranks_hold_the_same_adapter"] = ranks_hold_the_same_weights(trainer)
    state = offload_state(trainer.accelerator.unwrap_model(trainer.model))
    graphs = None if state is None else state.graphs
    summary["layer_graphs"] = None if graphs is None else {
        name: getattr(graphs, name) for name in ("captures", "replays", "failures", "releases")}  # fmt: skip


def quiet(*args, **kwargs) -> None:
    """What a process other than the main one does instead of printing or writing a file."""


def ranks_hold_the_same_weights(trainer) -> bool:
    """Whether every process holds the same trainable weights, bit for bit (all-gathered, compared on each)."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters() if p.requires_grad])
    gathered = trainer.accelerator.gather(weights[None])  # [processes, numel]
    return bool((gathered == gathered[:1]).all())


__all__ = ["DISTILLATION_PLOTTED", "PLOTTED", "TIMINGS", "accuracy_line", "demo_logs", "headline", "moving_average",
           "plot_history", "print_summary", "progress_callback", "quiet", "ranks_hold_the_same_weights", "record_run",
           "step_line"]  # fmt: skip
