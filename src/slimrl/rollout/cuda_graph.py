"""The decode step as a CUDA graph: warm-up, capture, and what a graph bakes in (its fingerprint).

A captured step replays every launch with the addresses it saw. The model's tensors are read in place (an optimizer
step changes their values, not their addresses, so the graph sees it); a new tensor (a new adapter, a re-loaded
weight) changes the fingerprint and the engine captures again. The KV cache is baked in too, unless every kernel
reached it through the session's address table (the fused decode kernels with Triton attention), which is what
lets a graph outlive `release()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.session import Session


def fingerprint(decoder: Decoder, session: Session) -> tuple:
    """What the session's graph bakes in: the model's tensors, and the cache's unless it reads them through the
    table."""
    cache = (session.cache.data_ptrs(),) if session.graph_bakes_cache else ()
    return decoder.fingerprint() + cache


def capture(session: Session, step: Callable[[Session], None], device: torch.device) -> None:
    """Warm up (compiles, lazy inits, scratch growth) on a side stream, then capture one `step(session)`."""
    session.graph = None
    session.reset_for_capture()
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(session)
    torch.cuda.current_stream(device).wait_stream(stream)
    session.reset_for_capture()
    # a private pool of its own: the replaced graph's pool may be gone with it (reusing that handle trips the
    # caching allocator); the graphs kept for other shapes each hold their own
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        step(session)
    session.graph = graph
    session.graph_bakes_cache = session.step_bakes_cache


def ensure_captured(decoder: Decoder, session: Session, step: Callable[[Session], None], device) -> bool:
    """Capture unless the session's graph is valid for the model's current tensors; whether it captured."""
    if session.graph is not None and session.fingerprint == fingerprint(decoder, session):
        return False
    capture(session, step, device)
    session.fingerprint = fingerprint(decoder, session)
    return True
