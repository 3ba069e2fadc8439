"""Does slimrl's rollout engine decode what the model computes? SmolLM2-135M-Instruct with a live LoRA adapter.

The model: SmolLM2-135M-Instruct (`FastLanguageModel.from_pretrained`), LoRA r=16 on the seven projections
(`FastLanguageModel.get_peft_model`), then every lora_B set to N(0, --lora-b-std^2) from a fixed seed, so the adapter
is non-zero and changes the outputs (recorded: how many greedy replies differ with the adapter disabled, about half
at the default std, and how far it moves the log-probs of the engine's sampled tokens). Each of
--dtypes (bf16, fp32) gets a freshly loaded model, in eval mode. Prompts: 32 arithmetic problems (slimrl.data,
held-out split) as chat prompts behind system messages of 0 to 5 sentences, so their lengths differ.

(a) greedy agreement: slimrl's engine (`RolloutEngine(model, tokenizer=tok).generate(prompt_ids,
    SamplingParams(temperature=0), max_new_tokens=64)`) against `model.generate(do_sample=False)` on the left-padded
    batch; each completion is cut after its first EOS. Per row: identical or not, the first position where they
    differ; overall: identical rows and the share of identical tokens (positions up to the longer completion).
(b) log-probs: 64 tokens sampled at temperature 1.0 (no top-k/top-p) by the engine (its returned log-probs) and by
    `model.generate(do_sample=True, output_logits=True, return_dict_in_generate=True)` (fp32 log-softmax of its own
    raw logits at its own sampled tokens: the baseline), each against the training forward: one teacher-forced
    forward of prompt + completion through the peft model as TRL batches it (left-padded prompts, right-padded
    completions, attention mask), fp32 log-softmax of the logits at the completion tokens. Mean, p99 and max of
    |delta log-prob| over completion tokens for both. Requirement: the engine's mean |delta| is no larger than
    generate's own, or both are below --noise-floor (1e-5: in fp32 both are rounding noise, about 1e-7, and either
    can be the smaller; the strict comparison is recorded too, as engine_not_above_generate).
(c) the same comparison on the same tokens, without the sampling noise of two different samples: generate decodes
    the engine's sampled completions token by token (a logits processor forces each next token; its raw logits are
    kept), so generate's and the engine's log-probs of the same tokens each meet the same training forward. The
    requirement is checked here (`same_tokens`), and with the engine's LoRA matmuls in exact fp32 too
    (`tf32_adapters=False`, `same_tokens_exact_adapters`).

    python bench/real_engine.py $OUT/real_engine.json [--dtypes bf16 fp32] [--prompts 32] [--max-new-tokens 64]
                                [--lora-b-std 0.1] [--noise-floor 1e-5] [--seed 0] [--tiny]

--tiny uses slimrl.testing's 2-layer Llama and byte tokenizer: a CPU smoke run. The JSON is rewritten after each
part; the exit status is 1 when a dtype raised (traceback in the JSON), the requirement fails, or the adapter
changes no greedy reply.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
from common import Report, default_output, environment, markdown_table, mean, quantile, rounded  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SENTENCES = (
    "You are a careful assistant who checks every sum twice.",
    "Answers are graded automatically, so the format matters.",
    "Keep the reply to a single line.",
    "Whole numbers only; negative results keep their sign.",
    "Do not explain the method and do not add anything after the number.",
)


# -- model and prompts -------------------------------------------------------------------------------------------


def load_model(args, dtype: torch.dtype, device: str):
    """The peft model with its LoRA adapter (lora_B randomised from --seed), in eval mode, and its tokenizer."""
    from slimrl import FastLanguageModel

    if args.tiny:
        from slimrl.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama", dtype=dtype).to(device), tiny_tokenizer()
    else:
        model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=1024,
                                                             dtype=dtype, device_map={"": device})  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False,
                                             random_state=args.seed)  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:  # peft starts B at zero: the adapter would be a no-op
                noise = torch.randn(parameter.shape, generator=generator) * args.lora_b_std
                parameter.copy_(noise.to(parameter.device, parameter.dtype))
    model.eval()
    return model, tokenizer


def chat_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Token ids of `count` arithmetic chat prompts, each behind a system message of (i mod 6) sentences."""
    from slimrl.data import arithmetic_dataset

    problems = arithmetic_dataset(count, seed=seed, split="eval")
    prompts = []
    for i, row in enumerate(problems):
        system = " ".join(SENTENCES[: i % (len(SENTENCES) + 1)])
        messages = ([{"role": "system", "content": system}] if system else []) + list(row["prompt"])
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def stop_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))


