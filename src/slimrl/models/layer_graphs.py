"""CUDA graphs of the offloaded checkpoints' layer passes: a decoder layer's gradient-free forward and its
recompute-and-backward, each replayed as one graph launch once the same shapes come back.

A short sequence's step is host-bound (W1 at 1,024 tokens: 240 ms of kernels in a 400 ms step, about 8,000 launches,
nearly all in the layer passes); a pass's work is the same whenever its shapes are, so one graph launch replays it.

How a pass runs (`LayerGraphs.forward` / `.backward`, for the split, Llama-family layers on CUDA):
- Its key (models/graph_keys.py) holds what a replay would not see change. A key seen once runs eagerly (a shape that
  never comes back costs no capture); the second time the pass runs eagerly and is then captured (the capture runs
  nothing; one warm-up per capturing thread makes the stream's lazy state first); from then on it is replayed.
- Inputs are copied into static buffers (one set per shape, shared by the layers and the two passes; the rotary
  tables once per forward pass); the result goes into a static buffer outside the graphs' private pool and is cloned
  after the replay, so it never aliases memory a later replay writes. The pool, shared by the model's graphs, is only
  their scratch: it holds about one pass's transient memory, as the eager pass's own.
- The weights' gradients come back through the checkpoint node as before (one per weight per pass, for DDP): the
  captured pass runs on aliases of the weights made on its stream and writes their gradients into one flat buffer
  per dtype, cloned after the replay.
- A failed capture is logged once and its key stays eager. At most `max_shapes` shapes keep graphs (LRU); once every
  layer has run both passes without a replay, all graphs and buffers go.

Not used for sharded weights (FSDP, DeepSpeed), layers keeping their attention (its records live in host memory),
active dropout (not split), keyword arguments other than tensors and plain values (a KV cache), or a CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from slimrl.models import recompute
from slimrl.models.graph_keys import global_state, kwargs_signature, layer_state, tensor_signature
from slimrl.models.recompute import RecomputeState, Weights, _walk

logger = logging.getLogger(__name__)

CAPTURE_AFTER = 2  # a key runs eagerly until it is seen this many times, then it is captured and replayed
KEPT_COUNTS = 64  # keys counted but not captured, per layer, before the counts start again


def split_forward(state: RecomputeState, layer, kwargs: dict, hidden_states: torch.Tensor,
                  kept_attention=None) -> torch.Tensor:  # fmt: skip
    """The split layer's gradient-free forward (recompute.split_forward), from a CUDA graph where `_graphs_for`
    allows one."""
    graphs = _graphs_for(state, hidden_states, kept_attention)
    if graphs is None:
        return recompute.split_forward(state, layer, kwargs, hidden_states)

    def run(x, keywords):
        return recompute.split_forward(state, layer, keywords, x)

    return graphs.forward(layer, kwargs, hidden_states, run)


def split_backward(state: RecomputeState, layer, kwargs: dict, hidden_states: torch.Tensor, grad_output: torch.Tensor,
                   weights: Weights, kept_attention=None) -> torch.Tensor | None:  # fmt: skip
    """The split layer's recompute and backward (recompute.split_backward), from a CUDA graph where `_graphs_for`
    allows one."""
    graphs = None if weights.params is None else _graphs_for(state, hidden_states, kept_attention)
    if graphs is None:
        return recompute.split_backward(state, layer, kwargs, hidden_states, grad_output, weights)
    before = state.split_recomputes  # a capture runs the pass eagerly and then captures it, a replay runs no Python

    def run(x, grad, into, keywords):
        return recompute.split_backward(state, layer, keywords, x, grad, into)

    grad = graphs.backward(layer, kwargs, hidden_states, grad_output, weights, run)
    state.split_recomputes = before + 1
    return grad


def _graphs_for(state, hidden_states: torch.Tensor, kept_attention) -> LayerGraphs | None:
    """The model's layer graphs (made on first use) when this pass may use them: CUDA on the current device (not a
    layer of a model split over devices), the state's `cuda_graphs` on, the weights passed through the checkpoint
    node (`weights_in_graph`), the attention not kept from the forward (its records live outside any graph)."""
    usable = hidden_states.is_cuda and hidden_states.device.index == torch.cuda.current_device()
    if not (usable and state.cuda_graphs and state.weights_in_graph and kept_attention is None):
        if state.graphs is not None:
            state.graphs.ran_eagerly()
        return None
    if state.graphs is None:
        state.graphs = LayerGraphs()
    return state.graphs


class _Statics:
    """The static inputs of one input shape's graphs (shared by every layer: a pass copies its inputs in before its
    replay) and their result buffers, all outside the graphs' pool, allocated on the stream that uses them."""

    def __init__(self, kwargs: dict, stream: torch.cuda.Stream):
        self.stream = stream
        with torch.cuda.stream(stream):
            self.kwargs = {name: _empty_like(value) for name, value in kwargs.items()}
        self.sources: dict = {}  # (name, index) -> (the tensor last copied in, its version)
        self.buffers: dict = {}  # (name, shape, dtype) -> a static tensor (made on first use)

    def buffer(self, name: str, like: torch.Tensor, requires_grad: bool = False, shape: tuple | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
        """The static tensor `name` with `like`'s shape and dtype (or those given) on its device. Made the first time
        (before a capture, never in one); a graph holds its address, so it is never replaced."""
        shape, dtype = tuple(like.shape) if shape is None else shape, like.dtype if dtype is None else dtype
        key = (name, shape, dtype)
        found = self.buffers.get(key)
        if found is None:
            with torch.cuda.stream(self.stream):
                found = self.buffers[key] = torch.empty(shape, dtype=dtype, device=like.device)
        if found.requires_grad != requires_grad:
            found.requires_grad_(requires_grad)
        return found

    def load_kwargs(self, kwargs: dict) -> None:
        """Copy the keyword tensors in, skipping one already copied and not modified since (the rotary tables are
        the same tensors for every layer of a pass)."""
        with torch.no_grad():
            for name, value in kwargs.items():
                static = self.kwargs[name]
                pairs = [(value, static)] if torch.is_tensor(value) else \
                    list(zip(value, static, strict=True)) if isinstance(value, tuple | list) else []  # fmt: skip
                for index, (source, target) in enumerate(pairs):
                    seen = self.sources.get((name, index))
                    if seen is None or seen[0] is not source or seen[1] != source._version:
                        target.copy_(source)
                        self.sources[(name, index)] = (source, source._version)


def _empty_like(value):
    if torch.is_tensor(value):
        return torch.empty_like(value)
    if isinstance(value, tuple | list) and value and all(torch.is_tensor(v) for v in value):
        return type(value)(torch.empty_like(v) for v in value)
    return value


class _Graph:
    """One captured pass: its graph, buffers, result buffer and (a backward) its weight gradients' `_flat_layout`."""

    def __init__(self, graph: torch.cuda.CUDAGraph, statics: _Statics, input_grad: torch.Tensor | None = None,
                 layout: tuple = (), out: torch.Tensor | None = None):  # fmt: skip
        self.graph, self.statics, self.input_grad, self.layout, self.out = graph, statics, input_grad, layout, out


class LayerGraphs:
    """One model's captured layer passes, their static buffers and the private memory pool they share."""

    def __init__(self, max_shapes: int = 2):
        self.max_shapes = max_shapes
        self.entries: dict = {}  # key -> _Graph, or the number of times the key was seen (int), or "eager"
        self.shapes: OrderedDict = OrderedDict()  # shape key -> _Statics, least recently used first
        self.pool = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.warmed: set[int] = set()  # threads that ran a warm-up on the capture stream
        self.captures = 0  # passes captured so far (tests read these)
        self.replays = 0
        self.failures = 0
        self.releases = 0
        self.layers: set[int] = set()  # the layers seen (ids)
        self.idle = 0  # passes run eagerly since the last replay

    # -- the two passes -------------------------------------------------------------------------------------------
    def forward(self, layer, kwargs: dict, hidden_states: torch.Tensor, run: Callable) -> torch.Tensor:
        """`run(hidden_states, kwargs)` (the layer's gradient-free split forward), replayed from a graph once its key
        has come back."""
        key = self._key("forward", layer, kwargs, hidden_states, ())
        entry = self._entry(key)
        if entry is None:
            return run(hidden_states, kwargs)
        statics = self._statics(key, kwargs)
        if isinstance(entry, _Graph):
            self._load(statics, kwargs, {"x": hidden_states})
            entry.graph.replay()
            self.replays += 1
            return entry.out.clone()
        # this call's result eagerly, then the capture into static buffers shaped after it (nothing runs in a capture)
        result = run(hidden_states, kwargs)
        x = self._load(statics, kwargs, {"x": hidden_states})["x"]
        out = statics.buffer("result", result)

        def body():
            out.copy_(run(x, statics.kwargs))

        graph = self._capture(key, hidden_states.device, body)
        if graph is not None:
            self.entries[key] = _Graph(graph, statics, out=out)
        return result

    def backward(self, layer, kwargs: dict, hidden_states: torch.Tensor, grad_output: torch.Tensor, weights: Weights,
                 run: Callable) -> torch.Tensor | None:  # fmt: skip
        """`run(hidden_states, grad_output, weights, kwargs)` (the layer's recompute and backward: returns the input's
        gradient and adds the weights' to `weights`, a fresh one per pass), replayed from a graph once its key has
        come back."""
        params = tuple(weights.params)
        extra = (tensor_signature(grad_output), hidden_states.requires_grad,
                 tuple((id(p), tensor_signature(p)) for p in params))  # fmt: skip
        key = self._key("backward", layer, kwargs, hidden_states, extra)
        entry = self._entry(key)
        if entry is None or any(s is not None for s in weights.sums):
            return run(hidden_states, grad_output, weights, kwargs)
        statics = self._statics(key, kwargs)
        inputs = {"x": hidden_states, "grad_output": grad_output}
        if isinstance(entry, _Graph):
            self._load(statics, kwargs, inputs, requires_grad=hidden_states.requires_grad)
            entry.graph.replay()
            self.replays += 1
            return self._backward_results(entry, weights)
        # this call's gradients eagerly, then the capture into static buffers shaped after them
        result = run(hidden_states, grad_output, weights, kwargs)
        layout = _flat_layout(params, weights.sums)
        flats = {dtype: statics.buffer("grads", hidden_states, shape=(total,), dtype=dtype)
                 for dtype, total in _totals(layout).items()}  # fmt: skip
        grad_input = None if result is None else statics.buffer("result", result)
        static = self._load(statics, kwargs, inputs, requires_grad=hidden_states.requires_grad)
        x, grad = static["x"], static["grad_output"]

        def body():
            with _aliased(layer, params) as aliases:
                inner = Weights(aliases)
                input_grad = run(x, grad, inner, statics.kwargs)
            if _flat_layout(params, inner.sums) != layout or (input_grad is None) != (grad_input is None):
                raise RuntimeError("the captured pass's gradients are not the eager pass's")
            for index, dtype, offset, numel in layout:
                flats[dtype][offset : offset + numel].copy_(inner.sums[index].reshape(-1))
            if input_grad is not None:
                grad_input.copy_(input_grad)
            del inner, input_grad  # nothing the capture made outlives it

        graph = self._capture(key, hidden_states.device, body)
        if graph is not None:
            self.entries[key] = _Graph(graph, statics, grad_input, layout)
        return result

    # -- keys, entries, buffers -----------------------------------------------------------------------------------
    def _key(self, kind: str, layer, kwargs: dict, hidden_states: torch.Tensor, extra: tuple) -> tuple | None:
        signature = kwargs_signature(kwargs)
        if signature is None:
            return None
        shape = (tensor_signature(hidden_states), signature)
        return kind, shape, id(layer), layer_state(layer), global_state(hidden_states.device), extra

    def _entry(self, key):
        """The key's graph, "capture" when it is due, or None (run eagerly)."""
        if key is None:
            self.ran_eagerly()
            return None
        self.layers.add(key[2])
        found = self.entries.get(key, 0)
        if isinstance(found, _Graph):
            self.shapes.move_to_end(key[1])
            self.idle = 0
            return found
        self.ran_eagerly()
        if found == "eager":
            return None
        if found == 0 and len(self.entries) > KEPT_COUNTS * len(self.layers):  # shapes seen once, long ago
            self.entries = {k: v for k, v in self.entries.items() if not isinstance(v, int)}
        self.entries[key] = found + 1
        return "capture" if found + 1 >= CAPTURE_AFTER else None

    def ran_eagerly(self) -> None:
        """Count a pass that replayed nothing; once every layer has run both passes so, the graphs are out of use
        (the shapes moved on) and `release` lets them and their buffers go."""
        self.idle += 1
        if self.shapes and self.idle > 2 * len(self.layers):
            self.release()

    def release(self) -> None:
        torch.cuda.current_stream().synchronize()  # no replay of a graph let go is still running
        # the counts stay: a shape the passes moved on to is captured when it comes back, as before
        self.entries = {k: v for k, v in self.entries.items() if not isinstance(v, _Graph)}
        self.shapes, self.pool, self.idle = OrderedDict(), None, 0
        self.releases += 1

    def _statics(self, key: tuple, kwargs: dict) -> _Statics:
        shape = key[1]
        statics = self.shapes.get(shape)
        if statics is None:
            while len(self.shapes) >= self.max_shapes:
                torch.cuda.current_stream().synchronize()  # no replay of a graph let go is still running
                old, _ = self.shapes.popitem(last=False)
                self.entries = {k: v for k, v in self.entries.items() if k[1] != old}
            statics = self.shapes[shape] = _Statics(kwargs, torch.cuda.current_stream())
        self.shapes.move_to_end(shape)
        return statics

    @staticmethod
    def _load(statics: _Statics, kwargs: dict, inputs: dict, requires_grad: bool = False) -> dict:
        statics.load_kwargs(kwargs)
        loaded = {}
        with torch.no_grad():
            for name, tensor in inputs.items():
                static = statics.buffer(name, tensor, requires_grad=requires_grad and name == "x")
                static.copy_(tensor)
                loaded[name] = static
        return loaded

    def _backward_results(self, entry: _Graph, weights: Weights) -> torch.Tensor | None:
        statics, params = entry.statics, weights.params
        flats = {dtype: statics.buffers[("grads", (total,), dtype)].clone()
                 for dtype, total in _totals(entry.layout).items()}  # fmt: skip
        for index, dtype, offset, numel in entry.layout:
            grad = flats[dtype][offset : offset + numel].view(params[index].shape)
            weights.sums[index] = grad if weights.sums[index] is None else weights.sums[index].add_(grad)
        return None if entry.input_grad is None else entry.input_grad.clone()

    def _capture(self, key: tuple, device: torch.device, body: Callable) -> torch.cuda.CUDAGraph | None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        current = torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        try:
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                if threading.get_ident() not in self.warmed:
                    # once per thread (forward passes run on the caller's, backward passes on autograd's): what is
                    # made lazily per stream and thread (cuBLAS's handle and workspace) is made here, not in a
                    # capture; the pass's shapes ran eagerly before (autotuning, attention plans). The warm-up's
                    # memory, cached for the capture stream alone, goes back.
                    body()
                    self.warmed.add(threading.get_ident())
                    torch.cuda.empty_cache()
                _captured(graph, self.pool, body)
            current.wait_stream(stream)
        except Exception as error:  # a pass a graph cannot hold: eager from now on
            current.wait_stream(stream)
            self.entries[key] = "eager"
            self.failures += 1
            logger.warning("slimrl: a decoder layer's %s pass runs without CUDA graphs: capturing it failed (%s: %s)",
                           key[0], type(error).__name__, error)  # fmt: skip
            return None
        self.captures += 1
        self.idle = 0
        return graph


def _captured(graph: torch.cuda.CUDAGraph, pool, body: Callable) -> None:
    """Capture `body()` into `graph` on the current stream. A failed capture raises the error that broke it and ends
    the allocation into the pool (left on, every later capture fails and freed memory waits)."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        body()
    except BaseException:
        try:
            graph.capture_end()
        except Exception:
            _stop_allocating_to(pool)
        raise
    try:
        graph.capture_end()
    except Exception:
        _stop_allocating_to(pool)
        raise


def _stop_allocating_to(pool) -> None:
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except Exception as error:  # nothing to stop
        logger.debug("slimrl: no allocation into the graphs' pool to stop (%s)", error)


@contextlib.contextmanager
def _aliased(layer: torch.nn.Module, params: tuple) -> Iterator[list[torch.Tensor]]:
    """The layer with each of `params` replaced by an alias (the same memory, a leaf of its own made on the current
    stream), yielding the aliases in `params`' order. A captured backward must take its weights' gradients at
    leaves whose autograd nodes run on the capture stream: the weights' own nodes were made on the stream of the
    training forward, and autograd would join that stream into the capture (which breaks it)."""
    aliases = {id(p): p.detach().requires_grad_(p.requires_grad) for p in params}
    slots = [(module, name, param) for module, name, param in _walk(layer).params if id(param) in aliases]
    for module, name, param in slots:
        module._parameters[name] = aliases[id(param)]
    try:
        yield [aliases[id(p)] for p in params]
    finally:
        for module, name, param in slots:
            module._parameters[name] = param


def _flat_layout(params: tuple, sums: list) -> tuple:
    """(index, dtype, offset, numel) of each weight with a gradient, in its dtype's flat buffer."""
    offsets: dict = {}
    layout = []
    for index, (param, grad) in enumerate(zip(params, sums, strict=True)):
        if grad is not None:
            offset = offsets.get(grad.dtype, 0)
            layout.append((index, grad.dtype, offset, param.numel()))
            offsets[grad.dtype] = offset + param.numel()
    return tuple(layout)


def _totals(layout: tuple) -> dict:
    totals: dict = {}
    for _, dtype, offset, numel in layout:
        totals[dtype] = max(totals.get(dtype, 0), offset + numel)
    return totals
