"""On-policy distillation with slimrl on the embedded model (SmolLM2-135M-Instruct), on the demo's arithmetic, CPU or
GPU.

The student is SmolLM2 with a fresh LoRA adapter. The teacher is SmolLM2 made better at the task, then frozen: by
default the base model after --teacher-steps (12) SFT steps on correct answers to training problems, its LoRA merged
into the weights (slimrl.cli.demo_algorithms.distillation_teacher); with --teacher-adapter, the base with that saved
adapter merged instead (e.g. outputs/demo/adapter, which `slimrl demo` saves after GRPO). Each step the student samples
one reply to each of 16 training problems and learns the teacher's next-token distribution on those replies (TRL's
generalised JSD; beta 1, the default, is the reverse KL). It prints the held-out accuracy (greedy, 48 problems never
trained on, as the demo measures it) of the teacher and of the student before and after, and the divergence at the
first and last steps, and saves the student's adapter.

    python examples/distillation_arithmetic.py [--steps 16] [--teacher-adapter outputs/demo/adapter]
    python examples/distillation_arithmetic.py --smoke   # seconds: checks that it runs (tests/test_examples.py)

`--smoke` swaps the embedded model for slimrl.testing's tiny 2-layer model (random weights, built from a config; the
135M model's load and steps take too long for a test), trains its teacher 1 SFT step and distils for 2 steps on the
CPU with 4 held-out problems. Flags given beside it still apply.

`PatchFastRL("distillation")` makes `trl.DistillationTrainer` slimrl's; the rest is plain TRL.

Measured on this project's 2-core CPU machine, shared with other work (wall time of the whole command: both model
loads, the teacher's SFT and three evaluations included): 353 s, of which distillation 216 s; held-out accuracy of the
teacher 79%, of the student 42% -> 77%; divergence 0.33 at the first step, 0.016 at the last.
"""

from __future__ import annotations

import argparse
import time

import torch
from example_setup import load_model, parse_with_smoke

# the smoke run's settings: a few seconds on a CPU
SMOKE_DEFAULTS = {"steps": 2, "teacher_steps": 1, "prompts": 4, "max_completion_length": 8, "eval_size": 4}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="distillation steps (optimizer steps)")
    parser.add_argument("--prompts", type=int, default=16, help="problems per step, one student reply each")
    parser.add_argument("--teacher-steps", type=int, default=12, help="SFT steps that make the teacher")
    parser.add_argument("--teacher-adapter", default=None, help="a saved LoRA adapter to merge into the teacher")
    parser.add_argument("--beta", type=float, default=1.0, help="0 forward KL, 0.5 JSD, 1 reverse KL")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--eval-size", type=int, default=48, help="held-out problems scored greedily")
    parser.add_argument("--output-dir", default="outputs/distillation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, CPU: checks that it runs")
    return parse_with_smoke(parser, SMOKE_DEFAULTS, argv)



def main(argv=None) -> dict:
    args = parse_args(argv)
    from slimrl import FastLanguageModel, PatchFastRL

    PatchFastRL("distillation", FastLanguageModel)
    from trl import DistillationConfig, DistillationTrainer

    from slimrl.cli.demo import evaluate
    from slimrl.cli.demo_algorithms import distillation_teacher
    from slimrl.data import arithmetic_dataset

    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    student, tokenizer = load_model(args.smoke, cuda, args.seed)
    base, _ = load_model(args.smoke, cuda, args.seed, lora=False)  # the teacher's own copy of the weights
    teacher = distillation_teacher(base, tokenizer, args.output_dir, device, adapter=args.teacher_adapter,
                                   steps=args.teacher_steps, seed=args.seed)  # fmt: skip
    held_out = arithmetic_dataset(args.eval_size, seed=1, split="eval")
    new_tokens = args.max_completion_length
    teacher_scores = evaluate(teacher, tokenizer, held_out, max_new_tokens=new_tokens, batch_size=args.eval_size)
    teacher.eval()  # evaluate hands a model back in training mode
    before = evaluate(student, tokenizer, held_out, max_new_tokens=new_tokens, batch_size=args.eval_size)
    print(f"held-out accuracy: teacher {teacher_scores['accuracy']:.0%}, student before {before['accuracy']:.0%}")

    config = DistillationConfig(output_dir=args.output_dir, max_steps=args.steps,
                                per_device_train_batch_size=args.prompts,
                                max_completion_length=args.max_completion_length, beta=args.beta,
                                learning_rate=args.learning_rate, lr_scheduler_type="constant", logging_steps=1,
                                gradient_checkpointing=False, report_to="none", save_strategy="no", bf16=cuda,
                                use_cpu=not cuda, seed=args.seed, disable_tqdm=True)  # fmt: skip
    prompts = arithmetic_dataset(args.prompts * args.steps, seed=args.seed, split="train")
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=prompts,
                                  processing_class=tokenizer)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(student, tokenizer, held_out, max_new_tokens=new_tokens, batch_size=args.eval_size)
    student.save_pretrained(args.output_dir)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"steps": trainer.state.global_step, "train_seconds": round(seconds, 1),
              "teacher_accuracy": teacher_scores["accuracy"], "accuracy_before": before["accuracy"],
              "accuracy_after": after["accuracy"], "divergence_first_step": losses[0],
              "divergence_last_step": losses[-1]}  # fmt: skip
    print(result)
    return result


if __name__ == "__main__":
    main()
