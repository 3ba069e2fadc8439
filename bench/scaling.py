"""W3 scaling: GRPO at W3's settings (bench/grpo_step.py) on N processes, data parallel through accelerate.

Every process builds the same model, data and trainer; HF Trainer's accelerate splits the batch, so each rank
generates and trains on its own prompts and the gradients are all-reduced (or sharded, under FSDP2 / ZeRO-3). Per
rank the workload is W3's: W1's model (Qwen2.5-1.5B's shape, bf16, random init) with LoRA r=64 on all linear layers,
8 completions of one 256-token prompt per rank and step (N prompts a step over all ranks), --completion-length
tokens at temperature 1.0, loss dapo, beta 0, gradient checkpointing, lr 1e-5 constant, rewards read from the text.
Sides, one after the other in the same process group, each on a freshly built model:
  slimrl       slimrl's GRPOTrainer, default settings (on CUDA its rollout engine, one per rank)
  trl          TRL's GRPOTrainer under the same config (--trl-steps steps: TRL's generate is slow)
  slimrl_device        slimrl's GRPOTrainer with its engine in a process of its own on --generation-device
                       (generation_device; default cuda:1, or cuda:0 beside training on a one-GPU machine)
  slimrl_device_async  the same with async_generation=True (the next step generated while this one trains)
  slimrl_full  with --full-finetune: slimrl's GRPOTrainer training every weight of W1's model (no LoRA); under an
               FSDP2 or ZeRO-3 config this is the sharded row (distributed_type, fsdp_version, zero_stage say which)
Per step (slimrl.trainers.common.step_timer.StepTimer, as in grpo_step.py; rank 0's clock): seconds split into
generation / reward / training; the step's completion tokens summed over all ranks over the slowest rank's step seconds
(tokens_per_s); each rank's peak GPU memory (max_memory_allocated; null on the CPU); bytes moved per weight sync (the
trainer's logged rollout/sync_bytes, else 0: the engine decodes with the training weights).

    python bench/scaling.py $OUT/scaling.json                                         # N = 1, no launcher
    python bench/scaling.py $OUT/device.json --sides slimrl slimrl_device slimrl_device_async   # the rollout device
    accelerate launch --config_file examples/accelerate/ddp.yaml --num_processes 2 bench/scaling.py $OUT/scaling_n2.json
    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 bench/scaling.py \\
        $OUT/scaling_fsdp2.json --full-finetune
    accelerate launch --config_file examples/accelerate/zero3.yaml --num_processes 2 bench/scaling.py \\
        $OUT/scaling_zero3.json --full-finetune
    python bench/scaling.py $OUT/full_plain.json --sides --full-finetune   # only slimrl_full, no launcher
On a machine with several GPUs, a run without a launcher makes one visible (CUDA_VISIBLE_DEVICES=0 python ...): one
process seeing several GPUs gets nn.DataParallel from HF's Trainer, which TRL's GRPOTrainer refuses. The
rollout-device sides need no such thing (with generation_device the trainer counts one training GPU).

Options: --steps 6, --trl-steps 2, --completion-length 1024, --sides slimrl trl, --full-finetune (--full-dtype bf16
or fp32), --prompts-per-step (over all ranks; default one per rank), --generation-backend auto|engine|transformers,
--tiny (a 2-layer Qwen2 from slimrl.testing, LoRA r=8, 128-token prompts, 32-token completions: a CPU smoke run;
torchrun launches it too). Only rank 0 writes the JSON, after every step and side, so a run cut short keeps what it
measured. The same global batch on 1 and 2 GPUs, HF generate (losses and rewards side by side):
    python bench/scaling.py $OUT/batch_n1.json --sides slimrl --prompts-per-step 2 --generation-backend transformers
    accelerate launch --config_file examples/accelerate/ddp.yaml --num_processes 2 bench/scaling.py \\
        $OUT/batch_n2.json --sides slimrl --prompts-per-step 2 --generation-backend transformers
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import grpo_step as w3  # noqa: E402
import torch  # noqa: E402
from common import Report, default_output, environment, markdown_table, mean, rounded, w1_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

SIDE_NAMES = ("slimrl", "trl", "slimrl_device", "slimrl_device_async")
SYNC_METRIC = "rollout/sync_bytes"
NO_SYNC_NOTE = "engine shares the training weights (no sync)"
LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ACCELERATE_", "FSDP_")  # names, or prefixes ending in _
TIMING = (
    "per optimizer step on rank 0 (StepTimer: on_step_begin to on_step_end, CUDA-synchronised): generation = "
    "_generate_single_turn, reward = _calculate_rewards, training = the rest; completion_tokens: the step's, summed "
    "over all ranks; interval_s: end to end, from the previous step's end (or the start of training) to this "
    "step's, which also counts HF pulling the step's batches (where async_generation waits for its rollout); "
    "tokens_per_s = completion_tokens / the slowest rank's interval_s; peak_GiB_per_rank: each rank's "
    "max_memory_allocated in the step (null on the CPU)"
)


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


class RankReport(Report):
    """The JSON report, written by rank 0 only."""

    def save(self) -> None:
        if is_main():
            super().save()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("scaling.json"))
    parser.add_argument("--steps", type=int, default=6, help="slimrl's steps per side")
    parser.add_argument("--trl-steps", type=int, default=2, help="TRL's steps")
    parser.add_argument("--completion-length", type=int, default=None, help="default 1024 (32 with --tiny)")
    parser.add_argument("--sides", nargs="*", default=["slimrl", "trl"], choices=SIDE_NAMES,
                        help="none at all with --full-finetune: only slimrl_full")  # fmt: skip
    parser.add_argument("--generation-device", default=None, help="rollout-device sides' engine (default cuda:1, "
                        "else cuda:0 with one GPU, else cpu)")  # fmt: skip
    parser.add_argument("--full-finetune", action="store_true", help="add slimrl_full: every weight trained, no LoRA")
    parser.add_argument("--full-dtype", default="bf16", choices=("bf16", "fp32"),
                        help="slimrl_full's weights: bf16 (AdamW state in bf16 too), or fp32 under bf16 autocast "
                        "(fp32 master weights and AdamW state, as FSDP2 and ZeRO-3 keep); not with --tiny",
                        )  # fmt: skip
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="prompts per optimizer step over all ranks (default: one per rank), split evenly; each "
                        "prompt gets 8 completions")  # fmt: skip
    parser.add_argument("--generation-backend", default="auto", choices=("auto", "engine", "transformers"),
                        help="slimrl's sides' generation_backend (transformers: HF generate, as TRL)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model from slimrl.testing: a CPU smoke run")
    args = parser.parse_args(argv)
    if min(args.steps, args.trl_steps) < 1:
        parser.error("--steps and --trl-steps must be at least 1")
    if not args.sides and not args.full_finetune:
        parser.error("nothing to run: name --sides, or pass --full-finetune")
    args.completion_length = args.completion_length or (32 if args.tiny else 1024)
    args.prompt_tokens = 128 if args.tiny else 256
    args.kinds = [*args.sides, *(["slimrl_full"] if args.full_finetune else [])]
    if args.tiny and args.full_dtype != "bf16":
        parser.error("--full-dtype: --tiny's model is fp32 on the CPU as it is")
    if args.prompts_per_step is not None and args.prompts_per_step < 1:
        parser.error("--prompts-per-step must be at least 1")
    args.algorithm, args.real, args.beta = "grpo", False, 0.0  # what grpo_step reads
    args.slimrl_backend = args.generation_backend
    return args


def build_model(kind: str, args, device: str):
    """W3's model with its LoRA adapter, or for slimrl_full the same model without one (every weight trains)."""
    context = args.prompt_tokens + args.completion_length
    if kind != "slimrl_full":
        return w3.build_w1_model(args.tiny, device, args.seed, context)
    if not args.tiny:
        dtype = torch.float32 if args.full_dtype == "fp32" else torch.bfloat16
        return w1_model(device=device, dtype=dtype, seed=args.seed, context=context, lora_rank=None)
    from slimrl.testing import tiny_model

    model = tiny_model("qwen2", seed=args.seed, tie_word_embeddings=True, max_position_embeddings=max(512, context))
    return model.to(device)


