"""Gradient checkpointing whose checkpoints live in (pinned) CPU memory instead of on the GPU.

Ordinary checkpointing keeps each decoder layer's input on the GPU until the backward pass recomputes that layer:
n_layers x tokens x hidden x 2 bytes, 2.8 GB per 32k-token sequence on a 1.5B model. Here each layer's input is
copied to host memory on a side CUDA stream while the forward goes on, and copied back ahead of its recompute: while
layer i is recomputed and backpropagated, layer i-1's input is already travelling back. GPU memory then no longer
grows with the number of layers.

Llama-family layers are recomputed in two parts, the attention, then the MLP tile by tile (models/recompute.py); the
first, gradient-free forward runs the MLP in the same tiles. Other layers (and layers with active dropout, whose masks
depend on the tiling) are recomputed whole.

On CUDA, a split layer's two passes (the gradient-free forward, the recompute and backward) are replayed as CUDA graphs
once their shapes come back (models/layer_graphs.py; `cuda_graphs`), which takes the host's launches out of short steps.

The layer's trainable weights are inputs of the checkpoint's autograd node, and its backward *returns* their
gradients (summed over the MLP tiles) instead of accumulating them from a backward of its own. Autograd then adds each
weight's gradient into `.grad` once per backward pass, from the outer graph, which is what DDP's reducer relies on:
its search for unused parameters walks that graph, and it refuses a second gradient for a weight in one pass. Under
FSDP and DeepSpeed the framework's own hooks run inside the recompute, on the weights it gathered, so
`weights_in_graph=False` keeps the recompute accumulating into them in place.

It plugs into transformers' own mechanism (`GradientCheckpointingLayer` calls `self._gradient_checkpointing_func`),
so the model code is untouched. On a CPU the same path runs with plain copies, which is what the tests exercise.
Each model keeps its own settings, side streams and counters (`OffloadState`, attached by
`enable_offloaded_checkpointing`): nothing here is process-global, so two models never see each other's tiles.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import deque
from dataclasses import dataclass, field

import torch

from slimrl.models import attention_store, layer_graphs
from slimrl.models.recompute import (
    SPLIT_LAYER_TYPES,
    Weights,
    layer_of,
    splittable_layer,
    trainable_weights,
)
from slimrl.models.unwrap import hf_model

_STATE = "_slimrl_offload"  # the attribute of the transformers model that holds its OffloadState
DEFAULT_MLP_TILE_TOKENS = 8192
MIN_OFFLOAD_BYTES = 32 * 2**20


@dataclass
class _Stash:
    """One layer call's input, parked in host memory between its forward and its backward."""

    host: torch.Tensor
    device: torch.device
    requires_grad: bool
    previous: _Stash | None = None  # the layer call just before this one in the same forward pass
    on_device: torch.Tensor | None = None  # set once copied back (possibly by the next layer's prefetch)
    ready: torch.cuda.Event | None = None
    consumed: bool = False
    rng_state: tuple | None = field(default=None, repr=False)
    attention: deque | None = None  # the layer call's stored attention (models/attention_store.py), when kept


