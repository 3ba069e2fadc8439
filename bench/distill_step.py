"""W3 for on-policy distillation (issue 35): slimrl's DistillationTrainer beside unpatched TRL 1.16's, in one run.

Both sides run in this one process, each on freshly built models (same seeds), the same data and the same settings:
  student  W1's model (bench/common.py: Qwen2, Qwen2.5-1.5B's shape, bf16, random init) with LoRA r=64 alpha 64 on all
           linear layers of the decoder, seeded as in bench/grpo_step.py
  teacher  a second W1-shaped model from another seed (--seed + 1), bf16, no adapter, eval mode, frozen
  data     W3's prompts (bench/grpo_step.py: slimrl's arithmetic problems behind a fixed preamble, 256 tokens each),
           each repeated 8 times in a row with the dataset unshuffled, so a step's batch is 1 prompt x 8 completions
           (TRL's distillation samples one completion per row)
  settings completions of --completion-length tokens (1024) at temperature 1.0 (the random student has no real EOS,
           so they run to full length), beta 0.5 (--beta: the JSD between forward and reverse KL), lr 1e-5 constant,
           bf16, gradient checkpointing, one optimizer step per batch
Sides (JSON keys; the speedup is TRL's seconds over slimrl's):
  slimrl_distillation  slimrl's trainer: its engine's rollouts ("auto" on CUDA), its chunked loss (num_chunks "auto")
  trl_distillation     TRL's trainer as it comes: the PEFT model's transformers `generate`, its one-piece loss; it
                       lacks slimrl's num_chunks and generation_backend (settings.trl_lacks). A configuration it
                       cannot run is recorded as its error (status "error", the traceback); the other side still runs.

Per step (on_step_begin to on_step_end, CUDA-synchronised at phase edges only; slimrl.trainers.common.step_timer):
  generation  `_generate_single_turn` (slimrl's engine, or TRL's `generate`)
  teacher     the teacher's backbone forward (TRL's `_get_last_hidden_state` on the teacher), synchronised around
              each call; both LM heads are projected inside the divergence, which stays in training
  training    the rest: tokenising, the student's forward and backward, the divergence, the optimizer
with peak GPU memory (the rollout's and the rest's) and the step's logged loss, grad norm, entropy and completion
lengths. Per side: the median step after the first (which compiles and captures slimrl's engine), means over all
steps and over those after the first. TRL's `generate` makes some 66 tokens/s at batch 8 on this model (2 minutes a
step at 1024 tokens), so TRL runs --trl-steps (2) steps, slimrl --steps (10). slimrl runs first; the JSON is
rewritten after every step. Exit status 1 when a side raised, a loss was not finite, or slimrl's side did not
generate with its engine on CUDA.

    python bench/distill_step.py [$OUT/distill_step.json] [--steps 10] [--trl-steps 2] [--completion-length 1024]
                                 [--beta 0.5] [--skip SIDE ...] [--slimrl-backend auto] [--tiny]

--tiny: slimrl.testing's 2-layer Qwen2 as student (LoRA r=8) and teacher, 128-token prompts, 32-token completions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import common  # noqa: E402
import grpo_step as w3  # noqa: E402 - W3's prompts, tokenizer, student and engine records
import torch  # noqa: E402
from common import Report, default_output, environment, markdown_table, mean, median, rounded  # noqa: E402

SIDES = {"slimrl_distillation": "slimrl", "trl_distillation": "trl"}  # JSON key -> whose trainer, in running order
GROUP = 8  # completions per prompt: W3's batch is one prompt's 8 completions
PHASE_KEYS = ("step_s", "generation_s", "teacher_s", "training_s")
SUMMARY_KEYS = (*PHASE_KEYS, "peak_GiB", "loss", "completion_mean_length")
LOG_FIELDS = {  # per-step record field -> the metric TRL's DistillationTrainer logs
    "loss": "loss",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "completion_mean_length": "completions/mean_length",
    "completion_clipped_ratio": "completions/clipped_ratio",
}
TIMING = (
    "per optimizer step, on_step_begin to on_step_end, CUDA-synchronised: generation = _generate_single_turn, teacher "
    "= the teacher's _get_last_hidden_state calls, training = the rest (the student's forward and backward, the "
    "divergence over both LM heads, the optimizer)"
)
TRL_LACKS = {  # slimrl's settings that TRL's DistillationConfig has no field for
    "num_chunks": "slimrl's chunked loss; TRL runs the micro-batch in one piece",
    "generation_backend": "slimrl's choice of rollout backend; TRL generates with transformers' generate",
}


# -- models, data, trainers ------------------------------------------------------------------------------------------


def build_teacher(tiny: bool, device: str, seed: int, context: int):
    """The teacher: W1's shape without an adapter (or the tiny Qwen2 for --tiny), from its own seed, frozen."""
    if tiny:
        from slimrl.testing import tiny_model

        model = tiny_model("qwen2", seed=seed, tie_word_embeddings=True, max_position_embeddings=max(512, context))
        model = model.to(device)
    else:
        model = common.w1_model(device=device, seed=seed, context=context, lora_rank=None)
    return model.eval().requires_grad_(False)


