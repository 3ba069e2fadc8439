"""How close the decode step's projection kernel (`kernels.projections.project`, no LoRA, at the shipped launch
settings: its own GEMM, or cuBLAS and its epilogue where those say so) comes to the other ways of writing a skinny
GEMM at W1's shapes (o, gate/up with SwiGLU, down), weights read from memory: cuBLAS (`x @ Wᵀ`), and a plain Triton
kernel over a grid of candidates: column tile, K step, K splits (fp32 atomics), x·Wᵀ or its transpose W·xᵀ (the
batch as the MMA's N), pointer loads or TMA descriptors (`triton.tools.tensor_descriptor`), warps. Each call runs
the GEMM over COPIES distinct weight sets (more than L2 holds), timed as CUDA-graph replays; GB/s counts weight
bytes. A candidate whose output differs from the fp32 reference by more than 2% of its largest magnitude is WRONG.
Report only: it says whether a redesign of the projection kernel can pay, not what the engine runs.

    python bench/skinny_gemm.py $OUT/skinny_gemm.json [--rows 64 8 256]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import common  # noqa: E402 - bench/common.py

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side TMA descriptors: pointer loads only
    TensorDescriptor = None

COPIES = 8
SHAPES = {"o": (1536, 1536, False), "gate_up": (8960, 1536, True), "down": (1536, 8960, False)}  # N, K, pair
# (tma, swap, block_n, block_k, splits, stages, warps)
CANDIDATES = list(itertools.product([False, True], [False, True], [64, 128, 256], [64, 128], [1, 2, 4, 8], [4], [4, 8]))


@triton.jit
def _load_x(x_ptr, x_desc, offs_m, m_ok, k, k0, K, TMA: tl.constexpr):
    if TMA:
        return x_desc.load([0, k0])
    return tl.load(x_ptr + offs_m[:, None] * K + k[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _load_w(w_ptr, w_desc, offs_n, k, k0, pid_n, K, BN: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        return w_desc.load([pid_n * BN, k0])
    return tl.load(w_ptr + offs_n[:, None] * K + k[None, :])


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, w2_ptr, x_desc, w_desc, w2_desc, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, SWAP: tl.constexpr,
                 PAIR: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """y [M, N] = x · Wᵀ (silu(x · Wᵀ) * x · W2ᵀ when PAIR) for one column tile and K split."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    k_per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = tl.program_id(1) * k_per
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = acc
    for k0 in tl.range(k_lo, tl.minimum(K, k_lo + k_per), BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        x = _load_x(x_ptr, x_desc, offs_m, m_ok, k, k0, K, TMA)
        w = _load_w(w_ptr, w_desc, offs_n, k, k0, pid_n, K, BN, TMA)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if PAIR:
            w2 = _load_w(w2_ptr, w2_desc, offs_n, k, k0, pid_n, K, BN, TMA)
            if SWAP:
                acc2 = tl.dot(w2, tl.trans(x), acc2)
            else:
                acc2 = tl.dot(x, tl.trans(w2), acc2)
    if PAIR:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if SWAP:
        ptrs, mask = y_ptr + offs_m[None, :] * N + offs_n[:, None], m_ok[None, :]
    else:
        ptrs, mask = y_ptr + offs_m[:, None] * N + offs_n[None, :], m_ok[:, None]
    if SPLIT == 1:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def candidate_fn(x, ws, w2s, ys, candidate, pair):
    tma, swap, block_n, block_k, split, stages, warps = candidate
    rows, features = x.shape
    width = ws[0].shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    descs = [(None, None, None)] * len(ws)
    if tma:
        xd = TensorDescriptor.from_tensor(x, [block_m, block_k])
        descs = [(xd, *(TensorDescriptor.from_tensor(t, [block_n, block_k]) for t in (w, w2)))
                 for w, w2 in zip(ws, w2s, strict=True)]  # fmt: skip

    def run():
        for i, (w, w2, y) in enumerate(zip(ws, w2s, ys, strict=True)):
            if split > 1:
                y.zero_()
            _gemm_kernel[(width // block_n, split)](
                x, w, w2, *descs[i], y, rows, width, features, BM=block_m, BN=block_n, BK=block_k, SPLIT=split,
                STAGES=stages, SWAP=swap, PAIR=pair, TMA=tma, num_warps=warps)  # fmt: skip

    return run


def fits(candidate, rows, width, features, pair) -> bool:
    tma, swap, block_n, block_k, split, stages, warps = candidate
    block_m = max(16, triton.next_power_of_2(rows))
    if (tma and TensorDescriptor is None) or width % block_n or (swap and block_n < 64) or (pair and split > 1):
        return False  # (silu of a partial sum is not the product's silu: pairs unsplit only)
    if (features // block_k) % split or block_m * block_n * (2 if pair else 1) / (32 * warps) > 128:
        return False
    smem = stages * (block_m * block_k + block_n * block_k * (2 if pair else 1)) * 2
    return smem <= 200_000 and 48 <= (width // block_n) * split <= 2048


def projection_fn(x, ws, w2s, ys, name: str, pair: bool):
    """(a call of `projections.project` over every weight copy as the engine runs it at these rows: the kernel's own
    GEMM, or, where the settings say so, cuBLAS and the kernel's epilogue; those settings)."""
    from slimrl.rollout import fused_ops
    from slimrl.rollout.kernels import projections

    buckets = fused_ops.choices_for(x.device)[0][name]
    choice = buckets[min(b for b in buckets if b >= x.shape[0])]
    scratch = projections.SplitScratch()

    def run():
        for i in range(COPIES):
            weights = [ws[i], w2s[i]] if pair else [ws[i]]
            outputs = None if choice.gemm else [x @ w.t() for w in weights]
            projections.project(x, weights if choice.gemm else None, None, outputs, None, ys[i], pair,
                                block_n=choice.block_n, block_k=choice.block_k, num_warps=choice.num_warps,
                                num_stages=choice.num_stages, block_m=choice.block_m, per_sm=choice.per_sm,
                                split_k=choice.split_k, scratch=scratch)  # fmt: skip

    return run, choice


def measure(rows: int, name: str, g) -> dict:
    width, features, pair = SHAPES[name]
    x = torch.randn(rows, features, device="cuda", generator=g).to(torch.bfloat16)
    ws = [(torch.randn(width, features, device="cuda", generator=g) * features**-0.5).to(torch.bfloat16)
          for _ in range(2 * COPIES if pair else COPIES)]  # fmt: skip
    ws, w2s = (ws[:COPIES], ws[COPIES:]) if pair else (ws, ws)
    weight_bytes = (2 if pair else 1) * width * features * 2
    ref = x.float() @ ws[0].float().t()
    if pair:
        ref = torch.nn.functional.silu(ref) * (x.float() @ w2s[0].float().t())

    def timing(fn, y) -> tuple | str:
        fn()
        torch.cuda.synchronize()
        error = float((y.float() - ref).abs().max() / ref.abs().max())
        if error > 2e-2:
            return f"WRONG {error:.3g}"
        us = 1000 * common.graph_ms(fn, rep=20) / COPIES
        return round(us, 2), round(weight_bytes / us / 1e3)  # (us per launch, GB/s of weights)

    out = {"weight_bytes": weight_bytes}
    ys = [torch.empty(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]

    def cublas():
        for i in range(COPIES):
            torch.matmul(x, ws[i].t(), out=ys[i])
            if pair:
                torch.matmul(x, w2s[i].t())

    if pair:  # cuBLAS has no SwiGLU epilogue: its two GEMMs, timed only
        us = 1000 * common.graph_ms(cublas, rep=20) / COPIES
        out["cublas"] = (round(us, 2), round(weight_bytes / us / 1e3))
    else:
        out["cublas"] = timing(cublas, ys[0])
    ours, choice = projection_fn(x, ws, w2s, ys, name, pair)
    ours()  # (the split-K scratch grows outside the capture)
    out["slimrl"] = timing(ours, ys[0])
    out["slimrl_settings"] = str(choice)
    for candidate in CANDIDATES:
        if not fits(candidate, rows, width, features, pair):
            continue
        tma, swap, block_n, block_k, split, stages, warps = candidate
        key = f"{'tma' if tma else 'ptr'}_{'wx' if swap else 'xw'}_n{block_n}_k{block_k}_x{split}_s{stages}_w{warps}"
        acc = [torch.zeros(rows, width, device="cuda", dtype=torch.float32 if split > 1 else torch.bfloat16)
               for _ in range(COPIES)]  # fmt: skip
        try:
            out[key] = timing(candidate_fn(x, ws, w2s, acc, candidate, pair), acc[0])
        except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            out[key] = f"ERR {type(exc).__name__}: {str(exc)[:120]}"
    timed = sorted((v[0], k) for k, v in out.items() if isinstance(v, tuple) and k not in ("cublas", "slimrl"))
    out["best"] = timed[:5]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=common.default_output("skinny_gemm"))
    parser.add_argument("--rows", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    report = common.Report(args.out, command=" ".join(sys.argv), copies=COPIES, **common.environment(True))
    src, dst = (torch.empty(1 << 28, dtype=torch.uint8, device="cuda") for _ in range(2))
    report["copy_GBps"] = round(2 * src.numel() / common.graph_ms(lambda: dst.copy_(src)) / 1e6)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in args.rows:
        for name in SHAPES:
            with report.recording_failure():
                result = report.setdefault("results", {})[f"{name}@{rows}"] = measure(rows, name, g)
                print(f"{name}@{rows}: cublas {result['cublas']}, slimrl {result['slimrl']}, best {result['best'][:3]}",
                      flush=True)  # fmt: skip
            report.save()
    report.print_outcome()
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