class OffloadState:
    """One model's offloaded checkpointing: its settings, the side stream its copies run on (per device), the last
    parked stash (to chain a forward pass's layers for prefetching) and two counters.

    `enable_offloaded_checkpointing` attaches one to the model (`offload_state(model)` returns it) and installs its
    bound `checkpoint` as the model's checkpoint function, so two models never share settings, streams or a chain of
    stashes. A deep copy of a model gets a fresh state with the same settings.
    """

    def __init__(self, mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS, min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                 weights_in_graph: bool = True, attention_tokens: int = 0, cuda_graphs: bool = False):  # fmt: skip
        self.mlp_tile_tokens = mlp_tile_tokens  # MLP tile of the split recompute; 0: the whole sequence at once
        # Llama-family layers over sequences of at least this many tokens keep their attention's graph from the
        # forward (its saved tensors parked like the checkpoint), so the recompute skips it; 0: never
        self.attention_tokens = attention_tokens
        # True: the layer's trainable weights are inputs of the checkpoint node and their gradients come back through
        # it (once per backward pass). False: the recompute accumulates into .grad itself (FSDP, DeepSpeed).
        self.weights_in_graph = weights_in_graph
        # Checkpoints smaller than this stay on the GPU: 28 of them cost under 1 GiB, and their copies would cost more
        # time than they save memory.
        self.min_offload_bytes = min_offload_bytes
        self.offloaded = 0  # tensors parked in host memory so far (tests read it to know the copy path ran)
        self.split_recomputes = 0  # layers recomputed attention-then-MLP-tiles so far (tests read it)
        self.kept_attention = 0  # layer calls whose recompute took the attention stored by their forward
        # True: split layers' passes on CUDA are replayed as CUDA graphs once their shapes come back
        # (models/layer_graphs.py); needs weights_in_graph (sharded weights move between passes)
        self.cuda_graphs = cuda_graphs
        self.graphs: layer_graphs.LayerGraphs | None = None
        self.side: dict[torch.device, torch.cuda.Stream] = {}
        self.last: _Stash | None = None

    def __deepcopy__(self, memo) -> OffloadState:
        return OffloadState(self.mlp_tile_tokens, self.min_offload_bytes, self.weights_in_graph, self.attention_tokens,
                            self.cuda_graphs)  # fmt: skip

    def checkpoint(self, function, hidden_states, *args, preserve_rng_state: bool = True, **kwargs):
        """Drop-in for `torch.utils.checkpoint.checkpoint` as transformers calls it: function(hidden_states, *args)."""
        layer = layer_of(function)
        if kwargs:
            function = _bind(function, kwargs)
        if not torch.is_tensor(hidden_states):
            return function(hidden_states, *args)
        if not torch.is_grad_enabled():
            # a gradient-free pass (a reference model's, PPO's old log-probs) computes what the training forward
            # computes, op for op: in bf16 the MLP's tiles and the fused ops round differently from the whole layer
            split = splittable_layer(function, args)
            return function(hidden_states, *args) if split is None else layer_graphs.split_forward(self, *split,
                                                                                                    hidden_states)
        # An unknown layer's weights cannot be named, so its recompute accumulates into them (correct on one process)
        weights = trainable_weights(layer) if self.weights_in_graph and layer is not None else None
        # A grad-requiring anchor makes autograd call backward even when no input of the node requires grad (a frozen
        # embedding, with the weights accumulated by the recompute rather than passed in), so the weights still get
        # their gradients.
        anchor = torch.empty(0, device=hidden_states.device, requires_grad=True)
        count = -1 if weights is None else len(weights)
        return _OffloadedCheckpoint.apply(self, function, preserve_rng_state, count, hidden_states, anchor,
                                          *(weights or ()), *args)  # fmt: skip

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.side:
            self.side[device] = torch.cuda.Stream(device=device)
        return self.side[device]


def _park(state: OffloadState, tensor: torch.Tensor) -> _Stash:
    """Copy `tensor` to host memory: on CUDA asynchronously into pinned memory on the side stream."""
    if tensor.device.type == "cuda" and tensor.nbytes < state.min_offload_bytes:
        return _Stash(host=None, device=tensor.device, requires_grad=tensor.requires_grad, on_device=tensor.detach())
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        side = state.side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor must be computed before it is copied
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)  # keep the GPU memory alive until the copy has read it
    else:
        host = tensor.detach().to("cpu", copy=True)
    state.offloaded += 1
    return _Stash(host=host, device=tensor.device, requires_grad=tensor.requires_grad)


def _fetch(state: OffloadState, stash: _Stash) -> None:
    """Start copying a stash back to its device (no wait): the recompute waits on `stash.ready` when it needs it."""
    if stash.on_device is not None:
        return
    if stash.device.type == "cuda":
        side = state.side_stream(stash.device)
        with torch.cuda.stream(side):
            stash.on_device = stash.host.to(stash.device, non_blocking=True)
            stash.ready = torch.cuda.Event()
            stash.ready.record(side)
    else:
        stash.on_device = stash.host.to(stash.device, copy=True)


def _take(state: OffloadState, stash: _Stash) -> torch.Tensor:
    _fetch(state, stash)
    tensor = stash.on_device
    if stash.ready is not None:
        current = torch.cuda.current_stream(stash.device)
        current.wait_event(stash.ready)
        tensor.record_stream(current)  # allocated on the side stream, used on this one
    stash.on_device, stash.host, stash.consumed = None, None, True
    return tensor