def build_data(args) -> dict:
    """W3's prompts (one per step of the longer side), each repeated GROUP times in a row: read unshuffled, a batch of
    GROUP rows is one prompt's GROUP completions."""
    from slimrl.testing import TINY_VOCAB

    tokenizer = w3.offline_tokenizer(TINY_VOCAB if args.tiny else common.W1_VOCAB)
    prompts = w3.build_dataset(tokenizer, max(args.steps, args.trl_steps), args.prompt_tokens, seed=args.seed)
    rows = [i for i in range(len(prompts)) for _ in range(GROUP)]
    return {"tokenizer": tokenizer, "dataset": prompts.select(rows).remove_columns("answer")}


def trainer_settings(args, steps: int, output_dir: str, cuda: bool) -> dict:
    """The config settings both sides get."""
    return dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=GROUP,
                gradient_accumulation_steps=1, shuffle_dataset=False, max_completion_length=args.completion_length,
                temperature=1.0, beta=args.beta, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                gradient_checkpointing=True, bf16=cuda and not args.tiny, use_cpu=not cuda, seed=args.seed,
                logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)  # fmt: skip


def build_trainer(kind: str, student, teacher, data: dict, args, steps: int, output_dir: str, cuda: bool):
    """Side `kind`'s trainer: slimrl's (chunked loss, its backend choice) or TRL's as it comes."""
    import importlib

    owner = SIDES[kind]
    settings = trainer_settings(args, steps, output_dir, cuda)
    if owner == "slimrl":
        settings.update(num_chunks="auto", generation_backend=args.slimrl_backend)
    module = importlib.import_module(owner)
    config = module.DistillationConfig(**settings)
    return module.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=data["dataset"], processing_class=data["tokenizer"])  # fmt: skip


# -- timing ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def teacher_forward_timer(trainer, seconds: list[float]):
    """Wrap `trainer._get_last_hidden_state` on the instance for the block (TRL's `_compute_loss` looks it up at call
    time, for the student and then the teacher): each teacher call's seconds, from and to a synchronised GPU, are
    appended to `seconds`; student calls pass through untimed."""
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    original = trainer._get_last_hidden_state

    def timed(model, *args, **kwargs):
        if model is not teacher:
            return original(model, *args, **kwargs)
        start = common.sync_time()
        try:
            return original(model, *args, **kwargs)
        finally:
            seconds.append(common.sync_time() - start)

    trainer._get_last_hidden_state = timed
    try:
        yield
    finally:
        vars(trainer).pop("_get_last_hidden_state", None)


