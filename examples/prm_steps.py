"""A process reward model (PRM) with slimrl on the embedded model (SmolLM2-135M-Instruct): scoring each line of a
worked arithmetic solution as correct or not, CPU or GPU.

The data is built here from the demo's arithmetic problems: each solution starts from a problem ('7 + 9') and adds
two more operations, one line per step ('7 + 9 = 16', '16 - 4 = 12', '12 + 11 = 23'), each line starting from the
result the line before it stated. About a third of the stated results are off by 10 to 30. Each step's label comes
from checking that line alone: is its result the true value of its own left side? The PRM is SmolLM2's backbone with
a two-class token-classification head (fresh) and a LoRA adapter; it learns to put the step's label on the newline
after the step. It prints the held-out step accuracy (solutions built from problems never trained on) before and
after training, beside the share of correct steps (what always answering "correct" scores), and saves the adapter
and head. (Smaller slips are harder: with results off by 1, 2 or 10, a trial of 64 steps left the step accuracy at
that share.)

    python examples/prm_steps.py [--steps 96] [--output-dir outputs/prm]
    python examples/prm_steps.py --smoke   # seconds: checks that it runs (tests/test_examples.py)

`--smoke` swaps the embedded model for slimrl.testing's tiny 2-layer model (random weights, built from a config; the
135M model's load and steps take too long for a test): 8 solutions, 2 steps on the CPU, 4 held-out solutions.
Flags given beside it still apply.

`PatchFastRL("prm")` adds slimrl's PRMTrainer and PRMConfig to `trl` (TRL 1.16 removed its own); the dataset format
(prompt, completions = the steps, labels = one bool per step) is TRL's.

Measured on this project's 2-core CPU machine, shared with other work (wall time of the whole command, both
evaluations included): 296 s, of which training 239 s; held-out step accuracy 71% -> 83%, where 71% of the steps are
correct; held-out loss 0.89 -> 0.39.
"""

from __future__ import annotations

import argparse
import copy
import random
import re
import time

import torch
from example_setup import parse_with_smoke

# the smoke run's settings: a few seconds on a CPU
SMOKE_DEFAULTS = {"steps": 2, "solutions": 8, "eval_size": 4, "batch": 4}
STEP = re.compile(r"(-?\d+) ([+-]) (\d+) = .*")  # a line of a worked solution: 'a + b = c' or 'a - b = c'
WRONG_BY = (*range(-30, -9), *range(10, 31))  # how far a wrong result is off


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=96, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="solutions per step")
    parser.add_argument("--solutions", type=int, default=256, help="training solutions (a problem each)")
    parser.add_argument("--error-rate", type=float, default=0.3, help="chance that a line states a wrong result")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="constant: the LoRA's and the head's")
    parser.add_argument("--eval-size", type=int, default=48, help="held-out solutions")
    parser.add_argument("--output-dir", default="outputs/prm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, CPU: checks that it runs")
    return parse_with_smoke(parser, SMOKE_DEFAULTS, argv)


def step_is_correct(line: str) -> bool:
    """Check one line of a worked solution on its own: its stated result is the value of its left side."""
    from slimrl.rewards import extract_answer

    match = STEP.fullmatch(line)
    if match is None:
        return False
    left, operation, right = match.groups()
    value = int(left) + int(right) if operation == "+" else int(left) - int(right)
    return extract_answer(line) == str(value)


def state(value: int, rng: random.Random, error_rate: float) -> int:
    """The result a line states: `value`, or with chance `error_rate` a value off by one of WRONG_BY."""
    return value + rng.choice(WRONG_BY) if rng.random() < error_rate else value


