"""The `slimrl` command. `slimrl demo` runs the main job (see README); the demo's logic lives in slimrl.cli.demo."""

from __future__ import annotations

import argparse
import sys

import slimrl

EPILOG = """examples:
  slimrl demo                          GRPO on the embedded SmolLM2-135M-Instruct (about 15 minutes on 2 CPU cores)
  slimrl demo --steps 100 --device cuda --output-dir runs/demo
  slimrl demo --algorithm ppo          PPO (value head, GAE, clipped losses) on the same task; or --algorithm rloo
  slimrl demo --algorithm distillation SmolLM2 + LoRA learns from a teacher: SmolLM2 after 12 SFT steps on correct
                                       answers, or --teacher-adapter outputs/demo/adapter (a GRPO run's, merged)

exit status of demo: 0 done, 1 training stopped on a non-finite loss or gradient (metrics.json says where), 2 bad
settings.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimrl",
        description="Memory-lean, fast RL fine-tuning of language models as a drop-in for TRL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"slimrl {slimrl.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="GRPO teaches SmolLM2-135M-Instruct arithmetic: accuracy before/after, adapter, metrics, reward plot",
        description="GRPO (or RLOO, PPO, on-policy distillation) with slimrl's trainer teaches a small instruct model "
        "to answer arithmetic questions. Prints held-out accuracy before and after training and a line of metrics "
        "per step; writes the LoRA adapter, metrics.json and reward.png to --output-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_demo_arguments(demo)
    return parser


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    from slimrl.cli.demo import ALGORITHMS, DEVICES, GENERATION_BACKENDS, ON_NONFINITE, DemoSettings
    from slimrl.data import DIFFICULTIES

    defaults = DemoSettings()
    demo.add_argument("--algorithm", default=defaults.algorithm, choices=ALGORITHMS,
                      help="grpo; rloo (leave-one-out baseline); ppo (value head, GAE, one completion per problem, "
                      "2 optimizer steps per rollout); distillation (one completion per problem, sampled by the "
                      "student, which learns the teacher's next-token distribution on it: reverse KL)")  # fmt: skip
    demo.add_argument("--model", default=defaults.model,
                      help="the embedded model's name, a model directory or a .gguf file")  # fmt: skip
    demo.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    demo.add_argument("--output-dir", default=defaults.output_dir, help="where the adapter, metrics and plot go")
    demo.add_argument("--num-generations", type=int, default=defaults.num_generations,
                      help="completions per prompt (PPO: this many times the prompts, 1 each)")  # fmt: skip
    demo.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step, help="problems per step")
    demo.add_argument("--max-completion-length", type=int, default=defaults.max_completion_length,
                      help="most tokens per completion (the answer is one short line)")  # fmt: skip
    demo.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="LoRA learning rate")
    demo.add_argument("--lora-rank", type=int, default=defaults.lora_rank, help="LoRA rank (alpha is twice it)")
    demo.add_argument("--seed", type=int, default=defaults.seed, help="seed for problems, LoRA init and sampling")
    demo.add_argument("--eval-size", type=int, default=defaults.eval_size, help="held-out problems scored greedily")
    demo.add_argument("--difficulty", default=defaults.difficulty, choices=list(DIFFICULTIES),
                      help="operands up to 9, 20 or 99")  # fmt: skip
    demo.add_argument("--device", default=defaults.device, choices=DEVICES, help="auto: CUDA when there is one")
    demo.add_argument("--generation-backend", default=defaults.generation_backend, choices=GENERATION_BACKENDS,
                      help="who generates rollouts: auto = slimrl's engine on CUDA, else transformers")  # fmt: skip
    demo.add_argument("--load-in-4bit", action="store_true", help="load the base in 4 bits (NF4), LoRA over it")
    demo.add_argument("--generation-device", default=defaults.generation_device,
                      help="grpo/rloo: run the rollout engine in a process of its own on this device (e.g. cuda:1; "
                      "cuda:0 shares the training GPU), sent only the LoRA after each step")  # fmt: skip
    demo.add_argument("--async-generation", action="store_true",
                      help="grpo with --generation-device: generate the next step's rollout while this step trains "
                      "(one step stale, importance-sampling corrected)")  # fmt: skip
    demo.add_argument("--gradient-checkpointing", action="store_true",
                      help="checkpoint the decoder layers (on CUDA: slimrl's offloaded checkpoints, the MLP in tiles), "
                      "as a long-context run trains; the 135M model does not need it")  # fmt: skip
    demo.add_argument("--keep-attention-tokens", type=int, default=defaults.keep_attention_tokens,
                      help="with --gradient-checkpointing on CUDA: sequences of at least this many tokens keep their "
                      "attention from the forward instead of recomputing it (GRPOConfig.keep_attention_tokens; 1: "
                      "every sequence, which runs that path on the demo's short rows)")  # fmt: skip
    demo.add_argument("--no-layer-cuda-graphs", dest="layer_cuda_graphs", action="store_false",
                      help="with --gradient-checkpointing on CUDA: run every decoder layer pass eagerly instead of "
                      "replaying repeated shapes as CUDA graphs (GRPOConfig.layer_cuda_graphs=False)")  # fmt: skip
    demo.add_argument("--teacher-steps", type=int, default=defaults.teacher_steps,
                      help="distillation: the teacher is the model after this many SFT steps (8 correct answers "
                      "each) on a LoRA, merged")  # fmt: skip
    demo.add_argument("--teacher-adapter", default=defaults.teacher_adapter,
                      help="distillation: the teacher is the model with this saved LoRA adapter merged (e.g. "
                      "outputs/demo/adapter from a GRPO run) instead of --teacher-steps of SFT")  # fmt: skip
    demo.add_argument(
        "--on-nonfinite",
        default=defaults.on_nonfinite,
        choices=ON_NONFINITE,
        help="a step with a NaN/inf loss or gradient: raise (stop, evaluate, save, exit 1) or skip it",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from slimrl.cli.demo import DemoSettings, run_demo
        from slimrl.distributed.process_group import end_launcher_group

        settings = DemoSettings(**{k: v for k, v in vars(args).items() if k != "command"})
        try:
            settings.validate()
        except ValueError as error:
            print(f"slimrl demo: {error}", file=sys.stderr)
            return 2
        summary = run_demo(settings)
        end_launcher_group()  # under `accelerate launch`: every rank finished the demo
        if summary["raised_nonfinite_error"]:
            return 1
    return 0


