"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral for the engine's forward, from the live modules.

transformers 5.x lays a sparse block out as `mlp.gate` (a top-k router holding a [E, hidden] `weight`, not an
nn.Linear) and `mlp.experts` (3-D parameters `gate_up_proj` [E, 2I, hidden] and `down_proj` [E, hidden, I]). peft
0.21 puts LoRA on them through `target_parameters` (what "all-linear" and `target_modules=["gate"]` turn into for
these models): a `ParamWrapper` per parameter, nested when several parameters of one module are targeted, whose
forward adds the adapter's delta to the parameter for the duration of the call.

The math is transformers' (`*TopKRouter`, and the experts' default "grouped_mm" forward): router logits, softmax in
fp32, top-k, optionally renormalised; Qwen3-MoE rounds the routing weights to the logits' dtype, Mixtral keeps them
in fp32. The routed (token, expert) rows are sorted by expert and each expert's projection is one GEMM over its rows
(`grouped_linear`). peft's LoRA is applied as it folds it: into the router weight (tiny: [E, hidden]); on the experts
as the low-rank product on the routed rows, x W^T + s (x A_e^T) B_e^T, the same sum as peft's x (W + s B_e A_e)^T
without materialising every expert's weight each step. Nothing here syncs with the host on CUDA, so a decode step
with sparse layers can be captured as a graph. `expert_mix` is the reference; during a decode step with the fused
kernels on, `kernels.moe` runs the same math in five launches that read each routed expert's weights once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

MOE_TYPES = ("qwen3_moe", "mixtral")
# router class -> does it round the routing weights to the logits' dtype (Qwen3-MoE) or keep them in fp32 (Mixtral)
ROUTERS = {"Qwen3MoeTopKRouter": True, "MixtralTopKRouter": False}
EXPERTS = ("Qwen3MoeExperts", "MixtralExperts")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class ExpertProjection(NamedTuple):
    weight: torch.Tensor  # [E, out, in]
    loras: tuple  # ((A [E, r, in], B [E, out, r], scale), ...) in the weight's dtype, as peft folds them


class SparseSpec(NamedTuple):
    """How to apply one sparse block right now (adapters enabled or not, which are active)."""

    router: torch.Tensor  # [E, hidden], the active adapters' delta added as peft adds it
    top_k: int
    normalize: bool  # renormalise the top-k probabilities to sum to one
    round_weights: bool  # routing weights rounded to the logits' dtype (Qwen3-MoE) or kept in fp32 (Mixtral)
    gate_up: ExpertProjection
    down: ExpertProjection


def is_sparse_block(mlp: nn.Module) -> bool:
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def sparse_problem(mlp: nn.Module) -> str | None:
    """What in this sparse block the engine cannot run, or None."""
    router, router_wrappers = _unwrap(mlp.gate)
    experts, expert_wrappers = _unwrap(mlp.experts)
    if type(router).__name__ not in ROUTERS or getattr(router, "weight", None) is None or router.weight.dim() != 2:
        return f"router {type(router).__name__} is not one the engine implements ({', '.join(ROUTERS)})"
    if type(experts).__name__ not in EXPERTS or not all(getattr(experts, n, None) is not None for n in EXPERT_PARAMS):
        return f"experts {type(experts).__name__} are not ones the engine implements ({', '.join(EXPERTS)})"
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return "transposed or biased expert weights (the engine reads [E, out, in] without bias)"
    dtypes = {getattr(experts, n).dtype for n in EXPERT_PARAMS} | {router.weight.dtype}
    if not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        return f"sparse block weights in {sorted(map(str, dtypes))}; the engine reads fp32/bf16/fp16 experts"
    for wrappers, names in ((router_wrappers, ("weight",)), (expert_wrappers, EXPERT_PARAMS)):
        if len({w.parameter_name for w in wrappers}) < len(wrappers):
            return "two LoRA wrappers on one parameter of the sparse block"
        for module in wrappers:
            if module.parameter_name not in names:
                return f"a LoRA on {module.parameter_name!r} of the sparse block, which the engine does not read"
            if getattr(module, "lora_variant", None) or any(b.bias is not None for b in module.lora_B.values()):
                return "a LoRA variant or LoRA bias on the sparse block (plain LoRA only)"
            if names is EXPERT_PARAMS and not module._did_swap_in_out_features:
                return "expert LoRA factors in a layout other than peft's for [E, out, in] parameters"
    return None


