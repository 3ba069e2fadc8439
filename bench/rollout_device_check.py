"""The rollout device on the real model: does the engine process hold the trainer's model, bit for bit?

For each base (4-bit NF4, and the compute dtype), the real model gets a LoRA adapter with random lora_B entries (so
the adapter changes the output), then slimrl's engine generates greedy completions of arithmetic prompts twice: in a
process of its own on --generation-device (generation_device: the model sent once, the base loaded back from it,
4-bit sent packed), and in this process over the model itself. Both engines run deterministic kernels (the trainers'
default, GRPOConfig.deterministic_rollouts), so any difference is a difference of the model. Recorded per base:
the engine process's state bytes against the trainer's, whether its base is quantised, the bytes sent once, the
process's start time, identical completions and the largest log-prob difference over identical ones.

There is no TRL side: TRL has no rollout process fed only the adapter (its vLLM server mode is the nearest, and it
pushes merged weights); the step time with and without async_generation beside TRL is bench/scaling.py's.

    python bench/rollout_device_check.py $OUT/rollout_device_check.json [--generation-device cuda:0]
        [--model SmolLM2-135M-Instruct] [--bases 4bit compute] [--max-new-tokens 32]
    python bench/rollout_device_check.py out.json --tiny --generation-device cpu --logprob-tolerance 1e-4  # CPU smoke
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import torch  # noqa: E402
from common import Report, default_output, environment  # noqa: E402

PAIRS = [(3, 4), (12, 9), (45, 38), (7, 70), (99, 1), (23, 23), (5, 60), (81, 11)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("rollout_device_check.json"))
    parser.add_argument("--generation-device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--bases", nargs="+", default=["4bit", "compute"], choices=["4bit", "compute"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--logprob-tolerance", type=float, default=0.0,
                        help="largest log-prob difference not reported as a problem (the CPU's thread counts differ "
                        "between the two processes, and with them fp32 sums' order)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="slimrl.testing's 2-layer Llama: a CPU smoke run")
    return parser.parse_args(argv)


def load(args, base: str, staging: Path):
    from slimrl import FastLanguageModel

    name = args.model
    if args.tiny:
        from slimrl.testing import tiny_model, tiny_tokenizer

        tiny_model("llama").save_pretrained(staging)
        tiny_tokenizer().save_pretrained(staging)
        name = str(staging)
    dtype = None if torch.cuda.is_available() else torch.float32
    model, tokenizer = FastLanguageModel.from_pretrained(name, max_seq_length=512, dtype=dtype,
                                                         load_in_4bit=base == "4bit")  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, random_state=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_((torch.randn(param.shape, generator=generator) * 0.02).to(param.dtype))
    return model.eval(), tokenizer


def prompt_ids(tokenizer, tiny: bool) -> list[list[int]]:
    if tiny:  # no chat template
        return [[5 + a % 50, 6 + b % 50, 7, 8] for a, b in PAIRS]
    ids = []
    for a, b in PAIRS:
        message = [{"role": "user", "content": f"What is {a} + {b}? Reply in one line that ends with the result."}]
        text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def check_base(args, base: str) -> dict:
    from slimrl.distributed.remote_engine import RemoteRolloutEngine
    from slimrl.distributed.rollout_server import state_bytes
    from slimrl.rollout.engine import RolloutEngine, SamplingParams

    with tempfile.TemporaryDirectory(prefix="slimrl-check-") as staging:
        model, tokenizer = load(args, base, Path(staging))
    prompts = prompt_ids(tokenizer, args.tiny)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    started = time.perf_counter()
    remote = RemoteRolloutEngine(model, args.generation_device, 512, deterministic=True)
    try:
        start_s = time.perf_counter() - started
        facts = remote.engine_facts()
        theirs = remote.generate(prompts, greedy, max_new_tokens=args.max_new_tokens)
        described = remote.describe()
    finally:
        remote.close()
    ours = RolloutEngine(model, max_seq_len=512, deterministic=True).generate(prompts, greedy, args.max_new_tokens)
    same = [a == b for a, b in zip(theirs.completion_ids, ours.completion_ids, strict=True)]
    deltas = [max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
              for a, b, equal in zip(theirs.logprobs, ours.logprobs, same, strict=True) if equal]  # fmt: skip
    return {
        "engine_quantized": facts["quantized"],
        "engine_state_bytes": facts["state_bytes"],
        "trainer_state_bytes": state_bytes(model),  # as the engine process counts its own
        "bytes_sent_once": described["model_bytes"],
        "transport": described["transport"],
        "engine_start_s": round(start_s, 2),
        "identical_completions": sum(same),
        "completions": len(same),
        "max_logprob_diff": max(deltas, default=None),
        "first_completion": tokenizer.decode(theirs.completion_ids[0]),
    }


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/rollout_device_check.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(args.out, benchmark="rollout_device_check", command=command, bases={})
    with report.recording_failure():
        report.update(environment(torch.cuda.is_available()), settings={k: v for k, v in vars(args).items()
                                                                          if k != "out"})  # fmt: skip
        for base in args.bases:
            result = report["bases"][base] = check_base(args, base)
            report.save()
            if (result["identical_completions"] != result["completions"]
                    or (result["max_logprob_diff"] or 0.0) > args.logprob_tolerance):  # fmt: skip
                report["problems"].append(f"{base}: the engine process's completions differ from the trainer's")
            if result["engine_state_bytes"] != result["trainer_state_bytes"]:
                report["problems"].append(f"{base}: the engine process's model is not the trainer's size")
    for base, result in report["bases"].items():
        print(f"{base}: {result['identical_completions']}/{result['completions']} identical, max log-prob diff "
              f"{result['max_logprob_diff']}, engine state {result['engine_state_bytes']:,} B (trainer "
              f"{result['trainer_state_bytes']:,} B), quantised {result['engine_quantized']}")  # fmt: skip
    report.print_outcome()
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
