"""Render README.md's figures from the committed benchmark JSON (standard library only).

Each figure block of README.md sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` and is rewritten
from the JSON that docs/bench/figures.json names for it: per source, the file, the fields read, the commit whose code
measured it, the machine and the kernel mode, which the block prints beside its figures. A figure typed into a block
by hand, or a JSON changed without re-rendering, makes `--check` fail (tests/test_readme_figures.py runs it).

    python scripts/readme_figures.py           # rewrite README.md's figure blocks
    python scripts/readme_figures.py --check   # exit 1 and print a diff where README.md differs from the rendering
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
MAPPING = "docs/bench/figures.json"
BLOCK = re.compile(r"<!-- figures:(\w+) -->\n(.*?)<!-- /figures:\1 -->", re.S)
BY_LENGTH = re.compile(r"results\.(\w+?)_L(\d+)(?:\.(\w+))?$")  # W1, W4, W5: results.<side>_L<length>.<metric>


class FiguresError(Exception):
    """The mapping, a JSON file or README.md does not allow a rendering; the message names the fix."""


def expand(pattern: str) -> list[str]:
    """`a.{x,y}.b` -> [`a.x.b`, `a.y.b`], one brace group after another (no nesting)."""
    head, brace, rest = pattern.partition("{")
    if not brace:
        return [pattern]
    choices, _, tail = rest.partition("}")
    return [path for choice in choices.split(",") for path in expand(head + choice + tail)]


class Source:
    """One JSON file as a block's mapping entry names it: its declared fields, and where and how it was measured."""

    def __init__(self, name: str, entry: dict, root: Path, kernel_modes: dict[str, str]):
        if missing := {"json", "commit", "machine", "kernels", "fields"} - set(entry):
            raise FiguresError(f"{MAPPING}: source {name!r} lacks {sorted(missing)}; add them")
        self.name, self.file, self.commit = name, entry["json"], entry["commit"]
        self.machine, self.kernels, self.kernel_modes = entry["machine"], entry["kernels"], kernel_modes
        self.fields = [path for pattern in entry["fields"] for path in expand(pattern)]
        self.used: set[str] = set()
        if not (root / self.file).is_file():
            raise FiguresError(f"{MAPPING}: source {name!r} names {self.file}, which does not exist; fix the path")
        self.data = json.loads((root / self.file).read_text())
        check_source(self)

    def get(self, path: str):
        """The value at a declared dotted path; `*` takes every item of a list (or every value of a dict)."""
        if path not in self.fields:
            raise FiguresError(f"{self.file}: {path!r} is read but not listed in {MAPPING} ({self.name}); add it there")
        self.used.add(path)
        return lookup(self.data, path.split("."), f"{self.file} has no field {path!r}")

    @property
    def label(self) -> str:
        return f"{self.machine}, commit {self.commit}, {self.kernel_modes[self.kernels]}"


def lookup(value, keys: list[str], error: str):
    for i, key in enumerate(keys):
        if key == "*":
            items = value.values() if isinstance(value, dict) else value
            return [lookup(item, keys[i + 1 :], error) for item in items]
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise FiguresError(f"{error}; fix the path in {MAPPING} or re-run the benchmark") from None
    return value


def engine_modes(value):
    """Every `engine.deterministic` the JSON records (bench/scaling.py and grpo_step.py write it per side)."""
    if isinstance(value, dict):
        engine = value.get("engine")
        if isinstance(engine, dict) and isinstance(engine.get("deterministic"), bool):
            yield engine["deterministic"]
        value = list(value.values())
    for item in value if isinstance(value, list) else ():
        yield from engine_modes(item)


