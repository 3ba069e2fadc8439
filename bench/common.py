"""Helpers shared by the benchmark scripts: offline settings, the environment record, a JSON report that is rewritten
as results arrive (a run cut off by a time limit keeps what it measured), summary statistics and markdown tables.

Scripts import it as `from common import ...` after putting this folder on sys.path (a script run as
`python bench/x.py` has it there already; a test that loads a script by path does not).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")  # there is no hub on the GPU machine: fail fast instead of retrying
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def environment(cuda: bool) -> dict:
    """The GPU's name (or "cpu") and the versions of everything the numbers depend on."""
    import peft
    import torch
    import transformers

    import slimrl

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                "peft": peft.__version__, "slimrl": slimrl.__version__, "python": sys.version.split()[0]}  # fmt: skip
    for name in ("trl", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "versions": versions}


class Report(dict):
    """A benchmark's JSON report: a dict with a `problems` list, saved to `path` by `save()`.

    `recording_failure()` turns an exception into a saved traceback (`error`) and a problem, so the script can exit
    non-zero with what it measured so far on disk."""

    def __init__(self, path: str | Path, **fields):
        super().__init__(**fields)
        self.path = Path(path)
        self.setdefault("problems", [])

    def save(self) -> None:
        from slimrl.cli.demo import write_json  # slimrl's atomic JSON write (a reader never sees half a file)

        write_json(self.path, self, indent=1)

    @contextlib.contextmanager
    def recording_failure(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # noqa: BLE001 - recorded in the report; the exit status says it failed
            traceback.print_exc()
            self["error"] = traceback.format_exc()
            self["problems"].append(f"raised {type(error).__name__}: {error}".splitlines()[0])
        finally:
            self.save()

    def exit_status(self) -> int:
        return 1 if self["problems"] else 0

    def print_outcome(self) -> None:
        """Each problem on a line of its own, then where the report is."""
        for problem in self["problems"]:
            print(f"PROBLEM: {problem}")
        print(f"wrote {self.path}")


def finite(values: Iterable) -> list[float]:
    """The numeric, finite entries of `values`."""
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def mean(values: Iterable) -> float | None:
    kept = finite(values)
    return sum(kept) / len(kept) if kept else None


def quantile(values: Iterable, q: float) -> float | None:
    """The q-quantile (0..1) of the finite values, interpolating linearly between neighbours (numpy's default)."""
    kept = sorted(finite(values))
    if not kept:
        return None
    position = q * (len(kept) - 1)
    low = math.floor(position)
    high = min(low + 1, len(kept) - 1)
    return kept[low] + (kept[high] - kept[low]) * (position - low)


def median(values: Iterable) -> float | None:
    return quantile(values, 0.5)


def rounded(value, digits: int = 4):
    """`value` with every float in it rounded (dicts and lists recursively)."""
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def markdown_table(header: list[str], rows: Iterable[Iterable]) -> str:
    """A GitHub markdown table; None prints as a dash."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join("-" if cell is None else str(cell) for cell in row) + " |")
    return "\n".join(lines)


def default_output(name: str) -> str:
    """`$OUT/name` where the GPU machine sets $OUT, else `./name`."""
    return os.path.join(os.environ.get("OUT", "."), name)


# -- W1's model (shared/bench/WORKLOAD.md): written once, used by every benchmark ------------------------------------

W1_VOCAB = 151936
W1_SHAPE = dict(vocab_size=W1_VOCAB, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
W1_LORA_RANK = 64


def w1_config(tiny: bool = False, context: int = 32768, **overrides):
    """The Qwen2 config of W1's model (Qwen2.5-1.5B's shape), or a 2-layer one of the same family for CPU smoke runs;
    `context` is the longest prompt + completion it must take."""
    from transformers import Qwen2Config

    shape = {**(TINY_SHAPE if tiny else W1_SHAPE), **overrides}
    return Qwen2Config(**shape, max_position_embeddings=max(32768, context))


def w1_model(tiny: bool = False, device: str = "cuda", dtype=None, seed: int = 0, context: int = 32768,
             lora_rank: int | None = W1_LORA_RANK, lora_b_std: float | None = None,
             reseed_adapter: bool = True):  # fmt: skip
    """W1's model with random weights from `seed` (bf16 by default) and, unless lora_rank is None, peft LoRA on all
    linear layers (alpha = rank, dropout 0; lora_A from the same seed, so two sides of a run get the same adapter);
    lora_b_std: B drawn from N(0, std^2) so the adapter changes the outputs (peft starts B at zero).
    reseed_adapter=False draws lora_A where the weights' initialisation left the generator (W1's recorded runs in
    docs/bench/w1_*.json were made that way)."""
    import torch
    from transformers import Qwen2ForCausalLM

    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(w1_config(tiny, context)).to(dtype)
    model.generation_config.eos_token_id = None  # random weights have no real EOS: completions run to full length
    model.generation_config.pad_token_id = 1
    if lora_rank is None:
        return model
    return with_lora(model, min(lora_rank, 8) if tiny else lora_rank, seed, lora_b_std, reseed_adapter)


def with_lora(model, rank: int, seed: int = 0, lora_b_std: float | None = None, reseed: bool = True):
    """`model` with peft LoRA of `rank` on all linear layers (alpha = rank, dropout 0; lora_A drawn after reseeding
    with `seed` unless reseed is False); lora_b_std: B drawn from N(0, std^2) so the adapter changes the outputs (peft
    starts B at zero). Its weights are made where torch makes new tensors (a `torch.device` context puts them there)."""
    import torch
    from peft import LoraConfig, get_peft_model

    if reseed:
        torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if lora_b_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, lora_b_std)
    return model


MODELS = ("w1", "gemma3-1b", "qwen3-moe")


def model_for(name: str, tiny: bool = False, device: str = "cuda", dtype=None, seed: int = 0, context: int = 32768,
              lora_rank: int | None = W1_LORA_RANK, lora_b_std: float | None = None):  # fmt: skip
    """The benchmark model `name` (MODELS): "w1" is `w1_model` with its defaults; the others are bench/models.py's
    (Gemma-3-1B's and Qwen3-30B-A3B's shapes), made in `dtype` on the device, adapter included."""
    if name == "w1":
        return w1_model(tiny, device, dtype, seed, context, lora_rank, lora_b_std)
    import models  # (bench/models.py, beside this file; it imports this module)

    return models.build(name, tiny, device, dtype, seed, context, lora_rank, lora_b_std)


def random_prompts(batch: int, length: int, vocab: int = W1_VOCAB, seed: int = 0, vary: bool = False) -> list:
    """`batch` prompts of random token ids (above the special ids), `length` long or, with vary, up to 56 shorter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [length - (i * 7) % 57 if vary else length for i in range(batch)]
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


