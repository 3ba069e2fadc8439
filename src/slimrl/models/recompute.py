"""How a checkpointed decoder layer is recomputed in its backward (models/checkpointing.py runs it).

Llama-family layers (Llama, Qwen2, Qwen3, Mistral: the residual attention + residual MLP shape) are recomputed in two
parts: the attention over the whole sequence, then the MLP tile by tile, each tile's forward followed at once by its
backward, so a long sequence's MLP activations ([tokens, intermediate], 4 of them) never exist at once. The
gradient-free forward runs the MLP in the same tiles, with the fused element-wise ops for long sequences, so both
compute the same thing op for op. A layer switched to fast LoRA (models/fast_lora.py) runs its fused MLP and RMSNorm
Functions here too: the fused ops above call a switched module's own forward. The recompute's MLP tiles' outputs are
only the roots of their backward, never read: a fused LoRA MLP does not compute them there
(`ops.lora_mlp.output_unread`: down's GEMM and the gated product's forward skipped).

`Weights` is how a recompute's gradients reach the layer's weights: summed over the tiles and handed back through the
checkpoint's autograd node (one gradient per weight per backward pass, which DDP's reducer needs), or accumulated in
place by a plain backward where a sharding framework's hooks must see them inside the recompute.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import NamedTuple, Protocol

import torch

from slimrl.ops.fused import mlp_forward, norm_forward
from slimrl.ops.lora_linear import one_layer_pass
from slimrl.ops.lora_mlp import output_unread


class RecomputeState(Protocol):
    """What the split recompute reads and counts of a model's offloaded checkpointing (checkpointing.OffloadState
    provides it; this module does not import that one, which imports this)."""

    mlp_tile_tokens: int  # MLP tile of the split recompute; 0: the whole sequence at once
    split_recomputes: int  # layers recomputed attention-then-MLP-tiles so far

SPLIT_LAYER_TYPES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
# The fused element-wise kernels pay a fixed CPU cost per call; below this many tokens per layer call the GPU work is
# too short to hide it, so the eager reference runs instead.
FUSED_MIN_TOKENS = 16384


class Weights:
    """The trainable weights of one recomputed layer and the gradients the recompute found for them.

    `params` None: the weights are not inputs of the checkpoint node; `backprop` then accumulates into every leaf the
    recompute reaches, as a plain backward does."""

    def __init__(self, params: list[torch.Tensor] | None):
        self.params = params
        self.sums: list[torch.Tensor | None] = [None] * len(params or ())

    def backprop(self, outputs: list, grad_outputs: list, inputs: list) -> list[torch.Tensor | None]:
        """Backpropagate `grad_outputs` through `outputs`; returns the gradients of the recompute's leaf `inputs`
        (None where one needs none) and adds the weights' gradients to `sums`."""
        wanted = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
        if not outputs:
            return [None] * len(inputs)
        if self.params is None:
            torch.autograd.backward(outputs, grad_outputs)
            return [t.grad if torch.is_tensor(t) and t.requires_grad else None for t in inputs]
        found = torch.autograd.grad(outputs, wanted + self.params, grad_outputs, allow_unused=True)
        for index, grad in enumerate(found[len(wanted) :]):
            if grad is not None:
                self.sums[index] = grad if self.sums[index] is None else self.sums[index].add_(grad)
        by_input = iter(found[: len(wanted)])
        return [next(by_input) if torch.is_tensor(t) and t.requires_grad else None for t in inputs]

    def grads(self) -> list[torch.Tensor | None]:
        """What the checkpoint node returns for its weight inputs."""
        return self.sums


def layer_of(function) -> torch.nn.Module | None:
    """The module whose forward `function` is, as transformers passes it (`partial(forward, layer, **kwargs)`, or a
    partial of the layer's bound `__call__` in older versions), else None."""
    return _unwrap(function)[0]


