"""A sparse block's top-k router (Qwen3-MoE, Mixtral) in one Triton launch for the decode step: router logits, their
softmax in fp32, the top k, renormalised and rounded as the model's router does.

The reference, `model.moe.route`, is six launches (the logits GEMM, softmax, top-k, sum, division, cast); at a decode
step of a few dozen tokens each costs more in launch and latency than its work (E = 128 experts of 2,048 inputs is a
512 KiB weight). Here a program owns BM tokens: it accumulates their logits over the hidden size in fp32, rounds them
to the input's dtype (what `F.linear` returns), takes the softmax over the experts in fp32 and picks the k largest
probabilities one after the other, largest first (as `torch.topk` returns them; on equal probabilities the lower
expert id, where torch's order is unspecified). Renormalising divides by their fp32 sum; Qwen3-MoE then rounds the
weights to the logits' dtype. Only the order of the logits' summation differs from the reference's.
Import this module only where Triton may be used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels import interpreting, runs_here
from slimrl.rollout.kernels.common import enter, precision, round_to
from slimrl.rollout.kernels.common import options as launch_options

MAX_EXPERTS = 256  # the program holds a [BM, E_PAD] tile of logits
BLOCK_M = 16
BLOCK_K = 128  # a [E_PAD, BLOCK_K] weight tile a step: half the steps of 64 over a 2,048-wide hidden state


@triton.jit
def _route_kernel(h_ptr, stride_hm, w_ptr, weights_ptr, experts_ptr, N, E, K, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr, BK: tl.constexpr,
                  NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_e = tl.arange(0, E_PAD)
    m_ok = offs_m < N
    e_ok = offs_e < E
    acc = tl.zeros((BM, E_PAD), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_e[:, None] * K + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:  # Triton's interpreter multiplies half-precision tiles wrongly; their fp32 products are exact
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    logits = round_to(acc, h_ptr.dtype.element_ty)  # F.linear's output, in the input's dtype
    logits = tl.where(e_ok[None, :], logits, float("-inf"))
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
    count, hidden = h.shape
    experts = router.shape[0]
    weights = torch.empty(count, top_k, dtype=h.dtype if round_weights else torch.float32, device=h.device)
    ids = torch.empty(count, top_k, dtype=torch.int64, device=h.device)
    _route_kernel[(triton.cdiv(count, BLOCK_M),)](
        h, h.stride(0), router, weights, ids, count, experts, hidden, TOP_K=top_k,
        K_PAD=max(2, triton.next_power_of_2(top_k)), BM=BLOCK_M, E_PAD=max(16, triton.next_power_of_2(experts)),
        BK=BLOCK_K, NORMALIZE=normalize, PRECISION=precision(h.dtype, False),
        DOT_F32=interpreting(), num_warps=8, **launch_options(h.device),
    )  # fmt: skip
    return weights, ids
