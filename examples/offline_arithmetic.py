"""SFT or DPO with slimrl on the embedded model (SmolLM2-135M-Instruct), on the demo's arithmetic, CPU or GPU.

SFT trains on the correct reply ("<a> + <b> = <result>"); DPO prefers that reply over the same line with a wrong
result. Both measure held-out accuracy (greedy, 48 problems never trained on) before and after, exactly as the demo
does, and save the LoRA adapter.

    python examples/offline_arithmetic.py sft [--steps 12] [--output-dir outputs/sft]
    python examples/offline_arithmetic.py dpo [--steps 12] [--output-dir outputs/dpo]

`PatchFastRL(algorithm)` makes `trl.SFTTrainer` / `trl.DPOTrainer` slimrl's; the rest is plain TRL.

Measured on this project's 2-core CPU machine, idle (wall time of the whole command, model load and both evaluations
included): SFT 89 s, held-out accuracy 42% -> 79%; DPO 109 s (4 pairs a step), 42% -> 54%.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


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
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from slimrl import FastLanguageModel, PatchFastRL

    PatchFastRL(args.algorithm, FastLanguageModel)
    import trl
    from datasets import Dataset

    from slimrl.data import arithmetic_dataset
    from slimrl.data.arithmetic import arithmetic_rows
    from slimrl.demo import evaluate

    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=256,
                                                         dtype=None if cuda else torch.float32)  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False,
                                             random_state=args.seed)  # fmt: skip
    held_out = arithmetic_dataset(48, seed=1, split="eval")
    before = evaluate(model, tokenizer, held_out, max_new_tokens=24)
    rows = replies(arithmetic_rows(8 * args.steps, seed=args.seed), args.seed)
    if args.algorithm == "sft":
        data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
        config_cls, trainer_cls, extra = trl.SFTConfig, trl.SFTTrainer, {"learning_rate": 2e-4}
    else:
        data = Dataset.from_list(rows)
        # 4 pairs a step: a DPO step runs the policy on both replies and the reference too (3x SFT's forwards)
        config_cls, trainer_cls, extra = trl.DPOConfig, trl.DPOTrainer, {"learning_rate": 1e-4, "beta": 0.1,
                                                                          "per_device_train_batch_size": 4}
    extra.setdefault("per_device_train_batch_size", 8)
    config = config_cls(output_dir=args.output_dir or f"outputs/{args.algorithm}",
                        max_steps=args.steps, logging_steps=5, report_to="none", save_strategy="no",
                        bf16=cuda, use_cpu=not cuda, seed=args.seed, **extra)  # fmt: skip
    trainer = trainer_cls(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(model, tokenizer, held_out, max_new_tokens=24)
    model.save_pretrained(config.output_dir)
    result = {"algorithm": args.algorithm, "steps": args.steps, "train_seconds": round(seconds, 1),
              "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"]}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
