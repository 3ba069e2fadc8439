"""A stored autograd graph's backward without autograd's engine: its nodes called directly, in order, on the current
stream. models/attention_store.py runs the kept attention's stored graph so. The engine would run each node on the
stream its forward ran on (the default stream, which a CUDA graph's capture on another stream cannot include) and
free the graph's saved tensors as it goes; called directly, the nodes run where the caller runs, inside a capture
too, and the same stored graph can run again (an eager backward, then the capture of the same pass).

A node called inside an engine task that asked for the gradients of some inputs (`torch.autograd.grad(...,
inputs)`, as the recompute does) computes only the gradients that task needs, and the stored graph's nodes are not
in it: the nodes are called from the backward of a node of their own, in a nested task that asks for none
(`_Own`)."""

from __future__ import annotations

import heapq
import itertools

import torch


class _Own(torch.autograd.Function):
    """A node whose backward runs `work()`: run by `torch.autograd.backward` with no inputs named, in a task of its
    own (on the current stream, where it was made)."""

    @staticmethod
    def forward(ctx, anchor, work):
        ctx.work = work
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, grad):
        work, ctx.work = ctx.work, None
        work()
        return None, None


def backprop(root, grad: torch.Tensor, inputs: list) -> list:
    """`_backprop(root, grad, inputs)` in an autograd task of its own (see the module docstring)."""
    found = []
    anchor = torch.empty(0, device=grad.device, requires_grad=True)
    with torch.enable_grad():
        out = _Own.apply(anchor, lambda: found.append(_backprop(root, grad, inputs)))
    torch.autograd.backward([out], [torch.empty_like(out)])
    return found[0]


def _backprop(root, grad: torch.Tensor, inputs: list) -> list:
    """The gradients reaching the gradient edges `inputs` from the edge `root` given `grad`: the nodes between them
    called directly on the current stream, each once, later-made ones first (as autograd's engine orders them), the
    gradients reaching one input of a node summed as they arrive. Autograd's engine would run each node on the
    stream its forward ran on, outside a graph's capture, and free the saved tensors; this does neither."""
    stops = {edge.node for edge in inputs}
    waiting: dict = {}  # node -> number of edges into it not yet followed
    stack, seen = [root.node], {root.node}
    while stack:
        node = stack.pop()
        if node in stops:
            continue
        for child, _ in node.next_functions:
            if child is not None:
                waiting[child] = waiting.get(child, 0) + 1
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    slots = {root.node: [None] * len(root.node._input_metadata)}
    slots[root.node][root.output_nr] = grad
    pushed = itertools.count()  # ties in the order (nodes made on other threads) never compare the nodes
    ready = [(-root.node._sequence_nr(), next(pushed), root.node)]
    arrived: dict = {}
    while ready:
        node = heapq.heappop(ready)[2]
        grads = slots.pop(node)
        if node in stops:
            arrived[node] = grads
            continue
        results = node(*grads)
        if results is None or torch.is_tensor(results):
            results = (results,)
        for (child, number), result in zip(node.next_functions, results, strict=False):
            if child is None:
                continue
            slot = slots.setdefault(child, [None] * len(child._input_metadata))
            if result is not None:
                slot[number] = result if slot[number] is None else slot[number] + result
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, (-child._sequence_nr(), next(pushed), child))
    return [arrived[edge.node][edge.output_nr] if edge.node in arrived else None for edge in inputs]
