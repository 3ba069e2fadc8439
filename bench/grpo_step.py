"""W3 (shared/bench/WORKLOAD.md): end-to-end GRPO steps on W1's model, TRL's GRPOTrainer beside slimrl's; with
--algorithm rloo TRL's RLOOTrainer beside slimrl's, with --algorithm ppo slimrl's PPOTrainer beside slimrl's GRPO.

Both trainers run in this one process, each on a freshly built model (same seed), the same data and the same
settings: W1's model (Qwen2, vocab 151936, hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 kv heads, tied
embeddings, bf16, random init) with peft LoRA r=64 alpha=64 dropout 0 on all linear layers; 1 prompt x 8
generations per step, prompts of 256 tokens (slimrl's arithmetic problems behind a fixed preamble), completions of
--completion-length tokens at temperature 1.0 (the random model has no real EOS, so completions run to full length:
the EOS id is one of 151936 near-equally likely tokens; each step's clipped ratio is recorded),
loss_type dapo, beta 0 (--beta), gradient checkpointing, bf16, lr 1e-5 (constant, so the first k steps are the same
run whatever --steps is), rewards decoded from text: slimrl's exact-answer, format and length rewards.

--algorithm (JSON sides; the speedup is the second side's seconds over the first's):
  grpo  "slimrl", "trl": slimrl's GRPOTrainer and TRL's, as above (the default).
  rloo  "slimrl_rloo", "trl_rloo": slimrl's RLOOTrainer and TRL's at the same settings (8 completions of one prompt
        per step, beta as GRPO's); RLOO's own loss and defaults otherwise (epsilon 0.2, no advantage whitening).
  ppo   "slimrl_ppo", "slimrl_grpo": slimrl's PPOTrainer (TRL 1.16 has none) with a value head on the policy, beside
        slimrl's GRPO at the same batch: 8 prompts x 1 completion per step for PPO (response_length = the completion
        length, one pass of one mini-batch: one optimizer step per rollout, kl_coef = --beta, PPO's defaults
        otherwise) against GRPO's 1 prompt x 8. Both run --steps steps.

Per step (HF Trainer's on_step_begin to on_step_end, CUDA-synchronised): wall seconds of
  generation  the trainer's rollout: `_generate_single_turn` for GRPO and RLOO (slimrl's engine or TRL's
              `generate`), `_generate` for PPO
  reward      the reward functions on the decoded completions: `_calculate_rewards` (GRPO, RLOO), `_scores` (PPO)
  training    the rest of the step: tokenising and decoding, the gradient-free scoring passes, the loss's forward and
              backward, the optimizer; for PPO its gradient-free pass over the rollout (old log-probs, values and
              reference log-probs: `ppo.rollout.score_rollout`) is also given on its own as scoring_pass_s
both methods wrapped on the trainer instance, so TRL and slimrl are timed by the same code; plus the step's loss,
reward, completion length and peak GPU memory from the trainer's logs (PPO: reward = objective/scores, and its
policy and value losses). Means are given over all steps and over all but the first (which compiles and captures
slimrl's engine). TRL's `generate` makes about 66 tokens/s at batch 8 on this model (some 2 minutes a step at 1024
tokens), so TRL's trainers run --trl-steps steps, fewer than slimrl's --steps.
slimrl runs first, and the JSON is rewritten after every step, so a run cut short keeps what it measured.

    python bench/grpo_step.py [$OUT/w3.json] [--algorithm grpo|rloo|ppo] [--steps 10] [--trl-steps 3]
                              [--skip SIDE ...] [--completion-length 1024] [--prompt-tokens 256] [--beta 0]
                              [--slimrl-backend auto] [--shared-prompt] [--tiny]

--tiny runs a 2-layer Qwen2 from slimrl.testing with short prompts and completions: a CPU smoke run.

--real: W3 on a real model and task instead of W1's random one: SmolLM2-135M-Instruct (bf16 on CUDA) with the
demo's LoRA (FastLanguageModel.get_peft_model, r=16, alpha 32, the seven projections, seeded), the demo's arithmetic
problems (slimrl.data, train split, medium, as plain chat prompts) and rewards (exact answer, format), completions
up to --completion-length 256 tokens (the model stops at its EOS, so lengths vary from step to step), 30 steps for
both trainers (--steps, --trl-steps); the other settings are W3's above. With --tiny it runs slimrl.testing's 2-layer
Llama through the same code (a CPU smoke run).

    python bench/grpo_step.py $OUT/w3_real.json --real [--steps 30] [--trl-steps 30] [--completion-length 256]

The engine prefills each of GRPO's 8 copies of a prompt once and keeps one copy of its K/V in the cache
(EngineOptions.share_prompt_prefill, share_prompt_cache); --no-shared-prefill turns both off for slimrl's sides (every
copy prefilled and cached), so `--prompt-tokens 1024` runs with and without it give its gain (the side's "engine" record
says which ran; each step's engine_stats the cache's bytes).

--shared-prompt (GRPO): a third side, "slimrl_shared_prompt", runs slimrl's GRPO with shared_prompt_forward=True (the
8 completions of the step's prompt trained against one copy of the prompt's activations) right after "slimrl", on
the same fresh model, data and seed, so one run measures the same step with and without it; the JSON's
"shared_prompt" block gives slimrl's seconds over the shared side's (per phase, and the training phase's median),
both sides' peak memory and first losses, and the reasons it fell back to the plain forward, if any (a problem).

    python bench/grpo_step.py $OUT/w3_shared.json --shared-prompt --prompt-tokens 1024 [--skip trl]

Per side the summary also gives the median training seconds over the steps after the first, the largest of those
over that median (stall ratio), and the mean step; the speedups (TRL / slimrl, or GRPO / PPO) are given for the mean
step, the mean and median training phase, and step by step.
The exit status is 1 when a side raised (its traceback is in the JSON) or a slimrl side did not generate with its
engine on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
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
    timed_calls,
    w1_model,
)

REAL_MODEL = "SmolLM2-135M-Instruct"
SIDES = {  # JSON key -> (whose trainer, which algorithm)
    "slimrl": ("slimrl", "grpo"),
    "trl": ("trl", "grpo"),
    "slimrl_rloo": ("slimrl", "rloo"),
    "trl_rloo": ("trl", "rloo"),
    "slimrl_ppo": ("slimrl", "ppo"),
    "slimrl_grpo": ("slimrl", "grpo"),
    "slimrl_shared_prompt": ("slimrl", "grpo"),  # --shared-prompt: slimrl's GRPO with shared_prompt_forward=True
}
SHARED_PROMPT_SIDE = "slimrl_shared_prompt"
# --algorithm -> its two sides in the order they run (slimrl's first: its steps are short, so a run cut off by a time
# limit still has them); the speedup is the second side's seconds over the first's
RUNS = {"grpo": ("slimrl", "trl"), "rloo": ("slimrl_rloo", "trl_rloo"), "ppo": ("slimrl_ppo", "slimrl_grpo")}
# A gradient-free pass timed on its own, inside the training phase: algorithm -> (module, function, step field)
SCORING_PASSES = {"ppo": ("slimrl.trainers.ppo.rollout", "score_rollout", "scoring_pass_s")}
GROUP = 8  # completions per prompt (GRPO and RLOO); W3's batch is one group
PHASE_KEYS = ("step_s", "generation_s", "reward_s", "training_s")
SUMMARY_KEYS = (*PHASE_KEYS, "peak_GiB", "loss", "reward", "completion_mean_length")
PPO_SUMMARY_KEYS = ("scoring_pass_s", "policy_loss", "value_loss")
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
PPO_LOG_FIELDS = {  # the same for slimrl's PPOTrainer (TRL 0.x's names; it logs no completion lengths)
    "loss": "loss",
    "grad_norm": "grad_norm",
    "reward": "objective/scores",
    "kl": "objective/kl",
    "policy_loss": "loss/policy_avg",
    "value_loss": "loss/value_avg",
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


def trainer_settings(algorithm: str, args, steps: int, output_dir: str, cuda: bool) -> dict:
    """The config settings both sides of `algorithm` get: W3's batch of 8 completions, sampling, optimizer and
    precision; GRPO's and RLOO's 8 generations of one prompt (GRPO's dapo loss), or PPO's 8 prompts x 1 completion
    in one mini-batch trained on once (one optimizer step per rollout)."""
    settings = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
                    gradient_accumulation_steps=1, temperature=1.0, learning_rate=1e-5, lr_scheduler_type="constant",
                    warmup_steps=0, gradient_checkpointing=True, bf16=cuda and not args.tiny, use_cpu=not cuda,
                    seed=args.seed, logging_steps=1, save_strategy="no", report_to="none",
                    disable_tqdm=True)  # fmt: skip
    if algorithm == "ppo":
        return {**settings, "response_length": args.completion_length, "num_ppo_epochs": 1, "num_mini_batches": 1,
                "kl_coef": args.beta}  # fmt: skip
    settings.update(num_generations=GROUP, max_completion_length=args.completion_length, beta=args.beta)
    return {**settings, "loss_type": "dapo"} if algorithm == "grpo" else settings


def trainer_classes(owner: str, algorithm: str) -> tuple[type, type]:
    """(trainer, config) classes of `owner`'s ("slimrl" or "trl") `algorithm`, by their public names."""
    import importlib

    module = importlib.import_module(owner)
    return getattr(module, f"{algorithm.upper()}Trainer"), getattr(module, f"{algorithm.upper()}Config")


def build_trainer(kind: str, model, tokenizer, data: dict, args, steps: int, output_dir: str, cuda: bool, **extra):
    """Side `kind`'s trainer (SIDES: whose, which algorithm) on `model`; PPO's value function is a head on it.
    `extra`: more config settings, for both owners (bench/scaling.py's batch size and rollout-device sides)."""
    owner, algorithm = SIDES[kind]
    settings = trainer_settings(algorithm, args, steps, output_dir, cuda)
    if owner == "slimrl":
        settings.update(num_chunks="auto", generation_backend=args.slimrl_backend)
    if kind == SHARED_PROMPT_SIDE:
        settings["shared_prompt_forward"] = True
    settings.update(extra)
    trainer_class, config_class = trainer_classes(owner, algorithm)
    return trainer_class(model=model, reward_funcs=data["rewards"], args=config_class(**settings),
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
    return {k: v if k in LOG_FIELDS or k in PPO_LOG_FIELDS else rounded(v) for k, v in record.items()}


def log_fields(algorithm: str) -> dict:
    """Per-step record field -> the metric `algorithm`'s trainer logs it as."""
    return PPO_LOG_FIELDS if algorithm == "ppo" else LOG_FIELDS


def scoring_pass_timer(algorithm: str):
    """A context timing `algorithm`'s gradient-free scoring pass (SCORING_PASSES), yielding the list of its calls'
    seconds; for the other algorithms a context yielding None."""
    if algorithm not in SCORING_PASSES:
        return contextlib.nullcontext()
    import importlib

    module, function, _ = SCORING_PASSES[algorithm]
    return timed_calls(importlib.import_module(module), function)


def summarise(records: list[dict], algorithm: str = "grpo") -> dict:
    """Means over all steps and over all but the first (warm-up: compilation and graph capture); the training
    phase's median and its largest step (the stall ratio) over the steps after the first."""
    keys = (*SUMMARY_KEYS, *PPO_SUMMARY_KEYS) if algorithm == "ppo" else SUMMARY_KEYS

    def means(rows: list[dict]) -> dict:
        return {k: rounded(mean(r.get(k) for r in rows)) for k in keys}

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
    if args.no_shared_prefill:
        without_shared_prefill(trainer)
    side["generation_backend"] = generation_backend(trainer)
    side["trainer"] = f"{type(trainer).__module__}.{type(trainer).__name__}"
    side["build_s"] = round(time.perf_counter() - start, 2)


def without_shared_prefill(trainer) -> None:
    """The rollout engine that slimrl's trainer builds at its first rollout prefills and caches every copy of a prompt
    itself (EngineOptions.share_prompt_prefill off, and with it share_prompt_cache; read at each rollout); TRL's
    trainers have no engine."""
    build = getattr(trainer, "_engine", None)
    if build is None:
        return

    def engine():
        built = build()
        if hasattr(built, "options"):
            built.options.share_prompt_prefill = False
        return built

    trainer._engine = engine


def finish_side(side: dict, held: dict, records: list[dict], algorithm: str) -> None:
    """What the run left to record: the engine's settings (then its memory freed), chunks, checkpointing, summary."""
    trainer, model = held.get("trainer"), held.get("model")
    if trainer is not None:
        side["engine"] = engine_config(trainer)
        side["engine_used"] = any("engine_stats" in r for r in records)
        side["num_chunks"] = getattr(trainer, "last_auto_chunks", None)  # slimrl's last automatic choice
        if getattr(trainer.args, "shared_prompt_forward", False):
            side["shared_prompt_fallbacks"] = trainer.shared_prompt_fallbacks
        engine = rollout_engine(trainer)
        if engine is not None:
            engine.release(keep_graph=False)  # its graphs and cache must not count against the next side
    if model is not None:
        side["offloaded_checkpointing"] = offloaded_checkpointing(model)
    side["steps_run"] = len(records)
    side["steps"] = [record_view(r) for r in records]
    side.update(summarise(records, algorithm))


def run_side(kind: str, steps: int, args, data, side: dict, save, cuda: bool) -> None:
    """Build `kind`'s model and trainer, train `steps` steps and fill `side`; an exception is recorded, not
    raised."""
    from transformers import PrinterCallback

    from slimrl.trainers.common.step_timer import StepTimer

    algorithm = SIDES[kind][1]
    fields = log_fields(algorithm)
    side.update(status="running", steps_requested=steps, steps_run=0, steps=[])
    held = {"dir": tempfile.mkdtemp(prefix=f"w3-{kind}-")}

    def on_step(record):
        record.update({field: record["logs"][key] for field, key in fields.items() if key in record["logs"]})
        if scoring is not None:  # the step's scoring pass ran before its logs arrived (one rollout per step)
            record[SCORING_PASSES[algorithm][2]] = sum(scoring)
            scoring.clear()
        side["steps_run"] = len(timer.steps)
        side["steps"] = [record_view(r) for r in timer.steps]
        print(json.dumps({kind: {k: v for k, v in record_view(record).items() if k != "logs"}}), flush=True)
        save()

    timer = StepTimer(on_step=on_step, track_memory=True)
    try:
        with scoring_pass_timer(algorithm) as scoring:
            build_side(kind, steps, args, data, side, held, cuda)
            timer.attach(held["trainer"])  # PPO's phases are its own methods: PPOTrainer.timed_phases
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
        finish_side(side, held, timer.steps, algorithm)
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


def compared_sides(report: dict) -> tuple[str, str]:
    """(the side measured, the side it is compared with): the speedup is the second's seconds over the first's."""
    return RUNS[report["algorithm"]]


def speedups(report: dict) -> dict | None:
    """The compared side's seconds over the measured side's (TRL's over slimrl's, or slimrl GRPO's over PPO's): per
    phase on both means (after the first step, and all steps), the training phase's median after the first step, and
    step by step (whole step and training phase) where both ran it."""
    measured, compared = (report["sides"].get(kind, {}) for kind in compared_sides(report))
    result = {}
    for basis in ("mean_after_first", "mean_all"):
        a, b = compared.get(basis), measured.get(basis)
        if a and b:
            result[basis] = {key: ratio(a.get(key), b.get(key)) for key in PHASE_KEYS}
    if not result:
        return None
    result["training_median_after_first"] = ratio(compared.get("training_median_after_first"),
                                                  measured.get("training_median_after_first"))  # fmt: skip
    pairs = list(zip(compared.get("steps", []), measured.get("steps", []), strict=False))
    result["per_step"] = {key: [ratio(a.get(key), b.get(key)) for a, b in pairs] for key in ("step_s", "training_s")}
    return result


def print_summary(report: dict) -> None:
    scoring = ["scoring_pass_s"] if report["algorithm"] in SCORING_PASSES else []  # a part of the training phase
    header = ["side", "steps", "backend", "step s", "gen s", "reward s", "train s", *("scoring s" for _ in scoring),
              "train median s", "stall ratio", "peak GiB", "first step s"]  # fmt: skip
    rows = []
    for kind, side in report["sides"].items():
        if side.get("status") == "skipped":
            continue
        means = side.get("mean_after_first") or side.get("mean_all") or {}
        first = side["steps"][0]["step_s"] if side.get("steps") else None
        rows.append([kind, f"{side.get('steps_run', 0)}/{side.get('steps_requested')}", side.get("generation_backend"),
                     *(means.get(k) for k in (*PHASE_KEYS, *scoring)), side.get("training_median_after_first"),
                     side.get("stall_ratio"), side.get("peak_GiB"), first])  # fmt: skip
    speedup = report.get("speedup") or {}
    label = "/".join(reversed(compared_sides(report)))
    for basis in ("mean_after_first", "mean_all"):
        if basis in speedup:
            rows.append([label, basis, None, *(speedup[basis][k] for k in PHASE_KEYS), *(None for _ in scoring),
                         speedup.get("training_median_after_first"), None, None, None])  # fmt: skip
    print(f"\nW3 ({report['algorithm']}): seconds per step (means over all steps but the first, where there are two or "
          "more)")  # fmt: skip
    print(markdown_table(header, rows))
    gain = report.get("shared_prompt") or {}
    if gain.get("mean_after_first") or gain.get("mean_all"):
        basis = "mean_after_first" if gain.get("mean_after_first") else "mean_all"
        print(f"shared prompt: training {gain[basis]['training_s']}x, step {gain[basis]['step_s']}x ({basis}; "
              f"{gain['speedup_is']}), peak GiB {gain['peak_GiB']}")  # fmt: skip
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
    record.update(algorithm_record(args))
    record.update(completion_length=args.completion_length, temperature=1.0, learning_rate=1e-5,
                  lr_scheduler="constant", gradient_checkpointing=True, bf16=cuda and not args.tiny, seed=args.seed,
                  slimrl_backend=args.slimrl_backend, rewards=[getattr(f, "__name__", str(f)) for f in data["rewards"]],
                  shared_prompt=getattr(args, "shared_prompt", False),
                  steps={kind: side_steps(kind, args) for kind in sides_to_run(args)})  # fmt: skip
    return record


def algorithm_record(args) -> dict:
    """The batch and loss settings of --algorithm's sides (trainer_settings), as the JSON names them."""
    group = {"prompts_per_step": 1, "num_generations": GROUP}
    if args.algorithm == "grpo":
        return {**group, "loss_type": "dapo", "beta": args.beta}
    if args.algorithm == "rloo":
        return {**group, "beta": args.beta, "loss": "RLOO's (TRL 1.16 defaults: epsilon 0.2, normalize_advantages off)"}
    return {"ppo": {"prompts_per_step": 8, "completions_per_prompt": 1, "num_ppo_epochs": 1, "num_mini_batches": 1,
                    "kl_coef": args.beta, "value_function": "a value head on the policy"},
            "grpo": {**group, "loss_type": "dapo", "beta": args.beta}}  # fmt: skip


def sides_to_run(args) -> tuple[str, ...]:
    """--algorithm's sides in the order they run; with --shared-prompt the shared side right after slimrl's."""
    sides = RUNS[args.algorithm]
    if not getattr(args, "shared_prompt", False):  # (bench/scaling.py, which shares this, has no --shared-prompt)
        return sides
    return (sides[0], SHARED_PROMPT_SIDE, *sides[1:])


def shared_prompt_gain(report: dict) -> dict | None:
    """slimrl's seconds over the shared-prompt side's (per phase on both means, and the training phase's median after
    the first step), both sides' peak memory and first losses (the same run but for the forward), the shared side's
    fallback reasons."""
    plain, shared = (report["sides"].get(kind, {}) for kind in ("slimrl", SHARED_PROMPT_SIDE))
    if not plain.get("steps") or not shared.get("steps"):
        return None
    gain = {"speedup_is": f"slimrl seconds / {SHARED_PROMPT_SIDE} seconds"}
    for basis in ("mean_after_first", "mean_all"):
        a, b = plain.get(basis), shared.get(basis)
        if a and b:
            gain[basis] = {key: ratio(a.get(key), b.get(key)) for key in PHASE_KEYS}
    gain["training_median_after_first"] = ratio(plain.get("training_median_after_first"),
                                                shared.get("training_median_after_first"))  # fmt: skip
    gain["peak_GiB"] = {"slimrl": plain.get("peak_GiB"), SHARED_PROMPT_SIDE: shared.get("peak_GiB")}
    gain["first_loss"] = {"slimrl": plain["steps"][0].get("loss"), SHARED_PROMPT_SIDE: shared["steps"][0].get("loss")}
    gain["fallbacks"] = shared.get("shared_prompt_fallbacks", [])
    return gain


def side_steps(kind: str, args) -> int:
    """Steps side `kind` runs: TRL's trainers --trl-steps, slimrl's --steps."""
    return args.trl_steps if SIDES[kind][0] == "trl" else args.steps


def engine_generated(side: dict) -> bool:
    """Whether a side's rollouts came from slimrl's engine (chosen, and its stats seen after a rollout)."""
    return bool(side.get("engine_used")) and side.get("generation_backend") == "engine"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("grpo_step.json"))
    parser.add_argument("--algorithm", default="grpo", choices=tuple(RUNS),
                        help="grpo: TRL's GRPO and slimrl's; rloo: TRL's RLOO and slimrl's; ppo: slimrl's PPO and "
                        "slimrl's GRPO")  # fmt: skip
    parser.add_argument("--real", action="store_true", help=f"{REAL_MODEL} on the demo's task instead of W1's model")
    parser.add_argument("--steps", type=int, default=None, help="slimrl's steps (default 10, 30 with --real)")
    parser.add_argument("--trl-steps", type=int, default=None,
                        help="TRL's steps (default 3: about 2 minutes each on W1; 30 with --real)")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=tuple(SIDES),
                        help="sides not to run (those of --algorithm: see RUNS)")  # fmt: skip
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL coefficient against the reference (the adapter disabled): GRPO's and RLOO's beta, "
                        "PPO's kl_coef (default 0)")  # fmt: skip
    parser.add_argument("--completion-length", type=int, default=None,
                        help="default 1024 (256 with --real; 32 with --tiny, 16 with --real --tiny)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=None, help="W1: default 256 (128 with --tiny)")
    parser.add_argument("--slimrl-backend", default="auto", choices=("auto", "engine", "transformers"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shared-prefill", action="store_true",
                        help="slimrl's engine prefills and caches every copy (share_prompt_prefill off)")  # fmt: skip
    parser.add_argument("--shared-prompt", action="store_true",
                        help="GRPO: also run slimrl's GRPO with shared_prompt_forward=True (side "
                        f"{SHARED_PROMPT_SIDE}) after slimrl's, and compare the two")  # fmt: skip
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
    if args.shared_prompt and args.algorithm != "grpo":
        parser.error("--shared-prompt measures GRPO's shared-prompt forward: use it with --algorithm grpo")
    other = [kind for kind in args.skip if kind not in sides_to_run(args)]
    if other:
        sides = " and ".join(sides_to_run(args))
        parser.error(f"--skip {' '.join(other)}: --algorithm {args.algorithm} runs {sides}")
    return args


def build_data(args) -> dict:
    """The dataset, reward functions and (W1) shared tokenizer both sides train on: a prompt for each step of the
    longer side (PPO: 8 prompts a step), 8 at least."""
    rows = max(args.steps, args.trl_steps) * (8 if args.algorithm == "ppo" else 1)
    rows = max(rows, 8)
    if args.real:
        return real_data(rows, args.seed)
    from slimrl.testing import TINY_VOCAB

    tokenizer = offline_tokenizer(TINY_VOCAB if args.tiny else W1_VOCAB)
    dataset = build_dataset(tokenizer, rows, args.prompt_tokens, seed=args.seed)
    return {"tokenizer": tokenizer, "dataset": dataset, "rewards": reward_functions(args.completion_length)}


TIMING = (
    "per optimizer step, on_step_begin to on_step_end, CUDA-synchronised (slimrl.trainers.common.step_timer): "
    "generation = "
    "_generate_single_turn, reward = _calculate_rewards, training = the rest of the step. Peak memory is reset when "
    "generation starts and ends: generation_peak_GiB and training_peak_GiB (reward + training) per step; slimrl's own "
    "logged peak_gpu_memory_GiB therefore covers the training phase only"
)
PPO_TIMING = (
    "; PPO's phases: generation = _generate, reward = _scores, and scoring_pass_s = ppo.rollout.score_rollout (old "
    "log-probs, values and reference log-probs of the rollout, gradient-free), a part of training_s"
)


def main(argv=None) -> Report:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    cuda = torch.cuda.is_available()
    measured, compared = RUNS[args.algorithm]
    report = Report(args.out, workload="W3", command=shlex.join(["python", "bench/grpo_step.py", *argv]),
                    algorithm=args.algorithm, tiny=args.tiny, real=args.real,
                    timing=TIMING + (PPO_TIMING if args.algorithm == "ppo" else ""),
                    speedup_is=f"{compared} seconds / {measured} seconds", sides={})  # fmt: skip

    def save():
        report["speedup"] = speedups(report)
        if args.shared_prompt:
            report["shared_prompt"] = shared_prompt_gain(report)
        report.save()

    with report.recording_failure():
        report.update(environment(cuda))
        data = build_data(args)
        report["settings"] = settings_record(args, data, cuda)
        for kind in sides_to_run(args):
            side = report["sides"][kind] = {}
            if kind in args.skip:
                side["status"] = "skipped"
                continue
            run_side(kind, side_steps(kind, args), args, data, side, save, cuda)
            report["problems"] += side_problems(kind, side, args, cuda)
        save()
        print_summary(report)
    print(f"wrote {report.path}")
    return report


def side_problems(kind: str, side: dict, args, cuda: bool) -> list[str]:
    if side["status"] == "error":
        return [f"{kind} raised: {side['error'].strip().splitlines()[-1]}"]
    if side.get("shared_prompt_fallbacks"):
        return [f"{kind} fell back to the plain forward: {'; '.join(side['shared_prompt_fallbacks'])}"]
    if SIDES[kind][0] == "slimrl" and cuda and args.slimrl_backend != "transformers" and not engine_generated(side):
        return [f"{kind} generated with {side.get('generation_backend')!r} on CUDA, not its rollout engine"]
    return []


if __name__ == "__main__":
    sys.exit(main().exit_status())