def check_source(src: Source) -> None:
    """The mapping's commit, machine and kernel mode, against what the JSON itself records."""
    where = f"{MAPPING}: {src.name} ({src.file})"
    if src.kernels not in src.kernel_modes:
        raise FiguresError(f"{where}: kernels {src.kernels!r} is none of the kernel_modes {sorted(src.kernel_modes)}")
    if not re.fullmatch(r"[0-9a-f]{7,40}", src.commit):
        raise FiguresError(f"{where}: commit {src.commit!r} is not a commit hash; give the short hash")
    ran_on = str(src.data.get("gpu") or src.data.get("device"))  # a GPU's name, or the demo's "cpu" / "cuda"
    if ran_on not in ("None", "cuda") and ran_on.removeprefix("NVIDIA ").lower() not in src.machine.lower():
        raise FiguresError(f"{where}: the JSON ran on {ran_on!r}, the mapping says {src.machine!r}; fix the machine")
    ranks = max(src.data.get("world_size") or 1, src.data.get("processes") or 1)
    if ranks > 1 and not src.machine.startswith(f"{ranks} x "):
        raise FiguresError(f"{where}: the JSON ran {ranks} processes; the machine should start with '{ranks} x '")
    modes = set(engine_modes(src.data))
    if modes and modes != {"deterministic": {True}, "non-deterministic": {False}}.get(src.kernels):
        said = "deterministic" if modes == {True} else "non-deterministic" if modes == {False} else "both modes"
        raise FiguresError(f"{where}: the JSON records {said} engine kernels, the mapping says {src.kernels!r}")


# formatting: every number in a block goes through one of these
def gib(x: float) -> str:
    return f"{x:.2f} GiB"


def pct(x: float) -> str:
    return f"{x:.0%}"


def span(xs: list[float], fmt: Callable[[float], str]) -> str:
    low, high = fmt(min(xs)), fmt(max(xs))
    return low if low == high else f"{low}-{high}"


def listed(xs: Iterable) -> str:
    return ", ".join(str(x) for x in xs)


def provenance(*sources: Source, kernels: bool = True) -> str:
    """A table's line naming its JSON files by machine, commit and kernel mode (unless the table's columns say it)."""
    groups: dict[str, list[str]] = {}
    for src in sources:
        label = src.label if kernels else f"{src.machine}, commit {src.commit}"
        if src.file not in groups.setdefault(label, []):
            groups[label].append(src.file)
    return "_Measured on " + "; ".join(f"{k}: {', '.join(f'`{f}`' for f in v)}" for k, v in groups.items()) + "._"


def meta_cells(*sources: Source) -> str:
    """The machine, commit, kernels and source cells of a table row drawn from these sources."""
    cells = [[s.machine, s.commit, s.kernel_modes[s.kernels], f"`{Path(s.file).name}`"] for s in sources]
    return " | ".join("; ".join(dict.fromkeys(column)) for column in zip(*cells, strict=True))


def by_length(*sources: Source) -> dict[int, dict]:
    """{length: {side: {metric: value} or a value ("OOM"), "sources": [...]}} from `results.<side>_L<length>...`."""
    rows: dict[int, dict] = {}
    for src in sources:
        for path in src.fields:
            if match := BY_LENGTH.match(path):
                side, length, metric = match[1], int(match[2]), match[3]
                row = rows.setdefault(length, {"sources": []})
                if metric:
                    row.setdefault(side, {})[metric] = src.get(path)
                else:
                    row[side] = src.get(path)
                if src not in row["sources"]:
                    row["sources"].append(src)
    return dict(sorted(rows.items()))


def render_demo(b: dict[str, Source]) -> str:
    cpu, gpu, soak = b["cpu"], b["gpu"], b["soak"]
    rewards = cpu.get("history.*.reward")
    cpu_text = (
        f"On a {cpu.machine} ({cpu.get('torch_threads')} torch threads) the default run ({cpu.get('settings.steps')} "
        f"steps, {cpu.get('settings.num_generations')} completions x {cpu.get('settings.prompts_per_step')} prompts, "
        f"LoRA r={cpu.get('settings.lora_rank')}) took {cpu.get('total_seconds'):.0f} s (training "
        f"{cpu.get('train_seconds'):.0f} s: {sum(cpu.get('history.*.generation_s')):.0f} s generating, "
        f"{sum(cpu.get('history.*.training_s')):.0f} s in the loss's forward and backward and the optimizer step). "
        f"It moved held-out accuracy from {pct(cpu.get('accuracy_before.accuracy'))} to "
        f"{pct(cpu.get('accuracy_after.accuracy'))} ({cpu.get('settings.eval_size')} problems, greedy, final answer; "
        f"{pct(cpu.get('accuracy_after.in_format'))} of the replies in the one-line format), with a mean reward of "
        f"{mean(rewards[:5]):.2f} over the first five steps and {mean(rewards[-5:]):.2f} over the last five.")
    runs, soaks = gpu.get("summary.runs"), soak.get("summary.runs")
    improved = gpu.get("summary.improved") + soak.get("summary.improved")
    improved = "all" if improved == runs + soaks else f"{improved} of the"
    gpu_text = (
        f"On an {gpu.machine} (`--device cuda`), {runs} such runs of {gpu.get('settings.steps')} steps (seeds "
        f"{listed(gpu.get('settings.seeds'))}) ran side by side with {soaks} runs of {soak.get('settings.steps')} "
        f"steps on the one GPU, and {improved} {runs + soaks} improved; "
        f"the {runs} demo runs trained in "
        f"{span(gpu.get('runs.*.train_seconds'), '{:.0f}'.format)} s each "
        f"({span(gpu.get('runs.*.wall_s'), '{:.0f}'.format)} s with loading and evaluation) and moved held-out "
        f"accuracy from {span(gpu.get('runs.*.accuracy_before'), pct)} to "
        f"{listed(pct(x) for x in gpu.get('runs.*.accuracy_after'))}.")
    return f"{cpu_text} {gpu_text}\n\n{provenance(cpu, gpu, soak)}"


