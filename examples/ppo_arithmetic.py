"""PPO with slimrl on the embedded model (SmolLM2-135M-Instruct) and the demo's arithmetic reward, CPU or GPU.

The demo's task and rewards (slimrl.cli.demo: a correct final answer, one short line ending with the number) and its
held-out measure (greedy replies to problems never trained on, `slimrl.cli.demo.evaluate`), trained with slimrl's own
PPOTrainer: a value head on the LoRA policy, the reference by disabling the adapter, per-token KL penalty, GAE,
whitened advantages, clipped policy and value losses. The default run (8 rollouts of 16 problems, 16 optimizer
steps) took 425 s on 2 CPU cores shared with other work and moved held-out accuracy from 48% to 64%.

    python examples/ppo_arithmetic.py [--rollouts 8] [--output-dir outputs/ppo] [--device cpu|cuda]
    python examples/ppo_arithmetic.py --smoke   # seconds: checks that it runs (tests/test_examples.py)

`--smoke` swaps the embedded model for slimrl.testing's tiny 2-layer model (random weights, built from a config; the
135M model's load and rollouts take too long for a test) and runs one rollout of 2 prompts, one optimizer step, on
the CPU unless --device says otherwise. Flags given beside it still apply.

`main(argv)` returns {accuracy_before, accuracy_after, in_format_before, in_format_after, train_seconds,
total_seconds, ...} and prints one line per optimizer step.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch
from example_setup import parse_with_smoke

# the smoke run's settings: a few seconds on a CPU
SMOKE_DEFAULTS = {"rollouts": 1, "prompts": 2, "ppo_epochs": 1, "response_length": 4, "eval_size": 2, "device": "cpu"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts of --prompts completions each")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout (one completion each)")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="optimizer steps per rollout (one mini-batch)")
    parser.add_argument("--response-length", type=int, default=16, help="most tokens per completion")
    # at 1.0 the 135M model samples almost no correct answer (0 of 16 in a trial), at 0.7 about one in five
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--kl-coef", type=float, default=0.02)
    parser.add_argument("--eval-size", type=int, default=50, help="held-out problems scored greedily")
    parser.add_argument("--output-dir", default="outputs/ppo")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one short rollout: checks that it runs")
    return parse_with_smoke(parser, SMOKE_DEFAULTS, argv)


def step_printer():
    from transformers import TrainerCallback

    class StepLine(TrainerCallback):
        """One line per optimizer step: the rollout's score and batch accuracy, then the step's PPO numbers."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"step {state.global_step:3d}  score {logs.get('objective/scores', float('nan')):.3f}  "
                      f"batch acc {logs.get('rewards/exact_answer_reward', float('nan')):4.0%}  "
                      f"kl {logs.get('objective/kl', float('nan')):+.3f}  "
                      f"approxkl {logs.get('policy/approxkl_avg', float('nan')):.4f}  "
                      f"clipfrac {logs.get('policy/clipfrac_avg', float('nan')):.2f}  "
                      f"value loss {logs.get('loss/value_avg', float('nan')):.4f}")  # fmt: skip

    return StepLine()


def main(argv=None) -> dict:
    args = parse_args(argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    from transformers.trainer_callback import PrinterCallback

    from slimrl import FastLanguageModel
    from slimrl.cli.demo import evaluate, resolve_device, set_cpu_threads
    from slimrl.data import arithmetic_dataset
    from slimrl.rewards import exact_answer_reward, format_reward
    from slimrl.trainers.ppo.trainer import PPOConfig, PPOTrainer

    device = resolve_device(args.device)
    threads = set_cpu_threads() if device == "cpu" else None
    torch.manual_seed(args.seed)
    if args.smoke:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama", seed=args.seed).to(device), tiny_tokenizer()
    else:
        model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=512,
                                                             dtype=torch.float32 if device == "cpu" else None,
                                                             device_map={"": device})  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False,
                                             random_state=args.seed)  # fmt: skip
    train_set = arithmetic_dataset(args.rollouts * args.prompts, seed=args.seed, split="train")
    held_out = arithmetic_dataset(args.eval_size, seed=args.seed, split="eval")
    # one greedy batch of all held-out problems: on a CPU a few long decodes beat many short ones
    before = evaluate(model, tokenizer, held_out, max_new_tokens=32, batch_size=args.eval_size)
    print(f"held-out accuracy before: {before['accuracy']:.0%} (in format {before['in_format']:.0%})")

    config = PPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.prompts, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=args.ppo_epochs, max_steps=args.rollouts * args.ppo_epochs,
        response_length=args.response_length, temperature=args.temperature, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", kl_coef=args.kl_coef, vf_coef=0.1, gamma=1.0, lam=0.95, cliprange=0.2,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, use_cpu=device == "cpu",
        disable_tqdm=True, num_chunks="auto",
    )  # fmt: skip
    trainer = PPOTrainer(model, [exact_answer_reward, format_reward], config, train_set, tokenizer,
                         callbacks=[step_printer()])  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    tick = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - tick

    after = evaluate(model, tokenizer, held_out, max_new_tokens=32, batch_size=args.eval_size)
    print(f"held-out accuracy after:  {after['accuracy']:.0%} (in format {after['in_format']:.0%})")
    trainer.save_model(args.output_dir)
    steps = [e for e in trainer.state.log_history if "loss" in e]
    result = {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
              "in_format_before": before["in_format"], "in_format_after": after["in_format"],
              "rollouts": args.rollouts, "optimizer_steps": trainer.state.global_step, "device": device,
              "torch_threads": threads, "generation_backend": trainer.generation_backend,
              "score_first_rollout": steps[0].get("objective/scores") if steps else None,
              "score_last_rollout": steps[-1].get("objective/scores") if steps else None,
              "train_seconds": round(train_seconds, 1),
              "total_seconds": round(time.perf_counter() - started, 1),
              "cpu_seconds": round(time.process_time() - cpu_started, 1)}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
