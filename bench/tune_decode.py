"""Tune the fused decode kernels' launch settings (`fused_ops.KernelChoice`) at W1's shapes, one launch at a time.

For each projection group (qkv, o, gate_up, down) and decode row count (8, 64, 256: row buckets 16, 64, 256) every
candidate of TUNE_CANDIDATES runs on one layer's worth of random projections shaped as W1's (bf16 weights, q/k/v
biases as Qwen2's, fp32 LoRA r=64 as peft gives it, TF32 adapters as the engine runs them). Its output is first
compared with the unfused reference (`model.reference`: the projections with peft's LoRA math, RoPE, the cache's own
column write): a candidate whose largest error exceeds TOLERANCE of the largest reference magnitude is WRONG and
cannot be chosen (one that fails to compile or run is ERR). Checked candidates are timed as CUDA-graph replays
(`triton.testing.do_bench_cudagraph`), keeping the current setting's `shrink_k`, over --layers copies of the layer
with weights of their own (W1's 28 by default), one launch after another as in a decode step: each copy's weights then
stream from HBM, as they do in a step. One layer replayed alone keeps its weights in L2 (q/k/v's 6 MB, o's 5 MB),
where a deeper pipeline shows no gain and the per-launch times rank settings differently from the step. On the fastest
tiles of each group and row bucket, each of SHRINK_CANDIDATES (how the launch gets its LoRA shrink: its own producers
over that many K columns each, or an ordered `shrink_` launch before it) is checked and timed on the deterministic
path, the trainers' default. The fastest replaces that entry of the GPU's current settings (`fused_ops.choices_for`),
the whole set is checked again at every row count, on both paths, and only then written with `fused_ops.save_choices`
to --choices (default `fused_ops.tuned_path(<GPU name>)`, the file the engine loads at run time; on the GPU machine
pass a path under $OUT to get it back). The JSON holds every timing and the chosen set.

The decode attention kernel's (block_s, num_warps, splits) candidates are checked against SDPA and timed the same
way with 3/4 of the cache's columns live, for caches of --attention-columns (W2's 512, and W3's 1,024 new tokens past
a prompt); the engine's attention launch settings are not in the tuned file (see `runner.Runner._attention_kernel`:
`attention.launch_tiles` and `attention.context_splits`, whose choice is reported beside them), so these are
reported only.

A launch timed alone is not a decode step: with PDL a step can rank settings differently (on the H100 the tuner's
64-row picks made the step slower). --confirm-in-step N therefore times, for each tuned row count, the decode step of
W1's model (live LoRA, the deterministic engine the trainers run, W2's 256-token prompts and 256 new tokens) in fresh
engines, N times with the current settings and N times with that bucket's new entries, alternating; the new entries
are written only where the slowest of their runs beats the fastest current one. When they do not and more than one
group changed, each changed group's new entry is timed alone the same way (N against N again), and of those that
pass the one with the fastest slowest run is kept; else the bucket keeps its current settings (`in_step` in the
JSON holds every run, `kept_groups` what was written). `bench/rollout.py --variants GROUP@ROWS.FIELD=VALUE` times single
settings the same way.

    python bench/tune_decode.py [$OUT/tune_decode.json] [--groups qkv o gate_up down attention] [--rows 8 64 256]
                                [--attention-columns 512 1536] [--layers 28] [--choices PATH] [--confirm-in-step 2]
                                [--tiny]

--tiny: a small layer (hidden 96, 4 heads of 32, 2 kv heads, intermediate 80, LoRA r=8) on the CPU in Triton's
interpreter (set TRITON_INTERPRET=1): the candidates' checks and the choosing run, the times are one wall-clock call
each and mean nothing, and nothing is written unless --choices is given; the step confirmation runs the 2-layer W1
family model with 64-token prompts and 8 new tokens. Exit status 1 when a chosen set fails its
check, a group and row count has no correct candidate, or something raised.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    W1_LORA_RANK,
    W1_SHAPE,
    Report,
    default_output,
    environment,
    model_for,
    random_prompts,
    recorded,
)

GROUPS = ("qkv", "o", "gate_up", "down")
# (gemm, block_n, block_k, warps, stages[, block_m, per_sm, split_k]); for qkv block_n = columns per RoPE half.
# block_m 0 = up to 64 rows by the row count; per_sm > 0 spreads the columns over that many programs per SM.
TUNE_CANDIDATES = {
    "qkv": [(True, 16, 128, 4, 3), (True, 32, 128, 4, 3), (True, 16, 128, 4, 5), (True, 32, 128, 4, 5),
            (True, 16, 256, 4, 4), (True, 32, 256, 4, 4), (True, 16, 128, 4, 3, 0, 0, 2),
            (True, 16, 128, 4, 3, 0, 0, 3), (True, 16, 128, 4, 3, 0, 0, 4), (True, 32, 128, 4, 3, 0, 0, 2),
            (True, 32, 128, 4, 3, 0, 0, 4), (True, 16, 64, 4, 4, 0, 0, 4), (True, 32, 64, 4, 4, 0, 0, 3)],
    "o": [(True, 16, 128, 4, 4), (True, 64, 128, 4, 3), (True, 16, 128, 4, 5), (True, 32, 128, 4, 5),
          (True, 16, 128, 4, 4, 0, 0, 2), (True, 16, 128, 4, 4, 0, 0, 3),
          (True, 16, 128, 4, 4, 0, 0, 4), (True, 32, 128, 4, 3, 0, 0, 2), (True, 32, 128, 4, 3, 0, 0, 4),
          (True, 64, 128, 4, 3, 0, 0, 2), (True, 64, 128, 4, 3, 0, 0, 4), (True, 16, 64, 4, 4, 0, 0, 4)],
    "gate_up": [(True, 64, 64, 4, 4), (True, 64, 64, 4, 3), (True, 64, 64, 4, 3, 0, 2), (False, 128, 64, 4, 3),
                (True, 32, 128, 4, 3), (True, 64, 128, 4, 3),
                (False, 64, 64, 4, 3),
                (True, 64, 64, 4, 4, 0, 0, 2), (True, 64, 64, 4, 4, 0, 0, 3), (True, 32, 64, 4, 4, 0, 0, 2),
                (True, 32, 128, 4, 3, 0, 0, 2), (True, 64, 128, 4, 3, 0, 0, 2), (True, 128, 64, 8, 3, 0, 0, 2),
                (True, 128, 64, 8, 3, 0, 0, 4), (True, 64, 64, 8, 3, 0, 0, 2)],
    "down": [(False, 64, 64, 4, 3), (False, 32, 64, 4, 3), (True, 32, 128, 4, 4, 0, 0, 2),
             (True, 16, 128, 4, 4, 0, 0, 4), (True, 16, 128, 4, 4, 0, 0, 8), (True, 32, 128, 4, 3, 0, 0, 4),
             (True, 32, 128, 4, 3, 0, 0, 8),
             (True, 64, 128, 4, 3, 0, 0, 8), (True, 32, 64, 4, 4, 0, 0, 8), (True, 64, 64, 4, 4, 0, 0, 4),
             (True, 64, 128, 4, 3, 0, 0, 4), (True, 32, 128, 4, 4, 0, 0, 4)],
}  # fmt: skip
# K columns per producer of a launch's own LoRA shrink (`KernelChoice.shrink_k`; 0: an ordered `shrink_` launch before
# it), tried on each group's fastest tiles, timed on the deterministic path (the trainers' default)
SHRINK_CANDIDATES = (0, 128, 256, 512)
# (block_s, num_warps, splits: programs sharing a row's columns)
ATTENTION_CANDIDATES = [(64, 4, 1), (128, 4, 1), (128, 8, 1), (32, 4, 1), *((128, 8, n) for n in (2, 3, 4, 8, 12, 16)),
                        *((64, 4, n) for n in (2, 4, 8, 16, 24))]  # fmt: skip
# largest error over the largest reference magnitude, bf16 outputs with TF32 adapters (measured on the H100: 0.6%)
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Layer:
    """The shapes of one decoder layer's decode step."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rank: int
    cache_len: int = 512