class _OffloadedCheckpoint(torch.autograd.Function):
    """forward: run the layer without saving activations and park its input on the host.
    backward: bring the input back (prefetched), recompute the layer with grad, backpropagate through it, and return
    the gradients of its input, of its other tensor arguments and of its trainable weights.

    `num_weights` of the inputs after the anchor are the layer's trainable weights (their gradients are returned, so
    autograd accumulates each once per pass, from this graph); -1: none are passed and the recompute accumulates into
    whatever weights it reaches (`OffloadState.weights_in_graph` False, or a layer that cannot be named)."""

    @staticmethod
    def forward(ctx, state: OffloadState, function, preserve_rng: bool, num_weights: int, hidden_states, grad_anchor,
                *weights_and_args):  # fmt: skip
        weights, other_args = weights_and_args[: max(num_weights, 0)], weights_and_args[max(num_weights, 0) :]
        ctx.state, ctx.function, ctx.num_weights = state, function, num_weights
        ctx.autocast = _autocast_state(hidden_states.device)
        # other tensor inputs (position embeddings, masks) are small next to the hidden states: kept as they are
        ctx.save_for_backward(*weights, *[a for a in other_args if torch.is_tensor(a)])
        ctx.other_args = [None if torch.is_tensor(a) else a for a in other_args]
        stash = _park(state, hidden_states)
        if preserve_rng:
            stash.rng_state = _rng_state(hidden_states.device)
        last = state.last
        if last is not None and not last.consumed and last.device == stash.device:
            stash.previous = last
        state.last = stash
        ctx.stash = stash
        ctx.split = splittable_layer(function, other_args)
        if ctx.split is not None and 0 < state.attention_tokens <= hidden_states.shape[-2]:
            stash.attention = deque()
        with torch.no_grad():
            if ctx.split is None:
                return function(hidden_states, *other_args)
            with _attention_kept(state, stash.attention, replay=False):
                output = layer_graphs.split_forward(state, *ctx.split, hidden_states, kept_attention=stash.attention)
        if not stash.attention:  # nothing stored (the layer's attention is not slimrl's): the recompute runs it
            stash.attention = None
        return output

    @staticmethod
    def backward(ctx, *output_grads):
        state, stash = ctx.state, ctx.stash
        hidden_states = _take(state, stash).detach().requires_grad_(stash.requires_grad)
        if stash.previous is not None and not stash.previous.consumed:
            _fetch(state, stash.previous)  # overlap the previous layer's copy with this layer's recompute
        saved = iter(ctx.saved_tensors)
        weights = Weights([next(saved) for _ in range(ctx.num_weights)] if ctx.num_weights >= 0 else None)
        others = []
        for arg in ctx.other_args:
            if arg is None:
                tensor = next(saved)
                others.append(tensor.detach().requires_grad_(tensor.requires_grad))
            else:
                others.append(arg)
        with torch.random.fork_rng(devices=_rng_devices(hidden_states.device), enabled=stash.rng_state is not None):
            if stash.rng_state is not None:
                _set_rng_state(hidden_states.device, stash.rng_state)
            if ctx.split is not None:
                with torch.enable_grad(), torch.amp.autocast(hidden_states.device.type, **ctx.autocast), \
                        _attention_kept(state, stash.attention, replay=True):  # fmt: skip
                    input_grads = [layer_graphs.split_backward(state, *ctx.split, hidden_states, output_grads[0],
                                                               weights, kept_attention=stash.attention)]  # fmt: skip
                if stash.previous is not None and not stash.previous.consumed:
                    # the previous layer's stored attention output, once this layer's tensors are gone (not
                    # earlier: it would add to this layer's peak); its replay then fetches the rest
                    attention_store.fetch_outputs(stash.previous.attention)
                state.kept_attention += stash.attention is not None and len(stash.attention) == 0
                stash.attention = None
            else:
                with torch.enable_grad(), torch.amp.autocast(hidden_states.device.type, **ctx.autocast):
                    outputs = ctx.function(hidden_states, *others)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                pairs = [(o, g) for o, g in zip(outputs, output_grads, strict=False)
                         if torch.is_tensor(o) and o.requires_grad and g is not None]  # fmt: skip
                input_grads = weights.backprop([o for o, _ in pairs], [g for _, g in pairs], [hidden_states, *others])
        ctx.state = ctx.function = ctx.other_args = ctx.stash = ctx.split = None
        other_grads = input_grads[1:] + [None] * (len(others) + 1 - len(input_grads))
        return (None, None, None, None, input_grads[0], None, *weights.grads(), *other_grads)


def _attention_kept(state: OffloadState, records: deque | None, replay: bool):
    """The block in which the layer's attention is stored (forward) or replayed (recompute), when it is kept."""
    if records is None:
        return contextlib.nullcontext()
    return attention_store.replaying(records) if replay else attention_store.recording(state, records)


def _bind(function, kwargs):
    def bound(*args):
        return function(*args, **kwargs)

    return bound


def _autocast_state(device: torch.device) -> dict:
    device_type = device.type
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type)}


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple:
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda_state


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def offload_state(model) -> OffloadState | None:
    """The model's offloaded-checkpointing state (settings and counters), or None when it is not enabled."""
    return getattr(hf_model(model), _STATE, None)


def _install(model, state: OffloadState) -> None:
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = state.checkpoint
            # transformers >= 5.24 wraps the layer class's forward (functools.wraps leaves __wrapped__) and runs it
            # plain without grad; earlier versions call the checkpoint function then too
            if type(module).__name__ in SPLIT_LAYER_TYPES and hasattr(type(module).forward, "__wrapped__"):
                _route_gradient_free_calls(module)


