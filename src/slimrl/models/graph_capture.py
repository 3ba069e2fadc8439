"""What the layer graphs (models/layer_graphs.py) capture with: the static buffers of one input shape, a captured
pass, the capture itself (ending a failed one's allocation into the pool), the weights' aliases a captured backward
runs on, and the flat layout of the weights' gradients."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from slimrl.models.recompute import _walk

logger = logging.getLogger(__name__)


class Statics:
    """The static inputs of one input shape's graphs (shared by every layer: a pass copies its inputs in before its
    replay) and their result buffers, all outside the graphs' pool, allocated on the stream that uses them."""

    def __init__(self, kwargs: dict, stream: torch.cuda.Stream):
        self.stream = stream
        with torch.cuda.stream(stream):
            self.kwargs = {name: empty_like(value) for name, value in kwargs.items()}
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


def empty_like(value):
    """An uninitialised tensor like `value` (or a tuple or list of them); anything else as it is."""
    if torch.is_tensor(value):
        return torch.empty_like(value)
    if isinstance(value, tuple | list) and value and all(torch.is_tensor(v) for v in value):
        return type(value)(torch.empty_like(v) for v in value)
    return value


class Graph:
    """One captured pass: its graph, its shape's statics, its result buffer, (a backward) its weight gradients'
    `flat_layout`, and (a layer keeping its attention) the kept attention's layout (attention_store.Layout)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, statics: Statics, input_grad: torch.Tensor | None = None,
                 layout: tuple = (), out: torch.Tensor | None = None, kept=None):  # fmt: skip
        self.graph, self.statics, self.input_grad, self.layout, self.out = graph, statics, input_grad, layout, out
        self.kept = kept


def captured(graph: torch.cuda.CUDAGraph, pool, body: Callable) -> None:
    """Capture `body()` into `graph` on the current stream. A failed capture raises the error that broke it and ends
    the allocation into the pool (left on, every later capture fails and freed memory waits)."""
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        body()
    except BaseException:
        try:
            graph.capture_end()
        except Exception:
            stop_allocating_to(pool)
        raise
    try:
        graph.capture_end()
    except Exception:
        stop_allocating_to(pool)
        raise


def stop_allocating_to(pool) -> None:
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except Exception as error:  # nothing to stop
        logger.debug("slimrl: no allocation into the graphs' pool to stop (%s)", error)


@contextlib.contextmanager
def aliased(layer: torch.nn.Module, params: tuple) -> Iterator[list[torch.Tensor]]:
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


def flat_layout(params: tuple, sums: list) -> tuple:
    """(index, dtype, offset, numel) of each weight with a gradient, in its dtype's flat buffer."""
    offsets: dict = {}
    layout = []
    for index, (param, grad) in enumerate(zip(params, sums, strict=True)):
        if grad is not None:
            offset = offsets.get(grad.dtype, 0)
            layout.append((index, grad.dtype, offset, param.numel()))
            offsets[grad.dtype] = offset + param.numel()
    return tuple(layout)


def totals(layout: tuple) -> dict:
    totals: dict = {}
    for _, dtype, offset, numel in layout:
        totals[dtype] = max(totals.get(dtype, 0), offset + numel)
    return totals