# -- timing and bandwidth ------------------------------------------------------------------------------------------


def graph_ms(fn, rep: int = 50) -> float:
    """Milliseconds a call of `fn` takes on the GPU, from CUDA-graph replays (`triton.testing.do_bench_cudagraph`)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep)


def sync_time() -> float:
    """perf_counter after the GPU has finished what was queued (plain perf_counter on a machine without CUDA)."""
    import time

    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[tuple[int, float]]]:
    """(generation, seconds) of each of Python's garbage collections inside the block (gc.callbacks)."""
    import gc
    import time

    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def timed_iterations(iteration, repeats: int = 1, gc_ms: list | None = None) -> tuple[float, list[float], object]:
    """Run `iteration()` (one training phase: compute_loss + backward) once untimed, then `repeats` times timed, each
    from a synchronised start with the peak-memory counter reset; returns (median seconds, every timed iteration's
    seconds, the last iteration's result). repeats=1 is the "second of two iterations" the W1 figures always used.
    `gc_ms`, when given, gets each timed iteration's milliseconds in Python's garbage collector (host time the GPU
    may or may not hide)."""
    import statistics

    import torch

    times, result = [], None
    for index in range(1 + max(repeats, 1)):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with gc_pauses() as pauses:
            start = sync_time()
            result = iteration()
            elapsed = sync_time() - start
        if index:
            times.append(round(elapsed, 4))
            if gc_ms is not None:
                gc_ms.append(round(1000 * sum(seconds for _, seconds in pauses), 2))
    return statistics.median(times), times, result