def w1_cell(side: dict) -> str:
    return f"{gib(side['peak_GiB'])} / {side['s']:.3f}"


TABLE_SOURCES = ("short", "slimrl_long", "slimrl_131072")  # the others feed the notes


def render_w1(b: dict[str, Source]) -> str:
    rows = by_length(*(b[name] for name in TABLE_SOURCES))
    longest = max(length for length, row in rows.items() if "trl" in row)
    short = b["short"]
    lines = [f"| completion length | TRL {short.get('versions.trl')} peak / s per step | Unsloth "
             f"{short.get('unsloth_versions.unsloth')} peak / s per step | slimrl peak / s per step | slimrl's time "
             "/ Unsloth's |", "|---|---|---|---|---|"]  # fmt: skip
    for length, row in rows.items():
        trl = w1_cell(row["trl"]) if "trl" in row else (
            f"not run (~{rows[longest]['trl']['peak_GiB'] * length / longest:.0f} GiB at its linear growth)")
        unsloth = w1_cell(row["unsloth"]) if "unsloth" in row else "not run"
        ratio = f"{row['slimrl']['s'] / row['unsloth']['s']:.2f}" if "unsloth" in row else "-"
        lines.append(f"| {length:,} | {trl} | {unsloth} | {w1_cell(row['slimrl'])} | {ratio} |")
    both = [row for row in rows.values() if "trl" in row]
    differ = {key: max(abs(r["slimrl"][key] / r["trl"][key] - 1) for r in both) for key in ("loss", "grad_norm")}
    lengths = [length for length, row in rows.items() if short in row["sources"]]
    repeats = len(short.get(f"results.slimrl_L{lengths[0]}.s_each"))
    note = (
        f"The same loss as TRL where TRL fits (largest relative difference {differ['loss']:.0e}) and the gradient "
        f"norm within {differ['grad_norm']:.0e} of TRL's (bf16 summed in another order). The rows up to "
        f"{lengths[-1]:,} tokens ran in one run, each side's median of {repeats} timed iterations, slimrl with its "
        f"defaults on CUDA (fast LoRA; the layer passes replayed as CUDA graphs, from 4,096 tokens with the attention "
        f"kept from the forward). {w1_layer_graphs_note(b)} {w1_kept_attention_note(b)} The longer rows are "
        f"from before fast LoRA. {w1_spread_note(short, lengths)} "
        f"{w1_host_note(b)} {w3_training_note(b)}")
    sources = [src for row in rows.values() for src in row["sources"]]
    return "\n".join(lines) + f"\n\n{provenance(*dict.fromkeys(sources))}\n\n{note}"


def w1_layer_graphs_note(b: dict[str, Source]) -> str:
    """The layer passes replayed as CUDA graphs against run eagerly, alternating in one call."""
    src = b["layer_graphs"]

    def runs(graphs: int) -> str:
        names = [f"results.slimrl[auto/8192/1/1/4096/{graphs}]{tag}_L1024." for tag in ("", "#2")]
        return " / ".join(f"{src.get(name + 's'):.3f}" for name in names) + \
            f" s (peak {gib(src.get(names[0] + 'peak_GiB'))})"  # fmt: skip

    return (f"Replaying the layer passes as CUDA graphs (`layer_cuda_graphs`) against running them eagerly at 1,024 "
            f"tokens, median of 5 iterations (the first captures), two runs of each alternating in one call "
            f"({src.label}, `{src.file}`): {runs(1)} against {runs(0)}.")


