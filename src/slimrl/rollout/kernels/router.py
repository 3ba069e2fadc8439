"""A sparse block's top-k router (Qwen3-MoE, Mixtral) for the decode step in two launches: the router logits by
`F.linear` (cuBLAS), then one Triton launch for their softmax in fp32, the top k, renormalised and rounded as the
model's router does.

The reference, `model.moe.route`, is six launches (the logits GEMM, softmax, top-k, sum, division, cast); at a decode
step of a few dozen tokens each costs more in launch and latency than its work. The logits are the reference's own
call (the same GEMM on the same operands: the same logits, bit for bit); a GEMM of E = 128 experts by 2,048 inputs
done in one Triton program per 16 tokens (the previous design) read the 512 KiB weight on 4 SMs at Qwen3-30B-A3B's
64 tokens, 14 us a layer on an H100. Here a program owns BM tokens' logits: the softmax over the experts in fp32, then
the k largest probabilities one after the other, largest first (as `torch.topk` returns them; on equal
probabilities the lower expert id, where torch's order is unspecified). Renormalising divides by their fp32 sum;
Qwen3-MoE then rounds the weights to the logits' dtype. Only the softmax's exp and sum may round otherwise than
torch's (a pick can differ only where two probabilities tie to fp32's rounding).
Import this module only where Triton may be used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slimrl.rollout.kernels import runs_here
from slimrl.rollout.kernels.common import enter
from slimrl.rollout.kernels.common import options as launch_options

MAX_EXPERTS = 256  # the program holds a [BM, E_PAD] tile of logits
BLOCK_M = 8


@triton.jit
def _top_k_kernel(logits_ptr, weights_ptr, experts_ptr, N, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  BM: tl.constexpr, E_PAD: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_e = tl.arange(0, E_PAD)
    m_ok = offs_m < N
    e_ok = offs_e < E
    logits = tl.load(logits_ptr + offs_m[:, None] * E + offs_e[None, :], mask=m_ok[:, None] & e_ok[None, :],
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    top = tl.max(logits, axis=1)
    p = tl.exp(logits - top[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    probs = tl.where(e_ok[None, :], probs, -1.0)
    lanes = tl.arange(0, K_PAD)
    picked = tl.zeros((BM, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BM, K_PAD), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        which = tl.min(tl.where(probs == best[:, None], offs_e[None, :], E_PAD), axis=1)
        picked = tl.where(lanes[None, :] == j, best[:, None], picked)
        ids = tl.where(lanes[None, :] == j, which.to(tl.int64)[:, None], ids)
        probs = tl.where(offs_e[None, :] == which[:, None], -1.0, probs)
    if NORMALIZE:
        picked = picked / tl.sum(picked, axis=1)[:, None]  # (lanes past TOP_K hold zeros)
    out = m_ok[:, None] & (lanes[None, :] < TOP_K)
    where = offs_m[:, None] * TOP_K + lanes[None, :]
    tl.store(weights_ptr + where, picked.to(weights_ptr.dtype.element_ty), mask=out)
    tl.store(experts_ptr + where, ids, mask=out)


def fits(h: torch.Tensor, router: torch.Tensor, top_k: int) -> bool:
    """Whether `route` takes these: h [N, H] where kernels run, the router [E, H] contiguous in h's dtype (fp32, bf16,
    fp16), E up to MAX_EXPERTS, 1 <= top_k <= E."""
    if not runs_here(h) or h.dim() != 2 or h.shape[0] == 0 or h.stride(-1) != 1:
        return False
    if h.dtype not in (torch.float32, torch.bfloat16, torch.float16) or router.dtype != h.dtype:
        return False
    if router.dim() != 2 or router.shape[1] != h.shape[1] or not router.is_contiguous():
        return False
    return router.shape[0] <= MAX_EXPERTS and 1 <= top_k <= router.shape[0]


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, round_weights: bool) -> tuple:
    """(routing weights [N, k], expert ids [N, k] int64) of h [N, H], as `model.moe.route`: weights in h's dtype when
    round_weights (Qwen3-MoE; the store rounds them), else fp32 (Mixtral); largest first."""
    logits = F.linear(h, router).contiguous()  # the reference's logits, in h's dtype
    count, experts = logits.shape
    weights = torch.empty(count, top_k, dtype=h.dtype if round_weights else torch.float32, device=h.device)
    ids = torch.empty(count, top_k, dtype=torch.int64, device=h.device)
    _top_k_kernel[(triton.cdiv(count, BLOCK_M),)](
        logits, weights, ids, count, experts, TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), BM=BLOCK_M,
        E_PAD=max(16, triton.next_power_of_2(experts)), NORMALIZE=normalize, num_warps=4,
        **launch_options(h.device),
    )  # fmt: skip
    return weights, ids