def finish_record(record: dict, teacher_seconds: list[float]) -> None:
    """A step's record from StepTimer's: TRL's logged values, the teacher's seconds taken out of training, no reward
    phase (distillation has none)."""
    record.update({field: record["logs"][key] for field, key in LOG_FIELDS.items() if key in record["logs"]})
    record["teacher_s"] = sum(teacher_seconds)
    teacher_seconds.clear()
    record["training_s"] -= record["teacher_s"]
    record.pop("reward_s", None)


def record_view(record: dict) -> dict:
    """A step record for the JSON: timings rounded, the trainer's logged values as they are."""
    return {k: v if k in LOG_FIELDS else rounded(v) for k, v in record.items()}


def summarise(records: list[dict]) -> dict:
    """The median step and training phase over the steps after the first (warm-up: compilation, graph capture), means
    over all steps and over those after the first, the peak memory and the loss of every step."""
    later = records[1:]

    def means(rows: list[dict]) -> dict:
        return {k: rounded(mean(r.get(k) for r in rows)) for k in SUMMARY_KEYS}

    peaks = [r["peak_GiB"] for r in records if "peak_GiB" in r]
    return {"step_median_after_first": rounded(median(r["step_s"] for r in later)),
            "training_median_after_first": rounded(median(r["training_s"] for r in later)),
            "mean_all": means(records), "mean_after_first": means(later) if later else None,
            "peak_GiB": round(max(peaks), 3) if peaks else None,
            "losses": [r.get("loss") for r in records]}  # fmt: skip


# -- one side --------------------------------------------------------------------------------------------------------


