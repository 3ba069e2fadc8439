"""W1 (shared/bench/WORKLOAD.md): the GRPO training phase on a Qwen2.5-1.5B-shaped model, TRL beside slimrl.

For each completion length L: compute_loss + backward on 8 completions (prompt 256 tokens), second of two
iterations timed, peak memory from torch.cuda.max_memory_allocated, loss and LoRA grad norm; TRL's trainer first
(gradient checkpointing on, as HF Trainer enables it), then slimrl's on the same model and inputs.
With --beta, the reference log-probs come from the same model with the adapter disabled, computed before the
training phase by each trainer's own scoring pass, whose peak is reported too.

    python bench/grpo_memory.py --out $OUT 1024 4096 16384 32768 65536 131072 [--beta 0.04] [--skip-trl-above 32768]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

V, B, P = 151936, 8, 256


def build_model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=V, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=140000,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).cuda()
    lora = LoraConfig(r=64, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


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


def make_inputs(length: int):
    g = torch.Generator(device="cuda").manual_seed(length)
    return {
        "prompt_ids": torch.randint(10, V, (B, P), device="cuda", generator=g),
        "prompt_mask": torch.ones(B, P, device="cuda", dtype=torch.long),
        "completion_ids": torch.randint(10, V, (B, length), device="cuda", generator=g),
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


def measure(trainer, length: int, beta: float) -> dict:
    model = trainer.model
    inputs = make_inputs(length)
    result = {}
    if beta:
        inputs["ref_per_token_logps"], result["ref_pass_peak_GiB"] = reference_logps(trainer, inputs)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    grads = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
    result.update(peak_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2), s=round(seconds, 3),
                  loss=loss.item(), grad_norm=torch.stack(grads).sum().sqrt().item(),
                  tokens=B * (P + length))  # fmt: skip
    if hasattr(trainer, "last_auto_chunks"):
        result["num_chunks"] = trainer.last_auto_chunks
    model.zero_grad(set_to_none=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", nargs="*", type=int, default=[1024, 4096, 16384, 32768, 65536, 131072])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--trainers", default="trl,slimrl")
    parser.add_argument("--skip-trl-above", type=int, default=32768, help="TRL does not fit beyond this in 80 GB")
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--variants",
        default="",
        help="slimrl settings to compare, e.g. '8/8192/1;8/0/0' = "
        "num_chunks/mlp_tile_tokens/offload (0 or 1); each is measured as slimrl[variant]",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import peft
    import transformers
    import trl

    report = {"workload": "W1", "beta": args.beta, "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__, "peft": peft.__version__}, "results": {}}  # fmt: skip
    model = build_model()
    report["weights_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    path = out / f"grpo_memory{args.tag}.json"
    runs = [(kind, None) for kind in args.trainers.split(",")]  # TRL first: slimrl installs its savers on the model
    for spec in filter(None, args.variants.split(";")):
        chunks, tile, offload = spec.split("/")
        variant = {"num_chunks": chunks if chunks == "auto" else int(chunks), "mlp_tile_tokens": int(tile),
                   "offload_checkpoints": offload == "1"}  # fmt: skip
        runs.append((f"slimrl[{spec}]", variant))
    for kind, variant in runs:
        if variant is not None and not variant["offload_checkpoints"]:
            from slimrl.models.checkpointing import disable_offloaded_checkpointing

            disable_offloaded_checkpointing(model)
        trainer = build_trainer("trl" if kind == "trl" else "slimrl", model, max(args.lengths), args.beta, variant)
        for length in args.lengths:
            if kind == "trl" and length > args.skip_trl_above:
                report["results"][f"{kind}_L{length}"] = "skipped (beyond 80 GB in the anchor)"
                continue
            try:
                report["results"][f"{kind}_L{length}"] = measure(trainer, length, args.beta)
            except torch.OutOfMemoryError:
                report["results"][f"{kind}_L{length}"] = "OOM"
            gc.collect()
            torch.cuda.empty_cache()
            print(json.dumps({f"{kind}_L{length}": report["results"][f"{kind}_L{length}"]}), flush=True)
            path.write_text(json.dumps(report, indent=2))
        if "ref" in getattr(model, "peft_config", {}):
            model.delete_adapter("ref")  # TRL's frozen copy of the initial adapter, made when beta > 0
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    path.write_text(json.dumps(report, indent=2))
    try:
        plot(report, out / f"grpo_memory{args.tag}.png")
    except ImportError as error:  # matplotlib is not on every GPU image; the JSON is the record
        print(f"no plot: {error}")


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
