"""W3 (shared/bench/WORKLOAD.md): end-to-end GRPO steps on W1's model, TRL's GRPOTrainer beside slimrl's.

Both trainers run in this one process, each on a freshly built model (same seed), the same data and the same
settings: W1's model (Qwen2, vocab 151936, hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 kv heads, tied
embeddings, bf16, random init) with peft LoRA r=64 alpha=64 dropout 0 on all linear layers; 1 prompt x 8
generations per step, prompts of 256 tokens (slimrl's arithmetic problems behind a fixed preamble), completions of
--completion-length tokens at temperature 1.0 (the random model has no real EOS, so completions run to full length:
the EOS id is one of 151936 near-equally likely tokens; each step's clipped ratio is recorded),
loss_type dapo, beta 0, gradient checkpointing, bf16, lr 1e-5 (constant, so the first k steps are the same run
whatever --steps is), rewards decoded from text: slimrl's exact-answer, format and length rewards.

Per step (HF Trainer's on_step_begin to on_step_end, CUDA-synchronised): wall seconds of
  generation  the trainer's `_generate_single_turn` (the rollout: slimrl's engine or TRL's `generate`)
  reward      the trainer's `_calculate_rewards` (decoded completions scored by the reward functions)
  training    the rest of the step: tokenising and decoding, the loss's forward and backward, the optimizer
both methods wrapped on the trainer instance, so TRL and slimrl are timed by the same code; plus the step's loss,
reward, completion length and peak GPU memory from the trainer's logs. Means are given over all steps and over all
but the first (which compiles and captures slimrl's engine). TRL's `generate` makes about 66 tokens/s at batch 8 on
this model (some 2 minutes a step at 1024 tokens), so it runs --trl-steps steps, fewer than slimrl's --steps.
slimrl runs first, and the JSON is rewritten after every step, so a run cut short keeps what it measured.

    python bench/grpo_step.py [$OUT/w3.json] [--steps 10] [--trl-steps 3] [--skip trl|slimrl]
                              [--completion-length 1024] [--slimrl-backend auto] [--tiny]

--tiny runs a 2-layer Qwen2 from slimrl.testing with short prompts and completions: a CPU smoke run.
The exit status is 1 when a side raised (its traceback is in the JSON) or slimrl did not generate with its engine
on CUDA.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")  # there is no hub on the GPU machine: fail fast instead of retrying
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

V = 151936
SIDES = ("slimrl", "trl")  # slimrl first: its steps are short, so a run cut off by a time limit still has them
SUMMARY_KEYS = ("step_s", "generation_s", "reward_s", "training_s", "peak_GiB", "loss", "reward",
                "completion_mean_length")  # fmt: skip
# The prompt's bulk: fixed text in the system message, cut so each prompt is --prompt-tokens tokens long.
PREAMBLE = (
    "You are a careful calculator. Each question below asks for the result of adding or subtracting two whole "
    "numbers. Work the sum out exactly, keep the sign of the result, and do not round. Reply with a single short "
    "line that ends with the number, for example '7 + 9 = 16'. Do not explain the method, do not restate the rules "
    "and do not add anything after the number. "
)
LOG_FIELDS = {  # per-step record field -> the trainer's logged metric
    "loss": "loss",
    "grad_norm": "grad_norm",
    "reward": "reward",
    "reward_std": "reward_std",
    "completion_mean_length": "completions/mean_length",
    "completion_clipped_ratio": "completions/clipped_ratio",
}


# -- model, tokenizer, data ------------------------------------------------------------------------------------------


def build_model(tiny: bool, device: str, seed: int = 0, context: int = 32768):
    """W1's model with its LoRA adapter (or a 2-layer Qwen2 for --tiny), freshly initialised from `seed`; `context`
    is the longest prompt + completion it must take."""
    from peft import LoraConfig, get_peft_model

    if tiny:
        from slimrl.testing import tiny_model

        model = tiny_model("qwen2", seed=seed, tie_word_embeddings=True, max_position_embeddings=max(512, context))
        model = model.to(device)
        rank = 8
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=V, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=max(32768, context),
                             tie_word_embeddings=True)  # fmt: skip
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.generation_config.eos_token_id = None  # the tokenizer's EOS is the only stop token, as for TRL
        rank = 64
    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(seed)  # peft draws lora_A from the global generator: the same adapter for both sides
    return get_peft_model(model, lora)


def offline_tokenizer(vocab_size: int):
    """A byte-level tokenizer whose vocabulary covers every id of a `vocab_size` model, built without a download.

    slimrl.testing's tokenizer (4 specials + 256 bytes, same ids here) encodes the prompts; the other ids decode to
    2-3 printable characters each, so a completion sampled anywhere in W1's 151936 ids decodes to text of varying
    length with digits in it, which is what the reward functions parse (the testing tokenizer drops unknown ids)."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from slimrl.testing import CHATML_TEMPLATE, EOS, PAD, SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(vocab) + i for i, ch in enumerate(alphabet)})
    printable = ["Ġ", "Ċ", *map(chr, range(0x21, 0x7F))]  # byte-level spellings of space, newline, ASCII 33-126
    pieces = itertools.chain(itertools.product(printable, repeat=2), itertools.product(printable, repeat=3))
    for piece in itertools.islice(pieces, max(0, vocab_size - len(vocab))):
        vocab["".join(piece)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: prompts encode byte by byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=None,
                                        unk_token=None, padding_side="left")  # fmt: skip
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def prompt_length(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def padded_prompt(tokenizer, messages: list[dict], tokens: int) -> list[dict]:
    """`messages` behind a system message of preamble text cut so the rendered prompt is `tokens` long (or the
    longest that does not exceed it)."""
    shortest = prompt_length(tokenizer, [{"role": "system", "content": ""}, *messages])
    if shortest > tokens:
        raise ValueError(f"a prompt takes {shortest} tokens without any preamble; ask for at least that many.")
    text = PREAMBLE * (tokens // max(1, len(PREAMBLE) // 4) + 1)  # more characters than tokens are needed
    low, high = 0, len(text)
    while low < high:  # the longest cut of the preamble that fits
        middle = (low + high + 1) // 2
        if prompt_length(tokenizer, [{"role": "system", "content": text[:middle]}, *messages]) <= tokens:
            low = middle
        else:
            high = middle - 1
    return [{"role": "system", "content": text[:low]}, *messages]


def build_dataset(tokenizer, rows: int, prompt_tokens: int, seed: int = 0):
    """slimrl's arithmetic problems (conversational prompts with an `answer` column), each padded to
    `prompt_tokens` tokens."""
    from datasets import Dataset

    from slimrl.data.arithmetic import arithmetic_dataset

    problems = arithmetic_dataset(rows, seed=seed)
    prompts = [padded_prompt(tokenizer, row["prompt"], prompt_tokens) for row in problems]
    return Dataset.from_dict({"prompt": prompts, "answer": problems["answer"]})


def reward_functions(completion_length: int) -> list:
    """Rewards read from the decoded text: the right final number, the one-line format, and a penalty for text
    beyond half the token budget in characters (it varies with the decoded length, so even a random model's
    completions get different rewards and each step has a non-zero gradient)."""
    from slimrl.rewards import exact_answer_reward, format_reward, length_penalty

    return [exact_answer_reward, format_reward, length_penalty(target_chars=max(1, completion_length // 2))]


# -- trainers --------------------------------------------------------------------------------------------------------


def grpo_settings(args, steps: int, output_dir: str, cuda: bool) -> dict:
    """The GRPOConfig settings both trainers get."""
    return dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8, num_generations=8,
                gradient_accumulation_steps=1, max_completion_length=args.completion_length, temperature=1.0,
                loss_type="dapo", beta=0.0, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                gradient_checkpointing=True, bf16=cuda and not args.tiny, use_cpu=not cuda, seed=args.seed,
                logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)  # fmt: skip


def build_trainer(kind: str, model, tokenizer, dataset, args, steps: int, output_dir: str, cuda: bool):
    settings = grpo_settings(args, steps, output_dir, cuda)
    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from slimrl import GRPOConfig, GRPOTrainer

        settings.update(num_chunks="auto", generation_backend=args.slimrl_backend)
    return GRPOTrainer(model=model, reward_funcs=reward_functions(args.completion_length),
                       args=GRPOConfig(**settings), train_dataset=dataset, processing_class=tokenizer)  # fmt: skip


def generation_backend(trainer) -> str:
    """Who generated this trainer's rollouts: slimrl's choice where it made one, else TRL's configured path."""
    chosen = getattr(trainer, "_generation_backend", None)
    if chosen is not None:
        return chosen
    if trainer.use_vllm:
        return "vllm"
    return "transformers_continuous_batching" if trainer.args.use_transformers_continuous_batching else "transformers"


def engine_config(trainer) -> dict | None:
    """The settings of slimrl's rollout engine, if the trainer built one."""
    engine = getattr(trainer, "_rollout_engine", None)
    if engine is None:
        return None
    return {"grouped_decode": getattr(engine, "grouped_decode", None), "tf32_adapters": getattr(engine, "tf32", None),
            "triton_attention": getattr(engine, "_attention_kernel", None) is not None,
            "fused_decode": getattr(engine, "_fused", None) is not None,
            "cuda_graphs": getattr(engine, "use_graphs", None),
            "compile": getattr(engine, "use_compile", None)}  # fmt: skip


def offloaded_checkpointing(model) -> bool | None:
    """Whether slimrl's host-offloaded gradient checkpointing is installed on the model (slimrl turns it on, on
    CUDA)."""
    try:
        from slimrl.models.checkpointing import is_offloaded_checkpointing

        return is_offloaded_checkpointing(model)
    except (ImportError, AttributeError):
        return None


# -- timing ----------------------------------------------------------------------------------------------------------


def step_timer_class():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Times each optimizer step and the phases inside it; merges the trainer's per-step logs into the record.

        The phases are measured by wrapping the trainer instance's methods (not the class), so the same code times
        TRL and slimrl; the training phase is the step minus the other two."""

        def __init__(self, trainer, records: list[dict], on_record, cuda: bool):
            self.trainer, self.records, self.on_record, self.cuda = trainer, records, on_record, cuda
            self.current: dict | None = None
            self.start = 0.0
            self._wrap("_generate_single_turn", "generation")
            self._wrap("_calculate_rewards", "reward")

        def clock(self) -> float:
            if self.cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def _wrap(self, name: str, phase: str) -> None:
            method = getattr(self.trainer, name)  # bound to the instance; the class keeps its own

            @functools.wraps(method)
            def timed(*args, **kwargs):
                if phase == "generation" and self.cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = self.clock()
                try:
                    return method(*args, **kwargs)
                finally:
                    elapsed = self.clock() - start
                    if self.current is not None:
                        self.current[f"{phase}_s"] += elapsed
                        if phase == "generation":
                            self._after_generation()

            setattr(self.trainer, name, timed)

        def _after_generation(self) -> None:
            if self.cuda:
                self.current["generation_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()  # what follows is the reward and training phases' peak
            stats = getattr(getattr(self.trainer, "_rollout_engine", None), "last_stats", None)
            if stats:
                self.current["engine_stats"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in
                                                stats.items()}  # fmt: skip

        def on_step_begin(self, args, state, control, **kwargs):
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            self.current = {"step": state.global_step + 1, "generation_s": 0.0, "reward_s": 0.0}
            self.start = self.clock()

        def on_step_end(self, args, state, control, **kwargs):
            record, self.current = self.current, None
            if record is None:
                return
            record["step_s"] = self.clock() - self.start
            record["training_s"] = record["step_s"] - record["generation_s"] - record["reward_s"]
            if self.cuda:
                rest = torch.cuda.max_memory_allocated() / 2**30
                record["training_peak_GiB"] = rest
                record["peak_GiB"] = max(rest, record.get("generation_peak_GiB", 0.0))
            self.records.append(record)

        def on_log(self, args, state, control, logs=None, **kwargs):
            record = next((r for r in reversed(self.records) if r["step"] == state.global_step), None)
            if record is None or not logs or "loss" not in logs:
                return
            record.update({field: logs[key] for field, key in LOG_FIELDS.items() if key in logs})
            record["logs"] = {k: v for k, v in logs.items() if isinstance(v, int | float | str)}
            self.on_record(record)

    return StepTimer


def rounded(record: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) and k not in LOG_FIELDS else v for k, v in record.items()}


def summarise(records: list[dict]) -> dict:
    """Means over all steps and over all but the first (warm-up: compilation and graph capture)."""

    def mean(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        return round(sum(values) / len(values), 4) if values else None

    summary = {"mean_all": {k: mean(records, k) for k in SUMMARY_KEYS}}
    summary["mean_after_first"] = {k: mean(records[1:], k) for k in SUMMARY_KEYS} if len(records) > 1 else None
    peaks = [r["peak_GiB"] for r in records if "peak_GiB" in r]
    summary["peak_GiB"] = round(max(peaks), 3) if peaks else None
    return summary


# -- one side --------------------------------------------------------------------------------------------------------


def run_side(kind: str, steps: int, args, data, side: dict, save, cuda: bool) -> None:
    """Build `kind`'s model and trainer, train `steps` steps and fill `side`; an exception is recorded, not
    raised."""
    from transformers import PrinterCallback

    device = "cuda" if cuda else "cpu"
    records: list[dict] = []
    side.update(status="running", steps_requested=steps, steps_run=0, steps=records)
    output_dir = tempfile.mkdtemp(prefix=f"w3-{kind}-")
    model = trainer = None

    def on_record(record):
        side["steps_run"] = len(records)
        side["steps"] = [rounded(r) for r in records]
        print(json.dumps({kind: {k: v for k, v in rounded(record).items() if k != "logs"}}), flush=True)
        save()

    try:
        start = time.perf_counter()
        if cuda:
            torch.cuda.empty_cache()
            side["allocated_before_build_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        model = build_model(args.tiny, device, seed=args.seed, context=args.prompt_tokens + args.completion_length)
        if cuda:
            side["resident_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        trainer = build_trainer(kind, model, data["tokenizer"], data["dataset"], args, steps, output_dir, cuda)
        side["generation_backend"] = generation_backend(trainer)
        side["trainer"] = f"{type(trainer).__module__}.{type(trainer).__name__}"
        side["build_s"] = round(time.perf_counter() - start, 2)
        trainer.add_callback(step_timer_class()(trainer, records, on_record, cuda))
        trainer.remove_callback(PrinterCallback)  # the timer prints one line per step instead
        save()
        start = time.perf_counter()
        trainer.train()
        side["train_wall_s"] = round(time.perf_counter() - start, 2)
        side["status"] = "ok"
    except Exception:  # noqa: BLE001 - a failing side is reported and the other still runs
        side["status"] = "error"
        side["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        if trainer is not None:
            side["engine"] = engine_config(trainer)
            side["engine_used"] = any("engine_stats" in r for r in records)
            side["num_chunks"] = getattr(trainer, "_last_auto_chunks", None)  # slimrl's last automatic choice
            engine = getattr(trainer, "_rollout_engine", None)
            if engine is not None:
                engine.release(keep_graph=False)  # its graphs and cache must not count against the next side
        if model is not None:
            side["offloaded_checkpointing"] = offloaded_checkpointing(model)
        side["steps_run"] = len(records)
        side["steps"] = [rounded(r) for r in records]
        side.update(summarise(records))
        del model, trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        shutil.rmtree(output_dir, ignore_errors=True)
        save()


# -- report ----------------------------------------------------------------------------------------------------------


def speedups(report: dict) -> dict | None:
    """TRL's seconds over slimrl's, per step and per phase, on both means (after the first step, and all steps)."""
    trl, slim = report["sides"].get("trl", {}), report["sides"].get("slimrl", {})
    result = {}
    for basis in ("mean_after_first", "mean_all"):
        a, b = trl.get(basis), slim.get(basis)
        if not a or not b:
            continue
        result[basis] = {
            key: round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None
            for key in ("step_s", "generation_s", "reward_s", "training_s")
        }
    return result or None


def environment(cuda: bool) -> dict:
    import peft
    import transformers
    import trl

    import slimrl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                "peft": peft.__version__, "slimrl": slimrl.__version__, "python": sys.version.split()[0]}  # fmt: skip
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions}


def print_summary(report: dict) -> None:
    rows = [("side", "steps", "backend", "step s", "gen s", "reward s", "train s", "peak GiB", "first step s")]
    for kind, side in report["sides"].items():
        if side.get("status") == "skipped":
            continue
        mean = side.get("mean_after_first") or side.get("mean_all") or {}
        first = side["steps"][0]["step_s"] if side.get("steps") else None
        rows.append((kind, f"{side.get('steps_run', 0)}/{side.get('steps_requested')}",
                     str(side.get("generation_backend")),
                     *(str(mean.get(k)) for k in ("step_s", "generation_s", "reward_s", "training_s")),
                     str(side.get("peak_GiB")), str(first)))  # fmt: skip
    for basis, ratios in (report.get("speedup") or {}).items():
        rows.append(("TRL/slimrl", basis, "", *(str(ratios[k]) for k in ("step_s", "generation_s", "reward_s",
                                                                          "training_s")), "", ""))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\nW3: seconds per step (means over all steps but the first, where there are two or more)")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem.splitlines()[0]}")


def settings_record(args, vocab: int, tokenizer_vocab: int, prompt_lengths: list[int], cuda: bool) -> dict:
    return {
        "model_vocab": vocab,
        "tokenizer_vocab": tokenizer_vocab,
        "prompts_per_step": 1,
        "num_generations": 8,
        "prompt_tokens": args.prompt_tokens,
        "prompt_tokens_min_max": [min(prompt_lengths), max(prompt_lengths)],
        "completion_length": args.completion_length,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "learning_rate": 1e-5,
        "lr_scheduler": "constant",
        "gradient_checkpointing": True,
        "bf16": cuda and not args.tiny,
        "seed": args.seed,
        "slimrl_backend": args.slimrl_backend,
        "rewards": [getattr(f, "__name__", str(f)) for f in reward_functions(args.completion_length)],
        "steps": {"slimrl": args.steps, "trl": args.trl_steps},
    }


def engine_generated(side: dict) -> bool:
    """Whether a side's rollouts came from slimrl's engine (chosen, and its stats seen after a rollout)."""
    return bool(side.get("engine_used")) and side.get("generation_backend") == "engine"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "grpo_step.json"))
    parser.add_argument("--steps", type=int, default=10, help="slimrl's training steps")
    parser.add_argument("--trl-steps", type=int, default=3, help="TRL's training steps (about 2 minutes each)")
    parser.add_argument("--skip", nargs="*", default=[], choices=SIDES)
    parser.add_argument("--completion-length", type=int, default=None, help="default 1024 (32 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (128 with --tiny)")
    parser.add_argument("--slimrl-backend", default="auto", choices=("auto", "engine", "transformers"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Qwen2 from slimrl.testing: a CPU smoke run")
    args = parser.parse_args(argv)
    if args.completion_length is None:
        args.completion_length = 32 if args.tiny else 1024
    if args.prompt_tokens is None:
        args.prompt_tokens = 128 if args.tiny else 256
    if min(args.steps, args.trl_steps) < 1:
        parser.error("--steps and --trl-steps must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available()
    from slimrl.testing import TINY_VOCAB

    vocab = TINY_VOCAB if args.tiny else V
    tokenizer = offline_tokenizer(vocab)
    dataset = build_dataset(tokenizer, max(args.steps, args.trl_steps, 8), args.prompt_tokens, seed=args.seed)
    lengths = [prompt_length(tokenizer, p) for p in dataset["prompt"]]
    report = {
        "workload": "W3",
        "command": shlex.join(["python", "bench/grpo_step.py", *argv]),
        **environment(cuda),
        "tiny": args.tiny,
        "settings": settings_record(args, vocab, len(tokenizer), lengths, cuda),
        "timing": "per optimizer step, on_step_begin to on_step_end, CUDA-synchronised: generation = "
        "_generate_single_turn, reward = _calculate_rewards, training = the rest of the step. Peak memory is reset "
        "when generation starts and ends: generation_peak_GiB and training_peak_GiB (reward + training) per step; "
        "slimrl's own logged peak_gpu_memory_GiB therefore covers the training phase only",
        "sides": {},
        "problems": [],
    }
    path = Path(args.out)

    def save():
        report["speedup"] = speedups(report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))

    data = {"tokenizer": tokenizer, "dataset": dataset}
    for kind in SIDES:
        side = report["sides"][kind] = {}
        if kind in args.skip:
            side["status"] = "skipped"
            continue
        run_side(kind, args.steps if kind == "slimrl" else args.trl_steps, args, data, side, save, cuda)
        if side["status"] == "error":
            report["problems"].append(f"{kind} raised: {side['error'].strip().splitlines()[-1]}")
        elif kind == "slimrl" and cuda and args.slimrl_backend != "transformers" and not engine_generated(side):
            report["problems"].append(f"slimrl generated with {side.get('generation_backend')!r} on CUDA, not its "
                                      "rollout engine")  # fmt: skip
    save()
    print_summary(report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["problems"] else 0)