def w1_kept_attention_note(b: dict[str, Source]) -> str:
    """The attention kept from the forward against recomputed, in one run."""
    src = b["kept_attention"]

    def side(threshold: int, length: int) -> str:
        return f"{src.get(f'results.slimrl[auto/8192/1/1/{threshold}]_L{length}.s'):.3f} s / " \
               f"{gib(src.get(f'results.slimrl[auto/8192/1/1/{threshold}]_L{length}.peak_GiB'))}"  # fmt: skip

    return (f"Keeping the attention (`keep_attention_tokens`) against recomputing it, median of 5 iterations, the "
            f"later of two runs of each in one call ({src.label}, `{src.file}`): {side(1024, 1024)} against "
            f"{side(32768, 1024)} at 1,024 tokens (hence the default of 4,096), {side(1024, 4096)} against "
            f"{side(32768, 4096)} at 4,096, {side(1024, 8192)} against {side(32768, 8192)} at 8,192.")


def w1_spread_note(src: Source, lengths: list[int]) -> str:
    """How much each side's step moved between the timed iterations of the table's run."""

    def spread(side: str, first: int = 0) -> float:
        every = (src.get(f"results.{side}_L{n}.s_each")[first:] for n in lengths)
        return max(max(e) / min(e) - 1 for e in every)

    capture = src.get(f"results.slimrl_L{lengths[0]}.s_each")[0]
    return (f"Between those iterations slimrl's step moved by up to {spread('slimrl', 1):.0%} after the first, which "
            f"captures the layer graphs ({capture:.3f} s at {lengths[0]:,} tokens; TRL's by {spread('trl'):.0%}, "
            f"Unsloth's by {spread('unsloth'):.0%}); between runs on different loans of the same kind of machine it "
            "moves by more, with the host's speed.")


def w1_host_note(b: dict[str, Source]) -> str:
    """Why the short steps spread: the host, measured by a profile and by the same code in two processes."""
    profile, alone, next_call = b["host_profile"], b["host_alone"], b["host_next_call"]
    field = "results.slimrl_L1024."

    def run(src: Source) -> str:
        return f"{src.get(field + 's'):.3f} s (spread {span(src.get(field + 's_each'), lambda x: f'{x:.3f}')})"

    return (f"Run eagerly, the step at 1,024 tokens is host-bound: its kernels take "
            f"{profile.get(field + 'kernel_ms'):.1f} ms of GPU time ({profile.label}, `{profile.file}`), and the same "
            f"code's median was {run(alone)} in one run and {run(next_call)} in another, on a machine of the same "
            f"kind (`{alone.file}`, `{next_call.file}`).")


def w3_training_note(b: dict[str, Source]) -> str:
    after, before = b["w3_after"], b["w3_before"]
    measured = "sides.slimrl.mean_after_first."
    return (f"W3's training phase at N = {after.get('world_size')} "
            f"({after.get('settings.num_generations')} completions of {after.get('settings.completion_length'):,} "
            f"tokens): {after.get(measured + 'training_s'):.3f} s and {gib(after.get(measured + 'peak_GiB'))} "
            f"({after.label}, `{after.file}`), against {before.get(measured + 'training_s'):.3f} s and "
            f"{gib(before.get(measured + 'peak_GiB'))} before it ({before.label}, `{before.file}`).")  # fmt: skip


def w3_shape(src: Source) -> str:
    return (f"{src.get('settings.prompts_per_step')} prompt x {src.get('settings.num_generations')} completions of "
            f"{src.get('settings.completion_length'):,} tokens")  # fmt: skip


def demo_row(src: Source) -> str:
    return (f"| `slimrl demo {' '.join(src.get('settings.demo_args'))}`, seeds {listed(src.get('settings.seeds'))}, "
            f"{src.get('settings.steps')} steps: held-out accuracy | {span(src.get('runs.*.accuracy_before'), pct)} -> "
            f"{span(src.get('runs.*.accuracy_after'), pct)} | - | {meta_cells(src)} |")  # fmt: skip


