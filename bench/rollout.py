"""W2 (shared/bench/WORKLOAD.md): rollout throughput on W1's model with a live LoRA adapter, beside TRL's paths.

Model: `common.w1_model` (bf16, random weights from seed 0, LoRA r=64 on all linear layers, lora_B ~ N(0, 0.01^2)), or
with --model gemma3-1b / qwen3-moe the same on Gemma-3-1B's or (24 layers of) Qwen3-30B-A3B's shape (bench/models.py;
issue 33). The JSON names the model (`model`: config, parameters, where peft put LoRA) and holds `speedup_vs_hf`, the
engine's tok/s over TRL's generate path per batch. What assumes W1's shape is adapted or skipped with its reason: the
roofline counts a sparse model's expected routed experts and each layer's window; a --variants kernel setting of a
fused kernel group the model's decode step does not run (Gemma: none; MoE: qkv and o only) is skipped; the fused
kernels' launch settings (tuned at W1's shapes) are used as they are (`engine_config.kernel_choices_tuned_for`); the
release-then-reuse check expects no capture only where the fused qkv kernel writes the cache (not Gemma); fp32 is
skipped for the full-size MoE (`MODEL_SKIPS`: it does not fit).
Prompts: 256 random tokens, 256 new tokens at temperature 1.0, no EOS, batch 8, 64, 256. `SECTIONS` (listed below)
run in order, `--skip NAME` leaves one out, the JSON is saved after each. A failed check (fp32 greedy, a rollout's
length, a capture after release, a torch.compile fallback) or a section that raises is a problem (`problems`, `errors`;
exit status 1); nothing is switched off to pass a check. The kernels' checks at W1's shapes are GPU tests
(tests/rollout/kernels/test_w1_shapes.py); their launch settings come from bench/tune_decode.py. --tiny: a 2-layer
model of --model's family, 64-token prompts, 8 new tokens, on the CPU without a GPU (a smoke run; CUDA sections are
skipped).
--variants, each KEY=VALUE[,KEY=VALUE]: pdl (`kernels.common.MODE`; 0 = ordinary launches), attention_splits (an
int), a boolean EngineOptions field, or GROUP[@ROWS].FIELD (a `KernelChoice` field in every decode row bucket, or in
that of ROWS rows). A variant named again (A B A, to see the spread) is reported as "A #2", "A #3", ....
--repeat-prompts G: each timed batch holds batch / G distinct prompts, each G times in a row, as TRL repeats GRPO's
prompts; with `--variants share_prompt_prefill=0` it times the engine without the shared prefill beside it.
--prompt-tokens: the prompts' length (default 256; 64 with --tiny).

    python bench/rollout.py [$OUT/rollout.json] [--batches 8 64 256] [--baseline-tokens 64] [--skip hf cb ...]
                            [--variants pdl=0 deterministic=1 down@64.split_k=1 ...] [--fp32-check] [--tiny]
                            [--repeat-prompts 8 --prompt-tokens 1024 --variants share_prompt_prefill=0]
                            [--model w1|gemma3-1b|qwen3-moe]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # a test loads this file by path
import common  # noqa: E402
import models  # noqa: E402
import torch  # noqa: E402
from common import Report, recorded, sync_time  # noqa: E402

from slimrl.rollout.engine import RolloutEngine  # noqa: E402
from slimrl.rollout.options import EngineOptions  # noqa: E402
from slimrl.rollout.sampling import SamplingParams  # noqa: E402

W2_SAMPLING = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=0)
UNFUSED = dict(fused_decode=False, fused_sampling=False)
# sections a model cannot run at full size, with the reason (reported under `skipped`; --tiny runs them)
MODEL_SKIPS = {"qwen3-moe": {"fp32": "an fp32 copy of the 15.6B-parameter model (62 GB, plus 8 GB of LoRA) and "
                             "generate's working set do not fit an 80 GB GPU"}}  # fmt: skip


@dataclass
class Bench:
    """What the sections share: the options, the report, the model and the engine under test."""

    args: argparse.Namespace
    report: Report
    model: object
    engine: RolloutEngine | None = None

    def prompts(self, batch: int, seed: int = 0, vary: bool = False) -> list[list[int]]:
        repeat = 1 if vary else self.args.repeat_prompts  # (the greedy checks keep their distinct prompts)
        distinct = common.random_prompts(-(-batch // repeat), self.args.prompt_tokens, self.model.config.vocab_size,
                                         seed, vary)  # fmt: skip
        return [p for p in distinct for _ in range(repeat)][:batch]

    def new_engine(self, **flags) -> RolloutEngine:
        return RolloutEngine(self.model, max_batch_size=max(self.args.batches), **flags)


def engine_run(bench: Bench, engine: RolloutEngine, batch: int, runs: int = 3) -> dict:
    """Tokens/s: the median of `runs` timed rollouts after one that compiles and captures (no EOS: full length)."""
    prompts, new = bench.prompts(batch), bench.args.new_tokens
    start = time.perf_counter()
    engine.generate(prompts, W2_SAMPLING, max_new_tokens=new)
    timed, full_collections = [], []
    for _ in range(runs):
        before = gc.get_stats()[-1]["collections"]
        tick = sync_time()
        out = engine.generate(prompts, W2_SAMPLING, max_new_tokens=new)
        timed.append((sync_time() - tick, out))
        full_collections.append(gc.get_stats()[-1]["collections"] - before)
    prefills = [round(o.stats["prefill_s"], 4) for _, o in timed]
    seconds, out = sorted(timed, key=lambda t: t[0])[runs // 2]
    tokens = sum(len(c) for c in out.completion_ids)
    if tokens != batch * new:
        bench.report["problems"].append(f"a rollout of batch {batch} returned {tokens} tokens, not {batch * new}")
    step_ms = 1000 * out.stats["decode_s"] / max(1, out.stats["decode_steps"])
    return {"tok_s": round(tokens / seconds), "s": round(seconds, 3), "runs_s": [round(t, 3) for t, _ in timed],
            "tokens": tokens, "decode_step_ms": round(step_ms, 3), "stats": common.rounded(out.stats),
            # each run's prefill, and the garbage collector's full passes during it (the 8-row prefill's time
            # varies between runs far beyond its compute: docs/benchmarks.md, twentieth session)
            "prefill_runs_s": prefills, "full_gc_runs": full_collections,
            "kv_cache_GiB": round(engine.sessions.held_bytes() / 2**30, 3),
            "first_call_s": round(time.perf_counter() - start, 1)}  # fmt: skip


def time_batches(bench: Bench, engine: RolloutEngine, into: dict, label: str) -> None:
    for batch in bench.args.batches:
        with recorded(bench.report, f"{label}.B{batch}"):
            into[f"B{batch}"] = engine_run(bench, engine, batch)


def time_fresh(bench: Bench, into: dict, label: str, **flags) -> None:  # the engine under test released first
    bench.engine.release(keep_graph=False)
    other = bench.new_engine(**flags)
    time_batches(bench, other, into, label)
    if bench.args.profile_variants and other.device.type == "cuda":
        profile_graphs(bench, other, into, f"{label}.profile")
    other.release(keep_graph=False)


def profile_graphs(bench: Bench, engine: RolloutEngine, into: dict, name: str) -> None:
    """`graph_profile` of the decode step at batch 8, 64 and 256 (those of --batches), into[decode_graph_B*]."""
    for batch in (b for b in (8, 64, 256) if b in bench.args.batches):
        with recorded(bench.report, f"{name}.B{batch}"):
            engine.generate(bench.prompts(batch), W2_SAMPLING, max_new_tokens=8)
            into[f"decode_graph_B{batch}"] = graph_profile(engine)


def graph_profile(engine: RolloutEngine, reps: int = 20) -> dict:
    """The current session's captured decode step: time per replay, and its kernels (a profile of three replays)."""
    session = engine.sessions.current
    if session is None or session.graph is None:
        raise RuntimeError("the engine holds no captured decode graph")
    start = sync_time()
    for _ in range(reps):
        session.graph.replay()
    step_ms = (sync_time() - start) * 1000 / reps
    rows = common.kernel_profile(lambda: [session.graph.replay() for _ in range(3)], cuda=True, repeats=3)
    return {"batch": session.batch, "replay_ms": round(step_ms, 3),
            "profiled_kernels_per_step": round(sum(n for _, n, _ in rows)),
            "profiled_gpu_us_per_step": round(sum(t for t, _, _ in rows)),
            "top": [{"us": round(t, 1), "n": n, "kernel": k} for t, n, k in rows[:30]]}  # fmt: skip


