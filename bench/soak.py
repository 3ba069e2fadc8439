"""Soak: N runs of the demo's GRPO (slimrl's trainer teaching SmolLM2-135M-Instruct arithmetic) side by side on one
device, each a `python -m slimrl.cli demo` subprocess with its own seed, to see whether training is reliable: does
every run improve, does any collapse, does any step go non-finite, and do runs of the same seed repeat each other.

Per run (from the demo's metrics.json, which the demo rewrites after every step, and its exit status):
  held-out accuracy before and after (greedy, 100 problems by default), the reward curve (each step's mean reward,
  and the means of the first 5 and last 5 steps), the step timer's generation / reward / training seconds per step
  (median and max), completion lengths, whether slimrl's rollout engine generated, and non-finite events: a
  NonFiniteError that stopped training (demo exit 1), steps skipped with --on-nonfinite skip (`nonfinite_skipped`),
  NaN/inf loss or grad norm in the step logs.
  Collapse: accuracy after below before, or the last 10 steps' reward all 0 with completions at the length cap.
Summary: runs finished / improved / collapsed / with a non-finite event; for a seed run more than once, whether its
runs logged identical curves (reward, loss, completion length per step). The environment (GPU, torch,
transformers, peft, trl, triton) is recorded; a markdown table for docs/benchmarks.md is printed at the end.

    python bench/soak.py $OUT/soak.json [--runs 5] [--steps 100] [--seeds 0 1 2 3 4] [--parallel N] [--device cuda]
        [--model SmolLM2-135M-Instruct] [--time-limit SECONDS] [--runs-dir DIR] [--variants NAME=FLAGS ...]
        [demo flags, e.g. --generation-backend transformers]

--variants runs every seed once per variant, each with its own demo flags besides the common ones, e.g. an A/B of
the layer graphs: `--variants graphs= eager=--no-layer-cuda-graphs --parallel 1 --gradient-checkpointing`. The
variants of a seed run in turn, in the given order for the first seed, reversed for the second, and so on (so that
a warm-up or a drift does not always fall on the same variant); with --parallel 1 they do not share the device.
The summary gives each variant's training-phase seconds (the median of its runs' medians, and the sum over its runs
of every step but the first), and the same-seed check then says whether the variants trained identically.

Flags soak.py does not know go to every demo run (checked against the demo's parser first). The JSON is rewritten
every few seconds while the runs go; --time-limit stops the runs still going after that many seconds (their
partial curves are kept). Each run's output (log.txt, metrics.json, adapter, plot) is in --runs-dir/run<i>_seed<s>/
(default a new folder under /tmp: the device machine returns only a few files from $OUT); the JSON holds what the
report needs, with the end of the log of each run that did not finish cleanly; a failed run's line under PROBLEM
ends with the exception its log ends with (a model not installed on a fresh machine, say).
The exit status is 1 when a run failed, timed out or stopped on a non-finite step, or soak.py itself raised (the
traceback is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
from common import Report, default_output, environment, markdown_table, mean, median, rounded  # noqa: E402

SRC = HERE.parent / "src"
OWN_FLAGS = ("--seed", "--steps", "--output-dir", "--device", "--model")  # soak.py sets these for every run
POLL_S = 2.0
LOG_TAIL_LINES = 40


# -- one run's numbers -------------------------------------------------------------------------------------------


def is_bad(value) -> bool:
    """True for a NaN or infinite number."""
    return isinstance(value, float) and not math.isfinite(value)


def collapse_reasons(metrics: dict, history: list[dict]) -> list[str]:
    """Why this run counts as collapsed (empty: it did not)."""
    reasons = []
    before, after = metrics.get("accuracy_before"), metrics.get("accuracy_after")
    if before and after and after["accuracy"] < before["accuracy"]:
        reasons.append(f"accuracy fell from {before['accuracy']:.2f} to {after['accuracy']:.2f}")
    cap = metrics.get("settings", {}).get("max_completion_length")
    last = history[-10:]
    if len(last) == 10 and cap and all(h.get("reward") == 0 for h in last):
        lengths = [h.get("completions/mean_length") for h in last]
        if all(isinstance(n, int | float) and n >= cap for n in lengths):
            reasons.append(f"the last 10 steps' reward is 0 with completions at the {cap}-token cap")
    return reasons


def nonfinite_events(metrics: dict, history: list[dict]) -> dict:
    error = metrics.get("nonfinite_error")
    return {
        "raised": error is not None,
        "raised_at_step": error["step"] if error else None,
        "message": error["message"] if error else None,
        "skipped_steps": [h["step"] for h in history if h.get("nonfinite_skipped", 0) > 0],
        "nan_loss_steps": [h["step"] for h in history if is_bad(h.get("loss"))],
        "nan_grad_norm_steps": [h["step"] for h in history if is_bad(h.get("grad_norm"))],
    }


def spread(values: list) -> dict:
    return {"median": median(values), "max": max(values) if values else None}


def run_numbers(metrics: dict) -> dict:
    """What a run measured, from its (possibly partial) metrics.json."""
    history = metrics.get("history", [])
    training = [h["training_s"] for h in history if "training_s" in h]
    rewards = [h.get("reward") for h in history]
    lengths = [h.get("completions/mean_length") for h in history]
    nonfinite = nonfinite_events(metrics, history)
    before, after = metrics.get("accuracy_before"), metrics.get("accuracy_after")
    return {
        "steps_done": len(history),
        "demo_status": metrics.get("status"),
        "accuracy_before": before["accuracy"] if before else None,
        "accuracy_after": after["accuracy"] if after else None,
        "in_format_before": before["in_format"] if before else None,
        "in_format_after": after["in_format"] if after else None,
        "reward_first5": mean(rewards[:5]),
        "reward_last5": mean(rewards[-5:]),
        "rewards": rewards,
        "losses": [h.get("loss") for h in history],
        "completion_lengths": lengths,
        "completion_length_mean": mean(lengths),
        "completion_length_first5_last5": [mean(lengths[:5]), mean(lengths[-5:])],
        "generation_s": spread([h["generation_s"] for h in history if "generation_s" in h]),
        "reward_s": spread([h["reward_s"] for h in history if "reward_s" in h]),
        "training_s": spread(training),
        "training_s_after_first": sum(training[1:]) if len(training) > 1 else None,
        "step_time_s": spread([h["step_time"] for h in history if "step_time" in h]),
        "rollout_engine_used": metrics.get("rollout_engine_used"),
        "layer_graphs": metrics.get("layer_graphs"),  # captured / replayed layer passes (None: none made)
        "train_seconds": metrics.get("train_seconds"),
        "nonfinite": nonfinite,
        "nonfinite_event": nonfinite["raised"] or any(nonfinite[k] for k in nonfinite if k.endswith("_steps")),
        "collapse_reasons": collapse_reasons(metrics, history),
    }


def read_metrics(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet (the demo writes it whole, by rename)


# -- processes ---------------------------------------------------------------------------------------------------


def demo_command(args, run: dict) -> list[str]:
    own = ["--model", args.model, "--device", args.device, "--seed", str(run["seed"]), "--steps", str(args.steps),
           "--output-dir", run["dir"]]  # fmt: skip
    return [sys.executable, "-m", "slimrl.cli", "demo", *own, *args.demo_args, *run.get("variant_args", [])]


def child_env(args) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    if args.device == "cpu" and "OMP_NUM_THREADS" not in env:  # share the cores instead of oversubscribing them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    return env


def start(args, run: dict) -> subprocess.Popen:
    Path(run["dir"]).mkdir(parents=True, exist_ok=True)
    log = open(Path(run["dir"]) / "log.txt", "w")  # noqa: SIM115 - closed when the run is collected
    command = demo_command(args, run)
    run.update(status="running", command=shlex.join(command), started=time.time())
    # same process group as soak.py (no new session): whatever stops soak.py stops its runs too
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(args))
    process.log = log
    return process


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the run, SIGKILL it if it is still there after 10 s."""
    for signal_it, wait in ((process.terminate, 10), (process.kill, 5)):
        if process.poll() is not None:
            return
        signal_it()
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(run: dict) -> str:
    try:
        lines = (Path(run["dir"]) / "log.txt").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(line for line in lines[-LOG_TAIL_LINES:] if not line.startswith("GRPO:"))