def distillation_row(src: Source) -> str:
    slimrl_s, trl_s = (src.get(f"sides.{side}.step_median_after_first") for side in ("slimrl_distillation",
                                                                                     "trl_distillation"))  # fmt: skip
    shape = (f"{src.get('settings.prompts_per_step')} prompt x {src.get('settings.completions_per_prompt')} "
             f"completions of {src.get('settings.completion_length'):,} tokens, beta {src.get('settings.beta')}")
    return (f"| On-policy distillation, W3-style step (student W1 + LoRA, teacher W1-shaped; {shape}) | "
            f"{slimrl_s:.2f} s ({trl_s / slimrl_s:.1f}x faster) | {trl_s:.2f} s | {meta_cells(src)} |")


def render_status(b: dict[str, Source]) -> str:
    rloo, dpo, sft = b["rloo"], b["dpo"], b["sft"]
    slimrl_s, trl_s = (rloo.get(f"sides.{side}.mean_after_first.step_s") for side in ("slimrl_rloo", "trl_rloo"))
    lines = [f"| measured | slimrl | TRL {rloo.get('versions.trl')} | machine | commit | kernels | source |",
             "|---|---|---|---|---|---|---|",
             f"| RLOO, W3 step ({w3_shape(rloo)}) | {slimrl_s:.2f} s ({trl_s / slimrl_s:.1f}x faster) | "
             f"{trl_s:.2f} s | {meta_cells(rloo)} |"]  # fmt: skip
    for length, row in by_length(dpo, b["dpo_16384"]).items():
        share = row["slimrl"]["peak_GiB"] / row["trl"]["peak_GiB"]
        lines.append(f"| DPO (W4), {dpo.get('pairs_or_rows')} pairs, chosen and rejected of {length:,} tokens: peak | "
                     f"{gib(row['slimrl']['peak_GiB'])} ({share:.1%} of TRL's) | {gib(row['trl']['peak_GiB'])} | "
                     f"{meta_cells(*row['sources'])} |")  # fmt: skip
    for length, row in by_length(sft).items():
        trl = "out of memory" if row["trl"] == "OOM" else gib(row["trl"]["peak_GiB"])
        lines.append(f"| SFT (W5), {sft.get('pairs_or_rows')} rows of {length:,} tokens: peak | "
                     f"{gib(row['slimrl']['peak_GiB'])} | {trl} | {meta_cells(sft)} |")  # fmt: skip
    lines.append(distillation_row(b["distillation"]))
    lines += [demo_row(b["ppo_demo"]), demo_row(b["rloo_demo"])]
    return "\n".join(lines) + "\n\nSource files are under `docs/bench/`; docs/benchmarks.md gives each one's command."


def scaling_rows(b: dict[str, Source]) -> list[tuple]:
    """W3 under DDP beside one GPU and TRL, the rollout GPU, the demo under DDP: (what, measured, sources)."""
    n1, n2, device = b["n1"], b["n2"], b["rollout_gpu"]
    t1, t2 = (src.get("sides.slimrl.interval_s.mean_after_first") for src in (n1, n2))
    p1, p2 = (src.get("sides.slimrl.mean_after_first.peak_GiB") for src in (n1, n2))
    trl_t, tok1 = n2.get("sides.trl.interval_s.mean_all"), n1.get("sides.slimrl.tokens_per_s.mean_after_first")
    tok = device.get("sides.slimrl_device_async.tokens_per_s.mean_after_first")
    demos = [src for key, src in b.items() if key.startswith("demo_")]
    accuracy = "; ".join(f"seed {d.get('settings.seed')}: {pct(d.get('accuracy_before.accuracy'))} -> "
                         f"{pct(d.get('accuracy_after.accuracy'))}" for d in demos)  # fmt: skip
    same = "every run ends" if all(d.get("ranks_hold_the_same_adapter") for d in demos) else "not every run ends"
    prompts = [src.get("settings.prompts_per_step") for src in (n2, n1, device)]
    return [
        (f"W3 under DDP (`examples/accelerate/ddp.yaml`, an engine per rank, the offloaded checkpoints on): "
         f"{prompts[0]} prompts a step against {prompts[1]} on one GPU",
         f"{t2:.3f} s a step, {t2 / t1:.3f}x the one-GPU step ({t1:.3f} s); {gib(p2)} per GPU, {p2 / p1 - 1:+.1%}",
         (n1, n2)),
        (f"TRL {n2.get('versions.trl')} under DDP in the same run (its one step, warm-up included)",
         f"{trl_t:.2f} s a step: slimrl's step is {trl_t / t2:.0f}x faster", (n2,)),
        (f"the rollout GPU (`generation_device`, the engine in its own process on the second GPU) with "
         f"`async_generation`, {prompts[2]} prompts a step",
         f"{tok:,.0f} completion tokens/s, {tok / tok1:.2f}x one GPU's in-process engine ({tok1:,.0f})", (device, n1)),
        (f"the demo under DDP (`--gradient-checkpointing`), {span([d.get('settings.steps') for d in demos], str)} "
         "steps", f"held-out accuracy {accuracy}; {same} with the same adapter on both ranks", tuple(demos)),
    ]  # fmt: skip