def parse_variant(variant: str, engine: RolloutEngine) -> tuple[dict, int | None]:
    """(engine flags, PDL mode or None) of one --variants entry (see the module docstring)."""
    from slimrl.rollout.fused_ops import choices_for

    flags, pdl, choices = {}, None, None
    for key, value in (item.split("=") for item in variant.split(",") if item):
        if key == "pdl":
            pdl = int(value)
        elif key == "attention_splits":
            flags[key] = int(value)
        elif key in EngineOptions.__dataclass_fields__:  # a flag: deterministic, triton_attention, ...
            flags[key] = bool(int(value))
        else:
            target, field = key.split(".")
            group, _, rows = target.partition("@")
            if choices is None:
                choices = copy.deepcopy(engine.options.kernel_choices or choices_for(engine.device)[0])
            buckets = choices[group]
            picked = [min(b for b in buckets if b >= int(rows))] if rows else [b for b in buckets if b <= 256]
            for bucket in picked:
                kind = type(getattr(buckets[bucket], field))  # an unknown field raises here
                setattr(buckets[bucket], field, kind(int(value)))
            flags["kernel_choices"] = choices
    return flags, pdl


def kernel_groups(engine: RolloutEngine) -> set[str]:
    """The fused decode kernel groups this model's decode step runs when fused_decode is on: none for a recipe other
    than Llama's (Gemma's norm and GeGLU, rollout/model/features.py), only the attention's for sparse layers (the
    experts run moe.py's routed GEMMs), all four for a dense Llama-style model such as W1's."""
    decoder = engine.decoder
    if not decoder.recipe.llama_pieces:
        return set()
    sparse = any(layer.sparse is not None for layer in decoder.layers)
    return {"qkv", "o"} if sparse else {"qkv", "o", "gate_up", "down"}