def refresh(run: dict) -> None:
    metrics = read_metrics(Path(run["dir"]) / "metrics.json")
    if metrics is not None:
        run.update(run_numbers(metrics))


def collect(run: dict, process: subprocess.Popen, timed_out: bool = False) -> None:
    """Fill in a finished (or stopped) run."""
    process.log.close()
    run["exit_code"] = process.returncode
    run["wall_s"] = round(time.time() - run.pop("started"), 1)
    refresh(run)
    if timed_out:
        run["status"] = "timeout"
    elif process.returncode == 0:
        run["status"] = "ok"
    elif process.returncode == 1 and run.get("nonfinite", {}).get("raised"):
        run["status"] = "nonfinite_error"
    else:
        run["status"] = "failed"
    if run["status"] != "ok":
        run["log_tail"] = log_tail(run)


def run_all(args, report: Report) -> None:
    """Run the demos, at most --parallel at once, rewriting the report as they go."""
    runs, waiting, going = report["runs"], list(report["runs"]), {}
    began = time.time()
    try:
        while waiting or going:
            while waiting and len(going) < args.parallel:
                run = waiting.pop(0)
                going[run["index"]] = (run, start(args, run))
            time.sleep(POLL_S)
            late = args.time_limit is not None and time.time() - began > args.time_limit
            for index, (run, process) in list(going.items()):
                stopped = late and process.poll() is None
                if stopped:
                    stop(process)
                if process.poll() is not None:
                    collect(run, process, timed_out=stopped)
                    del going[index]
                else:
                    refresh(run)
            if late:
                for run in waiting:
                    run["status"] = "not_started"
                waiting = []
            report["summary"] = summarise(runs)
            report.save()
    finally:
        for run, process in going.values():  # an exception or a signal: leave no run behind
            stop(process)
            collect(run, process, timed_out=True)