def rollout_device(args, cuda: bool) -> str:
    if args.generation_device:
        return args.generation_device
    return ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0") if cuda else "cpu"


def distribution(accelerator) -> dict:
    """How accelerate runs the trainer: processes, distributed type, FSDP version or ZeRO stage, precision."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    fsdp = getattr(accelerator.state, "fsdp_plugin", None) if kind == "FSDP" else None
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) if kind == "DEEPSPEED" else None
    return {"world_size": accelerator.num_processes, "distributed_type": kind,
            "fsdp_version": getattr(fsdp, "fsdp_version", None), "zero_stage": getattr(deepspeed, "zero_stage", None),
            "mixed_precision": str(accelerator.mixed_precision)}  # fmt: skip


def batch_record(trainer) -> dict:
    """Prompts and completions per optimizer step, per rank and over all ranks."""
    config, world = trainer.args, trainer.accelerator.num_processes
    per_rank = config.per_device_train_batch_size * config.gradient_accumulation_steps
    return {"completions_per_step": per_rank * world, "prompts_per_step_per_rank": per_rank / config.num_generations,
            "prompts_per_step": per_rank * world / config.num_generations}  # fmt: skip


class RankStats(TrainerCallback):
    """Counts this rank's completion tokens (`_generate`, wrapped on the instance); at each step's end, after the
    StepTimer closed the step, gathers every rank's tokens, step seconds and peak memory into the timer's record."""

    def __init__(self, trainer, timer):
        self.trainer, self.timer, self.tokens = trainer, timer, 0
        generate = trainer._generate

        def counted(*args, **kwargs):
            out = generate(*args, **kwargs)
            self.tokens += sum(len(ids) for ids in out[1])  # (prompt_ids, completion_ids, ...)
            return out

        trainer._generate = counted
        trainer.add_callback(self)

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_end = self.clock()

    def clock(self) -> float:
        if self.timer.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        record = self.timer.step(state.global_step)
        if record is None:
            return
        # end to end: HF pulls a step's batches (get_batch_samples, where async_generation waits for its rollout)
        # before on_step_begin, so the step's own clock misses that wait; the interval between step ends does not
        now, self.last_end, before = self.clock(), self.clock(), self.last_end
        record["interval_s"] = round(now - before, 4)
        accelerator = self.trainer.accelerator
        mine = [float(self.tokens), record["interval_s"], record.get("peak_GiB", -1.0)]
        self.tokens = 0
        rows = accelerator.gather(torch.tensor([mine], dtype=torch.float64, device=accelerator.device)).tolist()
        record["completion_tokens"] = int(sum(row[0] for row in rows))
        record["interval_s_slowest_rank"] = max(row[1] for row in rows)
        record["tokens_per_s"] = record["completion_tokens"] / record["interval_s_slowest_rank"]
        record["peak_GiB_per_rank"] = [round(row[2], 3) for row in rows] if self.timer.cuda else None

    def detach(self) -> None:
        vars(self.trainer).pop("_generate", None)
        self.trainer.remove_callback(self)


def build_side(kind: str, steps: int, args, data: dict, side: dict, held: dict, cuda: bool) -> None:
    """`kind`'s model and trainer into `held`, and what they say about the run into `side`."""
    start = time.perf_counter()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    held["model"] = build_model(kind, args, device)
    owner = "trl" if kind == "trl" else "slimrl"  # w3's sides: slimrl's settings are num_chunks auto, backend auto
    extra = {"per_device_train_batch_size": w3.GROUP * args.prompts_per_rank}
    if kind.startswith("slimrl_device"):  # the engine in its own process on the rollout device
        extra.update(generation_device=rollout_device(args, cuda), async_generation=kind.endswith("_async"))
    trainer = w3.build_trainer(owner, held["model"], data["tokenizer"], data, args, steps, held["dir"], cuda, **extra)
    held["trainer"] = trainer
    side.update(trainer=f"{type(trainer).__module__}.{type(trainer).__name__}", lora=kind != "slimrl_full",
                generation_backend=w3.generation_backend(trainer), **distribution(trainer.accelerator),
                **batch_record(trainer), build_s=round(time.perf_counter() - start, 2))  # fmt: skip