def full_finetuning_rows(b: dict[str, Source]) -> list[tuple]:
    """Full fine-tuning at two GPUs: FSDP2 and ZeRO-3 against DDP (what, measured, sources)."""
    runs = {key.removeprefix("full_"): src for key, src in b.items() if key.startswith("full_")}
    peak = {key: src.get("sides.slimrl_full.peak_GiB") for key, src in runs.items()}
    norms = [runs[key].get("sides.slimrl_full.steps.0.grad_norm") for key in ("ddp_bf16", "fsdp2", "zero3")]
    fsdp2, zero3, fp32 = peak["fsdp2"], peak["zero3"], peak["ddp_fp32"]
    return [
        ("full fine-tuning of W1's model: FSDP2 and ZeRO-3 against DDP, all with fp32 weights and Adam state",
         f"{gib(fsdp2)} and {gib(zero3)} per GPU, {fsdp2 / fp32:.0%} and {zero3 / fp32:.0%} of DDP's {gib(fp32)}; "
         f"step 1's gradient norm within {max(norms) / min(norms) - 1:.2%} of DDP with bf16 weights",
         (runs["fsdp2"], runs["zero3"], runs["ddp_fp32"])),
        ("full fine-tuning under DDP with bf16 weights and Adam state", f"{gib(peak['ddp_bf16'])} per GPU",
         (runs["ddp_bf16"],)),
    ]  # fmt: skip


def render_two_gpus(b: dict[str, Source]) -> str:
    lines = ["| two GPUs | measured | machine | commit | kernels | source |", "|---|---|---|---|---|---|"]
    rows = scaling_rows(b) + full_finetuning_rows(b)
    return "\n".join(lines + [f"| {what} | {result} | {meta_cells(*sources)} |" for what, result, sources in rows])


def render_w2(b: dict[str, Source]) -> str:
    latest, default, det, w3 = b["latest"], b["default_kernels"], b["deterministic_kernels"], b["w3"]
    batches = [int(m[1]) for path in latest.fields if (m := re.fullmatch(r"engine\.B(\d+)\.tok_s", path))]
    lines = ["| batch | TRL default: generate via PEFT (tok/s) | transformers continuous batching (tok/s) | "
             "slimrl engine (tok/s) |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {n} | " + " | ".join(f"{latest.get(f'{k}.B{n}.tok_s'):,}" for k in ("hf", "cb", "engine")) + " |"
              for n in batches]  # fmt: skip
    lines += ["", f"{provenance(latest)} One run and process for every column; TRL's columns generate "
              f"{latest.get('hf.B8.new_tokens')} new tokens a sequence, the engine {latest.get('new_tokens')}.", "",
              "The trainers run the engine with deterministic kernels (`deterministic_rollouts=True`, their default: "
              "the same seed gives the same rollouts); both settings in one run:", "",
              "| batch | non-deterministic kernels (tok/s) | deterministic kernels (tok/s) | change |",
              "|---|---|---|---|"]  # fmt: skip
    det_batches = [int(m[1]) for path in default.fields if (m := re.fullmatch(r"engine\.B(\d+)\.tok_s", path))]
    for n in det_batches:
        fast, ordered = default.get(f"engine.B{n}.tok_s"), det.get(f"engine_variants.deterministic=1.B{n}.tok_s")
        lines.append(f"| {n} | {fast:,} | {ordered:,} | {ordered / fast - 1:+.1%} |")
    lines += ["", provenance(default, det, kernels=False), "",
              f"A full GRPO step (W3: {w3_shape(w3)}), means after each side's first step:", "",
              f"| | TRL {w3.get('versions.trl')} | slimrl | TRL / slimrl |", "|---|---|---|---|"]  # fmt: skip
    for what, key in (("s per step", "step_s"), ("generation s", "generation_s")):
        trl, slimrl = (w3.get(f"sides.{side}.mean_after_first.{key}") for side in ("trl", "slimrl"))
        lines.append(f"| {what} | {trl:.2f} | {slimrl:.2f} | {trl / slimrl:.1f}x |")
    return "\n".join(lines + ["", provenance(w3)])