# -- report ------------------------------------------------------------------------------------------------------


CURVES = ("rewards", "losses", "completion_lengths")  # compared step by step between runs of one seed


def first_difference(runs: list[dict]) -> int | None:
    """The first step (1-based) at which the runs' logged curves differ, or None where they are identical."""
    curves = [list(zip(*(r.get(name) or [] for name in CURVES), strict=True)) for r in runs]
    for step, values in enumerate(zip(*curves, strict=False)):
        if len({repr(v) for v in values}) > 1:  # repr: NaN equals NaN here
            return step + 1
    lengths = {len(c) for c in curves}
    return min(lengths) + 1 if len(lengths) > 1 else None


def same_seed_runs(runs: list[dict]) -> list[dict]:
    """For each seed run more than once: whether its runs logged identical curves (reward, loss, length per step)."""
    by_seed: dict[int, list[dict]] = {}
    for run in runs:
        by_seed.setdefault(run["seed"], []).append(run)
    result = []
    for seed, group in by_seed.items():
        if len(group) > 1:
            difference = first_difference(group)
            steps = [r.get("steps_done") for r in group]
            identical = difference is None and all(steps)
            result.append({"seed": seed, "runs": [r["index"] for r in group], "steps": steps,
                           "identical_curves": identical, "first_difference_step": difference})  # fmt: skip
    return result


def summarise(runs: list[dict]) -> dict:
    finished = [r for r in runs if r.get("accuracy_after") is not None]
    return {
        "runs": len(runs),
        "finished": len(finished),
        "improved": sum(r["accuracy_after"] > r["accuracy_before"] for r in finished),
        "collapsed": sum(bool(r.get("collapse_reasons")) for r in runs),
        "nonfinite": sum(bool(r.get("nonfinite_event")) for r in runs),
        "failed": sum(r.get("status") in ("failed", "timeout", "not_started") for r in runs),
        "accuracy_before_mean": mean(r["accuracy_before"] for r in finished),
        "accuracy_after_mean": mean(r["accuracy_after"] for r in finished),
        "same_seed": same_seed_runs(runs),
        "variants": variant_times(runs),
    }