def finish_side(side: dict, records: list[dict], held: dict) -> None:
    """The side's summary: W3's means, tokens/s, each rank's peak and the bytes per weight sync."""
    engine = w3.rollout_engine(held["trainer"]) if "trainer" in held else None
    side["engine_used"] = any("engine_stats" in r for r in records)
    if engine is not None:
        side["engine"] = engine.describe()
        engine.release(keep_graph=False)  # its graphs and cache must not count against the next side
        getattr(engine, "close", lambda: None)()  # a rollout device's process ends with its side
    side["steps_run"], side["steps"] = len(records), [w3.record_view(r) for r in records]
    side.update(w3.summarise(records))
    intervals = [r.get("interval_s") for r in records]
    side["interval_s"] = {"mean_all": rounded(mean(intervals)), "mean_after_first": rounded(mean(intervals[1:]))}
    rates = [r.get("tokens_per_s") for r in records]
    side["tokens_per_s"] = {"mean_all": rounded(mean(rates)), "mean_after_first": rounded(mean(rates[1:]))}
    peaks = [r["peak_GiB_per_rank"] for r in records if r.get("peak_GiB_per_rank")]
    side["peak_GiB_per_rank"] = [max(column) for column in zip(*peaks, strict=True)] if peaks else None
    history = held["trainer"].state.log_history if "trainer" in held else []
    synced = [entry[SYNC_METRIC] for entry in history if SYNC_METRIC in entry]  # logged where weights are copied
    side["sync_bytes"] = round(mean(synced) or 0) if synced else 0
    if not synced:
        side["sync_note"] = NO_SYNC_NOTE