def cut_at_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """`tokens` up to and including the first stop token (the engine's convention)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


# -- the two generators ------------------------------------------------------------------------------------------


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.no_grad()
def transformers_generate(model, tokenizer, prompts, max_new_tokens: int, sample: bool, seed: int):
    """(completions cut at the first stop token, each token's fp32 log-prob from generate's own raw logits)."""
    pad_id = tokenizer.pad_token_id
    ids, mask = left_padded(prompts, pad_id, next(model.parameters()).device)
    torch.manual_seed(seed)
    options = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                         output_logits=True, return_dict_in_generate=True, **options)  # fmt: skip
    new = out.sequences[:, ids.shape[1] :]  # [B, T]
    logits = torch.stack(out.logits, dim=1).float()  # [B, T, V] raw, before any processing
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0]  # [B, T]
    stops = stop_ids(model)
    completions = [cut_at_stop(row, stops) for row in new.tolist()]
    logprobs = [chosen[b, : len(c)].tolist() for b, c in enumerate(completions)]
    return completions, logprobs


def generate_scores_of(model, tokenizer, prompts, completions) -> list[list[float]]:
    """generate's own log-probs of given completions: it decodes them token by token (each step's sampled token
    forced by a logits processor), and the fp32 log-softmax of its raw logits is taken at those tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    pad_id = tokenizer.pad_token_id
    ids, mask = left_padded(prompts, pad_id, next(model.parameters()).device)
    width = max(len(c) for c in completions)
    forced = torch.tensor([c + [pad_id] * (width - len(c)) for c in completions], device=ids.device)  # [B, T]

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - ids.shape[1]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, forced[:, step : step + 1], 0.0)

    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=width, do_sample=False,
                         pad_token_id=pad_id, logits_processor=LogitsProcessorList([Force()]), output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    logits = torch.stack(out.logits, dim=1).float()  # [B, T', V] raw; T' <= T when every row ended early
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, forced[:, : logits.shape[1], None])[..., 0]
    return [chosen[b, : len(c)].tolist() for b, c in enumerate(completions)]


def engine_generate(engine, prompts, max_new_tokens: int, sample: bool, seed: int):
    from slimrl.rollout.sampling import SamplingParams

    params = SamplingParams(temperature=1.0 if sample else 0.0, logprobs=True, seed=seed)
    out = engine.generate(prompts, params, max_new_tokens=max_new_tokens)
    return out.completion_ids, out.logprobs


@torch.no_grad()
def training_logprobs(model, prompts, completions, pad_id: int, batch: int = 8) -> list[list[float]]:
    """Per completion token, the fp32 log-prob of a teacher-forced forward of prompt + completion, batched as TRL's
    training step does: left-padded prompts, right-padded completions, the attention mask, no position ids."""
    device = next(model.parameters()).device
    result = []
    for start in range(0, len(prompts), batch):
        rows_p, rows_c = prompts[start : start + batch], completions[start : start + batch]
        prompt_ids, prompt_mask = left_padded(rows_p, pad_id, device)
        width = max(1, max(len(c) for c in rows_c))
        completion_ids = torch.tensor([c + [pad_id] * (width - len(c)) for c in rows_c], device=device)
        completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in rows_c], device=device)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [b, P + T]
        logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1)).logits
        logits = logits[:, prompt_ids.shape[1] - 1 : -1].float()  # [b, T, V]: the logits that predict each token
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[..., None])[..., 0]  # [b, T]
        result += [chosen[i, : len(c)].tolist() for i, c in enumerate(rows_c)]
    return result


# -- comparisons -------------------------------------------------------------------------------------------------


