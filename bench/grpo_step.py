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

--real: W3 on a real model and task instead of W1's random one: SmolLM2-135M-Instruct (bf16 on CUDA) with the
demo's LoRA (FastLanguageModel.get_peft_model, r=16, alpha 32, the seven projections, seeded), the demo's arithmetic
problems (slimrl.data, train split, medium, as plain chat prompts) and rewards (exact answer, format), completions
up to --completion-length 256 tokens (the model stops at its EOS, so lengths vary from step to step), 30 steps for
both trainers (--steps, --trl-steps); the other settings are W3's above. With --tiny it runs slimrl.testing's 2-layer
Llama through the same code (a CPU smoke run).

    python bench/grpo_step.py $OUT/w3_real.json --real [--steps 30] [--trl-steps 30] [--completion-length 256]

Per side the summary also gives the median training seconds over the steps after the first, the largest of those
over that median (stall ratio), and the mean step; the speedups (TRL / slimrl) are given for the mean step, the
mean and median training phase, and step by step.
The exit status is 1 when a side raised (its traceback is in the JSON) or slimrl did not generate with its engine
on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import (  # noqa: E402
    W1_LORA_RANK,
    W1_VOCAB,
    Report,
    default_output,
    environment,
    markdown_table,
    mean,
    median,
    rounded,
    w1_model,
)

REAL_MODEL = "SmolLM2-135M-Instruct"
SIDES = ("slimrl", "trl")  # slimrl first: its steps are short, so a run cut off by a time limit still has them
PHASE_KEYS = ("step_s", "generation_s", "reward_s", "training_s")
SUMMARY_KEYS = (*PHASE_KEYS, "peak_GiB", "loss", "reward", "completion_mean_length")
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


def build_model(args, device: str, context: int):
    """(model with its LoRA adapter, its tokenizer or None where the run shares one) for --real or W1."""
    if args.real:
        return build_real_model(args.tiny, device, args.seed, context)
    return build_w1_model(args.tiny, device, args.seed, context), None


def build_real_model(tiny: bool, device: str, seed: int, context: int):
    """SmolLM2-135M-Instruct (bf16 on CUDA, fp32 on the CPU; slimrl.testing's 2-layer Llama for --tiny) with the
    demo's LoRA adapter (r=16, alpha 32, the seven projections) initialised from `seed`, and its tokenizer."""
    from slimrl import FastLanguageModel

    if tiny:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama", max_position_embeddings=max(512, context)).to(device), tiny_tokenizer()
    else:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model, tokenizer = FastLanguageModel.from_pretrained(REAL_MODEL, max_seq_length=max(1024, context),
                                                             dtype=dtype, device_map={"": device})  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False,
                                             random_state=seed)  # fmt: skip
    return model, tokenizer


def build_w1_model(tiny: bool, device: str, seed: int = 0, context: int = 32768):
    """W1's model with its LoRA adapter (bench/common.py), or for --tiny slimrl.testing's 2-layer Qwen2 (the testing
    tokenizer's vocabulary, its EOS) with LoRA r=8; freshly initialised from `seed`, lora_A drawn right after
    reseeding, so both sides get the same adapter. `context` is the longest prompt + completion it must take."""
    if not tiny:
        return w1_model(device=device, seed=seed, context=context)  # EOS unset: the tokenizer's is the only stop
    from peft import LoraConfig, get_peft_model

    from slimrl.testing import tiny_model

    model = tiny_model("qwen2", seed=seed, tie_word_embeddings=True, max_position_embeddings=max(512, context))
    model = model.to(device)
    lora = LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
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


def real_data(rows: int, seed: int) -> dict:
    """The demo's problems (train split, medium) and reward functions; the tokenizer comes with the model."""
    from slimrl.data import arithmetic_dataset
    from slimrl.rewards import exact_answer_reward, format_reward

    return {"dataset": arithmetic_dataset(rows, seed=seed, difficulty="medium", split="train"), "tokenizer": None,
            "rewards": [exact_answer_reward, format_reward]}  # fmt: skip


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


def build_trainer(kind: str, model, tokenizer, data: dict, args, steps: int, output_dir: str, cuda: bool):
    settings = grpo_settings(args, steps, output_dir, cuda)
    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from slimrl import GRPOConfig, GRPOTrainer

        settings.update(num_chunks="auto", generation_backend=args.slimrl_backend)
    return GRPOTrainer(model=model, reward_funcs=data["rewards"], args=GRPOConfig(**settings),
                       train_dataset=data["dataset"], processing_class=tokenizer)  # fmt: skip