def step_bytes(bench: Bench, batch: int) -> float:
    """Bytes one decode step of `batch` rows reads at the mean context (prompt + half the new tokens): every weight,
    except that of a sparse model's experts only the expected share its tokens are routed to if each token picks
    top_k of E experts uniformly, 1 - (1 - k/E)^batch; and each layer's K/V up to its sliding window."""
    d, config = bench.engine.describe(), bench.model.config
    context = bench.args.prompt_tokens + bench.args.new_tokens / 2
    kv_token = 2 * d["kv_heads"] * d["head_dim"] * getattr(torch, d["dtype"]).itemsize  # one layer's K and V
    kv = batch * kv_token * sum(context if w is None else min(context, w) for w in bench.engine.decoder.windows)
    weights, experts = common.weight_bytes(bench.model), models.expert_bytes(bench.model)
    if experts:
        weights -= experts * (1 - config.num_experts_per_tok / config.num_experts) ** batch
    return weights + kv


def section_roofline(bench: Bench) -> None:
    bandwidth = common.copy_bandwidth()
    bench.report["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
    bench.report["roofline"] = {f"B{b}": round(b * bandwidth / step_bytes(bench, b)) for b in bench.args.batches}


def section_engine(bench: Bench) -> None:
    from slimrl.rollout.kernels.common import options as launch_options

    engine, runner = bench.engine, bench.engine.runner
    bench.report["engine_config"] = {**engine.describe(), "pdl_mode": launch_options(engine.device)["PDL"],
                                     "fused_kernel_groups": sorted(kernel_groups(engine)),
                                     "kernel_choices_tuned_for": "W1's shapes (bench/tune_decode.py)"}  # fmt: skip
    time_batches(bench, engine, bench.report.setdefault("engine", {}), "engine")
    ops = engine.decoder.recipe_ops(runner.ops)  # the pieces this model's forward runs (Gemma's own norm, GeGLU)
    failed = [getattr(p, "fn", p).__name__ for p in (*ops[:4], runner.choose) if getattr(p, "failed", False)]
    bench.report["engine_compile_failed"] = failed
    if failed:
        bench.report["problems"].append(f"torch.compile failed for {failed}: the engine ran them eagerly")


def section_variants(bench: Bench) -> None:
    from slimrl.rollout.kernels import common as launch

    saved, bench.report["engine_variants"] = launch.MODE, {}
    for variant in bench.args.variants:
        keys = [item.split("=")[0] for item in variant.split(",") if item]
        groups = {key.split(".")[0].partition("@")[0] for key in keys if "." in key}  # GROUP[@ROWS].FIELD entries
        unused = sorted(groups - kernel_groups(bench.engine))
        if unused:  # timing it would time the engine unchanged under the variant's name
            bench.report["skipped"][f"variant {variant}"] = f"this model's decode step runs no fused {unused} kernel"
            continue
        name, repeat = variant, 1
        while name in bench.report["engine_variants"]:  # a repeat (an A/B/A run) keeps the earlier runs' figures
            repeat += 1
            name = f"{variant} #{repeat}"
        with recorded(bench.report, f"variant {name}"):
            flags, pdl = parse_variant(variant, bench.engine)
            launch.MODE = saved if pdl is None else pdl  # read at every launch: the fresh engine captures with it
            try:
                time_fresh(bench, bench.report["engine_variants"].setdefault(name, {}), name, **flags)
            finally:
                launch.MODE = saved


def section_reuse(bench: Bench) -> None:
    """After release() and an in-place edit of every lora_B (as an optimizer step makes), a rollout of the same shape
    replays the kept graph where it reads the cache through its address table (fused_decode, triton_attention)."""
    engine, batch, new = bench.engine, bench.args.batches[0], bench.args.new_tokens
    engine.generate(bench.prompts(batch), W2_SAMPLING, max_new_tokens=new)
    held = engine.sessions.held_bytes()
    engine.release()
    freed = held - engine.sessions.held_bytes()
    with torch.no_grad():
        for p in (p for name, p in bench.model.named_parameters() if "lora_B" in name):
            p.mul_(1.01)
    start = sync_time()
    out = engine.generate(bench.prompts(batch), W2_SAMPLING, max_new_tokens=new)
    captures = out.stats.get("captures", 0)
    bench.report["release_then_reuse"] = {"batch": batch, "freed_GiB": round(freed / 2**30, 3), "captures": captures,
                                          "capture_s": round(out.stats["capture_s"], 4),
                                          "s": round(sync_time() - start, 3)}  # fmt: skip
    o = engine.options
    # the graph outlives the cache only where the fused qkv kernel writes K/V through the address table (not Gemma)
    kept = bool(o.cuda_graphs and o.fused_decode and o.triton_attention and "qkv" in kernel_groups(engine))
    bench.report["release_then_reuse"]["graph_kept_by_design"] = kept
    if kept and captures:
        bench.report["problems"].append(f"the rollout after release() captured {captures} graph(s), not 0")


def section_prefill(bench: Bench) -> None:
    """Kernels of one prefill of the largest batch (a rollout of one new token), by device time."""
    engine, batch, cuda = bench.engine, max(bench.args.batches), bench.engine.device.type == "cuda"
    prompts = bench.prompts(batch)
    engine.generate(prompts, W2_SAMPLING, max_new_tokens=1)
    start = sync_time()
    rows = common.kernel_profile(lambda: engine.generate(prompts, W2_SAMPLING, max_new_tokens=1), cuda)
    top = [{"ms": round(t / 1000, 2), "n": n, "kernel": k} for t, n, k in rows[:25]]
    bench.report["prefill_profile"] = {"batch": batch, "wall_s_profiled": round(sync_time() - start, 3),
                                       "gpu_ms": round(sum(t for t, _, _ in rows) / 1000, 1), "top": top}  # fmt: skip


def section_greedy(bench: Bench, fp32: bool = False) -> None:
    """Engine greedy vs `generate` greedy, 64 tokens, 8 left-padded prompts of different lengths. bf16: reported (a
    random model's near-ties flip with the order of roundings). fp32, TF32 off: the same math: every row identical,
    checked with the default kernels and with the deterministic ones (the trainers' default)."""
    model, tf32 = bench.model, torch.backends.cuda.matmul.allow_tf32
    prompts = bench.prompts(8, seed=1, vary=True)
    runs = {"greedy_fp32": {}, "greedy_fp32_deterministic": {"deterministic": True}} if fp32 else {"greedy_bf16": {}}
    try:
        if fp32:
            bench.engine.release(keep_graph=False)
            torch.backends.cuda.matmul.allow_tf32 = False
            model = bench.model.float()
        for key, how in runs.items():
            engine = bench.new_engine(**how) if fp32 else bench.engine
            out = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=64)
            bench.report[key] = result = common.greedy_agreement(model, prompts, out.completion_ids, 64)
            if fp32:
                engine.release(keep_graph=False)
                if result["identical_rows"] != result["rows"]:
                    bench.report["problems"].append(f"{key}: differs from generate: prefixes "
                                                    f"{result['matching_prefix']}")  # fmt: skip
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def section_profile(bench: Bench) -> None:
    profile_graphs(bench, bench.engine, bench.report, "profile")


