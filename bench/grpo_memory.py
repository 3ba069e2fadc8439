"""W1 (shared/bench/WORKLOAD.md): the GRPO training phase on a Qwen2.5-1.5B-shaped model, TRL beside slimrl.

For each completion length L: compute_loss + backward on 8 completions (prompt 256 tokens), second of two
iterations timed, peak memory from torch.cuda.max_memory_allocated, loss and LoRA grad norm; TRL's trainer first
(gradient checkpointing on, as HF Trainer enables it), then slimrl's on the same model and inputs.
With --beta, the reference log-probs come from the same model with the adapter disabled, computed before the
training phase by each trainer's own scoring pass, whose peak is reported too.

    python bench/grpo_memory.py --out $OUT 1024 4096 16384 32768 65536 131072 [--beta 0.04] [--skip-trl-above 32768]

--unsloth-site DIR adds Unsloth as a third side in the same run (bench/unsloth_side.py, in a process of its own with
DIR, where Unsloth and its TRL are installed, first on its path; ../shared/bench/anchors/README.md says which wheels).
--model llama8b runs Llama-3.1-8B's shape instead of W1's (issue 34's row: `--model llama8b --trainers slimrl 20480`).
--isolate runs each side (TRL, slimrl, each --variants spec) in a process of its own on the same weights, as Unsloth's
always runs: one after another in one process, a side's step can run slower than alone (the host-bound short rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import W1_VOCAB, model_for, timed_iterations, w1_model  # noqa: E402

B, P = 8, 256
CONTEXT = 140000  # the model's max_position_embeddings: room for 131072 completion tokens behind the prompt


def build_model(name: str = "w1"):
    """W1's model with its LoRA r=64 adapter (bench/common.py), initialised on the CPU and lora_A drawn without
    reseeding, as this benchmark always was (so loss and grad norm compare with the runs in docs/bench/w1_*.json),
    then moved to the GPU; another of bench/models.py's shapes is made on the GPU (an 8B model's fp32 host copy would
    take minutes)."""
    if name != "w1":
        return model_for(name, device="cuda", context=CONTEXT)
    return w1_model(device="cpu", context=CONTEXT, reseed_adapter=False).cuda()


def build_trainer(kind: str, model, max_len: int, beta: float, variant: dict | None = None):
    from datasets import Dataset

    from slimrl.testing import tiny_tokenizer

    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer

        extra = {}
    else:
        from slimrl import GRPOConfig, GRPOTrainer

        extra = {"num_chunks": "auto", **(variant or {})}
    args = GRPOConfig(output_dir="/tmp/bench-grpo", per_device_train_batch_size=B, num_generations=B,
                      report_to="none", bf16=True, gradient_checkpointing=True, save_strategy="no", loss_type="dapo",
                      beta=beta, max_completion_length=max_len, **extra)  # fmt: skip
    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_list([{"prompt": "a"}] * 16)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    # as HF Trainer's training loop does when args.gradient_checkpointing is set
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.enable_input_require_grads()
    return trainer


def make_inputs(length: int, vocab: int = W1_VOCAB):
    g = torch.Generator(device="cuda").manual_seed(length)
    return {
        "prompt_ids": torch.randint(10, vocab, (B, P), device="cuda", generator=g),
        "prompt_mask": torch.ones(B, P, device="cuda", dtype=torch.long),
        "completion_ids": torch.randint(10, vocab, (B, length), device="cuda", generator=g),
        "completion_mask": torch.ones(B, length, device="cuda", dtype=torch.long),
        "advantages": torch.randn(B, device="cuda", generator=g),
        "num_items_in_batch": torch.tensor(float(B * length), device="cuda"),
        "old_per_token_logps": None,
    }


def reference_logps(trainer, inputs) -> tuple[torch.Tensor, float]:
    """Reference log-probs through the trainer's own scoring pass with the adapter disabled, and its peak GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad(), trainer.model.disable_adapter():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].size(1), batch_size=B
        )
    torch.cuda.synchronize()
    return logps, torch.cuda.max_memory_allocated() / 2**30


