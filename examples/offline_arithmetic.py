"""SFT or DPO with slimrl on the embedded model (SmolLM2-135M-Instruct), on the demo's arithmetic, CPU or GPU.

SFT trains on the correct reply ("<a> + <b> = <result>"); DPO prefers that reply over the same line with a wrong
result. Both measure held-out accuracy (greedy, 48 problems never trained on) before and after, exactly as the demo
does, and save the LoRA adapter.

    python examples/offline_arithmetic.py sft [--steps 12] [--output-dir outputs/sft]
    python examples/offline_arithmetic.py dpo [--steps 12] [--output-dir outputs/dpo]
    python examples/offline_arithmetic.py sft --smoke   # seconds: checks that it runs (tests/test_examples.py)

`--smoke` swaps the embedded model for slimrl.testing's tiny 2-layer model (random weights, built from a config; the
135M model's load and steps take too long for a test) and runs 1 step on the CPU with 4 held-out problems.

`PatchFastRL(algorithm)` makes `trl.SFTTrainer` / `trl.DPOTrainer` slimrl's; the rest is plain TRL.

Measured on this project's 2-core CPU machine, idle (wall time of the whole command, model load and both evaluations
included): SFT 89 s, held-out accuracy 42% -> 79%; DPO 109 s (4 pairs a step), 42% -> 54%.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from example_setup import load_model


def replies(rows: list[dict], seed: int) -> list[dict]:
    """Each problem as prompt (a user turn), its correct reply and a reply with a wrong result."""
    from slimrl.data.arithmetic import INSTRUCTION

    rng = random.Random(seed)
    out = []
    for row in rows:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        wrong = int(row["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3])
        out.append({"prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
                    "chosen": [{"role": "assistant", "content": f"{expression} = {row['answer']}"}],
                    "rejected": [{"role": "assistant", "content": f"{expression} = {wrong}"}]})  # fmt: skip
    return out



def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algorithm", choices=("sft", "dpo"))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 12; 1 with --smoke)")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 step, CPU: checks that the example runs")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 12

    from slimrl import FastLanguageModel, PatchFastRL

    PatchFastRL(args.algorithm, FastLanguageModel)
    import trl
    from datasets import Dataset

    from slimrl.cli.demo import evaluate
    from slimrl.data import arithmetic_dataset
    from slimrl.data.arithmetic import arithmetic_rows

    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available() and not args.smoke
    model, tokenizer = load_model(args.smoke, cuda, args.seed)
    # the smoke run's tiny model answers nothing right: a few problems and tokens show the evaluation runs
    held_out = arithmetic_dataset(4 if args.smoke else 48, seed=1, split="eval")
    new_tokens = 4 if args.smoke else 24
    before = evaluate(model, tokenizer, held_out, max_new_tokens=new_tokens)
    batch = 2 if args.smoke else 8
    rows = replies(arithmetic_rows(batch * args.steps, seed=args.seed), args.seed)
    if args.algorithm == "sft":
        data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
        config_cls, trainer_cls, extra = trl.SFTConfig, trl.SFTTrainer, {"learning_rate": 2e-4}
    else:
        data = Dataset.from_list(rows)
        # 4 pairs a step: a DPO step runs the policy on both replies and the reference too (3x SFT's forwards)
        extra = {"learning_rate": 1e-4, "beta": 0.1, "per_device_train_batch_size": batch // 2}
        config_cls, trainer_cls = trl.DPOConfig, trl.DPOTrainer
    extra.setdefault("per_device_train_batch_size", batch)
    config = config_cls(output_dir=args.output_dir or f"outputs/{args.algorithm}",
                        max_steps=args.steps, logging_steps=5, report_to="none", save_strategy="no",
                        bf16=cuda, use_cpu=not cuda, seed=args.seed, **extra)  # fmt: skip
    trainer = trainer_cls(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(model, tokenizer, held_out, max_new_tokens=new_tokens)
    model.save_pretrained(config.output_dir)
    result = {"algorithm": args.algorithm, "steps": args.steps, "train_seconds": round(seconds, 1),
              "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"]}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