def sparse_spec(mlp: nn.Module, staged: StagedFactors | None = None) -> SparseSpec:
    """The live spec of a sparse block `sparse_problem` accepted; its experts' LoRA factors from `staged` (the
    engine's, during a rollout) or laid out anew."""
    router, router_wrappers = _unwrap(mlp.gate)
    experts, expert_wrappers = _unwrap(mlp.experts)
    by_param = {w.parameter_name: w for w in expert_wrappers}
    projections = [ExpertProjection(getattr(experts, n), _expert_loras(by_param.get(n), staged))
                   for n in EXPERT_PARAMS]  # fmt: skip
    rounds = ROUTERS[type(router).__name__]
    normalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral's router always renormalises
    wrapper = router_wrappers[0] if router_wrappers else None
    weight = _folded_router(router.weight, wrapper) if staged is None else staged.router(router.weight, wrapper)
    return SparseSpec(weight, int(router.top_k), normalize, rounds, *projections)


def sparse_identity(mlp: nn.Module) -> tuple:
    """Addresses and constants of the tensors a captured graph of this block reads (`Decoder.fingerprint`): the
    parameters and adapter factors themselves, not the per-step views of them `sparse_spec` builds."""
    router, router_wrappers = _unwrap(mlp.gate)
    experts, expert_wrappers = _unwrap(mlp.experts)
    parts = [type(router).__name__, int(router.top_k), bool(getattr(router, "norm_topk_prob", True))]
    parts.extend((p.data_ptr(), p.dtype) for p in (router.weight, *(getattr(experts, n) for n in EXPERT_PARAMS)))
    for wrapper in (*router_wrappers, *expert_wrappers):
        factors = _active_factors(wrapper)
        parts.append((wrapper.parameter_name, *((a.data_ptr(), b.data_ptr(), a.dtype, s) for a, b, s in factors)))
    return tuple(parts)


# -- peft's ParamWrapper, read as its forward applies it ------------------------------------------------------------


def _unwrap(module: nn.Module) -> tuple[nn.Module, list]:
    """The module under peft's (possibly nested) ParamWrappers, and the wrappers from the outside in."""
    wrappers = []
    while type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name"):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def _active_factors(wrapper) -> list:
    """[(A weight, B weight, scale)] of the adapters the wrapper's forward would apply now; a merged adapter is in
    the parameter already (and one merged but switched off is unmerged, as peft's forward does)."""
    if wrapper.merged and wrapper.disable_adapters:
        wrapper.unmerge()
    if wrapper.merged or wrapper.disable_adapters:
        return []
    names = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    return [(wrapper.lora_A[n].weight, wrapper.lora_B[n].weight, float(wrapper.scaling[n])) for n in names]


def _folded_router(weight: torch.Tensor, wrapper) -> torch.Tensor:
    """W + sum of the adapters' (B @ A) * scale, each rounded to W's dtype: peft's delta for a 2-D parameter
    (computed in fp32 for half-precision adapters on the CPU, as peft's `get_delta_weight`)."""
    factors = [] if wrapper is None else _active_factors(wrapper)
    if not factors:
        return weight
    delta = None
    for lora_a, lora_b, scale in factors:
        upcast = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
        a, b = (lora_a.float(), lora_b.float()) if upcast else (lora_a, lora_b)
        piece = ((b @ a) * scale).to(lora_b.dtype).to(weight.dtype)
        delta = piece if delta is None else delta + piece
    return weight + delta


def _expert_loras(wrapper, staged: StagedFactors | None = None) -> tuple:
    """Per-expert factors of a 3-D parameter's adapters (`expert_layout`), from `staged` when given."""
    if wrapper is None:
        return ()
    experts = wrapper.num_experts
    dtype = wrapper.get_param().dtype
    loras = []
    for lora_a, lora_b, scale in _active_factors(wrapper):
        if staged is None:
            a, b = expert_layout(lora_a, lora_b, experts, dtype)
        else:
            a, b = staged.factors(lora_a, lora_b, experts, dtype)
        loras.append((a, b, scale))
    return tuple(loras)


