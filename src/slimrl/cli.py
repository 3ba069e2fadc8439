"""The `slimrl` command: `slimrl demo` runs the main job (see README)."""

from __future__ import annotations

import argparse
import sys

import slimrl


def build_parser() -> argparse.ArgumentParser:
    from slimrl.demo import DemoSettings

    defaults = DemoSettings()
    description = "Memory-lean, fast RL fine-tuning as a drop-in for TRL."
    parser = argparse.ArgumentParser(prog="slimrl", description=description)
    parser.add_argument("--version", action="version", version=f"slimrl {slimrl.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="GRPO teaches SmolLM2-135M-Instruct arithmetic (CPU or GPU)")
    demo.add_argument("--model", default=defaults.model, help="model: the embedded default, a directory or a .gguf")
    demo.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    demo.add_argument("--output-dir", default=defaults.output_dir, help="where the adapter, metrics and plot go")
    demo.add_argument("--num-generations", type=int, default=defaults.num_generations, help="completions per prompt")
    demo.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    demo.add_argument("--max-completion-length", type=int, default=defaults.max_completion_length)
    demo.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    demo.add_argument("--lora-rank", type=int, default=defaults.lora_rank)
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--eval-size", type=int, default=defaults.eval_size, help="held-out problems to score")
    demo.add_argument("--device", default=defaults.device, choices=["auto", "cpu", "cuda"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from slimrl.demo import DemoSettings, run_demo

        settings = DemoSettings(**{k: v for k, v in vars(args).items() if k != "command"})
        if settings.steps < 1 or settings.num_generations < 2 or settings.eval_size < 1:
            print("slimrl demo: --steps and --eval-size must be >= 1 and --num-generations >= 2", file=sys.stderr)
            return 2
        run_demo(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