def variant_times(runs: list[dict]) -> dict:
    """Per variant (--variants): its runs' training-phase seconds, the median of their medians and the sum of every
    step but each run's first."""
    by_variant: dict[str, list[dict]] = {}
    for run in runs:
        if "variant" in run:
            by_variant.setdefault(run["variant"], []).append(run)
    result = {}
    for name, group in by_variant.items():
        medians = [r["training_s"]["median"] for r in group if (r.get("training_s") or {}).get("median") is not None]
        sums = [r["training_s_after_first"] for r in group if r.get("training_s_after_first") is not None]
        result[name] = {"runs": [r["index"] for r in group], "training_s_median": median(medians),
                        "training_s_after_first_sum": sum(sums) if len(sums) == len(group) else None}  # fmt: skip
    return result


def pair(a, b, digits: int = 2, joint: str = " -> ") -> str | None:
    if a is None and b is None:
        return None
    return joint.join("-" if v is None else f"{v:.{digits}f}" for v in (a, b))


def median_max(phase: dict | None) -> str | None:
    return pair((phase or {}).get("median"), (phase or {}).get("max"), 3, " / ")


def table(report: Report) -> str:
    varied = ["variant"] if any("variant" in r for r in report["runs"]) else []
    header = ["run", "seed", *varied, "status", "steps", "accuracy before -> after", "reward first 5 -> last 5",
              "gen s median / max", "train s median / max", "mean length", "non-finite", "collapsed"]  # fmt: skip
    rows = []
    for r in report["runs"]:
        length = r.get("completion_length_mean")
        rows.append([r["index"], r["seed"], *[r.get(v) for v in varied], r.get("status"), r.get("steps_done"),
                     pair(r.get("accuracy_before"), r.get("accuracy_after")),
                     pair(r.get("reward_first5"), r.get("reward_last5")),
                     median_max(r.get("generation_s")), median_max(r.get("training_s")),
                     None if length is None else f"{length:.1f}", "yes" if r.get("nonfinite_event") else "no",
                     "; ".join(r.get("collapse_reasons") or []) or "no"])  # fmt: skip
    return markdown_table(header, rows)


def problems(runs: list[dict], engine_expected: bool) -> list[str]:
    """Runs that did not finish cleanly, and (on CUDA, unless transformers was asked for) runs that did not
    generate with slimrl's rollout engine."""
    found = []
    for r in runs:
        if engine_expected and r.get("steps_done") and r.get("rollout_engine_used") is False:
            found.append(f"run {r['index']} (seed {r['seed']}) generated with transformers on CUDA, not the engine")
        if r.get("status") == "nonfinite_error":
            found.append(f"run {r['index']} (seed {r['seed']}) stopped: NonFiniteError at step "
                         f"{r['nonfinite']['raised_at_step']}")  # fmt: skip
        elif r.get("status") != "ok":
            why = last_error(r.get("log_tail", "")) if r.get("status") == "failed" else ""
            found.append(f"run {r['index']} (seed {r['seed']}): {r.get('status')} (exit {r.get('exit_code')})"
                         + (f": {why}" if why else ""))  # fmt: skip
    return found