def baseline(name: str, run):  # a section timing `run(model, prompts, new tokens)` at every batch
    def section(bench: Bench) -> None:
        bench.engine.release(keep_graph=False)
        results = bench.report.setdefault(name, {})
        for batch in bench.args.batches:
            with recorded(bench.report, f"{name}.B{batch}"):
                results[f"B{batch}"] = run(bench.model, bench.prompts(batch), bench.args.baseline_tokens)

    return section


SECTIONS = (  # (name for --skip, what it runs, whether it needs CUDA, what it reports), in the order they run
    ("roofline", section_roofline, True, "batch / ((weight + KV bytes read per step) / measured copy bandwidth)"),
    ("engine", section_engine, False, "tok/s of the engine as the device resolves it (`engine.B64.tok_s`, ...)"),
    ("variants", section_variants, False, "the same per --variants entry, each in a fresh engine"),
    ("reuse", section_reuse, False, "release(), lora_B edited in place, the same rollout: 0 captures"),
    ("prefill", section_prefill, False, "kernels of one prefill of the largest batch, by device time"),
    ("unfused", lambda b: time_fresh(b, b.report.setdefault("engine_unfused", {}), "unfused", **UNFUSED), False,
     "tok/s of a fresh engine with fused_decode=False, fused_sampling=False"),
    ("greedy", section_greedy, False, "engine greedy vs generate greedy in bf16 (reported, not checked)"),
    ("profile", section_profile, True, "kernels of one captured decode step at batch 8, 64 and 256"),
    ("hf", baseline("hf", common.generate_throughput), False, "TRL's default path: generate via the PEFT model"),
    ("cb", baseline("cb", common.continuous_batching_throughput), False, "transformers' continuous batching"),
    ("fp32", lambda b: section_greedy(b, fp32=True), False, "with --fp32-check: fp32 greedy, checked against generate"),
)


