"""Sessions: one cache at a time; graphs that outlive their cache kept for a few other shapes."""

from __future__ import annotations

from slimrl.rollout import session as session_module
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.sampling import SamplingParams
from slimrl.rollout.session import Session, Sessions
from tests.rollout.helpers import build


def new_session(decoder, seq_len: int, graph: bool = True) -> Session:
    session = Session(decoder, 2, seq_len, SamplingParams(), set(), fused_sampling=False)
    if graph:  # what a capture through the address table leaves: a graph that does not bake the cache in
        session.graph, session.graph_bakes_cache = object(), False
    return session


def test_only_the_current_shape_holds_a_cache_and_idle_graphs_come_back():
    decoder = Decoder(build("llama"))
    sessions = Sessions()
    first = sessions.get(("a",), lambda: new_session(decoder, 128))
    second = sessions.get(("b",), lambda: new_session(decoder, 256))
    assert first.cache is None and second.cache is not None, "the previous shape's cache is freed first"
    again = sessions.get(("a",), lambda: new_session(decoder, 128))
    assert again is first and first.cache is not None and second.cache is None
    sessions.release()
    assert first.cache is None and first.graph is not None and sessions.held_bytes() == 0


def test_graphs_that_bake_the_cache_in_are_not_kept_and_at_most_four_are():
    decoder = Decoder(build("llama"))
    sessions = Sessions()
    baked = sessions.get(("baked",), lambda: new_session(decoder, 128, graph=False))
    made = [sessions.get((i,), lambda: new_session(decoder, 128)) for i in range(6)]
    assert baked.graph is None and baked.cache is None
    kept = [s for s in made[:-1] if s.graph is not None]
    assert kept == made[-1 - session_module.IDLE_GRAPHS : -1], "the oldest idle graphs go first"
    sessions.release(keep_graph=False)
    assert all(s.graph is None and s.cache is None for s in made)
