"""XPO (exploratory preference optimisation) with slimrl on the embedded model (SmolLM2-135M-Instruct) and the demo's
arithmetic reward as the judge, CPU or GPU.

Each step, for each of 8 training problems, the policy (SmolLM2 + LoRA) samples one reply and the reference model
(the same model with its adapter disabled) another; the demo's reward functions (a correct final answer, one short
line ending with the number) score both, and the better one is the pair's chosen reply (the policy's wins ties).
The loss is online DPO's on that pair plus alpha times the policy's log-probability of the reference's reply, XPO's
exploration term. It prints held-out accuracy (greedy, 48 problems never trained on, as the demo measures it) before
and after, and the mean score of the policy's samples against the reference's over the first and last steps, and
saves the adapter.

    python examples/xpo_arithmetic.py [--steps 16] [--output-dir outputs/xpo]
    python examples/xpo_arithmetic.py --smoke   # seconds: checks that it runs (tests/test_examples.py)

`--smoke` swaps the embedded model for slimrl.testing's tiny 2-layer model (random weights, built from a config; the
135M model's load and steps take too long for a test) and runs 2 steps of 2 pairs on the CPU with 4 held-out
problems. Flags given beside it still apply.

`PatchFastRL("xpo")` adds slimrl's XPOTrainer and XPOConfig to `trl` (TRL 1.16 removed its own); the rest is TRL's
online DPO interface.

Measured on this project's 2-core CPU machine, shared with other work (wall time of the whole command, both
evaluations included): 355 s, of which training 298 s; held-out accuracy 42% -> 56%; mean score of the policy's
samples against the reference's 1.06 vs 0.72 over the first quarter of the steps, 1.31 vs 1.06 over the last.
"""

from __future__ import annotations

import argparse
import time

import torch
from example_setup import load_model, parse_with_smoke

# the smoke run's settings: a few seconds on a CPU
SMOKE_DEFAULTS = {"steps": 2, "pairs": 2, "max_new_tokens": 8, "eval_size": 4}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps")
    parser.add_argument("--pairs", type=int, default=8, help="problems per step: a policy and a reference reply each")
    parser.add_argument("--alpha", type=float, default=1e-5, help="weight of the exploration term (TRL's default)")
    parser.add_argument("--beta", type=float, default=0.1)
    # at 1.0 the 135M model samples few correct answers, at 0.7 about one in five (examples/ppo_arithmetic.py)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--eval-size", type=int, default=48, help="held-out problems scored greedily")
    parser.add_argument("--output-dir", default="outputs/xpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, CPU: checks that it runs")
    return parse_with_smoke(parser, SMOKE_DEFAULTS, argv)



def mean_of(entries: list[dict], key: str) -> float:
    return sum(entry[key] for entry in entries) / len(entries)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from slimrl import FastLanguageModel, PatchFastRL

    PatchFastRL("xpo", FastLanguageModel)
    from trl import XPOConfig, XPOTrainer

    from slimrl.cli.demo import evaluate
    from slimrl.data import arithmetic_dataset
    from slimrl.rewards import exact_answer_reward, format_reward

    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available() and not args.smoke
    model, tokenizer = load_model(args.smoke, cuda, args.seed)
    held_out = arithmetic_dataset(args.eval_size, seed=1, split="eval")
    before = evaluate(model, tokenizer, held_out, max_new_tokens=args.max_new_tokens, batch_size=args.eval_size)
    print(f"held-out accuracy before: {before['accuracy']:.0%}")

    config = XPOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.pairs,
                       alpha=args.alpha, beta=args.beta, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, max_length=256, learning_rate=args.learning_rate,
                       lr_scheduler_type="constant", gradient_checkpointing=False, logging_steps=1, report_to="none",
                       save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=args.seed, disable_tqdm=True)  # fmt: skip
    prompts = arithmetic_dataset(args.pairs * args.steps, seed=args.seed, split="train")  # with an `answer` column
    trainer = XPOTrainer(model=model, reward_funcs=[exact_answer_reward, format_reward], args=config,
                         train_dataset=prompts, processing_class=tokenizer)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(model, tokenizer, held_out, max_new_tokens=args.max_new_tokens, batch_size=args.eval_size)
    print(f"held-out accuracy after: {after['accuracy']:.0%}")
    model.save_pretrained(args.output_dir)
    steps = [entry for entry in trainer.state.log_history if "objective/model_scores" in entry]
    first, last = steps[: max(1, len(steps) // 4)], steps[-max(1, len(steps) // 4) :]  # a quarter of the run each
    result = {"steps": trainer.state.global_step, "train_seconds": round(seconds, 1),
              "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
              "policy_score_first": mean_of(first, "objective/model_scores"),
              "reference_score_first": mean_of(first, "objective/ref_scores"),
              "policy_score_last": mean_of(last, "objective/model_scores"),
              "reference_score_last": mean_of(last, "objective/ref_scores"),
              "loss_dpo_last": last[-1]["loss/dpo"]}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