def last_error(tail: str) -> str:
    """The exception line a failed run's log ends with (`Name: message` after a traceback), else ''."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not any(line.startswith("Traceback") for line in lines):
        return ""
    return next((line for line in reversed(lines) if not line.startswith(("File ", "^", "~")) and ":" in line), "")


# -- main --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # "--seed" is the demo's flag, not short for "--seeds"
    parser.add_argument("out", nargs="?", default=default_output("soak.json"), help="the JSON report (*.json)")
    parser.add_argument("--runs", type=int, default=5, help="runs, with seeds 0..runs-1 (unless --seeds)")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", help="one seed per run; repeat one to check determinism")
    parser.add_argument("--parallel", type=int, default=None, help="runs at once (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default cuda where there is one, else cpu")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the demo's --model (tiny: a smoke run)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop runs still going after this many s")
    parser.add_argument("--runs-dir", default=None, help="where each run writes (default: a new folder in /tmp)")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME=FLAGS",
                        help="run each seed once per variant, adding its demo flags (see above)")  # fmt: skip
    args, args.demo_args = parser.parse_known_args(argv)
    if not args.out.endswith(".json"):  # a demo flag's value taken for the path: the path must come first
        parser.error(f"the first argument is the report's path and must end in .json, got {args.out!r}")
    if args.seeds is None:
        args.seeds = list(range(args.runs))
    args.variants = parse_variants(parser, args.variants)
    args.runs = len(args.seeds) * max(1, len(args.variants))
    args.parallel = min(args.parallel or args.runs, args.runs)
    if min(args.runs, args.steps, args.parallel) < 1:
        parser.error("--runs, --steps and --parallel must be at least 1")
    from slimrl.cli import build_parser

    for extra in [[]] + [flags for _, flags in args.variants]:
        flags = [*args.demo_args, *extra]
        for flag in flags:
            if flag.split("=")[0] in OWN_FLAGS:
                parser.error(f"{flag} is soak.py's own setting for each run; use soak.py's option")
        try:
            build_parser().parse_args(["demo", *flags])  # a bad demo flag fails here, not in every run
        except SystemExit:
            parser.error(f"the demo does not take {shlex.join(flags)} (see python -m slimrl.cli demo --help)")
    return args


def parse_variants(parser: argparse.ArgumentParser, given: list[str] | None) -> list[tuple[str, list[str]]]:
    """--variants NAME=FLAGS ... as (name, demo flags); [] without the option."""
    variants = []
    for item in given or []:
        name, equals, flags = item.partition("=")
        if not equals or not name.strip():
            parser.error(f"a variant is NAME=FLAGS (FLAGS may be empty, as in 'graphs='), got {item!r}")
        variants.append((name.strip(), shlex.split(flags)))
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        parser.error(f"variant names must differ, got {names}")
    return variants


def planned_runs(args, folder: Path) -> list[dict]:
    """One run per seed, or per seed and variant: a seed's variants in the given order, reversed every other seed."""
    runs = []
    for number, seed in enumerate(args.seeds):
        for name, flags in (args.variants if number % 2 == 0 else args.variants[::-1]) or [(None, [])]:
            i = len(runs)
            run = {"index": i, "seed": seed, "status": "waiting", "dir": str(folder / f"run{i}_seed{seed}")}
            if name is not None:
                run.update(variant=name, variant_args=flags, dir=f"{run['dir']}_{name}")
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    command = shlex.join(["python", "bench/soak.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(args.out, benchmark="soak", command=command)
    with report.recording_failure():
        report.update(environment(args.device == "cuda"))
        report["settings"] = {"runs": args.runs, "steps": args.steps, "seeds": args.seeds, "parallel": args.parallel,
                              "device": args.device, "model": args.model, "demo_args": args.demo_args,
                              "time_limit_s": args.time_limit,
                              "variants": {name: flags for name, flags in args.variants}}  # fmt: skip
        folder = Path(args.runs_dir or tempfile.mkdtemp(prefix="slimrl-soak-")).resolve()
        report["settings"]["runs_dir"] = str(folder)
        report["runs"] = planned_runs(args, folder)
        report.save()
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop the runs, save
        try:
            run_all(args, report)
        finally:
            signal.signal(signal.SIGTERM, previous)
        report["summary"] = summarise(report["runs"])
        engine_expected = args.device == "cuda" and not any("transformers" in a for a in args.demo_args)
        report["problems"] += problems(report["runs"], engine_expected)
        report["runs"] = rounded(report["runs"])
        report["table"] = table(report)
        print(report["table"])
        counts = {k: v for k, v in report["summary"].items() if k not in ("same_seed", "variants")}
        print(f"\nsummary: {counts}")
        for name, times in report["summary"]["variants"].items():
            print(f"variant {name} (runs {times['runs']}): training s median {times['training_s_median']}, "
                  f"sum after each run's first step {times['training_s_after_first_sum']}")  # fmt: skip
        for check in report["summary"]["same_seed"]:
            print(f"seed {check['seed']} (runs {check['runs']}): identical curves: {check['identical_curves']}")
    report.print_outcome()
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