def expert_layout(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, dtype) -> tuple:
    """peft's factors of a 3-D parameter as grouped GEMMs read them: lora_A [r*E, in] holds expert e's A in rows
    e*r..(e+1)*r, lora_B [out, r*E] its B in columns e, E+e, 2E+e...; -> A [E, r, in], B [E, out, r], cast to the
    parameter's dtype as peft does, ranks zero-padded (exact) so rank rows are 16-byte aligned, as torch's grouped
    GEMM needs (bf16 at rank 4, say)."""
    a = lora_a.reshape(experts, -1, lora_a.shape[-1]).to(dtype)
    b = lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1).to(dtype).contiguous()
    pad = -a.shape[1] % (16 // a.element_size())
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    return a, b


class StagedFactors:
    """The experts' LoRA factors in `expert_layout` (and the routers' folded weights, `router`), kept between
    forwards and refreshed in place once per rollout
    instead of cast and permuted at every forward (on an H100 those copies were 39% of a Qwen3-MoE decode step: 12.9
    of 33 ms at batch 64, every replay of the captured graph repeating them). The engine calls `begin` at the start
    of each `generate` (adapters may have changed since: an optimizer step, a new adapter); the first forward of the
    rollout (a prefill, never a graph replay) refreshes each buffer, in place, so a captured decode graph reads the
    current values at the addresses it baked in. `identity` joins the graph's fingerprint: a buffer made anew (new
    adapter, or after `clear`, which the engine's release() calls to give the memory back) means capture again."""

    def __init__(self):
        self.rollout = 0
        self.entries: dict = {}  # key -> [source, rollout refreshed in, (held tensors)]

    def begin(self) -> None:
        self.rollout += 1

    def clear(self) -> None:
        self.entries.clear()

    def identity(self) -> tuple:
        return tuple(t.data_ptr() for entry in self.entries.values() for t in entry[2])

    def _held(self, key: tuple, source: tuple, make) -> tuple:
        """The tensors `make()` returns, made once for `source` and copied into in place once per rollout."""
        entry = self.entries.get(key)
        if entry is None or entry[0] != source:
            entry = self.entries[key] = [source, self.rollout, tuple(make())]
        elif entry[1] != self.rollout:
            for held, fresh in zip(entry[2], make(), strict=True):
                held.copy_(fresh)
            entry[1] = self.rollout
        return entry[2]

    def factors(self, lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, dtype) -> tuple:
        source = (lora_a.data_ptr(), lora_b.data_ptr(), tuple(lora_a.shape), tuple(lora_b.shape), dtype)
        return self._held((id(lora_a), id(lora_b)), source, lambda: expert_layout(lora_a, lora_b, experts, dtype))

    def router(self, weight: torch.Tensor, wrapper) -> torch.Tensor:
        """`_folded_router(weight, wrapper)`, the router weight with its adapters' delta, held like the factors (a
        decode step would otherwise fold it again at every replay: four launches a layer)."""
        factors = [] if wrapper is None else _active_factors(wrapper)
        if not factors:
            return weight
        source = (weight.data_ptr(), weight.dtype, *((a.data_ptr(), b.data_ptr(), s) for a, b, s in factors))
        return self._held(("router", id(weight)), source, lambda: (_folded_router(weight, wrapper),))[0]


# -- the routed MLP -------------------------------------------------------------------------------------------------


class Groups(NamedTuple):
    """Routed rows sorted by expert: expert e's rows are [ends[e-1], ends[e]); `experts` names each row's."""

    ends: torch.Tensor  # [E] int32, cumulative row counts
    experts: torch.Tensor  # [S]


def route(h: torch.Tensor, spec: SparseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [N, k], expert ids [N, k]) of h [N, hidden], as transformers' top-k routers."""
    logits = F.linear(h, spec.router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.round_weights:
        weights = weights.to(logits.dtype)
    return weights, experts


def fused_route(h: torch.Tensor, spec: SparseSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`route` by `kernels.router` (the same logits GEMM, then one launch), or None where it cannot run (no
    Triton, not on CUDA outside Triton's interpreter, operands it does not take)."""
    from slimrl.rollout import kernels

    if not kernels.available():
        return None
    from slimrl.rollout.kernels import router

    if not router.fits(h, spec.router, spec.top_k):
        return None
    return router.route(h, spec.router, spec.top_k, spec.normalize, spec.round_weights)


def routed_mlp(h: torch.Tensor, spec: SparseSpec, fused=None) -> torch.Tensor:
    """The sparse block's output [N, hidden] for its input h [N, hidden]. fused: the engine's `FusedDecode`
    (`ops.fused`); bound to a decode step (its `context` set, never in a prefill) the router and the experts run as
    `kernels.router`'s and `kernels.moe`'s launches where those take the spec (deterministic when it is `ordered`),
    else as `route` and `expert_mix`."""
    decoding = fused is not None and fused.context is not None
    routed = fused_route(h, spec) if decoding else None
    weights, experts = routed if routed is not None else route(h, spec)
    if decoding:
        out = fused_expert_mix(h, weights, experts, spec, fused.ordered)
        if out is not None:
            return out
    return expert_mix(h, weights, experts, spec)


def expert_mix(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, spec: SparseSpec) -> torch.Tensor:
    """The reference: each token's top-k experts' SwiGLU outputs of h [N, hidden] (experts [N, k] ids, weights
    [N, k]), weighted by the routing weights and summed over k in their dtype, then rounded to h's dtype."""
    count, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    num_experts = spec.router.shape[0]
    sizes = torch.zeros(num_experts, dtype=torch.int64, device=h.device)
    sizes.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync (bincount's output size would need one)
    groups = Groups(sizes.cumsum(0).to(torch.int32), sorted_experts)
    rows = h[order // k]
    gate, up = expert_projection(rows, spec.gate_up, groups).chunk(2, dim=-1)
    out = expert_projection(F.silu(gate) * up, spec.down, groups)
    # back in pair order by a gather through the inverse permutation (the same values as scattering them through
    # `order`; on an H100 at a 16k-token prefill, 0.3 ms a layer against the scatter's 0.85), then weighted
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    unsorted = out.index_select(0, inverse) * weights.reshape(-1, 1)
    return unsorted.view(count, k, -1).sum(dim=1).to(h.dtype)


def fused_expert_mix(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, spec: SparseSpec,
                     ordered: bool = False) -> torch.Tensor | None:  # fmt: skip
    """`expert_mix` by `kernels.moe.routed_experts`, or None where it cannot run: no Triton, not on CUDA (outside
    Triton's interpreter), several adapters on one projection, operands it does not take (`kernels.moe.fits`)."""
    from slimrl.rollout import kernels

    if not kernels.available() or len(spec.gate_up.loras) > 1 or len(spec.down.loras) > 1:
        return None
    from slimrl.rollout.kernels import moe as moe_kernels

    gate_up_lora = spec.gate_up.loras[0] if spec.gate_up.loras else None
    down_lora = spec.down.loras[0] if spec.down.loras else None
    if not moe_kernels.fits(h, spec.gate_up.weight, spec.down.weight, gate_up_lora, down_lora):
        return None
    return moe_kernels.routed_experts(h, weights, experts, spec.gate_up.weight, spec.down.weight, gate_up_lora,
                                      down_lora, ordered)  # fmt: skip


def expert_projection(x: torch.Tensor, projection: ExpertProjection, groups: Groups) -> torch.Tensor:
    """Each expert's projection (and its LoRA) of its sorted rows x [S, in] -> [S, out]."""
    y = grouped_linear(x, projection.weight, groups)
    for lora_a, lora_b, scale in projection.loras:
        update = grouped_linear(grouped_linear(x, lora_a, groups), lora_b, groups)
        y = y + (update if scale == 1.0 else update * scale)  # (times 1.0 is the same values: a pass saved)
    return y


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of expert e (sorted) times weight[e]^T: x [S, in], weight [E, out, in] -> [S, out], in weight's dtype
    (transformers casts the input so too). torch's grouped GEMM where it runs; else, on the CPU one GEMM per expert
    over its rows, and on CUDA (no host sync allowed) every expert over all rows, each row keeping its own."""
    x = x.to(weight.dtype)
    if grouped_mm_fits(x, weight):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=groups.ends)
    if x.is_cuda:
        return masked_experts(x, weight, groups)
    return expert_loop(x, weight, groups)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM takes these operands: bf16 on a CUDA GPU of compute capability 8.0+ (any float dtype on
    the CPU), contiguous, with rows (in and out) and base addresses 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or not (x.is_contiguous() and weight.is_contiguous()):
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0)):
        return False
    size = x.element_size()
    alignments = (x.data_ptr(), weight.data_ptr(), x.shape[-1] * size, weight.shape[1] * size)
    return all(a % 16 == 0 for a in alignments) and x.shape[0] > 0


def expert_loop(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    """One GEMM per expert over its rows (reads the group bounds on the host)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(groups.ends.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
        start = end
    return out


def masked_experts(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Every expert over all rows, each row keeping its own expert's result: static shapes, no host sync."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for expert in range(weight.shape[0]):
        mine = (groups.experts == expert)[:, None]
        out = torch.where(mine, F.linear(x, weight[expert]), out)
    return out