def speedups(report: Report) -> dict:
    """The engine's tok/s over TRL's generate path (section hf), per batch timed by both."""
    engine, hf = report.get("engine", {}), report.get("hf", {})
    return {b: round(engine[b]["tok_s"] / hf[b]["tok_s"], 1) for b in engine if hf.get(b, {}).get("tok_s")}


def parse_args(argv) -> argparse.Namespace:
    epilog = "sections, in order:\n" + "\n".join(f"  {name:9} {what}" for name, _, _, what in SECTIONS)
    parser = argparse.ArgumentParser(description=__doc__, epilog=epilog, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("out", nargs="?", default=common.default_output("rollout.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--baseline-tokens", type=int, default=64)
    parser.add_argument("--skip", nargs="*", default=[], choices=[*(s[0] for s in SECTIONS), "ungrouped"])  # (gone)
    parser.add_argument("--fp32-check", action="store_true", help="also compare greedy output in fp32 (slow)")
    parser.add_argument("--variants", nargs="*", default=["pdl=0"], help="engine settings to time (see above)")
    parser.add_argument("--profile-variants", action="store_true",
                        help="also profile each variant's decode step at batch 8, 64 and 256 (as section profile)")
    parser.add_argument("--model", choices=common.MODELS, default="w1", help="W1's (default) or another shape")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family: a CPU smoke run")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 256; 64 with --tiny)")
    parser.add_argument("--repeat-prompts", type=int, default=1, help="G: each prompt G times in a row, as GRPO's")
    args = parser.parse_args(argv)
    if args.repeat_prompts < 1:
        parser.error("--repeat-prompts must be at least 1")
    tokens, args.new_tokens = (64, 8) if args.tiny else (256, 256)
    args.prompt_tokens = args.prompt_tokens or tokens
    return args


def main(argv=None) -> Report:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.tiny):
        raise SystemExit("W2 needs a CUDA device (--tiny runs a CPU smoke test).")
    report = Report(args.out, workload="W2", **common.environment(cuda), prompt_tokens=args.prompt_tokens,
                    command=shlex.join(["bench/rollout.py", *(sys.argv[1:] if argv is None else argv)]),
                    repeat_prompts=args.repeat_prompts, new_tokens=args.new_tokens,
                    sampling="temperature 1.0, top_k 0, top_p 1.0, no EOS", skipped={},
                    baseline_note=f"hf, cb: {args.baseline_tokens} new tokens per sequence (host overhead dominates "
                    "their step: tok/s changes little with length)")  # fmt: skip
    model = common.model_for(args.model, tiny=args.tiny, device="cuda" if cuda else "cpu", lora_b_std=0.01).eval()
    report["model"] = models.describe(args.model, model)
    report["weight_GiB"] = round(common.weight_bytes(model) / 2**30, 3)
    bench = Bench(args, report, model)
    with recorded(report, "engine construction"):
        bench.engine = bench.new_engine()
    skip = {**({} if args.tiny else MODEL_SKIPS.get(args.model, {})), **{name: "--skip" for name in args.skip},
            **({} if args.fp32_check else {"fp32": "no --fp32-check"})}  # fmt: skip
    for name, run, needs_cuda, _ in SECTIONS if bench.engine is not None else ():
        if name in skip or (needs_cuda and not cuda):
            report["skipped"][name] = skip.get(name, "needs CUDA")
            continue
        with recorded(report, name):
            run(bench)
    report["speedup_vs_hf"] = speedups(report)
    report.save()
    shown = ("engine", "engine_variants", "speedup_vs_hf", "problems")
    print(json.dumps({k: report.get(k) for k in shown}), flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main().exit_status())