def worked_solutions(n: int, seed: int, split: str, error_rate: float):
    """`n` PRM rows from the `split` problems of slimrl's arithmetic: prompt, completions (3 lines, some with wrong
    results) and labels (each line checked by `step_is_correct`)."""
    from datasets import Dataset

    from slimrl.data.arithmetic import arithmetic_rows

    rng, rows = random.Random(f"{seed}-{split}"), []
    for problem in arithmetic_rows(n, seed=seed, split=split):
        expression = problem["question"].removeprefix("What is ").removesuffix("?")
        stated = state(int(problem["answer"]), rng, error_rate)
        lines = [f"{expression} = {stated}"]
        for _ in range(2):
            operation, operand = rng.choice("+-"), rng.randint(1, 20)
            expression += f" {operation} {operand}"
            left, stated = stated, state(stated + operand if operation == "+" else stated - operand, rng, error_rate)
            lines.append(f"{left} {operation} {operand} = {stated}")
        rows.append({"prompt": f"What is {expression}? Work it out one step per line.\n", "completions": lines,
                     "labels": [step_is_correct(line) for line in lines]})  # fmt: skip
    return Dataset.from_list(rows)


def load_classifier(smoke: bool, cuda: bool, seed: int):
    """SmolLM2-135M-Instruct (or with `smoke` the tiny model) as a token classifier: its backbone, a fresh two-class
    head in place of the LM head. (classifier, tokenizer)."""
    from transformers import AutoModelForTokenClassification

    from slimrl import FastLanguageModel

    if smoke:
        from slimrl.testing import tiny_model, tiny_tokenizer

        causal, tokenizer = tiny_model("llama", seed=seed), tiny_tokenizer()
    else:
        causal, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=256,
                                                              dtype=None if cuda else torch.float32)  # fmt: skip
    config = copy.deepcopy(causal.config)
    config.num_labels = 2  # 0: the step is wrong, 1: it is correct
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the head's initial weights
        classifier = AutoModelForTokenClassification.from_config(config, dtype=causal.dtype)
    prefix = classifier.base_model_prefix  # "model" for Llama-style decoders: the backbone, shared, not copied
    setattr(classifier, prefix, getattr(causal, prefix))
    return classifier.to(causal.device), tokenizer


def main(argv=None) -> dict:
    args = parse_args(argv)
    from peft import LoraConfig

    from slimrl import FastLanguageModel, PatchFastRL

    PatchFastRL("prm", FastLanguageModel)
    from trl import PRMConfig, PRMTrainer

    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available() and not args.smoke
    model, tokenizer = load_classifier(args.smoke, cuda, args.seed)
    train_rows = worked_solutions(args.solutions, args.seed, "train", args.error_rate)
    held_out = worked_solutions(args.eval_size, args.seed, "eval", args.error_rate)
    correct_share = sum(map(sum, held_out["labels"])) / sum(map(len, held_out["labels"]))

    config = PRMConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
                       per_device_eval_batch_size=16, learning_rate=args.learning_rate, lr_scheduler_type="constant",
                       max_length=128,
                       gradient_checkpointing=False, logging_steps=max(1, args.steps // 8), report_to="none",
                       save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=args.seed, disable_tqdm=True)  # fmt: skip
    # LoRA on the backbone's projections; the fresh head trains in full (peft's modules_to_save)
    lora = LoraConfig(task_type="TOKEN_CLS", r=16, lora_alpha=32, modules_to_save=["score"],
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = PRMTrainer(model=model, args=config, train_dataset=train_rows, eval_dataset=held_out,
                         processing_class=tokenizer, peft_config=lora)  # fmt: skip
    before = trainer.evaluate()
    print(f"held-out step accuracy before: {before['eval_accuracy']:.0%} (correct steps: {correct_share:.0%})")
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = trainer.evaluate()
    print(f"held-out step accuracy after:  {after['eval_accuracy']:.0%}")
    trainer.save_model(args.output_dir)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"steps": trainer.state.global_step, "train_seconds": round(seconds, 1),
              "correct_step_share": correct_share, "step_accuracy_before": before["eval_accuracy"],
              "step_accuracy_after": after["eval_accuracy"], "eval_loss_before": before["eval_loss"],
              "eval_loss_after": after["eval_loss"], "loss_first_log": losses[0],
              "loss_last_log": losses[-1]}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
