"""A stored graph's backward without autograd's engine (models/node_backprop.py): the same gradients as
`torch.autograd.grad`, bit for bit, called on its own and from inside an engine task that asks for other inputs
(where a node called directly would compute none of them), with an input used twice and one unused; the graph can
run again (its saved tensors stay)."""

from __future__ import annotations

import torch

from slimrl.models.node_backprop import backprop


def stored_graph():
    """q, k, v entering through nodes of their own (as the kept attention's do), a graph over them, its output."""
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 4, 9, 8, generator=generator) for _ in range(3)]
    anchor = torch.empty(0, requires_grad=True)
    q, k, v = [t + anchor.sum() for t in leaves]  # a node each, like attention_store._Entry
    unused = leaves[0] * anchor.sum()
    scores = torch.softmax(q @ k.transpose(-1, -2) / 3, dim=-1)
    out = (scores @ v + q.exp()).transpose(1, 2).contiguous()  # q read twice
    edges = [torch.autograd.graph.get_gradient_edge(t) for t in (q, k, v, unused)]
    return torch.autograd.graph.get_gradient_edge(out), edges, torch.randn(out.shape, generator=generator)


class _Outer(torch.autograd.Function):
    """A node whose backward runs `backprop` over a stored graph, inside the engine's task for its own graph."""

    @staticmethod
    def forward(ctx, x, root, edges, grad, found):
        ctx.stored = (root, edges, grad, found)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        root, edges, grad, found = ctx.stored
        found.append(backprop(root, grad, edges))
        return g * 2, None, None, None, None


def test_direct_calls_give_the_engines_gradients_inside_and_outside_an_engine_task():
    root, edges, grad = stored_graph()
    expected = torch.autograd.grad([root], edges, [grad], retain_graph=True, allow_unused=True)
    assert expected[3] is None and all(t is not None for t in expected[:3])
    alone = backprop(root, grad, edges)
    again = backprop(root, grad, edges)  # the saved tensors are still there
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    found = []
    out = _Outer.apply(x, root, edges, grad, found) + y
    (gx,) = torch.autograd.grad(out.sum(), [x])  # a task that asks for x alone, with the stored graph outside it
    assert torch.equal(gx, torch.full((3,), 2.0))
    for result in (alone, again, found[0]):
        assert result[3] is None
        for got, want in zip(result[:3], expected[:3], strict=True):
            assert torch.equal(got, want)