def generation_backend(trainer) -> str:
    """Who generated this trainer's rollouts: slimrl's choice where it made one, else TRL's configured path."""
    chosen = getattr(trainer, "generation_backend", None)
    if chosen is not None:
        return chosen
    if trainer.use_vllm:
        return "vllm"
    return "transformers_continuous_batching" if trainer.args.use_transformers_continuous_batching else "transformers"


def rollout_engine(trainer):
    """slimrl's rollout engine, if the trainer built one (the trainer has no public accessor for it yet)."""
    return getattr(trainer, "rollout_engine", None)


def engine_config(trainer) -> dict | None:
    """The public settings of slimrl's rollout engine, if the trainer built one."""
    engine = rollout_engine(trainer)
    if engine is None:
        return None
    return engine.describe()


def offloaded_checkpointing(model) -> bool | None:
    """Whether slimrl's host-offloaded gradient checkpointing is installed on the model (slimrl turns it on, on
    CUDA)."""
    try:
        from slimrl.models.checkpointing import is_offloaded_checkpointing

        return is_offloaded_checkpointing(model)
    except (ImportError, AttributeError):
        return None


# -- timing ----------------------------------------------------------------------------------------------------------


def record_view(record: dict) -> dict:
    """A step record for the JSON: timings rounded, the trainer's logged values as they are."""
    return {k: v if k in LOG_FIELDS else rounded(v) for k, v in record.items()}


def summarise(records: list[dict]) -> dict:
    """Means over all steps and over all but the first (warm-up: compilation and graph capture); the training
    phase's median and its largest step (the stall ratio) over the steps after the first."""

    def means(rows: list[dict]) -> dict:
        return {k: rounded(mean(r.get(k) for r in rows)) for k in SUMMARY_KEYS}

    summary = {"mean_all": means(records), "mean_after_first": means(records[1:]) if len(records) > 1 else None}
    peaks = [r["peak_GiB"] for r in records if "peak_GiB" in r]
    summary["peak_GiB"] = round(max(peaks), 3) if peaks else None
    later = [r["training_s"] for r in records[1:]]
    typical = median(later)
    summary["training_median_after_first"] = rounded(typical)
    summary["training_max_after_first"] = rounded(max(later)) if later else None
    summary["stall_ratio"] = round(max(later) / typical, 2) if later and typical else None
    summary["step_mean"] = rounded(mean(r["step_s"] for r in records))
    return summary


# -- one side --------------------------------------------------------------------------------------------------------


