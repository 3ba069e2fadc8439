"""Sampling without filters in two small Triton launches: one read of the logits, no noise tensor.

For TRL's default settings (temperature only: no top-k, top-p, min-p or repetition penalty) the decode step's
sampling is "pick argmax(z - log E) with z = logits / T and E ~ Exp(1) i.i.d." (the exponential race of
`sampling.sample`, which draws token i with probability softmax(z)_i), plus the chosen token's log-probability
z_i - logsumexp(z). The plain path materialises a [B, V] fp32 noise tensor outside the graph and runs several passes
over fp32 copies of the logits; here each program streams a slice of a row once, drawing its Exp(1) variates in
registers with Philox (keyed by the rollout's seed and the step; one call gives the uniforms of four columns), a running
logsumexp and the best candidate, both kept per lane (one cross-warp reduction per 4,096 logits for the running max,
the rest at the end); a second launch combines the slices of each row.

On CUDA the outer log of the key z - log(E) is the hardware's approximate log2 (an absolute error of a few 1e-7 on a
key, below the fp32 rounding of z itself; E = -log(U) keeps the accurate log, see `_log_of_exponential`).
Same distribution as the plain path, not the same draws (another generator). Greedy (T = 0) takes the first largest
logit, as `argmax` does, and reports z - logsumexp(z) of the unscaled logits, as `choose_tokens` does.
`reference_choice` is the plain-PyTorch statement of what the kernels compute, given the same uniforms; the tests
compare the two, and check the sampled frequencies against softmax(z). Import only where Triton may be used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels.common import compiled_for_cuda, enter
from slimrl.rollout.kernels.common import options as launch_options
from slimrl.rollout.sampling import SamplingParams

BLOCK = 4096  # logits per loop step of a program
TARGET_PROGRAMS = 2048  # programs per launch to aim for: many in flight hide the latency of each row slice


def applies(params: SamplingParams) -> bool:
    """Whether the fused sampler implements these settings (no filters, no penalty)."""
    return (
        params.sampler == "race"
        and params.top_k_value == 0
        and params.top_p >= 1.0
        and params.min_p_value <= 0.0
        and params.repetition_penalty == 1.0
    )


@triton.jit
def _log_of_exponential(e, FAST: tl.constexpr):
    """ln(e) for the key z - ln(E), to within ~2e-7 absolute: the hardware's approximate log2 (one instruction,
    absolute error below 2^-22 near 1, relative beyond) times ln 2 when FAST, else the accurate log. E = -ln(U) itself
    keeps the accurate log: for U near 1, E is small and only a relative error would do there."""
    if FAST:
        log2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [e], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
        return log2 * 0.6931471805599453
    return tl.log(e)


@triton.jit
def _quarter(logits_ptr, row, V, limit, cols, u, inv_t, best, best_idx, GREEDY: tl.constexpr,
             FAST_LOG: tl.constexpr):  # fmt: skip
    """One lane-wise step over Q logits: their raw values and z = raw / T (-inf outside the slice), and each lane's
    best key so far (strictly larger keys replace it, so a lane keeps the first column of its largest key)."""
    ok = (cols < V) & (cols < limit)
    raw = tl.load(logits_ptr + row * V + cols, mask=ok, other=-float("inf")).to(tl.float32)
    z = raw * inv_t
    if GREEDY:
        key = z
    else:  # z + Gumbel = z - log(E), E = -log(U) ~ Exp(1); U = 0 gives E = inf, a key of -inf: never chosen
        key = z - _log_of_exponential(-tl.log(u), FAST_LOG)
    key = tl.where(ok, key, -float("inf"))
    take = key > best
    return raw, z, tl.where(take, key, best), tl.where(take, cols, best_idx)


@triton.jit
def _sum_exp(m, s, a, b, c, d):
    """Running logsumexp over lanes: the max m is shared (one reduction per block), the sums s stay per lane."""
    m_new = tl.maximum(m, tl.max(tl.maximum(tl.maximum(a, b), tl.maximum(c, d)), axis=0))
    s = s * tl.exp(m - m_new) + tl.exp(a - m_new) + tl.exp(b - m_new) + tl.exp(c - m_new) + tl.exp(d - m_new)
    return m_new, s


@triton.jit
def _partial_kernel(logits_ptr, seed_ptr, step_ptr, part_ptr, V, per_split, per_row, inv_t,
                    GREEDY: tl.constexpr, RAW: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    Q: tl.constexpr = BLOCK // 4  # one Philox call gives four uniforms: one for each quarter of a block
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seed_ptr) + tl.load(step_ptr)  # a new Philox key per step
    start = split * per_split
    limit = start + per_split
    lanes = tl.arange(0, Q)
    # state is kept per lane and reduced once at the end; only the running max is shared, once per block
    m = tl.full([], -float("inf"), tl.float32)  # max of z = logits / T so far, and per lane sum of exp(z - m)
    s = tl.zeros([Q], tl.float32)
    m_raw = tl.full([], -float("inf"), tl.float32)  # the same over the raw logits ("raw" log-probs)
    s_raw = tl.zeros([Q], tl.float32)
    best = tl.full([Q], -float("inf"), tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    for v0 in range(start, limit, BLOCK):
        if GREEDY:
            u0 = tl.zeros([Q], tl.float32)
            u1 = u0
            u2 = u0
            u3 = u0
        else:  # counters row * per_row + v0 / 4 + i: distinct for every (row, block, lane)
            u0, u1, u2, u3 = tl.rand4x(seed, row * per_row + v0 // 4 + lanes)
        r0, z0, best, best_idx = _quarter(logits_ptr, row, V, limit, v0 + lanes, u0, inv_t, best, best_idx, GREEDY,
                                          FAST_LOG)  # fmt: skip
        r1, z1, best, best_idx = _quarter(logits_ptr, row, V, limit, v0 + Q + lanes, u1, inv_t, best, best_idx,
                                          GREEDY, FAST_LOG)  # fmt: skip
        r2, z2, best, best_idx = _quarter(logits_ptr, row, V, limit, v0 + 2 * Q + lanes, u2, inv_t, best, best_idx,
                                          GREEDY, FAST_LOG)  # fmt: skip
        r3, z3, best, best_idx = _quarter(logits_ptr, row, V, limit, v0 + 3 * Q + lanes, u3, inv_t, best, best_idx,
                                          GREEDY, FAST_LOG)  # fmt: skip
        m, s = _sum_exp(m, s, z0, z1, z2, z3)
        if RAW:
            m_raw, s_raw = _sum_exp(m_raw, s_raw, r0, r1, r2, r3)
    top = tl.max(best, axis=0)
    # the first column holding the largest key, as argmax (V fits: V < 2**31)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    out = part_ptr + (row * SPLITS + split) * 8  # SPLITS: the slices launched per row
    tl.store(out + 0, m)
    tl.store(out + 1, tl.sum(s, axis=0))
    tl.store(out + 2, top)
    tl.store(out + 3, first.to(tl.float32))  # exact: V < 2**24
    tl.store(out + 5, m_raw)
    tl.store(out + 6, tl.sum(s_raw, axis=0))


@triton.jit
def _combine_kernel(part_ptr, logits_ptr, V, inv_t, tokens_ptr, logprobs_ptr, USED, SPLITS: tl.constexpr,
                    RAW: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    used = offs < USED  # slices past the row's end were not launched
    base = part_ptr + (row * USED + offs) * 8
    m = tl.load(base + 0, mask=used, other=-float("inf"))
    s = tl.load(base + 1, mask=used, other=0.0)
    best = tl.load(base + 2, mask=used, other=-float("inf"))
    top = tl.max(best, axis=0)
    winner = tl.argmax(best, axis=0)  # the first slice holding the largest key: first index, as argmax
    pick = offs == winner
    token = tl.sum(tl.where(pick, tl.load(base + 3, mask=used, other=0.0), 0.0), axis=0).to(tl.int64)
    token = tl.where(top > -float("inf"), token, 0)
    raw = tl.load(logits_ptr + row * V + token).to(tl.float32)  # the chosen token's logit
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(tl.where(used, s * tl.exp(m - big), 0.0), axis=0))
    logprob = raw * inv_t - lse
    if RAW:
        m_raw = tl.load(base + 5, mask=used, other=-float("inf"))
        big_raw = tl.max(m_raw, axis=0)
        terms = tl.load(base + 6, mask=used, other=0.0) * tl.exp(m_raw - big_raw)
        lse_raw = big_raw + tl.log(tl.sum(tl.where(used, terms, 0.0), axis=0))
        logprob = raw - lse_raw
    tl.store(tokens_ptr + row, token)
    tl.store(logprobs_ptr + row, logprob)


def splits_for(batch: int, vocab: int) -> int:
    """Slices per row: enough programs to fill the GPU, a power of two (the combine reads them as one tile)."""
    wanted = max(1, min(TARGET_PROGRAMS // max(batch, 1), triton.cdiv(vocab, BLOCK)))
    return 1 << (wanted.bit_length() - 1)


def choose(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, step: torch.Tensor):
    """(tokens [B] int64, log-probs [B] fp32) from logits [B, V] (contiguous); seed and step are int64 [1] device
    tensors (no host sync, graph-safe). Log-probs follow `params.logprobs_mode` as `choose_tokens` does."""
    batch, vocab = logits.shape
    splits = splits_for(batch, vocab)
    per_split = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    used = triton.cdiv(vocab, per_split)  # slices whose start is inside the row (an empty one would give NaN)
    parts = torch.empty(batch, used, 8, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    greedy = params.greedy
    raw = params.logprobs_mode == "raw"
    inv_t = 1.0 if greedy else 1.0 / params.temperature
    launch = launch_options(logits.device)
    _partial_kernel[(batch, used)](
        logits, seed, step, parts, vocab, per_split, _per_row(vocab), inv_t, GREEDY=greedy, RAW=raw, SPLITS=used,
        BLOCK=BLOCK, FAST_LOG=compiled_for_cuda(logits.device), **launch,
    )  # fmt: skip
    _combine_kernel[(batch,)](parts, logits, vocab, inv_t, tokens, logprobs, used, SPLITS=splits, RAW=raw, **launch)
    return tokens, logprobs


def _per_row(vocab: int) -> int:
    """Philox counters a row uses (a quarter of its blocks' lanes)."""
    return triton.cdiv(vocab, BLOCK) * (BLOCK // 4)


@triton.jit
def _uniforms_kernel(seed_ptr, step_ptr, out_ptr, V, per_row, BLOCK: tl.constexpr):
    Q: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    v0 = tl.program_id(1) * BLOCK
    seed = tl.load(seed_ptr) + tl.load(step_ptr)
    u0, u1, u2, u3 = tl.rand4x(seed, row * per_row + v0 // 4 + tl.arange(0, Q))
    cols = v0 + tl.arange(0, Q)
    tl.store(out_ptr + row * V + cols, u0, mask=cols < V)
    tl.store(out_ptr + row * V + cols + Q, u1, mask=cols + Q < V)
    tl.store(out_ptr + row * V + cols + 2 * Q, u2, mask=cols + 2 * Q < V)
    tl.store(out_ptr + row * V + cols + 3 * Q, u3, mask=cols + 3 * Q < V)


def uniforms(seed: torch.Tensor, step: torch.Tensor, batch: int, vocab: int) -> torch.Tensor:
    """The uniforms `choose` draws for this seed and step, [B, V] (for tests)."""
    out = torch.empty(batch, vocab, dtype=torch.float32, device=seed.device)
    _uniforms_kernel[(batch, triton.cdiv(vocab, BLOCK))](seed, step, out, vocab, _per_row(vocab), BLOCK=BLOCK)
    return out


def reference_choice(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None):
    """What the kernels compute, in plain PyTorch: uniforms [B, V] in (0, 1) (ignored when greedy)."""
    raw = logits.float()
    z = raw if params.greedy else raw / params.temperature
    key = z if params.greedy else z - torch.log(-torch.log(uniforms))
    tokens = key.argmax(dim=-1)
    reported = raw if params.logprobs_mode == "raw" else z
    logprobs = reported.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(reported, dim=-1)
    return tokens, logprobs
