"""QLoRA through FastLanguageModel on the W1 model shape (shared/bench/WORKLOAD.md: Qwen2.5-1.5B, random weights).

Builds the model from its config in bf16 and saves it, loads it back with `load_in_4bit=True` (NF4, double
quantisation), adds LoRA (r=16, all seven projections), runs a few AdamW steps of plain causal-LM loss on random tokens
with gradient checkpointing, and saves the merged 16-bit model; beside it, the plain path (transformers bf16 load and
peft LoRA) runs the same steps. Reports peak GPU memory (torch.cuda.max_memory_allocated, reset before each phase)
after loading, during training and during the merge, the time of each phase, and how far the reloaded merged model's
logits are from the 4-bit adapter model's.

    python bench/load_4bit.py --out $OUT                 # on CUDA, the W1 shape
    python bench/load_4bit.py --tiny --out /tmp/q        # a 2-layer model, CPU or GPU: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import sync_time, w1_config  # noqa: E402

GIB = 2**30


def save_random_model(path: Path, tiny: bool, device: str) -> None:
    """The W1 model with random weights, saved as a bf16 checkpoint with the tiny byte-level tokenizer."""
    from transformers import AutoModelForCausalLM

    from slimrl.testing import tiny_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        # the tiny tokenizer's pad and EOS ids, so the saved checkpoint loads with its tokenizer as a real one would
        model = AutoModelForCausalLM.from_config(w1_config(tiny, pad_token_id=0, eos_token_id=3), dtype=torch.bfloat16)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    del model


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / GIB, 3) if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def train_steps(model, args, device: str, vocab: int) -> dict:
    """A few AdamW steps of causal-LM loss on random tokens: losses, seconds per step, peak GiB."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    reset_peak(device)
    losses, step_times = [], []
    for _ in range(args.steps):
        ids = torch.randint(10, vocab, (args.batch, args.seq_len), generator=generator).to(device)
        start = sync_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(round(sync_time() - start, 3))
        losses.append(round(loss.item(), 4))
    return {"trainable_params": sum(p.numel() for p in trainable), "losses": losses, "step_s": step_times,
            "peak_gib_train": peak_gib(device), "losses_finite": all(map(math.isfinite, losses))}  # fmt: skip


def run_baseline(base_dir: Path, args, device: str) -> dict:
    """The plain path beside it: transformers bf16 load, peft LoRA on the same projections, torch checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    reset_peak(device)
    start = sync_time()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, device_map={"": device})
    result = {"load_s": round(sync_time() - start, 2), "peak_gib_load": peak_gib(device),
              "allocated_gib_after_load": allocated_gib(device)}  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=targets))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    result.update(train_steps(model, args, device, model.config.vocab_size))
    del model
    return result


def run_slimrl(base_dir: Path, merged_dir: Path, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from slimrl import FastLanguageModel

    reset_peak(device)
    start = sync_time()
    model, tokenizer = FastLanguageModel.from_pretrained(str(base_dir), max_seq_length=args.seq_len,
                                                         load_in_4bit=True)  # fmt: skip
    result = {"load_s": round(sync_time() - start, 2), "peak_gib_load": peak_gib(device),
              "allocated_gib_after_load": allocated_gib(device),
              "compute_dtype": str(model.model.layers[0].mlp.down_proj.compute_dtype)}  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=args.rank, lora_alpha=args.rank)
    vocab = model.config.vocab_size
    result.update(train_steps(model, args, device, vocab))

    FastLanguageModel.for_inference(model)
    reset_peak(device)
    start = sync_time()
    model.save_pretrained_merged(merged_dir, tokenizer, save_method="merged_16bit")
    result.update(merge_s=round(sync_time() - start, 2), peak_gib_merge=peak_gib(device),
                  merged_files=sorted(p.name for p in merged_dir.iterdir()))  # fmt: skip

    # the reloaded merged model computes what the 4-bit adapter model computes, up to NF4-vs-bf16 rounding
    probe = torch.randint(10, vocab, (1, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        adapter_logits = model(input_ids=probe).logits.float()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, device_map={"": device})
        merged_logits = merged(input_ids=probe).logits.float()
    result.update(
        merged_dtype=str(merged.dtype),
        merged_logits_max_abs_diff=(merged_logits - adapter_logits).abs().max().item(),
        adapter_logits_max_abs=adapter_logits.abs().max().item(),
        merged_argmax_agreement=(merged_logits.argmax(-1) == adapter_logits.argmax(-1)).float().mean().item(),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for load_4bit.json")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the W1 shape")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-baseline", action="store_true", help="skip the bf16 transformers + peft baseline")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()

    import peft
    import transformers

    import slimrl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("The W1 shape needs CUDA; pass --tiny to check the script on a CPU.")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="slimrl-load4bit-"))
    base_dir, merged_dir = workdir / "base", workdir / "merged"
    report: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "bitsandbytes": _version("bitsandbytes"), "slimrl": slimrl.__version__},
        "shape": "tiny" if args.tiny else "W1 (Qwen2.5-1.5B)",
        "batch": args.batch, "seq_len": args.seq_len, "rank": args.rank, "steps": args.steps,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def dump() -> None:  # after every phase, so that a run cut short still leaves its figures
        (args.out / "load_4bit.json").write_text(json.dumps(report, indent=2) + "\n")

    try:
        start = sync_time()
        save_random_model(base_dir, args.tiny, device)
        report["build_and_save_s"] = round(sync_time() - start, 2)
        if device == "cuda":
            torch.cuda.empty_cache()
        report["slimrl_4bit"] = run_slimrl(base_dir, merged_dir, args, device)
        print(json.dumps({"slimrl_4bit": report["slimrl_4bit"]}), flush=True)
        dump()
        if not args.no_baseline:
            if device == "cuda":
                torch.cuda.empty_cache()
            report["baseline_bf16"] = run_baseline(base_dir, args, device)
            print(json.dumps({"baseline_bf16": report["baseline_bf16"]}), flush=True)
            dump()
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def allocated_gib(device: str) -> float | None:
    return round(torch.cuda.memory_allocated() / GIB, 3) if device == "cuda" else None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
