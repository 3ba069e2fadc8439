"""W4 and W5: one training step of DPO (W4) or SFT (W5) on W1's model and LoRA, TRL beside TRL+Liger beside slimrl.

W4: DPO, loss sigmoid, beta 0.1, the reference by disabling the adapter; 8 pairs, prompts of 256 tokens, chosen and
rejected of L tokens each (L = 1024, 4096, 16384 by default). W5: SFT (nll), batch 8 of L tokens (4096, 16384,
65536). Each side gets a fresh W1 model (bench/common.py: Qwen2.5-1.5B's shape, random weights, LoRA r=64 on every
linear layer, bf16, gradient checkpointing), prepared by the trainer's accelerator as `train()` prepares it (bf16
autocast around the forward), and runs HF Trainer's `training_step` (forward, backward, slimrl's chunks and guards)
on the first batch of its own data collator, twice; the second is timed. Reported per side and L: peak
GPU memory (torch.cuda.max_memory_allocated), seconds, loss and LoRA grad norm, and for slimrl the chunk count.
A side that runs out of memory is recorded as "OOM"; TRL with `use_liger_kernel=True` needs the liger-kernel
package (recorded as missing where it is not installed).

    python bench/preference_memory.py $OUT/w4.json --algorithm dpo [--lengths 1024 4096 16384]
    python bench/preference_memory.py $OUT/w5.json --algorithm sft [--lengths 4096 16384 65536]
        [--sides trl liger slimrl] [--mlp-tile-tokens N]
    python bench/preference_memory.py /tmp/w4_tiny.json --algorithm dpo --tiny      # CPU smoke run, 2-layer model

Exit status 1 when a side raised anything but OOM, or when slimrl's loss differs from TRL's at some L where both ran
(relative 1e-2: bf16 with a different summation order).
"""

from __future__ import annotations

import argparse
import gc
import random
import string
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import Report, default_output, environment, sync_time, w1_model  # noqa: E402

PAIRS, PROMPT = 8, 256
DEFAULT_LENGTHS = {"dpo": [1024, 4096, 16384], "sft": [4096, 16384, 65536]}
SIDES = ("trl", "liger", "slimrl")


def text(length: int, rng: random.Random) -> str:
    """`length` tokens under slimrl.testing's byte tokenizer (one lowercase letter each)."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def dataset(algorithm: str, length: int, rows: int):
    from datasets import Dataset

    rng = random.Random(length)
    if algorithm == "dpo":
        return Dataset.from_list([{"prompt": text(PROMPT, rng), "chosen": text(length, rng),
                                   "rejected": text(length, rng)} for _ in range(rows)])  # fmt: skip
    return Dataset.from_list([{"text": text(length, rng)} for _ in range(rows)])


def trainer_classes(algorithm: str, side: str):
    if side == "slimrl":
        import slimrl

        return (slimrl.DPOTrainer, slimrl.DPOConfig) if algorithm == "dpo" else (slimrl.SFTTrainer, slimrl.SFTConfig)
    import trl

    return (trl.DPOTrainer, trl.DPOConfig) if algorithm == "dpo" else (trl.SFTTrainer, trl.SFTConfig)


def build_trainer(algorithm: str, side: str, model, length: int, cuda: bool, mlp_tile_tokens: int | None = None):
    from slimrl.testing import tiny_tokenizer

    trainer_cls, config_cls = trainer_classes(algorithm, side)
    settings = dict(output_dir="/tmp/bench-preference", per_device_train_batch_size=PAIRS, report_to="none",
                    save_strategy="no", gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda,
                    max_length=None, use_liger_kernel=side == "liger", disable_tqdm=True)  # fmt: skip
    if algorithm == "dpo":
        settings.update(beta=0.1, loss_type="sigmoid")
    if side == "slimrl":
        settings["num_chunks"] = "auto"
        if mlp_tile_tokens is not None:
            settings["mlp_tile_tokens"] = mlp_tile_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config_cls(**settings)
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset(algorithm, length, PAIRS),
                              processing_class=tiny_tokenizer())  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    # as HF Trainer's training loop does when args.gradient_checkpointing is set
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.enable_input_require_grads()
    # and as train() does, the accelerator prepares the model: with bf16, its forward runs under autocast
    trainer.model = trainer.model_wrapped = trainer.accelerator.prepare(trainer.model)
    return trainer


def measure(trainer, cuda: bool) -> dict:
    model = trainer.model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    inputs = trainer._prepare_inputs(batch)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = sync_time()
        loss = trainer.training_step(model, dict(inputs))
        seconds = sync_time() - start
    grads = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
    result = dict(s=round(seconds, 3), loss=loss.item(), grad_norm=torch.stack(grads).sum().sqrt().item(),
                  tokens=int(inputs["attention_mask"].sum()))  # fmt: skip
    if cuda:
        result["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if hasattr(trainer, "last_auto_chunks"):
        result["num_chunks"] = trainer.last_auto_chunks
    return result


def run_side(args, side: str, length: int, cuda: bool) -> dict | str:
    """One side at one length on a fresh model: its result, or why there is none."""
    if side == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger-kernel is not installed"
    model = w1_model(tiny=args.tiny, device="cuda" if cuda else "cpu", context=PROMPT + length + 8,
                     dtype=None if cuda else torch.float32)  # fmt: skip
    trainer = None
    try:
        trainer = build_trainer(args.algorithm, side, model, length, cuda, args.mlp_tile_tokens)
        return measure(trainer, cuda)
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        del model, trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def check_losses(report: Report) -> None:
    for key, result in report["results"].items():
        if not key.startswith("slimrl_") or not isinstance(result, dict):
            continue
        trl_result = report["results"].get(key.replace("slimrl_", "trl_", 1))
        if isinstance(trl_result, dict) and abs(result["loss"] - trl_result["loss"]) > 1e-2 * abs(trl_result["loss"]):
            report["problems"].append(f"{key}: loss {result['loss']:.6g} differs from TRL's {trl_result['loss']:.6g}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("preference_memory.json"))
    parser.add_argument("--algorithm", choices=("dpo", "sft"), default="dpo")
    parser.add_argument("--lengths", type=int, nargs="+", help="completion (DPO) or sequence (SFT) lengths")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--tiny", action="store_true", help="2-layer model on the CPU, short lengths: a smoke run")
    parser.add_argument("--mlp-tile-tokens", type=int, default=None, help="slimrl's MLP tile (default: its own)")
    args = parser.parse_args(argv)
    if args.lengths is None:
        args.lengths = [32, 64] if args.tiny else DEFAULT_LENGTHS[args.algorithm]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    report = Report(args.out, workload="W4" if args.algorithm == "dpo" else "W5", algorithm=args.algorithm,
                    command=" ".join(["python", "bench/preference_memory.py", *(argv or sys.argv[1:])]),
                    pairs_or_rows=PAIRS, prompt_tokens=PROMPT if args.algorithm == "dpo" else 0,
                    **environment(cuda), results={})  # fmt: skip
    with report.recording_failure():
        for length in args.lengths:
            for side in args.sides:
                key = f"{side}_L{length}"
                try:
                    report["results"][key] = run_side(args, side, length, cuda)
                except Exception as error:  # noqa: BLE001 - recorded; the other sides still run
                    report["results"][key] = f"raised {type(error).__name__}: {error}".splitlines()[0]
                    report["problems"].append(f"{key} {report['results'][key]}")
                print(f"{key}: {report['results'][key]}", flush=True)
                report.save()
        check_losses(report)
    report.print_outcome()
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