@contextlib.contextmanager
def timed_calls(owner, name: str) -> Iterator[list[float]]:
    """`owner.name` (a module's function, or an attribute of any object) wrapped for the duration of the block: each
    call's wall seconds, from and to a point where the GPU has finished its queued work (sync_time), are appended to
    the list the block receives. Callers that look the name up at call time (`module.name(...)`) are timed; the
    original is put back afterwards."""
    import functools

    original = getattr(owner, name)
    seconds: list[float] = []

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = sync_time()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(sync_time() - start)

    setattr(owner, name, timed)
    try:
        yield seconds
    finally:
        setattr(owner, name, original)


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes read + written per second by a device-to-device copy of `gib` GiB (best of 10)."""
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        start = sync_time()
        dst.copy_(src)
        best = min(best, sync_time() - start)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / best


def weight_bytes(model) -> int:
    """Bytes of every parameter (a tied embedding counted once: the LM head reads it whole every step)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# -- shared measurements -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recorded(report: Report, name: str) -> Iterator[None]:
    """Run one piece of a benchmark: what it raises is recorded in `report` (its traceback under `errors[name]`, a line
    in `problems`) and the script goes on to the next piece; the report is saved after it either way."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - recorded; the exit status says the run failed
        traceback.print_exc()
        report.setdefault("errors", {})[name] = traceback.format_exc()[-4000:]
        report["problems"].append(f"{name} raised {type(error).__name__}: {error}".splitlines()[0][:300])
    finally:
        report.save()


def kernel_profile(fn, cuda: bool, repeats: int = 1) -> list[tuple[float, float, str]]:
    """(self time in us, calls, name) of each kernel (CUDA) or operator (CPU) that `fn()` runs, divided by `repeats`,
    largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync_time()
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [(getattr(e, field, 0) or 0, e.count, e.key[:90]) for e in prof.key_averages()]
    return sorted(((t / repeats, n / repeats, k) for t, n, k in rows if t > 0), reverse=True)


def generate_throughput(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """TRL's default generation path: `generate(do_sample=True)` at temperature 1 through the (PEFT) model on
    same-length prompts, exactly `new_tokens` each, after a short warm-up; tokens/s of the timed call."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=1, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]), max_new_tokens=4, **kwargs)
        start = sync_time()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kwargs)  # fmt: skip
        seconds = sync_time() - start
    tokens = (out.shape[1] - ids.shape[1]) * len(prompts)
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "tokens": tokens, "new_tokens": new_tokens}


def continuous_batching_throughput(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """transformers' continuous batching (`generate_batch`, TRL's use_transformers_continuous_batching) at
    temperature 1 through the (PEFT) model, after a short warm-up; tokens/s of the timed call."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=None, pad_token_id=1)  # fmt: skip
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:4], generation_config=config, max_new_tokens=8)
        start = sync_time()
        out = model.generate_batch(inputs=prompts, generation_config=config)
        seconds = sync_time() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "tokens": tokens, "new_tokens": new_tokens}


def greedy_agreement(model, prompts: list[list[int]], completions: list[list[int]], new_tokens: int) -> dict:
    """`completions` (greedy, from another generator) against `model.generate` greedy on the same prompts, left-padded
    with id 1: the matching prefix of each row, the rows identical over `new_tokens` and the share of equal tokens."""
    import torch

    length = max(map(len, prompts))
    ids = torch.tensor([[1] * (length - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=1, eos_token_id=None)[:, length:].tolist()  # fmt: skip
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                for a, b in zip(completions, ref, strict=True)]  # fmt: skip
    same = sum(x == y for a, b in zip(completions, ref, strict=True) for x, y in zip(a, b, strict=False))
    return {"identical_rows": sum(p == new_tokens for p in prefixes), "rows": len(prompts), "matching_prefix": prefixes,
            "token_match_fraction": round(same / (len(prompts) * new_tokens), 4), "new_tokens": new_tokens}  # fmt: skip