def build_side(kind: str, steps: int, args, data: dict, side: dict, held: dict, cuda: bool) -> None:
    """Build `kind`'s student, teacher and trainer into `held` (so the caller frees them whatever happens)."""
    start = time.perf_counter()
    device = "cuda" if cuda else "cpu"
    context = args.prompt_tokens + args.completion_length
    if cuda:
        torch.cuda.empty_cache()
        side["allocated_before_build_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    held["student"] = w3.build_w1_model(args.tiny, device, args.seed, context)
    held["teacher"] = build_teacher(args.tiny, device, args.seed + 1, context)
    if cuda:
        side["resident_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)  # both models and the adapter
    trainer = held["trainer"] = build_trainer(kind, held["student"], held["teacher"], data, args, steps, held["dir"],
                                              cuda)  # fmt: skip
    trainer.timed_phases = {"generation": "_generate_single_turn"}  # StepTimer's phases: distillation has no reward
    # slimrl's backend choice; TRL's trainer generates with transformers unless told to use vLLM
    side["generation_backend"] = getattr(trainer, "generation_backend", None) or ("vllm" if trainer.use_vllm
                                                                                   else "transformers")  # fmt: skip
    side["trainer"] = f"{type(trainer).__module__}.{type(trainer).__name__}"
    side["build_s"] = round(time.perf_counter() - start, 2)


def finish_side(side: dict, held: dict, records: list[dict]) -> None:
    """The engine's settings (then its memory freed), chunks, checkpointing, the steps and their summary."""
    trainer = held.get("trainer")
    if trainer is not None:
        side["engine"] = w3.engine_config(trainer)
        side["engine_used"] = any("engine_stats" in r for r in records)
        side["num_chunks"] = getattr(trainer, "last_auto_chunks", None)  # slimrl's last automatic choice
        engine = w3.rollout_engine(trainer)
        if engine is not None:
            engine.release(keep_graph=False)  # its graphs and cache must not count against the next side
    if held.get("student") is not None:
        side["offloaded_checkpointing"] = w3.offloaded_checkpointing(held["student"])
    side["steps_run"] = len(records)
    side["steps"] = [record_view(r) for r in records]
    side.update(summarise(records))


def run_side(kind: str, steps: int, args, data: dict, side: dict, save, cuda: bool) -> None:
    """Build `kind`'s models and trainer, train `steps` steps and fill `side`; an exception is recorded, not
    raised."""
    from transformers import PrinterCallback

    from slimrl.trainers.common.step_timer import StepTimer

    side.update(status="running", steps_requested=steps, steps_run=0, steps=[])
    held = {"dir": tempfile.mkdtemp(prefix=f"distill-{kind}-")}
    teacher_seconds: list[float] = []

    def on_step(record):
        finish_record(record, teacher_seconds)
        side["steps_run"] = len(timer.steps)
        side["steps"] = [record_view(r) for r in timer.steps]
        print(json.dumps({kind: {k: v for k, v in record_view(record).items() if k != "logs"}}), flush=True)
        save()

    timer = StepTimer(on_step=on_step, track_memory=True)
    try:
        build_side(kind, steps, args, data, side, held, cuda)
        timer.attach(held["trainer"])
        held["trainer"].remove_callback(PrinterCallback)  # the timer prints one line per step instead
        save()
        with teacher_forward_timer(held["trainer"], teacher_seconds):
            start = time.perf_counter()
            held["trainer"].train()
            side["train_wall_s"] = round(time.perf_counter() - start, 2)
        side["status"] = "ok"
    except Exception:  # noqa: BLE001 - a failing side is reported and the other still runs
        side["status"] = "error"
        side["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        finish_side(side, held, timer.steps)
        timer.detach()
        shutil.rmtree(held.pop("dir"), ignore_errors=True)
        held.clear()  # the models and trainer: freed before the next side is built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save()


# -- report ----------------------------------------------------------------------------------------------------------


def speedups(report: dict) -> dict | None:
    """TRL's seconds over slimrl's: the median step after the first (the headline), per phase on both means, the
    training phase's median, and step by step where both ran the step."""
    fast, slow = (report["sides"].get(kind, {}) for kind in SIDES)
    if not (fast.get("mean_all") and slow.get("mean_all")):
        return None
    result = {key: w3.ratio(slow.get(key), fast.get(key))
              for key in ("step_median_after_first", "training_median_after_first")}  # fmt: skip
    for basis in ("mean_after_first", "mean_all"):
        if slow.get(basis) and fast.get(basis):
            result[basis] = {key: w3.ratio(slow[basis].get(key), fast[basis].get(key)) for key in PHASE_KEYS}
    pairs = zip(slow.get("steps", []), fast.get("steps", []), strict=False)
    result["per_step"] = [w3.ratio(a.get("step_s"), b.get("step_s")) for a, b in pairs]
    return result


def side_problems(kind: str, side: dict, args, cuda: bool) -> list[str]:
    if side["status"] == "error":
        return [f"{kind} raised: {side['error'].strip().splitlines()[-1]}"]
    problems = []
    if any(not isinstance(loss, float | int) or not math.isfinite(loss) for loss in side["losses"]):
        problems.append(f"{kind} logged a missing or non-finite loss: {side['losses']}")
    if SIDES[kind] == "slimrl" and cuda and args.slimrl_backend != "transformers" and not w3.engine_generated(side):
        problems.append(f"{kind} generated with {side.get('generation_backend')!r} on CUDA, not its rollout engine")
    return problems


def print_summary(report: dict) -> None:
    header = ["side", "steps", "backend", "step median s", "step s", "gen s", "teacher s", "train s", "peak GiB",
              "first step s", "loss first/last"]  # fmt: skip
    rows = []
    for kind, side in report["sides"].items():
        if side.get("status") == "skipped":
            continue
        means = side.get("mean_after_first") or side.get("mean_all") or {}
        losses = side.get("losses") or [None]
        first = side["steps"][0]["step_s"] if side.get("steps") else None
        rows.append([kind, f"{side.get('steps_run', 0)}/{side.get('steps_requested')}", side.get("generation_backend"),
                     side.get("step_median_after_first"), *(means.get(k) for k in PHASE_KEYS), side.get("peak_GiB"),
                     first, f"{losses[0]:.6g} / {losses[-1]:.6g}" if None not in losses else losses])  # fmt: skip
    speedup = report.get("speedup") or {}
    if "mean_after_first" in speedup:
        rows.append(["trl/slimrl", "after first", None, speedup["step_median_after_first"],
                     *(speedup["mean_after_first"][k] for k in PHASE_KEYS), None, None, None])  # fmt: skip
    print("\nW3 distillation: seconds per step (means over all steps but the first, where there are two or more)")
    print(markdown_table(header, rows))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem.splitlines()[0]}")


def settings_record(args, data: dict, cuda: bool) -> dict:
    from slimrl.testing import TINY_VOCAB

    lengths = [w3.prompt_length(data["tokenizer"], p) for p in data["dataset"]["prompt"]]
    return {"student": "tiny qwen2" if args.tiny else "W1", "lora": {"r": 8 if args.tiny else common.W1_LORA_RANK},
            "teacher": f"{'tiny qwen2' if args.tiny else 'W1'} shape, seed {args.seed + 1}, no adapter, eval mode",
            "model_vocab": TINY_VOCAB if args.tiny else common.W1_VOCAB, "prompt_tokens": args.prompt_tokens,
            "prompt_tokens_min_max": [min(lengths), max(lengths)], "prompts_per_step": 1,
            "completions_per_prompt": GROUP, "completion_length": args.completion_length, "beta": args.beta,
            "temperature": 1.0, "learning_rate": 1e-5, "lr_scheduler": "constant", "gradient_checkpointing": True,
            "bf16": cuda and not args.tiny, "seed": args.seed, "slimrl_backend": args.slimrl_backend,
            "slimrl_num_chunks": "auto", "trl_lacks": TRL_LACKS,
            "steps": {kind: side_steps(kind, args) for kind in SIDES}}  # fmt: skip


def side_steps(kind: str, args) -> int:
    return args.trl_steps if SIDES[kind] == "trl" else args.steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("distill_step.json"))
    parser.add_argument("--steps", type=int, default=10, help="slimrl's steps (default 10)")
    parser.add_argument("--trl-steps", type=int, default=2, help="TRL's steps (default 2: about 2 minutes each)")
    parser.add_argument("--skip", nargs="*", default=[], choices=tuple(SIDES), help="sides not to run")
    parser.add_argument("--beta", type=float, default=0.5, help="the JSD's interpolation: 0 forward KL, 1 reverse KL")
    parser.add_argument("--completion-length", type=int, default=None, help="default 1024 (32 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (128 with --tiny)")
    parser.add_argument("--slimrl-backend", default="auto", choices=("auto", "engine", "transformers"))
    parser.add_argument("--seed", type=int, default=0, help="the student's seed; the teacher's is this + 1")
    parser.add_argument("--tiny", action="store_true", help="2-layer models from slimrl.testing: a CPU smoke run")
    args = parser.parse_args(argv)
    if min(args.steps, args.trl_steps) < 1:
        parser.error("--steps and --trl-steps must be at least 1")
    if not 0.0 <= args.beta <= 1.0:
        parser.error(f"--beta {args.beta}: the divergence's interpolation must be within [0, 1]")
    args.completion_length = args.completion_length or (32 if args.tiny else 1024)
    args.prompt_tokens = args.prompt_tokens or (128 if args.tiny else 256)
    return args


def main(argv=None) -> Report:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available()
    command = shlex.join(["python", "bench/distill_step.py", *argv])
    report = Report(args.out, workload="W3 distillation", command=command, tiny=args.tiny, timing=TIMING,
                    speedup_is="trl_distillation seconds / slimrl_distillation seconds", sides={})  # fmt: skip

    def save():
        report["speedup"] = speedups(report)
        report.save()

    with report.recording_failure():
        report.update(environment(cuda))
        data = build_data(args)
        report["settings"] = settings_record(args, data, cuda)
        for kind in SIDES:
            side = report["sides"][kind] = {}
            if kind in args.skip:
                side["status"] = "skipped"
                continue
            run_side(kind, side_steps(kind, args), args, data, side, save, cuda)
            report["problems"] += side_problems(kind, side, args, cuda)
        save()
        print_summary(report)
    print(f"wrote {report.path}")
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