def run_side(kind: str, args, data: dict, side: dict, report: Report, cuda: bool) -> None:
    """Build `kind`'s trainer, train it and fill `side`; an exception is recorded in `side`, not raised."""
    from transformers import PrinterCallback

    from slimrl.trainers.common.step_timer import StepTimer

    steps = args.trl_steps if kind == "trl" else args.steps
    side.update(status="running", steps_requested=steps, steps_run=0, steps=[])
    held = {"dir": tempfile.mkdtemp(prefix=f"scaling-{kind}-")}

    def on_step(record):
        logs = record["logs"]
        record.update({field: logs[key] for field, key in w3.LOG_FIELDS.items() if key in logs})
        record["sync_bytes"] = logs.get(SYNC_METRIC, 0)
        side["steps_run"], side["steps"] = len(timer.steps), [w3.record_view(r) for r in timer.steps]
        if is_main():
            print(json.dumps({kind: {k: v for k, v in w3.record_view(record).items() if k != "logs"}}), flush=True)
        report.save()

    timer = StepTimer(on_step=on_step, track_memory=True)
    try:
        build_side(kind, steps, args, data, side, held, cuda)
        report.update({k: side[k] for k in ("world_size", "distributed_type", "fsdp_version", "zero_stage")})
        timer.attach(held["trainer"])
        held["stats"] = RankStats(held["trainer"], timer)  # after the timer: its step record is closed first
        held["trainer"].remove_callback(PrinterCallback)
        report.save()
        start = time.perf_counter()
        held["trainer"].train()
        side["train_wall_s"] = round(time.perf_counter() - start, 2)
        side["status"] = "ok"
    except Exception:  # noqa: BLE001 - a failing side is reported and the next still runs
        side["status"], side["error"] = "error", traceback.format_exc()
        traceback.print_exc()
    finally:
        finish_side(side, timer.steps, held)
        timer.detach()
        if "stats" in held:
            held["stats"].detach()
        shutil.rmtree(held.pop("dir"), ignore_errors=True)
        held.clear()  # the model and trainer: freed before the next side is built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        report.save()


