"""Launch settings of the fused MoE decode kernels (`rollout.kernels.moe.MoELaunch`) at one sparse layer of
Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert intermediate 768; bf16 weights; LoRA in the engine's staged
layout: rank 128 on gate_up, 64 on down): each candidate's output is checked against the grouped reference path
(`model.moe.expert_mix`), then timed as CUDA-graph replays beside the reference, with the bytes it must read (the
routed experts' weights and LoRA factors, once) turned into an effective bandwidth. Report only: the defaults are
changed by hand from what it finds.

    python bench/tune_moe.py $OUT/tune_moe.json [--tokens 64 256] [--ordered 1 0] [--breakdown] [--default-only]

--breakdown adds each launch's device time (a profile of graph replays, PDL off so that no kernel's time includes
its wait for the one before) for the default and the best candidate.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import common  # noqa: E402 - bench/common.py

EXPERTS, TOP_K, HIDDEN, INNER, RANK_GATE_UP, RANK_DOWN = 128, 8, 2048, 768, 128, 64
CANDIDATES = {"block_n": (32, 64, 128), "block_k": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4),
              "block_r": (32, 64, 128)}


def layer(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, std=0.02):
        return (std * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    gate_up, down = rand(EXPERTS, 2 * INNER, HIDDEN), rand(EXPERTS, HIDDEN, INNER)
    gate_up_lora = (rand(EXPERTS, RANK_GATE_UP, HIDDEN), rand(EXPERTS, 2 * INNER, RANK_GATE_UP), 0.5)
    down_lora = (rand(EXPERTS, RANK_DOWN, INNER), rand(EXPERTS, HIDDEN, RANK_DOWN), 1.0)
    return gate_up, down, gate_up_lora, down_lora


def routing(tokens: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
    weights, experts = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return h, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16), experts


def bytes_read(experts: torch.Tensor, tensors) -> int:
    used = experts.unique().numel()
    return sum(t.numel() // EXPERTS * t.element_size() for t in tensors) * used


def measure_case(kernels, moe, spec, tokens: int, ordered: bool, breakdown: bool = False,
                 candidates: dict = CANDIDATES) -> dict:  # fmt: skip
    """The reference's time and every candidate's check and time at `tokens` decode rows."""
    h, weights, experts = routing(tokens)
    gate_up, down = spec.gate_up.weight, spec.down.weight
    (gate_up_lora,), (down_lora,) = spec.gate_up.loras, spec.down.loras
    reference = moe.expert_mix(h, weights, experts, spec)
    nbytes = bytes_read(experts, [gate_up, down, *gate_up_lora[:2], *down_lora[:2]])
    rows = {"reference_ms": round(common.graph_ms(functools.partial(moe.expert_mix, h, weights, experts, spec)), 4),
            "bytes": nbytes, "candidates": []}  # fmt: skip
    for values in itertools.product(*candidates.values()):
        entry = dict(zip(candidates, values, strict=True))
        run = functools.partial(kernels.routed_experts, h, weights, experts, gate_up, down, gate_up_lora, down_lora,
                                ordered, kernels.MoELaunch(**entry))  # fmt: skip
        try:
            out = run()
            entry["rel_error"] = round(((out.float() - reference.float()).abs().max()
                                        / reference.float().abs().max()).item(), 5)  # fmt: skip
            if entry["rel_error"] > 0.02:
                entry["status"] = "WRONG"
            else:
                ms = common.graph_ms(run)
                entry.update(ms=round(ms, 4), GBps=round(nbytes / ms / 1e6, 1))
        except Exception as err:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            entry["status"] = f"ERR {type(err).__name__}: {str(err)[:120]}"
        rows["candidates"].append(entry)
    timed_ok = [c for c in rows["candidates"] if "ms" in c]
    rows["best"] = min(timed_ok, key=lambda c: c["ms"]) if timed_ok else None
    default = kernels.MoELaunch()
    rows["default"] = next((c for c in rows["candidates"] if all(c[k] == getattr(default, k) for k in CANDIDATES)),
                           None)  # fmt: skip
    if breakdown:
        for name in ("default", "best"):
            if rows[name] is not None:
                settings = {k: rows[name][k] for k in CANDIDATES}
                rows[f"{name}_launches"] = launches(functools.partial(
                    kernels.routed_experts, h, weights, experts, gate_up, down, gate_up_lora, down_lora, ordered,
                    kernels.MoELaunch(**settings)))  # fmt: skip
    return rows


def launches(run) -> list[dict]:
    """Device time of each kernel of one `run()` (mean of 10, replayed from a CUDA graph), PDL off."""
    from slimrl.rollout.kernels import common as launch

    saved, launch.MODE = launch.MODE, 0
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        rows = common.kernel_profile(lambda: [graph.replay() for _ in range(10)], cuda=True, repeats=10)
    finally:
        launch.MODE = saved
    return [{"us": round(t, 2), "n": n, "kernel": k} for t, n, k in rows]


def main(argv=None) -> dict:
    from slimrl.rollout.kernels import moe as kernels
    from slimrl.rollout.model import moe

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--ordered", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--breakdown", action="store_true", help="per-launch device times of default and best")
    parser.add_argument("--default-only", action="store_true", help="time MoELaunch's defaults alone")
    args = parser.parse_args(argv)
    gate_up, down, gate_up_lora, down_lora = layer()
    router = torch.zeros(EXPERTS, HIDDEN, dtype=torch.bfloat16, device="cuda")  # (the routing is drawn, not computed)
    spec = moe.SparseSpec(router=router, top_k=TOP_K, normalize=True, round_weights=True,
                          gate_up=moe.ExpertProjection(gate_up, (gate_up_lora,)),
                          down=moe.ExpertProjection(down, (down_lora,)))  # fmt: skip
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": {},
              "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inner": INNER,
                        "ranks": [RANK_GATE_UP, RANK_DOWN]}}  # fmt: skip
    for tokens, ordered in itertools.product(args.tokens, args.ordered):
        with torch.no_grad():
            default = kernels.MoELaunch()
            candidates = {k: (getattr(default, k),) for k in CANDIDATES} if args.default_only else CANDIDATES
            rows = measure_case(kernels, moe, spec, tokens, bool(ordered), args.breakdown, candidates)
        key = f"tokens{tokens}_{'ordered' if ordered else 'atomic'}"
        report["results"][key] = rows
        print(json.dumps({key: {k: rows[k] for k in ("reference_ms", "best", "default")}}), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