def build_side(kind: str, steps: int, args, data: dict, side: dict, held: dict, cuda: bool) -> None:
    """Build `kind`'s model and trainer into `held` (so the caller can free them whatever happens)."""
    start = time.perf_counter()
    if cuda:
        torch.cuda.empty_cache()
        side["allocated_before_build_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    context = (args.prompt_tokens or 512) + args.completion_length
    held["model"], tokenizer = build_model(args, "cuda" if cuda else "cpu", context)
    tokenizer = tokenizer or data["tokenizer"]
    if cuda:
        side["resident_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    if args.real:
        lengths = [prompt_length(tokenizer, p) for p in data["dataset"]["prompt"]]
        side["prompt_tokens_min_max"] = [min(lengths), max(lengths)]
    trainer = held["trainer"] = build_trainer(kind, held["model"], tokenizer, data, args, steps, held["dir"], cuda)
    side["generation_backend"] = generation_backend(trainer)
    side["trainer"] = f"{type(trainer).__module__}.{type(trainer).__name__}"
    side["build_s"] = round(time.perf_counter() - start, 2)


def finish_side(side: dict, held: dict, records: list[dict]) -> None:
    """What the run left to record: the engine's settings (then its memory freed), chunks, checkpointing, summary."""
    trainer, model = held.get("trainer"), held.get("model")
    if trainer is not None:
        side["engine"] = engine_config(trainer)
        side["engine_used"] = any("engine_stats" in r for r in records)
        side["num_chunks"] = getattr(trainer, "last_auto_chunks", None)  # slimrl's last automatic choice
        engine = rollout_engine(trainer)
        if engine is not None:
            engine.release(keep_graph=False)  # its graphs and cache must not count against the next side
    if model is not None:
        side["offloaded_checkpointing"] = offloaded_checkpointing(model)
    side["steps_run"] = len(records)
    side["steps"] = [record_view(r) for r in records]
    side.update(summarise(records))


def run_side(kind: str, steps: int, args, data, side: dict, save, cuda: bool) -> None:
    """Build `kind`'s model and trainer, train `steps` steps and fill `side`; an exception is recorded, not
    raised."""
    from transformers import PrinterCallback

    from slimrl.trainers.step_timer import StepTimer

    side.update(status="running", steps_requested=steps, steps_run=0, steps=[])
    held = {"dir": tempfile.mkdtemp(prefix=f"w3-{kind}-")}

    def on_step(record):
        record.update({field: record["logs"][key] for field, key in LOG_FIELDS.items() if key in record["logs"]})
        side["steps_run"] = len(timer.steps)
        side["steps"] = [record_view(r) for r in timer.steps]
        print(json.dumps({kind: {k: v for k, v in record_view(record).items() if k != "logs"}}), flush=True)
        save()

    timer = StepTimer(on_step=on_step, track_memory=True)
    try:
        build_side(kind, steps, args, data, side, held, cuda)
        timer.attach(held["trainer"])
        held["trainer"].remove_callback(PrinterCallback)  # the timer prints one line per step instead
        save()
        start = time.perf_counter()
        held["trainer"].train()
        side["train_wall_s"] = round(time.perf_counter() - start, 2)
        side["status"] = "ok"
    except Exception:  # noqa: BLE001 - a failing side is reported and the other still runs
        side["status"] = "error"
        side["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        finish_side(side, held, timer.steps)
        timer.detach()
        shutil.rmtree(held.pop("dir"), ignore_errors=True)
        held.clear()  # the model and trainer: freed before the next side is built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save()


# -- report ----------------------------------------------------------------------------------------------------------


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


def speedups(report: dict) -> dict | None:
    """TRL's seconds over slimrl's: per phase on both means (after the first step, and all steps), the training
    phase's median after the first step, and step by step (whole step and training phase) where both ran it."""
    trl, slim = report["sides"].get("trl", {}), report["sides"].get("slimrl", {})
    result = {}
    for basis in ("mean_after_first", "mean_all"):
        a, b = trl.get(basis), slim.get(basis)
        if a and b:
            result[basis] = {key: ratio(a.get(key), b.get(key)) for key in PHASE_KEYS}
    if not result:
        return None
    result["training_median_after_first"] = ratio(trl.get("training_median_after_first"),
                                                  slim.get("training_median_after_first"))  # fmt: skip
    pairs = list(zip(trl.get("steps", []), slim.get("steps", []), strict=False))
    result["per_step"] = {key: [ratio(a.get(key), b.get(key)) for a, b in pairs] for key in ("step_s", "training_s")}
    return result


def print_summary(report: dict) -> None:
    header = ["side", "steps", "backend", "step s", "gen s", "reward s", "train s", "train median s", "stall ratio",
              "peak GiB", "first step s"]  # fmt: skip
    rows = []
    for kind, side in report["sides"].items():
        if side.get("status") == "skipped":
            continue
        means = side.get("mean_after_first") or side.get("mean_all") or {}
        first = side["steps"][0]["step_s"] if side.get("steps") else None
        rows.append([kind, f"{side.get('steps_run', 0)}/{side.get('steps_requested')}", side.get("generation_backend"),
                     *(means.get(k) for k in PHASE_KEYS), side.get("training_median_after_first"),
                     side.get("stall_ratio"), side.get("peak_GiB"), first])  # fmt: skip
    speedup = report.get("speedup") or {}
    for basis in ("mean_after_first", "mean_all"):
        if basis in speedup:
            rows.append(["TRL/slimrl", basis, None, *(speedup[basis][k] for k in PHASE_KEYS),
                         speedup.get("training_median_after_first"), None, None, None])  # fmt: skip
    print("\nW3: seconds per step (means over all steps but the first, where there are two or more)")
    print(markdown_table(header, rows))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem.splitlines()[0]}")


def settings_record(args, data: dict, cuda: bool) -> dict:
    """The run's settings; W1's prompt padding where it applies."""
    if args.real:
        record = {"model": "tiny llama" if args.tiny else REAL_MODEL, "lora": {"r": 16, "alpha": 32},
                  "data": "slimrl.data arithmetic problems, train split, medium, prompts as they are"}  # fmt: skip
    else:
        from slimrl.testing import TINY_VOCAB

        tokenizer = data["tokenizer"]
        lengths = [prompt_length(tokenizer, p) for p in data["dataset"]["prompt"]]
        record = {"model": "tiny qwen2" if args.tiny else "W1", "lora": {"r": 8 if args.tiny else W1_LORA_RANK},
                  "model_vocab": TINY_VOCAB if args.tiny else W1_VOCAB, "tokenizer_vocab": len(tokenizer),
                  "prompt_tokens": args.prompt_tokens,
                  "prompt_tokens_min_max": [min(lengths), max(lengths)]}  # fmt: skip
    record.update(prompts_per_step=1, num_generations=8, completion_length=args.completion_length, temperature=1.0,
                  loss_type="dapo", beta=0.0, learning_rate=1e-5, lr_scheduler="constant", gradient_checkpointing=True,
                  bf16=cuda and not args.tiny, seed=args.seed, slimrl_backend=args.slimrl_backend,
                  rewards=[getattr(f, "__name__", str(f)) for f in data["rewards"]],
                  steps={"slimrl": args.steps, "trl": args.trl_steps})  # fmt: skip
    return record


def engine_generated(side: dict) -> bool:
    """Whether a side's rollouts came from slimrl's engine (chosen, and its stats seen after a rollout)."""
    return bool(side.get("engine_used")) and side.get("generation_backend") == "engine"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("grpo_step.json"))
    parser.add_argument("--real", action="store_true", help=f"{REAL_MODEL} on the demo's task instead of W1's model")
    parser.add_argument("--steps", type=int, default=None, help="slimrl's steps (default 10, 30 with --real)")
    parser.add_argument("--trl-steps", type=int, default=None,
                        help="TRL's steps (default 3: about 2 minutes each on W1; 30 with --real)")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=SIDES)
    parser.add_argument("--completion-length", type=int, default=None,
                        help="default 1024 (256 with --real; 32 with --tiny, 16 with --real --tiny)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=None, help="W1: default 256 (128 with --tiny)")
    parser.add_argument("--slimrl-backend", default="auto", choices=("auto", "engine", "transformers"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model from slimrl.testing: a CPU smoke run")
    args = parser.parse_args(argv)
    if args.real and args.prompt_tokens is not None:
        parser.error("--prompt-tokens pads W1's prompts; --real uses the demo's prompts as they are")
    if args.completion_length is None:
        args.completion_length = {(False, False): 1024, (False, True): 32, (True, False): 256, (True, True): 16}[
            (args.real, args.tiny)
        ]
    if args.prompt_tokens is None and not args.real:
        args.prompt_tokens = 128 if args.tiny else 256
    args.steps = args.steps or (30 if args.real else 10)
    args.trl_steps = args.trl_steps or (30 if args.real else 3)
    if min(args.steps, args.trl_steps) < 1:
        parser.error("--steps and --trl-steps must be at least 1")
    return args


def build_data(args) -> dict:
    """The dataset, reward functions and (W1) shared tokenizer both sides train on."""
    rows = max(args.steps, args.trl_steps, 8)
    if args.real:
        return real_data(rows, args.seed)
    from slimrl.testing import TINY_VOCAB

    tokenizer = offline_tokenizer(TINY_VOCAB if args.tiny else W1_VOCAB)
    dataset = build_dataset(tokenizer, rows, args.prompt_tokens, seed=args.seed)
    return {"tokenizer": tokenizer, "dataset": dataset, "rewards": reward_functions(args.completion_length)}


TIMING = (
    "per optimizer step, on_step_begin to on_step_end, CUDA-synchronised (slimrl.trainers.step_timer): generation = "
    "_generate_single_turn, reward = _calculate_rewards, training = the rest of the step. Peak memory is reset when "
    "generation starts and ends: generation_peak_GiB and training_peak_GiB (reward + training) per step; slimrl's own "
    "logged peak_gpu_memory_GiB therefore covers the training phase only"
)


def main(argv=None) -> Report:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available()
    report = Report(args.out, workload="W3", command=shlex.join(["python", "bench/grpo_step.py", *argv]),
                    tiny=args.tiny, real=args.real, timing=TIMING, sides={})  # fmt: skip

    def save():
        report["speedup"] = speedups(report)
        report.save()

    with report.recording_failure():
        report.update(environment(cuda))
        data = build_data(args)
        report["settings"] = settings_record(args, data, cuda)
        for kind in SIDES:
            side = report["sides"][kind] = {}
            if kind in args.skip:
                side["status"] = "skipped"
                continue
            run_side(kind, args.steps if kind == "slimrl" else args.trl_steps, args, data, side, save, cuda)
            report["problems"] += side_problems(kind, side, args, cuda)
        save()
        print_summary(report)
    print(f"wrote {report.path}")
    return report


def side_problems(kind: str, side: dict, args, cuda: bool) -> list[str]:
    if side["status"] == "error":
        return [f"{kind} raised: {side['error'].strip().splitlines()[-1]}"]
    if kind == "slimrl" and cuda and args.slimrl_backend != "transformers" and not engine_generated(side):
        return [f"slimrl generated with {side.get('generation_backend')!r} on CUDA, not its rollout engine"]
    return []


if __name__ == "__main__":
    sys.exit(main().exit_status())