def settings_record(args, data: dict, cuda: bool, world: int) -> dict:
    """W3's settings record (grpo_step.py) for this run's sides, its prompt count per rank and over all ranks."""
    record = w3.settings_record(args, data, cuda)
    record.pop("prompts_per_step")
    record["prompts_per_step_per_rank"] = args.prompts_per_rank
    record["prompts_per_step"] = args.prompts_per_rank * world
    record["generation_backend"] = args.generation_backend
    record["steps"] = {kind: args.trl_steps if kind == "trl" else args.steps for kind in args.kinds}
    record["full_finetune"] = args.full_finetune
    if args.full_finetune:
        record["full_dtype"] = "fp32" if args.tiny else args.full_dtype
    return record


def print_table(report: dict) -> None:
    header = ["side", "world", "type", "steps", "backend", "end-to-end s", "step s", "gen s", "reward s", "train s",
              "tok/s", "peak GiB per rank", "sync bytes"]  # fmt: skip
    rows = []
    for kind, side in report["sides"].items():
        means = side.get("mean_after_first") or side.get("mean_all") or {}
        rate = side.get("tokens_per_s") or {}
        rows.append([kind, side.get("world_size"), side.get("distributed_type"),
                     f"{side.get('steps_run', 0)}/{side.get('steps_requested')}", side.get("generation_backend"),
                     (side.get("interval_s") or {}).get("mean_after_first"),
                     *(means.get(k) for k in w3.PHASE_KEYS), rate.get("mean_after_first") or rate.get("mean_all"),
                     side.get("peak_GiB_per_rank"), side.get("sync_bytes")])  # fmt: skip
    print("\nW3 scaling: seconds per step on rank 0 (means after the first step, where there are two or more)")
    print(markdown_table(header, rows))


def main(argv=None) -> Report:
    import accelerate

    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = args.prompts_per_step or world
    if prompts % world:
        raise SystemExit(f"--prompts-per-step {prompts} does not split evenly over {world} processes: pass a multiple "
                         f"of {world}")  # fmt: skip
    args.prompts_per_step, args.prompts_per_rank = prompts, prompts // world
    report = RankReport(args.out, workload="W3 scaling", command=shlex.join(["python", "bench/scaling.py", *argv]),
                        launcher_env={k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_ENV)},
                        tiny=args.tiny, world_size=world, timing=TIMING, sides={})  # fmt: skip
    with report.recording_failure():
        report.update(environment(cuda))
        report["versions"]["accelerate"] = accelerate.__version__
        rows = {"steps": args.steps * prompts, "trl_steps": args.trl_steps * prompts}  # a prompt per step and rank's
        data = w3.build_data(argparse.Namespace(**{**vars(args), **rows}))  # share: no sample is seen twice
        report["settings"] = settings_record(args, data, cuda, world)
        for kind in args.kinds:
            side = report["sides"][kind] = {}
            run_side(kind, args, data, side, report, cuda)
            if side["status"] == "error":
                report["problems"].append(f"{kind} raised: {side['error'].strip().splitlines()[-1]}")
    from slimrl.distributed.process_group import end_launcher_group

    end_launcher_group()
    if is_main():
        print_table(report)
        report.print_outcome()
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
