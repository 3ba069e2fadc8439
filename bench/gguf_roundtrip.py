"""GGUF round trip on the demo's task: does the exported file answer as the trained model does?

Trains the demo (slimrl.cli.demo.run_demo: GRPO on SmolLM2-135M-Instruct's arithmetic, --steps steps) or takes an
adapter a demo run saved (--adapter DIR), loads it on its base and scores held-out accuracy with the demo's greedy
evaluation (slimrl.cli.demo.evaluate); exports the merged model with `slimrl.save_pretrained_gguf` (q8_0 by default),
loads the file back with transformers' own GGUF loader (AutoModelForCausalLM / AutoTokenizer with gguf_file=..., nothing
of slimrl in between) in the trained model's dtype and device, and scores it again on the same problems. Recorded: both
accuracies and their difference, the file's size, export and reload times, the versions and the command. A drop in
accuracy larger than --max-drop is reported as a problem.

There is no TRL side: TRL has no GGUF export (Unsloth's is the one this mirrors).

    python bench/gguf_roundtrip.py $OUT/gguf_roundtrip.json [--steps 50] [--method q8_0] [--eval-size 100]
    python bench/gguf_roundtrip.py $OUT/gguf_roundtrip.json --adapter outputs/demo/adapter   # a saved demo adapter
    python bench/gguf_roundtrip.py out.json --tiny     # CPU smoke: the 2-layer model, one step, 4 problems
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import Report, default_output, environment  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("gguf_roundtrip.json"))
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--adapter", default=None, help="a demo run's saved adapter; without it the demo trains")
    parser.add_argument("--steps", type=int, default=50, help="demo training steps (when no --adapter)")
    parser.add_argument("--method", default="q8_0", choices=["f16", "bf16", "q8_0"])
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--max-drop", type=float, default=0.02, help="largest accuracy drop not reported a problem")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="slimrl.testing's 2-layer Llama: a CPU smoke run")
    return parser.parse_args(argv)


def demo_settings(args, output_dir: Path):
    from slimrl.cli.demo import DemoSettings

    settings = DemoSettings(model=args.model, steps=args.steps, output_dir=str(output_dir), eval_size=args.eval_size,
                            max_completion_length=args.max_completion_length, device=args.device,
                            seed=args.seed)  # fmt: skip
    if args.tiny:
        settings.model, settings.steps, settings.num_generations, settings.eval_size = "tiny", 1, 4, 4
        settings.max_completion_length = 8
    settings.validate()
    return settings


def trained_model(settings, adapter: str, device: str):
    """The demo's base with the saved adapter on it, as the demo loads the base (same dtype and device)."""
    from peft import PeftModel

    from slimrl.cli.demo import load_model

    model, tokenizer = load_model(settings, device)  # base + a fresh LoRA of the demo's shape
    base = model.unload()  # the fresh LoRA off again: the saved adapter goes on the plain base
    return PeftModel.from_pretrained(base, adapter).eval(), tokenizer


def gguf_model(path: str, dtype: torch.dtype, device: str):
    """The exported file through transformers' GGUF loader alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(path).parent), Path(path).name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"  # batched greedy generation pads prompts on the left, as slimrl's loader sets it
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def round_trip(args, report: Report, work: Path) -> None:
    from slimrl import save_pretrained_gguf
    from slimrl.cli.demo import demo_datasets, evaluate, resolve_device, run_demo

    device = resolve_device(args.device)
    settings = demo_settings(args, work / "demo")
    report["demo_settings"] = asdict(settings)  # what ran (--tiny overrides the model and sizes)
    adapter = args.adapter
    if adapter is None:
        summary = run_demo(settings)
        report["demo"] = {key: summary[key] for key in ("accuracy_before", "accuracy_after", "train_seconds")}
        adapter = str(work / "demo" / "adapter")
    _, eval_set = demo_datasets(settings)
    model, tokenizer = trained_model(settings, adapter, device)
    trained = evaluate(model, tokenizer, eval_set, settings.max_completion_length)
    report.update(accuracy_trained=trained, adapter=args.adapter or "trained by this run")
    report.save()

    started = time.perf_counter()
    path = save_pretrained_gguf(model, work / "gguf", tokenizer, quantization_method=args.method)
    report.update(export_s=round(time.perf_counter() - started, 2), file=Path(path).name,
                  file_bytes=Path(path).stat().st_size)  # fmt: skip
    dtype = next(model.parameters()).dtype
    del model
    started = time.perf_counter()
    exported, exported_tokenizer = gguf_model(path, dtype, device)
    report.update(reload_s=round(time.perf_counter() - started, 2), reload_dtype=str(dtype).removeprefix("torch."))
    scored = evaluate(exported, exported_tokenizer, eval_set, settings.max_completion_length)
    drop = trained["accuracy"] - scored["accuracy"]
    report.update(accuracy_gguf=scored, accuracy_difference=round(scored["accuracy"] - trained["accuracy"], 4))
    if drop > args.max_drop:
        report["problems"].append(f"held-out accuracy fell by {drop:.3f} after the {args.method} round trip "
                                  f"(more than --max-drop {args.max_drop})")  # fmt: skip


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/gguf_roundtrip.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(args.out, benchmark="gguf_roundtrip", command=command)
    with report.recording_failure():
        import gguf

        report.update(environment(torch.cuda.is_available()), settings={k: v for k, v in vars(args).items()
                                                                          if k != "out"})  # fmt: skip
        report["versions"]["gguf"] = getattr(gguf, "__version__", None) or _distribution_version("gguf")
        with tempfile.TemporaryDirectory(prefix="slimrl-gguf-bench-") as work:
            round_trip(args, report, Path(work))
    if "accuracy_gguf" in report:
        print(f"held-out accuracy: trained {report['accuracy_trained']['accuracy']:.3f}, {args.method} GGUF "
              f"{report['accuracy_gguf']['accuracy']:.3f} (difference {report['accuracy_difference']:+.3f}); "
              f"file {report['file_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    report.print_outcome()
    return report


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main().exit_status())