def greedy_agreement(engine_rows: list[list[int]], reference_rows: list[list[int]]) -> dict:
    """Row-by-row agreement of two sets of greedy completions."""
    divergence, same, total = [], 0, 0
    for a, b in zip(engine_rows, reference_rows, strict=True):
        longest = max(len(a), len(b))
        first = next((i for i in range(longest) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)
        divergence.append(first)
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += longest
    return {"rows": len(engine_rows), "identical_rows": sum(d is None for d in divergence),
            "identical_token_share": same / total if total else 1.0, "first_divergence": divergence,
            "engine_lengths": [len(r) for r in engine_rows],
            "generate_lengths": [len(r) for r in reference_rows]}  # fmt: skip


def delta_stats(generated: list[list[float]], reference: list[list[float]]) -> dict:
    """|generated - reference| over all completion tokens: mean, p99, max (and the signed mean)."""
    deltas = [g - r for gs, rs in zip(generated, reference, strict=True) for g, r in zip(gs, rs, strict=True)]
    magnitudes = [abs(d) for d in deltas]
    return {"tokens": len(deltas), "mean_abs": mean(magnitudes), "p99_abs": quantile(magnitudes, 0.99),
            "max_abs": max(magnitudes) if magnitudes else None, "mean_signed": mean(deltas)}  # fmt: skip


# -- one dtype ---------------------------------------------------------------------------------------------------


def engine_settings(engine) -> dict:
    """The engine's resolved settings and shapes (`RolloutEngine.describe()`: cuda_graphs, compile, tf32_adapters,
    the Triton kernels in use, deterministic, kernel choices, max_seq_len, ...)."""
    return engine.describe()


def adapter_effect(model, tokenizer, prompts, max_new_tokens: int, with_adapter: list[list[int]]) -> dict:
    """How many greedy replies the adapter changes (generate with it disabled, against `with_adapter`)."""
    with model.disable_adapter():
        base, _ = transformers_generate(model, tokenizer, prompts, max_new_tokens, sample=False, seed=0)
    changed = sum(a != b for a, b in zip(base, with_adapter, strict=True))
    return {"greedy_rows_changed_by_adapter": changed, "rows": len(prompts)}


def measure_dtype(args, name: str, device: str, part: dict, save) -> None:
    """Fill `part` with dtype `name`'s greedy agreement and log-prob deltas, saving after each piece."""
    from slimrl.rollout.engine import RolloutEngine

    model, tokenizer = load_model(args, DTYPES[name], device)
    adapter = [p for n, p in model.named_parameters() if "lora_B" in n]
    part["adapter"] = {"rank": 16, "lora_b_std": args.lora_b_std, "lora_dtype": str(adapter[0].dtype).split(".")[-1]}
    prompts = chat_prompts(tokenizer, args.prompts, args.seed)
    part["prompt_lengths"] = [len(p) for p in prompts]
    engine = RolloutEngine(model, tokenizer=tokenizer)
    part["engine"] = engine_settings(engine)
    n = args.max_new_tokens
    reference, _ = transformers_generate(model, tokenizer, prompts, n, sample=False, seed=args.seed)
    engine_rows, _ = engine_generate(engine, prompts, n, sample=False, seed=args.seed)
    part["greedy"] = greedy_agreement(engine_rows, reference)
    part["adapter"].update(adapter_effect(model, tokenizer, prompts, n, reference))
    save()
    sampled = {"engine": engine_generate(engine, prompts, n, sample=True, seed=args.seed)}
    engine.release(keep_graph=False)
    sampled["generate"] = transformers_generate(model, tokenizer, prompts, n, sample=True, seed=args.seed)
    part["logprobs"], forward = logprob_deltas(model, prompts, sampled, tokenizer.pad_token_id, args.noise_floor)
    completions, engine_logprobs = sampled["engine"]
    by_generate = generate_scores_of(model, tokenizer, prompts, completions)
    part["same_tokens"] = same_token_deltas(engine_logprobs, by_generate, forward, args.noise_floor)
    exact = RolloutEngine(model, tokenizer=tokenizer, tf32_adapters=False)
    exact_completions, exact_logprobs = engine_generate(exact, prompts, n, sample=True, seed=args.seed)
    exact.release(keep_graph=False)
    exact_forward = training_logprobs(model, prompts, exact_completions, tokenizer.pad_token_id)
    exact_by_generate = generate_scores_of(model, tokenizer, prompts, exact_completions)
    part["same_tokens_exact_adapters"] = same_token_deltas(exact_logprobs, exact_by_generate, exact_forward,
                                                           args.noise_floor)  # fmt: skip
    with model.disable_adapter():  # how far the adapter moves the same tokens' log-probs: what ignoring it would cost
        base = training_logprobs(model, prompts, sampled["engine"][0], tokenizer.pad_token_id)
    part["adapter"]["logprob_shift"] = delta_stats(base, forward)
    part["status"] = "ok"


def logprob_deltas(model, prompts, sampled: dict, pad_id: int, noise_floor: float) -> tuple[dict, list]:
    """Each side's log-probs against the training forward of its own completions, and the requirement; and the
    training forward's log-probs of the engine's completions."""
    result, forwards = {}, {}
    for side, (completions, logprobs) in sampled.items():
        forwards[side] = training_logprobs(model, prompts, completions, pad_id)
        result[side] = delta_stats(logprobs, forwards[side])
        result[side]["completion_mean_length"] = mean(len(c) for c in completions)
    engine_mean, generate_mean = result["engine"]["mean_abs"], result["generate"]["mean_abs"]
    result["engine_over_generate_mean"] = engine_mean / generate_mean if generate_mean else None
    result["engine_not_above_generate"] = engine_mean <= generate_mean
    result["noise_floor"] = noise_floor
    result["requirement_met"] = engine_mean <= generate_mean or max(engine_mean, generate_mean) <= noise_floor
    return result, forwards["engine"]


def same_token_deltas(engine: list[list[float]], by_generate: list[list[float]], forward: list[list[float]],
                      noise_floor: float) -> dict:
    """The engine's and generate's log-probs of the same tokens, each against the training forward."""
    result = {"engine": delta_stats(engine, forward), "generate": delta_stats(by_generate, forward)}
    engine_mean, generate_mean = result["engine"]["mean_abs"], result["generate"]["mean_abs"]
    result["engine_over_generate_mean"] = engine_mean / generate_mean if generate_mean else None
    result["requirement_met"] = engine_mean <= generate_mean or max(engine_mean, generate_mean) <= noise_floor
    return result


# -- report ------------------------------------------------------------------------------------------------------


def problems_of(name: str, part: dict) -> list[str]:
    if part.get("status") != "ok":
        return [f"{name} raised: {part.get('error', '').strip().splitlines()[-1:]}"]
    found = []
    if not part["same_tokens"]["requirement_met"]:
        e, g = part["same_tokens"]["engine"]["mean_abs"], part["same_tokens"]["generate"]["mean_abs"]
        found.append(f"{name}: on the same tokens the engine's mean |delta log-prob| {e:.3g} exceeds "
                     f"generate's {g:.3g}")
    if part["adapter"]["greedy_rows_changed_by_adapter"] == 0:
        found.append(f"{name}: the adapter changes no greedy reply; raise --lora-b-std")
    return found


def table(report: Report) -> str:
    header = ["dtype", "greedy rows identical", "identical tokens", "engine |dlogp| mean / p99 / max",
              "generate |dlogp| mean / p99 / max", "same tokens: engine / generate mean |dlogp|",
              "same tokens, exact adapters: engine / generate", "engine <= generate (same tokens)",
              "rows changed by adapter", "adapter's |dlogp| mean"]  # fmt: skip
    rows = []
    for name, part in report["dtypes"].items():
        if part.get("status") != "ok":
            rows.append([name, part.get("status"), None, None, None, None, None, None, None, None])
            continue
        g, lp = part["greedy"], part["logprobs"]
        keys = ("mean_abs", "p99_abs", "max_abs")
        stats = [" / ".join(f"{lp[side][k]:.2e}" for k in keys) for side in ("engine", "generate")]
        same = [" / ".join(f"{part[key][side]['mean_abs']:.2e}" for side in ("engine", "generate"))
                for key in ("same_tokens", "same_tokens_exact_adapters")]  # fmt: skip
        rows.append([name, f"{g['identical_rows']}/{g['rows']}", f"{g['identical_token_share']:.1%}", *stats, *same,
                     "yes" if part["same_tokens"]["requirement_met"] else "NO",
                     f"{part['adapter']['greedy_rows_changed_by_adapter']}/{part['adapter']['rows']}",
                     f"{part['adapter']['logprob_shift']['mean_abs']:.2e}"])  # fmt: skip
    return markdown_table(header, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("real_engine.json"))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lora-b-std", type=float, default=0.1, help="std of the random lora_B entries")
    parser.add_argument("--noise-floor", type=float, default=1e-5,
                        help="means both below this count as equal (fp32 rounding noise)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="slimrl.testing's 2-layer Llama: a CPU smoke run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Report:
    import traceback

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    command = shlex.join(["python", "bench/real_engine.py", *(sys.argv[1:] if argv is None else argv)])
    report = Report(args.out, benchmark="real_engine", command=command, dtypes={})
    with report.recording_failure():
        report.update(environment(cuda), settings={k: v for k, v in vars(args).items() if k != "out"})
        for name in args.dtypes:
            part = report["dtypes"][name] = {"status": "running"}
            try:
                measure_dtype(args, name, "cuda" if cuda else "cpu", part, report.save)
            except Exception:  # noqa: BLE001 - one dtype failing is reported and the next still runs
                traceback.print_exc()
                part.update(status="error", error=traceback.format_exc())
            gc.collect()  # the last dtype's model and engine, before the next is loaded
            if cuda:
                torch.cuda.empty_cache()
            report["problems"] += problems_of(name, part)
            report.save()
        report["dtypes"] = rounded(report["dtypes"], 8)
        report["table"] = table(report)
        print(report["table"])
    report.print_outcome()
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