def step_attention(trainer, cudnn_sdpa: str):
    """The SDPA backends of the measured step: slimrl's training step avoids cuDNN's (`training_attention`), unless
    --cudnn-sdpa allow; TRL's keeps whatever torch picks, as its own training step does."""
    import contextlib

    import slimrl
    from slimrl.ops.attention_backends import training_attention

    if isinstance(trainer, slimrl.GRPOTrainer) and cudnn_sdpa == "as-trainer":
        return training_attention()
    return contextlib.nullcontext()


def measure(trainer, length: int, beta: float, cudnn_sdpa: str = "as-trainer", repeats: int = 1) -> dict:
    model = trainer.model
    inputs = make_inputs(length, model.config.vocab_size)
    result = {}
    if beta:
        inputs["ref_per_token_logps"], result["ref_pass_peak_GiB"] = reference_logps(trainer, inputs)

    def iteration():
        model.zero_grad(set_to_none=True)
        with step_attention(trainer, cudnn_sdpa):
            loss = trainer.compute_loss(model, dict(inputs))
            loss.backward()
        return loss

    gc_ms: list[float] = []
    seconds, every, loss = timed_iterations(iteration, repeats, gc_ms)
    if repeats > 1:
        result["s_each"], result["gc_ms_each"] = every, gc_ms
    grads = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
    # reserved too: a CUDA graph's private pool is memory the allocator holds that its allocated count leaves out
    result.update(peak_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2), s=round(seconds, 3),
                  peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                  loss=loss.item(), grad_norm=torch.stack(grads).sum().sqrt().item(),
                  tokens=B * (P + length))  # fmt: skip
    if hasattr(trainer, "last_auto_chunks"):
        result["num_chunks"] = trainer.last_auto_chunks
    model.zero_grad(set_to_none=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", nargs="*", type=int, default=[1024, 4096, 16384, 32768, 65536, 131072])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--trainers", default="trl,slimrl")
    parser.add_argument("--skip-trl-above", type=int, default=32768, help="TRL does not fit beyond this in 80 GB")
    parser.add_argument("--tag", default="")
    parser.add_argument("--isolate", action="store_true",
                        help="each side (TRL, slimrl, each --variants spec) in a process of its own, as Unsloth's "
                        "always is, instead of one after another in this one on the same model")  # fmt: skip
    parser.add_argument("--model", default="w1", choices=("w1", "llama8b"), help="W1's shape or Llama-3.1-8B's")
    parser.add_argument("--unsloth-site", default=None, help="a folder with Unsloth installed: adds it as a side")
    parser.add_argument("--repeats", type=int, default=1, help="timed iterations after one untimed, median reported "
                        "(every side; 1: the second of two iterations, as the earlier W1 figures)")  # fmt: skip
    parser.add_argument("--cudnn-sdpa", choices=("as-trainer", "allow"), default="as-trainer",
                        help="as-trainer: slimrl's step runs with cuDNN's SDPA off, as its training_step does; allow: "
                        "leave torch's choice (how the figures before the cuDNN NaN fix were measured)")  # fmt: skip
    parser.add_argument(
        "--variants",
        default="",
        help="slimrl settings to compare, e.g. '8/8192/1;8/0/0;auto/8192/1/0' = "
        "num_chunks/mlp_tile_tokens/offload (0 or 1)[/fast_lora (0, 1, or noattn: on but the attention blocks (their "
        "rotary embedding) left as the model's)][/keep_attention_tokens (0: recompute attention)][/layer_cuda_graphs "
        "(0 or 1)]; each is measured "
        "as slimrl[variant], a variant given again as slimrl[variant]#2, #3, ...",
    )
    return parser.parse_args(argv)