RENDERERS = dict(demo=render_demo, w1=render_w1, status=render_status, two_gpus=render_two_gpus, w2=render_w2)


def render_blocks(root: Path) -> dict[str, str]:
    """Every block's text, from the mapping and the JSON under `root`; every declared field must be used."""
    mapping = json.loads((root / MAPPING).read_text())
    if set(mapping["blocks"]) != set(RENDERERS):
        raise FiguresError(f"{MAPPING} has blocks {sorted(mapping['blocks'])}, this script renders "
                           f"{sorted(RENDERERS)}; make them the same")  # fmt: skip
    rendered = {}
    for name, entry in mapping["blocks"].items():
        block = {key: Source(key, value, root, mapping["kernel_modes"]) for key, value in entry["sources"].items()}
        rendered[name] = RENDERERS[name](block)
        unused = [f"{src.name}: {path}" for src in block.values() for path in src.fields if path not in src.used]
        if unused:
            raise FiguresError(f"{MAPPING}, block {name!r}, lists fields no figure reads: {unused}; remove them")
    return rendered


def wrap(text: str, width: int = 120) -> str:
    """Prose wrapped at the README's width (table rows kept), no line starting as a list item, heading or quote."""
    out = []
    for line in text.split("\n"):
        if line.startswith("|"):
            out.append(line)
            continue
        rows: list[list[str]] = [[]]
        for word in line.split(" "):
            if rows[-1] and len(" ".join([*rows[-1], word])) > width:
                starts_block = re.match(r"[-+*#>|]|\d+[.)]$", word)
                rows.append([rows[-1].pop(), word] if starts_block and len(rows[-1]) > 1 else [word])
            else:
                rows[-1].append(word)
        out += [" ".join(row) for row in rows]
    return "\n".join(out)


def rewrite(readme: str, blocks: dict[str, str]) -> str:
    """README.md with every figure block's content replaced by its rendering."""
    closed = [m[1] for m in BLOCK.finditer(readme)]
    if readme.count("<!-- figures:") != len(closed) or len(set(closed)) != len(closed):
        raise FiguresError("README.md: a figure block is unclosed or repeated; each `<!-- figures:NAME -->` needs one "
                           "`<!-- /figures:NAME -->` after it")
    if set(closed) != set(blocks):
        raise FiguresError(f"README.md has blocks {sorted(closed)}, {MAPPING} has {sorted(blocks)}; add the "
                           "`<!-- figures:NAME -->` and `<!-- /figures:NAME -->` lines where a block belongs")
    return BLOCK.sub(lambda m: f"<!-- figures:{m[1]} -->\n{wrap(blocks[m[1]])}\n<!-- /figures:{m[1]} -->", readme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if README.md differs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args(argv)
    path = args.root / "README.md"
    current = path.read_text()
    try:
        rendered = rewrite(current, render_blocks(args.root))
    except FiguresError as error:
        print(f"readme_figures: {error}", file=sys.stderr)
        return 2
    if args.check and rendered != current:
        lines = current.splitlines(True), rendered.splitlines(True)
        sys.stdout.writelines(difflib.unified_diff(*lines, "README.md", "README.md rendered from the JSON"))
        print("readme_figures: README.md differs from the JSON's rendering; run it without --check", file=sys.stderr)
        return 1
    if rendered != current:
        path.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
