"""Device time of the decode step's LoRA shrinks at W1's shapes, atomic (fp32) against the deterministic mode's three
ways (fixed point, `kernels.common.fixed_add`; per-split slots added in split order; at most two K splits added by
fp32 atomics), each forced at every row count, for several numbers of K splits and tiles, and of the gate/up launch
with and without
down's (fp32) shrink in its epilogue, to set beside down's separate shrink. CUDA-graph replays
(`triton.testing.do_bench_cudagraph`), random bf16 weights and fp32 adapters (peft's default), LoRA r=64. Report only:
it says how many splits each mode should aim for and where down's deterministic shrink should run.

    python bench/shrink_splits.py $OUT/shrink_splits.json [--rows 64 256] [--targets 512 256 128 64 32 16]
                                  [--tiles 16x16 32x16 16x32 64x32]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import common  # noqa: E402 - bench/common.py

HIDDEN, INTER, RANK = 1536, 8960, 64
SHRINKS = {"qkv": (3, HIDDEN), "o": (1, HIDDEN), "gate_up": (2, HIDDEN), "down": (1, INTER)}


def timed_us(fn) -> float:
    return round(1000 * common.graph_ms(fn), 2)


def rand(g, *shape, dtype=torch.bfloat16, std=0.02):
    return (std * torch.randn(*shape, generator=g, device="cuda")).to(dtype)


def shrink_times(rows: int, targets, tiles, g) -> dict:
    """Atomic shrinks for each target; fixed-point and slot ones for each target and largest tile (rows, rank
    columns); pairs (two K splits, fp32 atomics) for each tile, forced at every width."""
    from slimrl.rollout.kernels import lora

    knobs = ("TARGET_PROGRAMS", "TARGET_PROGRAMS_FIXED", "FIXED_TILE", "PAIR_TILE", "PAIR_MAX_FEATURES", "SLOT_ROWS")
    shipped = {knob: getattr(lora, knob) for knob in knobs}
    cases = [("atomic", None, t) for t in targets] + [(m, tile, t) for m in ("fixed", "slots", "pair") for tile in tiles
                                                      for t in (targets if m != "pair" else targets[:1])]  # fmt: skip
    out = {}
    for name, (group, features) in SHRINKS.items():
        x = rand(g, rows, features, std=1.0)
        lora_as = [rand(g, RANK, features, dtype=torch.float32, std=features**-0.5) for _ in range(group)]
        for mode, tile, target in cases:
            lora.TARGET_PROGRAMS = lora.TARGET_PROGRAMS_FIXED = target
            lora.FIXED_TILE = lora.PAIR_TILE = tile or shipped["FIXED_TILE"]
            lora.PAIR_MAX_FEATURES = 1 << 30 if mode == "pair" else 0
            lora.SLOT_ROWS = (0, 1 << 30) if mode == "slots" else (0, 0)
            ordered = mode != "atomic"
            workspace = torch.zeros(lora.workspace_elements(group, rows, RANK, ordered), device="cuda")
            key = f"{name}.{f'{mode}{tile[0]}x{tile[1]}' if ordered else mode}.target{target}"
            out[key] = timed_us(lambda: lora.shrink_(x, lora_as, workspace, True, ordered))  # noqa: B023
    for knob, value in shipped.items():
        setattr(lora, knob, value)
    return out


def gate_up_times(rows: int, g) -> dict:
    """The gate/up launch with the shipped settings, down's (fp32) shrink in its epilogue or not; the difference is
    to be set beside `shrink_times`' down row."""
    from slimrl.rollout.fused_ops import choices_for
    from slimrl.rollout.kernels import lora, projections

    choices, _ = choices_for(torch.device("cuda"))
    choice = choices["gate_up"][min(b for b in choices["gate_up"] if b >= rows)]
    x = rand(g, rows, HIDDEN, std=1.0)
    weights = (rand(g, INTER, HIDDEN), rand(g, INTER, HIDDEN))
    lora_as = [rand(g, RANK, HIDDEN, dtype=torch.float32, std=HIDDEN**-0.5) for _ in range(2)]
    lora_bs = [rand(g, INTER, RANK, dtype=torch.float32) for _ in range(2)]
    shrunk = lora.shrink_(x, lora_as, None, True, False)
    down_a = rand(g, RANK, INTER, dtype=torch.float32, std=INTER**-0.5)
    act = torch.empty(rows, INTER, dtype=torch.bfloat16, device="cuda")
    scratch = projections.SplitScratch()
    out = {}
    for mode in ("none", "atomic"):
        nxt = None if mode == "none" else (down_a, torch.zeros(rows, RANK, device="cuda"))

        def launch(nxt=nxt):
            projections.project(x, weights, None, None, (shrunk, lora_bs, (2.0, 2.0)), act, True,
                                block_n=choice.block_n, block_k=choice.block_k, num_warps=choice.num_warps,
                                num_stages=choice.num_stages, next_shrink=nxt, block_m=choice.block_m,
                                per_sm=choice.per_sm, split_k=choice.split_k, scratch=scratch)  # fmt: skip

        out[f"gate_up.down_shrink_{mode}"] = timed_us(launch)
    return out


def atomic_instructions() -> dict:
    """The distinct atomic instructions in the PTX of each compiled shrink and gate/up kernel (red or atom, type)."""
    from slimrl.rollout.kernels import lora, projections

    found = {}
    for name, kernel in (("shrink", lora._shrink_kernel), ("proj", projections._proj_kernel)):
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                ptx = compiled.asm.get("ptx", "")
                found.setdefault(name, []).append(sorted(set(re.findall(r"\b(?:red|atom)\.[\w.]+", ptx))))
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=common.default_output("shrink_splits.json"))
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--targets", type=int, nargs="+", default=[512, 256, 128, 64, 32, 16])
    parser.add_argument("--tiles", nargs="+", default=["16x16", "32x16", "16x32", "64x32"],
                        help="the ordered shrinks' largest tiles, ROWSxRANK (pair: at the first target only)")
    args = parser.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    report = {**common.environment(True), "command": sys.argv, "us": {}}
    tiles = [tuple(int(n) for n in tile.split("x")) for tile in args.tiles]
    for rows in args.rows:
        report["us"][f"B{rows}"] = {**shrink_times(rows, args.targets, tiles, g), **gate_up_times(rows, g)}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    report["atomics_ptx"] = atomic_instructions()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["us"], indent=1))
    return report


if __name__ == "__main__":
    main()