def planned_runs(args) -> list[tuple[str, dict | None]]:
    """(name, slimrl settings or None) per run: the trainers asked for, then each --variants spec."""
    # TRL first: slimrl installs its savers on the model; "" runs the variants alone
    runs = [(kind, None) for kind in filter(None, args.trainers.split(","))]
    given: dict[str, int] = {}
    for spec in filter(None, args.variants.split(";")):
        given[spec] = given.get(spec, 0) + 1  # a spec given again (an A/B alternating) is measured under a new name
        chunks, tile, offload, *fast = spec.split("/")
        variant = {"num_chunks": chunks if chunks == "auto" else int(chunks), "mlp_tile_tokens": int(tile),
                   "offload_checkpoints": offload == "1"}  # fmt: skip
        if fast:
            variant["fast_lora"] = fast[0] != "0"
            variant["attention"] = fast[0] != "noattn"
        if len(fast) > 1:
            variant["keep_attention_tokens"] = int(fast[1])
        if len(fast) > 2:
            variant["layer_cuda_graphs"] = fast[2] == "1"
        runs.append((f"slimrl[{spec}]" + (f"#{given[spec]}" if given[spec] > 1 else ""), variant))
    return runs


def run_lengths(kind: str, variant: dict | None, model, args, report: dict, path: Path) -> None:
    """One trainer (or slimrl variant) on the model at every length, each result saved as it comes."""
    if variant is not None and not variant["offload_checkpoints"]:
        from slimrl.models.checkpointing import disable_offloaded_checkpointing

        disable_offloaded_checkpointing(model)
    if variant is not None and variant.get("fast_lora") is False:
        from slimrl.models.fast_lora import disable_fast_lora

        disable_fast_lora(model)  # an earlier side's trainer switched the shared model's layers
    settings = None if variant is None else {k: v for k, v in variant.items() if k != "attention"}
    trainer = build_trainer("trl" if kind == "trl" else "slimrl", model, max(args.lengths), args.beta, settings)
    if variant is not None and variant.get("attention", True) is False:
        from slimrl.models.fast_lora import disable_fast_lora

        disable_fast_lora(model, kind="attention")  # the trainer switched every kind; this variant keeps eager RoPE
    for length in args.lengths:
        key = f"{kind}_L{length}"
        if kind == "trl" and length > args.skip_trl_above:
            report["results"][key] = "skipped (beyond 80 GB in the anchor)"
            continue
        try:
            report["results"][key] = measure(trainer, length, args.beta, args.cudnn_sdpa, args.repeats)
        except torch.OutOfMemoryError:
            report["results"][key] = "OOM"
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps({key: report["results"][key]}), flush=True)
        path.write_text(json.dumps(report, indent=2))
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # TRL's frozen copy of the initial adapter, made when beta > 0
    del trainer
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import peft
    import transformers
    import trl

    report = {"workload": "W1", "model": args.model, "beta": args.beta, "cudnn_sdpa": args.cudnn_sdpa,
              "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__, "peft": peft.__version__}, "results": {}}  # fmt: skip
    path = out / f"grpo_memory{args.tag}.json"
    if args.isolate:
        report["isolated"] = True
        for name, command in side_commands(args, out):
            run_side(name, command, report, path)
        model = build_model(args.model) if args.unsloth_site else None  # Unsloth's side is saved from it
    else:
        model = build_model(args.model)
        report["weights_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        for kind, variant in planned_runs(args):
            run_lengths(kind, variant, model, args, report, path)
    if args.unsloth_site:
        run_unsloth(model, args, report, out)
    path.write_text(json.dumps(report, indent=2))
    try:
        plot(report, out / f"grpo_memory{args.tag}.png")
    except ImportError as error:  # matplotlib is not on every GPU image; the JSON is the record
        print(f"no plot: {error}")


def side_commands(args, out: Path) -> list[tuple[str, list[str]]]:
    """(name, command) of each side's own process under --isolate: this script with the same lengths and settings and
    one trainer or one --variants spec, its report in a folder of its own. The model is built from the same seeds in
    every process (build_model), so every side trains the same weights on the same inputs. The names are
    planned_runs's, whose results the process reports under its spec's first name (renamed in `run_side`)."""
    shared = [f"--beta={args.beta}", f"--skip-trl-above={args.skip_trl_above}", f"--repeats={args.repeats}",
              f"--cudnn-sdpa={args.cudnn_sdpa}", f"--model={args.model}", *map(str, args.lengths)]  # fmt: skip
    kinds, specs = list(filter(None, args.trainers.split(","))), list(filter(None, args.variants.split(";")))
    commands = []
    for index, ((name, _), spec) in enumerate(zip(planned_runs(args), [None] * len(kinds) + specs, strict=True)):
        which = ["--trainers", name] if spec is None else ["--trainers", "", "--variants", spec]
        commands.append((name, [sys.executable, str(Path(__file__).resolve()), "--out", str(out / f"side{index}"),
                                *which, *shared]))  # fmt: skip
    return commands


def run_side(name: str, command: list[str], report: dict, path: Path) -> None:
    """One --isolate side: its process's results join the report under the side's name."""
    finished = subprocess.run(command, check=False)
    side = Path(command[command.index("--out") + 1]) / "grpo_memory.json"
    if not side.exists():
        report["results"][name] = f"failed (exit {finished.returncode}; see the run's log)"
    else:
        first, side_report = name.split("#")[0], json.loads(side.read_text())  # a spec given again: named as the first
        if "weights_GiB" in side_report:  # the same model in every side's process
            report.setdefault("weights_GiB", side_report["weights_GiB"])
        for key, value in side_report["results"].items():
            report["results"][name + key[len(first):] if key.startswith(first + "_L") else key] = value
    path.write_text(json.dumps(report, indent=2))


def run_unsloth(model, args, report: dict, out: Path) -> None:
    """Unsloth's side (bench/unsloth_side.py) on this run's weights and lengths, in a process of its own; its
    results join the report, with slimrl's time as a fraction of Unsloth's at each length both measured."""
    from unsloth_side import save_model

    model_dir = out / "unsloth_model"
    save_model(model, model_dir)
    side_json = out / f"unsloth_side{args.tag}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.unsloth_site, str(HERE)]),
               UNSLOTH_DISABLE_STATISTICS="1", HF_HUB_OFFLINE="1")  # fmt: skip
    command = [sys.executable, str(HERE / "unsloth_side.py"), str(model_dir), str(side_json),
               f"--repeats={args.repeats}", *map(str, args.lengths)]  # fmt: skip
    finished = subprocess.run(command, env=env, check=False)
    if not side_json.exists():
        report["results"]["unsloth"] = f"failed (exit {finished.returncode}; see the run's log)"
        return
    side = json.loads(side_json.read_text())
    report["unsloth_versions"] = side["versions"]
    report["results"].update(side["results"])
    for length in args.lengths:
        ours, theirs = report["results"].get(f"slimrl_L{length}"), side["results"].get(f"unsloth_L{length}")
        if isinstance(ours, dict) and isinstance(theirs, dict):
            report.setdefault("slimrl_over_unsloth_time", {})[str(length)] = round(ours["s"] / theirs["s"], 3)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind in ("trl", "slimrl"):
        points = [(int(k.split("_L")[1]), v["peak_GiB"]) for k, v in report["results"].items()
                  if k.startswith(kind + "_") and isinstance(v, dict)]  # fmt: skip
        if points:
            ax.plot(*zip(*sorted(points), strict=True), marker="o", label=kind)
    ax.axhline(80, color="grey", linestyle=":", label="H100 80 GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("completion length L (8 completions, prompt 256)")
    ax.set_ylabel("peak GiB (training phase)")
    ax.set_title(f"W1 GRPO training phase, beta={report['beta']} ({report['gpu']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