def _route_gradient_free_calls(layer) -> None:
    """Give `layer` an instance forward that sends gradient-free calls through the checkpoint function. A forward the
    instance already has (accelerate's device-map hooks put one there) is kept and called inside ours."""
    current = vars(layer).get("forward")
    if getattr(current, "__func__", None) is _checkpointed_without_grad:
        return
    vars(layer)["_slimrl_inner_forward"] = current  # None: the class's own forward
    layer.forward = types.MethodType(_checkpointed_without_grad, layer)


def _uninstall(model) -> None:
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is _checkpointed_without_grad:
            inner = vars(module).pop("_slimrl_inner_forward", None)
            del module.forward
            if inner is not None:
                module.forward = inner


def _checkpointed_without_grad(layer, *args, **kwargs):
    """A decoder layer's forward whose gradient-free calls in training mode, with checkpointing on, go through the
    checkpoint function as calls with grad do: a reference pass or PPO's old log-probs then compute what the training
    forward computes, MLP tiles and fused ops included (transformers >= 5.24 runs such a call as the plain layer)."""
    forward = vars(layer).get("_slimrl_inner_forward") or functools.partial(type(layer).forward, layer)
    if torch.is_grad_enabled() or not args or not (layer.training and layer.gradient_checkpointing):
        return forward(*args, **kwargs)
    return layer._gradient_checkpointing_func(functools.partial(forward, **kwargs), *args)


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
    """transformers' method, then this model's offloading checkpoint function installed again (bound per model)."""
    # newer transformers route `activation_checkpointing_enable(every_n_layers=..., offload=...)` here
    self._slimrl_original_gc_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)
    state = getattr(self, _STATE, None)
    if state is not None:
        _install(self, state)


def enable_offloaded_checkpointing(
    model,
    mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
    *,
    min_offload_bytes: int = MIN_OFFLOAD_BYTES,
    weights_in_graph: bool = True,
    attention_tokens: int = 0,
    cuda_graphs: bool = False,
) -> OffloadState:
    """Checkpoint every decoder layer with offloading to host memory; returns the model's `OffloadState`. Survives
    later `gradient_checkpointing_enable` calls (HF Trainer makes one when `gradient_checkpointing=True`): they
    re-install the offloading function. `mlp_tile_tokens` (0: no tiling) sets the MLP tile of the split recompute;
    checkpoints under `min_offload_bytes` stay on the GPU; `weights_in_graph=False` (FSDP, ZeRO-3) lets the recompute
    accumulate into the weights itself; layers over sequences of at least `attention_tokens` tokens (0: none) keep
    their attention from the forward instead of recomputing it (models/attention_store.py); `cuda_graphs` replays the
    split layers' passes on CUDA as graphs once their shapes repeat (models/layer_graphs.py). Calling it again updates
    the settings."""
    if mlp_tile_tokens < 0:
        raise ValueError(f"mlp_tile_tokens must be >= 0, got {mlp_tile_tokens}")
    if attention_tokens < 0:
        raise ValueError(f"attention_tokens must be >= 0, got {attention_tokens}")
    base = hf_model(model)
    state = getattr(base, _STATE, None)
    if state is None:
        state = OffloadState(mlp_tile_tokens, min_offload_bytes, weights_in_graph, attention_tokens, cuda_graphs)
        base._slimrl_original_gc_enable = base.gradient_checkpointing_enable
        base.gradient_checkpointing_enable = types.MethodType(_gradient_checkpointing_enable, base)
        setattr(base, _STATE, state)
    state.mlp_tile_tokens, state.min_offload_bytes, state.weights_in_graph, state.attention_tokens = (
        mlp_tile_tokens, min_offload_bytes, weights_in_graph, attention_tokens)
    if state.cuda_graphs != cuda_graphs:
        state.cuda_graphs, state.graphs = cuda_graphs, None
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return state


def disable_offloaded_checkpointing(model) -> None:
    """Back to transformers' own checkpointing (still enabled, with torch's checkpoint)."""
    base = hf_model(model)
    if getattr(base, _STATE, None) is not None:
        delattr(base, _STATE)
        _uninstall(base)
        base.gradient_checkpointing_enable = base._slimrl_original_gc_enable
        del base._slimrl_original_gc_enable
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_offloaded_checkpointing(model) -> bool:
    return offload_state(model) is not None


def gradient_free_forward(model, gradient_checkpointing_kwargs: dict | None = None):
    """The context of a gradient-free forward that must agree with the training forward (a reference pass, old
    log-probs): TRL's `disable_gradient_checkpointing`, except under offloaded checkpointing, whose checkpoint
    function computes without grad exactly what the checkpointed training forward computes."""
    if is_offloaded_checkpointing(model):
        return contextlib.nullcontext()
    from trl.models.utils import disable_gradient_checkpointing

    return disable_gradient_checkpointing(model, gradient_checkpointing_kwargs)