W1_LAYER = Layer(W1_SHAPE["hidden_size"], W1_SHAPE["num_attention_heads"], W1_SHAPE["num_key_value_heads"],
                 W1_SHAPE["hidden_size"] // W1_SHAPE["num_attention_heads"], W1_SHAPE["intermediate_size"],
                 W1_LORA_RANK)  # fmt: skip
TINY_LAYER = Layer(hidden=96, heads=4, kv_heads=2, head_dim=32, intermediate=80, rank=8, cache_len=24)


def layer_case(layer: Layer, rows: int, device, replica: int = 0) -> dict:
    """Random projections of one layer (bf16 weights, q/k/v biases, fp32 LoRA with non-zero B, scale 1) and the inputs
    of a decode step of `rows` rows; the same for the same (layer, rows, replica)."""
    from slimrl.rollout.model.views import LinearSpec

    g = torch.Generator(device=device).manual_seed(rows + 1000 * replica)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device) * std

    def spec(out_features, in_features, bias=False):
        weight = randn(out_features, in_features, std=in_features**-0.5).bfloat16()
        lora = (randn(layer.rank, in_features, std=in_features**-0.5), randn(out_features, layer.rank, std=0.05), 1.0)
        return LinearSpec(None, weight, randn(out_features, std=0.1).bfloat16() if bias else None, (lora,))

    width, dim = layer.heads * layer.head_dim, layer.head_dim
    qkv = [spec(n * dim, layer.hidden, bias=True) for n in (layer.heads, layer.kv_heads, layer.kv_heads)]
    gate, up = spec(layer.intermediate, layer.hidden), spec(layer.intermediate, layer.hidden)
    angles = torch.rand(rows, dim // 2, generator=g, device=device) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    return {"rows": rows, "qkv": qkv, "o": spec(layer.hidden, width), "gate_up": (gate, up),
            "down": spec(layer.hidden, layer.intermediate), "h": randn(rows, layer.hidden).bfloat16(),
            "attn": randn(rows, width).bfloat16(), "act": (randn(rows, layer.intermediate) * 0.3).bfloat16(),
            "cos": cos, "sin": sin, "column": torch.tensor([layer.cache_len * 3 // 5], device=device)}  # fmt: skip


def reference(layer: Layer, case: dict) -> dict:
    """Each group's outputs by the unfused path (peft's LoRA math, RoPE, the cache's own column write)."""
    from slimrl.rollout.kv_cache import StaticKVCache
    from slimrl.rollout.model.reference import add_lora_, project, qk_norm_rope, silu_mul

    rows, dim, h = case["rows"], layer.head_dim, case["h"]
    cache = StaticKVCache(1, rows, layer.kv_heads, layer.cache_len, dim, torch.bfloat16, h.device)
    with torch.no_grad():
        query, key, value = project(h, case["qkv"], add_lora_)
        query, key = qk_norm_rope(query.view(rows, layer.heads, dim), key.view(rows, layer.kv_heads, dim), None, None,
                                  case["cos"], case["sin"])  # fmt: skip
        cache.write_column(0, case["column"], key, value.view(rows, layer.kv_heads, dim))
        return {"qkv": (query.reshape(rows, -1), cache.keys[0], cache.values[0]),
                "o": (project(case["attn"], (case["o"],), add_lora_)[0],),
                "gate_up": (silu_mul(*project(h, case["gate_up"], add_lora_)),),
                "down": (project(case["act"], (case["down"],), add_lora_)[0],)}  # fmt: skip


def fused_call(layer: Layer, case: dict, group: str, choices: dict, ordered: bool = False):
    """A callable running `group`'s fused op (with its LoRA shrink) as a decode step does, returning its outputs in
    `reference`'s form; each call starts from a zeroed LoRA workspace. ordered: the deterministic engine's path."""
    from slimrl.rollout.fused_ops import FusedDecode
    from slimrl.rollout.kernels.lora import GroupedLoRA
    from slimrl.rollout.kv_cache import StaticKVCache, StepContext, table_entries

    rows, h = case["rows"], case["h"]
    lora = GroupedLoRA(tf32=True, ordered=ordered)
    ops = FusedDecode(layer.heads, layer.kv_heads, layer.head_dim, lora, tf32=True, ordered=ordered, choices=choices)
    cache = StaticKVCache(1, rows, layer.kv_heads, layer.cache_len, layer.head_dim, torch.bfloat16, h.device)
    anchor = torch.zeros(1, dtype=torch.bfloat16, device=h.device)
    table = torch.tensor(table_entries(cache, anchor), device=h.device)
    ops.bind(StepContext(table, anchor, case["column"], layer.cache_len, ops.new_scratch()))
    run = {"qkv": lambda: ops.qkv(0, h, case["qkv"], None, None, case["cos"], case["sin"]),
           "o": lambda: ops.linear(case["attn"], case["o"], "o"),
           "gate_up": lambda: ops.gate_up(h, *case["gate_up"], case["down"]),  # as the engine: with down's shrink
           "down": lambda: ops.linear(case["act"], case["down"], "down")}[group]  # fmt: skip

    def call():
        lora.begin(rows, 4, layer.rank, h.device)
        out = run()
        if out is None:
            raise RuntimeError(f"the fused {group} op declined the layer (it would run unfused)")
        return (out, cache.keys[0], cache.values[0]) if group == "qkv" else (out,)

    return call


def relative_error(got, want) -> float:
    """Largest |got - want| over the largest |want|, the worst of paired tensors."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
               for a, b in zip(got, want, strict=True))  # fmt: skip


class Chain:
    """Calls one group's fused op on `copies` layers in turn (`time_us` gives the time per layer)."""

    def __init__(self, calls: list):
        self.calls, self.copies = calls, len(calls)

    def __call__(self):
        return [call() for call in self.calls]


def checked_call(layer: Layer, rows: int, group: str, choices: dict, device, ordered: bool = False, copies: int = 1):
    """(relative error against the reference, the callable) of one group's fused op on these settings; with copies >
    1 the callable is a `Chain` over that many layers (the first the checked one, the others with weights of their
    own)."""
    case = layer_case(layer, rows, device)
    call = fused_call(layer, case, group, choices, ordered)
    with torch.no_grad():
        error = relative_error(call(), reference(layer, case)[group])
    if copies > 1:
        call = Chain([call, *(fused_call(layer, layer_case(layer, rows, device, replica), group, choices, ordered)
                              for replica in range(1, copies))])  # fmt: skip
    return error, call


def group_errors(layer: Layer, rows: int, choices: dict, device, groups=GROUPS, ordered=False) -> dict[str, float]:
    """Each group's relative error on `choices` at `rows` rows (the check every setting must pass, < TOLERANCE)."""
    return {group: checked_call(layer, rows, group, choices, device, ordered)[0] for group in groups}


def attention_error(layer: Layer, rows: int, device, block_s: int = 64, num_warps: int = 4, splits: int = 1):
    """(relative error against SDPA with the additive mask, the callable) of decode attention reading the cache
    through its address table, with each row's live columns from a random start to 3/4 of the cache."""
    from slimrl.rollout.kernels.attention import SplitScratch, decode_attention
    from slimrl.rollout.kv_cache import StaticKVCache, table_entries

    g = torch.Generator(device=device).manual_seed(rows)
    q = torch.randn(rows, layer.heads, layer.head_dim, generator=g, device=device).bfloat16()
    cache = StaticKVCache(1, rows, layer.kv_heads, layer.cache_len, layer.head_dim, torch.bfloat16, device)
    keys, values = cache.keys[0].normal_(generator=g), cache.values[0].normal_(generator=g)
    anchor = torch.zeros(1, dtype=torch.bfloat16, device=device)
    table = torch.tensor(table_entries(cache, anchor), device=device)
    starts = torch.randint(0, layer.cache_len // 8, (rows,), generator=g, device=device)
    last, scale = layer.cache_len * 3 // 4 - 1, layer.head_dim**-0.5
    end = torch.tensor([last], device=device)
    columns = torch.arange(layer.cache_len, device=device)
    live = (columns[None] >= starts[:, None]) & (columns[None] <= last)
    mask = torch.zeros(live.shape, device=device).masked_fill_(~live, float("-inf")).bfloat16()[:, None, None]
    k, v = (t.repeat_interleave(layer.heads // layer.kv_heads, 1) for t in (keys, values))
    want = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale)[:, :, 0]

    scratch = SplitScratch()

    def call():
        return decode_attention(q, keys, values, starts, end, scale, 0, table, anchor, block_s, num_warps,
                                splits=splits, scratch=scratch)  # fmt: skip

    return relative_error((call(),), (want,)), call


def time_us(call) -> float:
    """Microseconds per call (per layer of a `Chain`): CUDA-graph replays on a GPU; one wall-clock call elsewhere (the
    interpreter)."""
    copies = getattr(call, "copies", 1)
    if torch.cuda.is_available():
        from triton.testing import do_bench_cudagraph

        with torch.no_grad():
            return round(1000 * do_bench_cudagraph(call, rep=30) / copies, 2)
    start = time.perf_counter()
    call()
    return round(1e6 * (time.perf_counter() - start) / copies, 2)


def measure(report: dict, key: str, check) -> float | None:
    """Check, then time, one candidate (`check()` gives its error and callable): its time, or None when it is wrong
    or fails (recorded as WRONG / ERR under `key`)."""
    try:
        error, call = check()
        report[key] = time_us(call)
        if not error < TOLERANCE:  # a wrong kernel is no candidate, however fast (NaN is wrong too)
            report[key] = f"WRONG relative error {error:.3g} ({report[key]} us)"
    except Exception as err:  # noqa: BLE001 - a setting that does not compile or run is reported, not chosen
        report[key] = f"ERR {type(err).__name__}: {str(err)[:160]}"
    print(key, report[key], flush=True)
    return report[key] if isinstance(report[key], float) else None


def candidate(settings: tuple):
    """The KernelChoice of a TUNE_CANDIDATES entry (fields past its length at their defaults)."""
    from slimrl.rollout.fused_ops import KernelChoice

    return KernelChoice(*settings, *dataclasses.astuple(KernelChoice())[len(settings) :])


def candidate_key(group: str, rows: int, c) -> str:
    return (f"{group}_B{rows}_{'gemm' if c.gemm else 'cublas'}_n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}"
            f"_m{c.block_m}_p{c.per_sm}_x{c.split_k}")  # fmt: skip


def keep_fastest(fastest: dict, key, took: float | None, value) -> None:
    """fastest[key] = (took, value) when took (None: the candidate failed its check) beats what it holds."""
    if took is not None and took < fastest.get(key, (float("inf"),))[0]:
        fastest[key] = (took, value)


def timed_choice(layer: Layer, rows: int, group: str, choice, current: dict, device, timings: dict, key: str,
                 ordered: bool = False, copies: int = 1) -> float | None:
    """`measure` of `group` on `choice` (in every row bucket), the other groups on `current`, timed over `copies`
    layers."""
    from slimrl.rollout.fused_ops import ROW_BUCKETS

    choices = copy.deepcopy(current)
    choices[group] = {b: choice for b in ROW_BUCKETS}
    return measure(timings, key, lambda: checked_call(layer, rows, group, choices, device, ordered, copies))


def tune_groups(layer: Layer, groups, row_counts, current: dict, device, timings: dict, copies: int = 1) -> dict:
    """{(group, row bucket): (us, KernelChoice)} of the fastest checked candidate; every candidate into `timings`.
    Candidates keep the current setting's shrink_k (`tune_shrinks` tunes it)."""
    from slimrl.rollout.fused_ops import ROW_BUCKETS

    best = {}
    for rows in row_counts:
        bucket = min(b for b in ROW_BUCKETS if b >= rows)
        for group in (g for g in GROUPS if g in groups):
            for settings in TUNE_CANDIDATES[group]:
                choice = dataclasses.replace(candidate(settings), shrink_k=current[group][bucket].shrink_k)
                took = timed_choice(layer, rows, group, choice, current, device, timings,
                                    candidate_key(group, rows, choice), copies=copies)  # fmt: skip
                keep_fastest(best, (group, bucket), took, choice)
    return best


def tune_shrinks(layer: Layer, row_counts, best: dict, current: dict, device, timings: dict, copies: int = 1) -> dict:
    """`best` with each (group, bucket)'s shrink setting replaced by the fastest of SHRINK_CANDIDATES on its chosen
    tiles, checked and timed on the deterministic path; every candidate into `timings`."""
    from slimrl.rollout.fused_ops import ROW_BUCKETS

    tuned = {}
    for rows in row_counts:
        bucket = min(b for b in ROW_BUCKETS if b >= rows)
        for group in (g for g in GROUPS if (g, bucket) in best):
            for shrink_k in SHRINK_CANDIDATES:
                choice = dataclasses.replace(best[group, bucket][1], shrink_k=shrink_k)
                took = timed_choice(layer, rows, group, choice, current, device, timings,
                                    f"{candidate_key(group, rows, choice)}_shrink{shrink_k}_ordered", ordered=True,
                                    copies=copies)  # fmt: skip
                keep_fastest(tuned, (group, bucket), took, choice)
    return {**best, **tuned}


def tune_attention(layer: Layer, row_counts, columns, device, timings: dict) -> dict:
    """{B<rows>_c<columns>: the fastest checked (block_s, num_warps, splits), and the engine's choice}; every
    candidate into `timings`."""
    from slimrl.rollout.kernels.attention import context_splits, launch_tiles

    fastest = {}
    for rows, cache_len in ((r, c) for c in columns for r in row_counts):
        shaped = dataclasses.replace(layer, cache_len=cache_len)
        for block_s, warps, splits in ATTENTION_CANDIDATES:
            key = f"attention_B{rows}_c{cache_len}_s{block_s}_w{warps}_x{splits}"
            took = measure(timings, key, lambda a=shaped, r=rows, s=block_s, w=warps, n=splits: attention_error(
                a, r, device, s, w, n))  # fmt: skip
            keep_fastest(fastest, (rows, cache_len), took, {"block_s": block_s, "num_warps": warps, "splits": splits})
    engine = {(r, c): {**launch_tiles(r, torch.bfloat16, layer.head_dim),
                       "splits": context_splits(r, layer.kv_heads, c, device)} for r, c in fastest}  # fmt: skip
    return {f"B{r}_c{c}": {"us": us, **settings, "engine": engine[r, c]} for (r, c), (us, settings) in fastest.items()}


def decode_step_ms(model, rows: int, choices: dict, prompt_tokens: int, new_tokens: int) -> float:
    """ms per decode step of a fresh deterministic engine on `choices`: one rollout that compiles and captures, then
    the faster of two timed ones (no EOS: every rollout runs new_tokens - 1 decode steps)."""
    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.sampling import SamplingParams

    engine = RolloutEngine(model, max_batch_size=rows, deterministic=True, kernel_choices=copy.deepcopy(choices))
    prompts = random_prompts(rows, prompt_tokens, model.config.vocab_size)
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=0)
    engine.generate(prompts, sampling, max_new_tokens=new_tokens)
    fastest = float("inf")
    for _ in range(2):
        stats = engine.generate(prompts, sampling, max_new_tokens=new_tokens).stats
        fastest = min(fastest, 1000 * stats["decode_s"] / max(1, stats["decode_steps"]))
    engine.release(keep_graph=False)
    return fastest


def _alternate(model, rows, runs: int, current: dict, candidate: dict, prompt_tokens: int, new_tokens: int) -> dict:
    """`runs` decode-step timings (ms) of each settings set, current first, alternating."""
    timed = {"current": [], "tuned": []}
    for _ in range(runs):
        for name, choices in (("current", current), ("tuned", candidate)):
            timed[name].append(round(decode_step_ms(model, rows, choices, prompt_tokens, new_tokens), 4))
    return timed


def _with_new(current: dict, chosen: dict, groups, bucket: int) -> dict:
    """`current` with `groups`' entries of `bucket` from `chosen`."""
    candidate = copy.deepcopy(current)
    for group in groups:
        candidate[group][bucket] = chosen[group][bucket]
    return candidate


def _beats(timed: dict) -> bool:
    return max(timed["tuned"]) < min(timed["current"])


def confirm_in_step(report: Report, args, current: dict, chosen: dict, device) -> dict:
    """`current` with each tuned row bucket's entries from `chosen` where the decode step is faster with them, or
    failing that with the one changed group's entry that is (see the module docstring); every run into
    report["in_step"]."""
    from slimrl.rollout.fused_ops import ROW_BUCKETS

    model = model_for("w1", tiny=args.tiny, device=device.type, lora_b_std=0.01).eval()
    prompt_tokens, new_tokens = (64, 8) if args.tiny else (256, 256)  # W2's lengths (bench/rollout.py's, --tiny's)
    confirmed, results, timed = copy.deepcopy(current), report.setdefault("in_step", {}), set()
    for rows in args.rows:
        bucket = min(b for b in ROW_BUCKETS if b >= rows)
        changed = [g for g in GROUPS if chosen[g][bucket] != current[g][bucket]]
        entry = results[f"B{rows}"] = {"bucket": bucket, "changed": changed}
        if not changed or bucket in timed:
            continue  # nothing new here, or this bucket was already timed at another row count
        timed.add(bucket)
        entry["step_ms"] = _alternate(model, rows, args.confirm_in_step, current,
                                      _with_new(current, chosen, changed, bucket), prompt_tokens, new_tokens)
        entry["kept"] = _beats(entry["step_ms"])
        kept = changed if entry["kept"] else []
        if not kept and len(changed) > 1:
            alone = entry["alone"] = {}
            for group in changed:
                alone[group] = _alternate(model, rows, args.confirm_in_step, current,
                                          _with_new(current, chosen, [group], bucket), prompt_tokens, new_tokens)
            passing = [g for g in changed if _beats(alone[g])]
            kept = [min(passing, key=lambda g: max(alone[g]["tuned"]))] if passing else []
        entry["kept_groups"] = kept
        for group in kept:
            confirmed[group][bucket] = chosen[group][bucket]
    return confirmed


def choose(report: Report, layer: Layer, args, current: dict, best: dict, device) -> dict | None:
    """The current settings with each tuned (group, bucket) replaced by its fastest candidate, if the whole set
    passes the check at every tuned row count, on the ordinary and the deterministic path (else None, a problem)."""
    from slimrl.rollout.fused_ops import ROW_BUCKETS

    tuned_groups = [g for g in GROUPS if g in args.groups]
    for rows in args.rows:
        bucket = min(b for b in ROW_BUCKETS if b >= rows)
        missing = [g for g in tuned_groups if (g, bucket) not in best]
        if missing:
            report["problems"].append(f"no correct candidate for {missing} at {rows} rows: kept the current setting")
    chosen = copy.deepcopy(current)
    for (group, bucket), (_, choice) in best.items():
        chosen[group][bucket] = choice
    report["chosen"] = {f"{g}@{b}": dataclasses.asdict(c) for g, bs in chosen.items() for b, c in bs.items()}
    report["chosen_check"] = check = {f"B{rows}{'_ordered' if ordered else ''}": group_errors(  # deterministic too
        layer, rows, chosen, device, ordered=ordered) for rows in args.rows for ordered in (False, True)}  # fmt: skip
    worst = max((e for errors in check.values() for e in errors.values()), default=0.0)
    if not worst < TOLERANCE:
        report["problems"].append(f"the chosen settings fail their check (relative error {worst:.3g}): not written")
        return None
    return chosen


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=default_output("tune_decode.json"))
    parser.add_argument("--groups", nargs="+", default=[*GROUPS, "attention"], choices=[*GROUPS, "attention"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256], help="decode row counts to tune at")
    parser.add_argument("--attention-columns", type=int, nargs="+", default=[512, 1536],
                        help="cache lengths to time the attention at (3/4 of them live)")
    parser.add_argument("--layers", type=int, default=0,
                        help="layers (weights of their own) each candidate is timed over, one launch after another "
                             "(default: W1's 28; 2 with --tiny)")  # fmt: skip
    parser.add_argument("--choices", help="where to write the chosen settings (default: the GPU's tuned file)")
    parser.add_argument("--confirm-in-step", type=int, default=0, metavar="N",
                        help="write a row bucket's new settings only if N decode-step runs with them all beat N "
                             "with the current ones, else at most one changed group's that does alone (0: launch "
                             "timings alone decide)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a small layer, for a CPU run in Triton's interpreter")
    args = parser.parse_args(argv)
    if args.confirm_in_step < 0:
        parser.error("--confirm-in-step takes a number of runs, 0 or more")
    return args


def main(argv=None) -> Report:
    from slimrl.rollout.fused_ops import choices_for, save_choices, tuned_path

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device, layer = torch.device("cuda" if cuda else "cpu"), TINY_LAYER if args.tiny else W1_LAYER
    copies = args.layers or (2 if args.tiny else W1_SHAPE["num_hidden_layers"])
    report = Report(args.out, **environment(cuda), layer=dataclasses.asdict(layer), rows=args.rows,
                    command=shlex.join(["bench/tune_decode.py", *(sys.argv[1:] if argv is None else argv)]),
                    tolerance=TOLERANCE, timed_over_layers=copies, timings_us={})  # fmt: skip
    current, current_path = choices_for(device)
    report["started_from"] = current_path.name
    best, chosen = {}, None
    with recorded(report, "groups"):
        best = tune_groups(layer, args.groups, args.rows, current, device, report["timings_us"], copies)
        best = tune_shrinks(layer, args.rows, best, current, device, report["timings_us"], copies)
    if "attention" in args.groups:
        with recorded(report, "attention"):
            columns = [layer.cache_len] if args.tiny else args.attention_columns
            report["attention_fastest"] = tune_attention(layer, args.rows, columns, device, report["timings_us"])
    report["wrong_candidates"] = [k for k, v in report["timings_us"].items() if str(v).startswith("WRONG")]
    with recorded(report, "choose"):
        chosen = choose(report, layer, args, current, best, device)
    how = "launch by launch"
    if chosen is not None and args.confirm_in_step:
        with recorded(report, "in_step"):
            chosen = confirm_in_step(report, args, current, chosen, device)
            runs = args.confirm_in_step
            how += (f", each row bucket's kept only if {runs} decode-step runs all beat the current's (else its "
                    "one changed group that does, timed alone)")
    path = args.choices or (tuned_path(report["gpu"]) if cuda and not args.tiny else None)
    if best and chosen is not None and path is not None and not report["problems"]:
        save_choices(Path(path), chosen, report["gpu"], written_by="bench/tune_decode.py (the fastest checked "
                     f"candidate per group and row bucket, {how}, rows {args.rows}; started from "
                     f"{current_path.name})", measured=Path(args.out).name)  # fmt: skip
        report["choices_written"] = str(path)
    report.save()
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