def _unwrap(function) -> tuple[torch.nn.Module | None, dict]:
    """(layer, keyword arguments) of a layer's forward wrapped in partials. A partial that carries attributes (the
    one accelerate's hooks put on a layer, made by functools.update_wrapper) is not flattened into the next, so the
    chain is walked; outer keywords win, as they do when the partials are called."""
    keywords: dict = {}
    while isinstance(function, functools.partial):
        keywords = {**function.keywords, **keywords}
        owner = function.args[0] if function.args else getattr(function.func, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner, keywords
        function = function.func
    return None, keywords


class _Walk(NamedTuple):
    """What a walk over a layer's submodules found: every parameter with the module and name it sits under (in
    `parameters()` order, shared ones once), and the dropout modules; `registrations` as counted when it was made."""

    registrations: int
    params: tuple[tuple[torch.nn.Module, str, torch.Tensor], ...]
    dropouts: tuple[torch.nn.Module, ...]


_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its _Walk
# the modules some walk went through, held weakly: a set of ids would, once such a module is freed, count registrations
# under whatever new module takes its id (a ModuleList sliced by transformers' decoder loop, seen in a test)
_WALKED: weakref.WeakSet = weakref.WeakSet()
_REGISTRATIONS = [0]  # modules and parameters registered under a walked module since import


def _count_registration(parent: torch.nn.Module, *_) -> None:
    # only under a walked module: transformers' decoder loop slices its ModuleList on every forward, which registers
    # every layer again, into a new list
    if parent in _WALKED:
        _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def watch_registrations(modules) -> None:
    """Count from now on every module or parameter registered under one of `modules` (`registrations()`)."""
    _WALKED.update(modules)


def registrations() -> int:
    """Modules and parameters registered under a watched module since import: what a cache of a module's structure
    compares to know it is still current."""
    return _REGISTRATIONS[0]


def _walk(layer: torch.nn.Module) -> _Walk:
    """The layer's parameters and dropouts, walked once and reused while no module or parameter was registered under
    any walked module since and every parameter still sits where it was found (a swap through `_parameters` is caught
    too). A walk over a LoRA decoder layer's ~80 submodules cost about a millisecond of host time, two or three times
    per layer and chunk of each step; this check costs a few microseconds. What may change between steps is read
    live from what it returns: requires_grad and dropout p."""
    known = _WALKS.get(layer)
    if known is not None and known.registrations == _REGISTRATIONS[0] and all(
        module._parameters.get(name) is param for module, name, param in known.params
    ):
        return known
    modules = list(layer.modules())
    watch_registrations(modules)
    params, seen = [], set()
    for module in modules:  # parameters() order: modules first to last, each one's own in order
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append((module, name, param))
    dropouts = tuple(m for m in modules if isinstance(m, torch.nn.Dropout))
    _WALKS[layer] = known = _Walk(_REGISTRATIONS[0], tuple(params), dropouts)
    return known


def trainable_weights(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The layer's parameters that require grad, in `parameters()` order."""
    return [param for _, _, param in _walk(layer).params if param.requires_grad]


def splittable_layer(function, other_args) -> tuple | None:
    """(layer, kwargs) when `function` is a Llama-family decoder layer's forward that can be recomputed in parts."""
    layer, keywords = (None, {}) if other_args else _unwrap(function)
    if type(layer).__name__ not in SPLIT_LAYER_TYPES:
        return None
    if layer.training and any(m.p > 0 for m in _walk(layer).dropouts):
        return None
    return layer, keywords


def split_forward(state: RecomputeState, layer, kwargs: dict, hidden_states: torch.Tensor) -> torch.Tensor:
    """The layer's output without grad as the offloaded forward computes it: attention, then the MLP in tiles of
    `state.mlp_tile_tokens` tokens, with the fused ops for long sequences."""
    fused = _use_fused(hidden_states)
    with one_layer_pass():  # the tiles share the adapters' casts
        residual = hidden_states + _attention(layer, hidden_states, kwargs, fused)
        return _plus_tiled(lambda t: _mlp_block(layer, t, fused), residual, state.mlp_tile_tokens)


def _attention(layer, hidden_states: torch.Tensor, kwargs: dict, fused: bool) -> torch.Tensor:
    """attn(norm1(x)), the layer's first residual branch (the RMSNorm fused on CUDA for long sequences)."""
    normed = norm_forward(layer.input_layernorm, hidden_states) if fused else layer.input_layernorm(hidden_states)
    return layer.self_attn(hidden_states=normed, **kwargs)[0]


def _mlp_block(layer, hidden_states: torch.Tensor, fused: bool) -> torch.Tensor:
    """mlp(norm2(h)), the layer's second residual branch (RMSNorm and SwiGLU product fused for long sequences)."""
    if not fused:
        return layer.mlp(layer.post_attention_layernorm(hidden_states))
    return mlp_forward(layer.mlp, norm_forward(layer.post_attention_layernorm, hidden_states))


def _use_fused(hidden_states: torch.Tensor) -> bool:
    return hidden_states.is_cuda and hidden_states.numel() // hidden_states.shape[-1] >= FUSED_MIN_TOKENS


def tile_bounds(tokens: int, tile: int) -> list[tuple[int, int]]:
    """(start, end) of the MLP tiles over `tokens` rows: as few tiles of at most `tile` rows as cover them (0: one
    tile), of equal size rounded up to a multiple of 128 rows where they are that long (the GEMMs' row tile), the last
    one shorter. Equal tiles, not `tile`-sized ones and a remainder: 16,640 rows in tiles of 8,192 are 5,632 + 5,632 +
    5,376, not 8,192 + 8,192 + 256 (a 256-row pass over every MLP weight that costs nearly what a full tile's does)."""
    if tile <= 0 or tokens <= tile:
        return [(0, tokens)]
    pieces = -(-tokens // tile)
    size = -(-tokens // pieces)
    if size > 128 and -(-size // 128) * 128 <= tile:
        size = -(-size // 128) * 128
    return [(start, min(start + size, tokens)) for start in range(0, tokens, size)]


def _plus_tiled(function, hidden_states: torch.Tensor, tile: int) -> torch.Tensor:
    """`hidden_states + function(hidden_states)` for a token-wise `function` over [..., tokens, hidden], run in the
    tiles of `tile_bounds`; no grad (the gradient-free forward): each tile's sum goes into the output in place, where a
    concatenation of the tiles and then the sum would write the whole output twice."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    bounds = tile_bounds(flat.shape[0], tile)
    if len(bounds) == 1:
        return hidden_states + function(hidden_states)
    out = None
    for start, end in bounds:
        branch = function(flat[start:end])
        if out is None:  # the sum's dtype, as `+` would promote it
            out = flat.new_empty(flat.shape, dtype=torch.promote_types(flat.dtype, branch.dtype))
        torch.add(flat[start:end], branch, out=out[start:end])
        del branch
    return out.view(hidden_states.shape)


def _output_hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook (the module's own, or a global one) may read what `module` returns."""
    return bool(module._forward_hooks or torch.nn.modules.module._global_forward_hooks)


def split_backward(state: RecomputeState, layer, kwargs, hidden_states: torch.Tensor, grad_output: torch.Tensor,
                   weights: Weights) -> torch.Tensor | None:  # fmt: skip
    """Backward of `h + mlp(norm2(h))` with `h = x + attn(norm1(x))`: MLP tile by tile, then the attention. Returns the
    gradient of `x` (None when it needs none); the weights' gradients go to `weights`. Runs under enable_grad."""
    state.split_recomputes += 1
    fused = _use_fused(hidden_states)
    with one_layer_pass():  # the tiles share the adapters' casts (one autograd node each)
        return _split_backward(state, layer, kwargs, hidden_states, grad_output, weights, fused)


def _split_backward(state: RecomputeState, layer, kwargs, hidden_states, grad_output, weights: Weights, fused: bool):
    residual = hidden_states + _attention(layer, hidden_states, kwargs, fused)
    flat_mid = residual.detach().view(-1, residual.shape[-1])
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    # d loss / d h: the layer output's gradient (the residual path) plus the MLP branch's, summed tile by tile
    total = torch.empty_like(flat_grad)
    # the tiles' outputs only carry their gradients back: a fused LoRA MLP need not compute them (unless a forward
    # hook reads them)
    unread = output_unread if not _output_hooked(layer.mlp) else contextlib.nullcontext
    for start, end in tile_bounds(flat_mid.shape[0], state.mlp_tile_tokens):
        part = flat_mid[start:end].detach().requires_grad_(True)  # a leaf per tile
        with unread():
            out = _mlp_block(layer, part, fused)
        (part_grad,) = weights.backprop([out], [flat_grad[start:end]], [part])
        if part_grad is None:
            total[start:end] = flat_grad[start:end]
        else:
            torch.add(flat_grad[start:end], part_grad, out=total[start:end])
        del out, part_grad  # this tile's MLP activations go before the next tile's are made
    if not residual.requires_grad:
        return None
    (grad,) = weights.backprop([residual], [total.view_as(grad_output)], [hidden_states])
    return grad
