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
- A layer keeping its attention (models/attention_store.py) has the attention's saved storages (its output, its
  log-sum-exp) go through static byte buffers: a replayed forward leaves them there, and they are copied out and
  parked as the eager forward parks them (the record of a replay holds no stored graph); before a replayed backward
  the record's storages are copied in (its mask is one of the static keyword tensors). The backward is captured with
  an eager forward's record, whose stored graph then reads those buffers; a backward that finds a replay's record and
  no graph recomputes the attention and has the layer's next forward run eagerly.
- A failed capture is logged once and its key stays eager. At most `max_shapes` shapes keep graphs (LRU); once every
  layer has run both passes without a replay, all graphs and buffers go.

Not used for sharded weights (FSDP, DeepSpeed), active dropout (not split), keyword arguments other than tensors and
plain values (a KV cache), or a CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from slimrl.models import attention_store, kept_buffers, recompute
from slimrl.models.graph_capture import Graph, Statics, aliased, captured, flat_layout, totals
from slimrl.models.graph_keys import global_state, kwargs_signature, layer_state, tensor_signature
from slimrl.models.recompute import RecomputeState, Weights

logger = logging.getLogger(__name__)

CAPTURE_AFTER = 2  # a key runs eagerly until it is seen this many times, then it is captured and replayed
KEPT_COUNTS = 64  # keys counted but not captured, per layer, before the counts start again
# Longer passes run eagerly: their launches hide behind their kernels, and the static buffers grow with them. W1 on an
# H100 at 16,640 tokens a pass: 4.13 s graphed, 4.16 eager; at 33,280: 10.77 s and +0.19 GiB graphed, 10.71 eager.
MAX_TOKENS = 32768
RUN_AHEAD = 2  # replays the host may launch before the GPU has run the earlier ones (see LayerGraphs._replay)


def split_forward(state: RecomputeState, layer, kwargs: dict, hidden_states: torch.Tensor,
                  kept_attention=None) -> torch.Tensor:  # fmt: skip
    """The split layer's gradient-free forward (recompute.split_forward), from a CUDA graph where `_graphs_for`
    allows one; `kept_attention`: the deque the layer call's attention record goes to (when it is kept)."""
    graphs = _graphs_for(state, hidden_states)
    if graphs is None:
        return recompute.split_forward(state, layer, kwargs, hidden_states)

    def run(x, keywords):
        return recompute.split_forward(state, layer, keywords, x)

    return graphs.forward(layer, kwargs, hidden_states, run, kept_attention is not None)


def split_backward(state: RecomputeState, layer, kwargs: dict, hidden_states: torch.Tensor, grad_output: torch.Tensor,
                   weights: Weights, kept_attention=None) -> torch.Tensor | None:  # fmt: skip
    """The split layer's recompute and backward (recompute.split_backward), from a CUDA graph where `_graphs_for`
    allows one."""
    graphs = None if weights.params is None else _graphs_for(state, hidden_states)
    if graphs is None:
        return recompute.split_backward(state, layer, kwargs, hidden_states, grad_output, weights)
    before = state.split_recomputes  # a capture runs the pass eagerly and then captures it, a replay runs no Python

    def run(x, grad, into, keywords):
        return recompute.split_backward(state, layer, keywords, x, grad, into)

    grad = graphs.backward(layer, kwargs, hidden_states, grad_output, weights, run, kept_attention is not None)
    state.split_recomputes = before + 1
    return grad


def _graphs_for(state, hidden_states: torch.Tensor) -> LayerGraphs | None:
    """The model's layer graphs (made on first use) when this pass may use them: CUDA on the current device (not a
    layer of a model split over devices), at most MAX_TOKENS tokens, the state's `cuda_graphs` on, the weights passed
    through the checkpoint node (`weights_in_graph`)."""
    usable = hidden_states.is_cuda and hidden_states.device.index == torch.cuda.current_device()
    short = hidden_states.numel() <= MAX_TOKENS * hidden_states.shape[-1]
    if not (usable and short and state.cuda_graphs and state.weights_in_graph):
        if state.graphs is not None:
            state.graphs.ran_eagerly()
        return None
    if state.graphs is None:
        state.graphs = LayerGraphs(side_stream=state.side_stream)
    return state.graphs


class LayerGraphs:
    """One model's captured layer passes, their static buffers and the private memory pool they share."""

    def __init__(self, max_shapes: int = 2, side_stream: Callable | None = None):
        self.max_shapes = max_shapes
        self.side_stream = side_stream  # the checkpoints' copy stream on a device (its lag is bounded too)
        self.launched: deque = deque()  # per recent replay: its events on the compute stream and the copy stream
        self.entries: dict = {}  # key -> Graph, or the number of times the key was seen (int), or "eager"
        self.shapes: OrderedDict = OrderedDict()  # shape key -> Statics, least recently used first
        self.pool = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.warmed: set[int] = set()  # threads that ran a warm-up on the capture stream
        self.captures = 0  # passes captured so far (tests read these)
        self.replays = 0
        self.failures = 0
        self.releases = 0
        self.layers: set[int] = set()  # the layers seen (ids)
        self.idle = 0  # passes run eagerly since the last replay
        # layers whose next forward must run eagerly: their backward ran eagerly on a replayed forward's attention
        # record, which holds no stored graph (a capture of the backward needs one)
        self.unrecorded: set[int] = set()

    # -- the two passes -------------------------------------------------------------------------------------------
    def forward(self, layer, kwargs: dict, hidden_states: torch.Tensor, run: Callable, kept: bool) -> torch.Tensor:
        """`run(hidden_states, kwargs)` (the layer's gradient-free split forward), replayed from a graph once its key
        has come back. `kept`: the attention is kept (its record goes to the active tape: a replay makes it from the
        graph's buffers)."""
        key = self._key("forward", layer, kwargs, hidden_states, (kept,))
        entry = self._entry(key)
        if entry is not None and id(layer) in self.unrecorded:
            self.unrecorded.discard(id(layer))
            entry = None
        if entry is None:
            return run(hidden_states, kwargs)
        statics = self._statics(key, kwargs)
        tape = attention_store.active_tape() if kept else None
        if isinstance(entry, Graph):
            self._load(statics, kwargs, {"x": hidden_states})
            self._replay(entry, hidden_states.device)
            if entry.kept is not None:
                buffers = self._kept_buffers(statics, entry.kept, hidden_states)
                tape.records.append(kept_buffers.from_buffers(tape.state, buffers, entry.kept, kwargs))
            return entry.out.clone()
        # this call's result eagerly, then the capture into static buffers shaped after it (nothing runs in a capture)
        stored = len(tape.records) if tape is not None else 0
        result = run(hidden_states, kwargs)
        record = tape.records[-1] if tape is not None and len(tape.records) > stored else None
        layout = None if record is None else kept_buffers.layout(record, kwargs)
        if record is not None and layout is None:  # a record a graph cannot make
            self.entries[key] = "eager"
            return result
        x = self._load(statics, kwargs, {"x": hidden_states})["x"]
        out = statics.buffer("result", result)
        buffers = {} if layout is None else self._kept_buffers(statics, layout, hidden_states)

        def body():
            if tape is None:
                out.copy_(run(x, statics.kwargs))
                return
            with attention_store.capturing(tape.state) as records:
                out.copy_(run(x, statics.kwargs))
            made_layouts = [kept_buffers.layout(made, statics.kwargs) for made in records]
            if made_layouts != ([] if layout is None else [layout]):
                raise RuntimeError("the captured pass stored its attention unlike the eager pass")
            for made in records:  # the graph leaves the record's saved storages in the static buffers
                kept_buffers.load(made, buffers, layout)
                made.release()

        graph = self._capture(key, hidden_states.device, body)
        if graph is not None:
            self.entries[key] = Graph(graph, statics, out=out, kept=layout)
        return result

    def backward(self, layer, kwargs: dict, hidden_states: torch.Tensor, grad_output: torch.Tensor, weights: Weights,
                 run: Callable, kept: bool) -> torch.Tensor | None:  # fmt: skip
        """`run(hidden_states, grad_output, weights, kwargs)` (the layer's recompute and backward: returns the input's
        gradient and adds the weights' to `weights`, a fresh one per pass), replayed from a graph once its key has
        come back. `kept`: the attention is kept (the active tape holds the forward's record: a replay loads its
        saved storages into the graph's buffers)."""
        params = tuple(weights.params)
        extra = (tensor_signature(grad_output), hidden_states.requires_grad,
                 tuple((id(p), tensor_signature(p)) for p in params), kept)  # fmt: skip
        key = self._key("backward", layer, kwargs, hidden_states, extra)
        entry = self._entry(key)
        tape = attention_store.active_tape() if kept else None
        record = tape.records[0] if tape is not None and tape.records else None
        if record is not None and record.output_edge is None and not isinstance(entry, Graph):
            # a replayed forward's record (no stored graph): this pass recomputes the attention, and the layer's next
            # forward runs eagerly so that a capture of this pass finds a stored graph
            self.unrecorded.add(id(layer))
            entry = None
        if entry is None or any(s is not None for s in weights.sums):
            return run(hidden_states, grad_output, weights, kwargs)
        statics = self._statics(key, kwargs)
        inputs = {"x": hidden_states, "grad_output": grad_output}
        if isinstance(entry, Graph):
            if entry.kept is not None and (record is None or kept_buffers.layout(record, kwargs) != entry.kept):
                return run(hidden_states, grad_output, weights, kwargs)  # a record unlike the captured one's
            self._load(statics, kwargs, inputs, requires_grad=hidden_states.requires_grad)
            if entry.kept is not None:
                tape.records.popleft()
                kept_buffers.load(record, self._kept_buffers(statics, entry.kept, hidden_states), entry.kept)
            self._replay(entry, hidden_states.device)
            if entry.kept is not None:
                record.release()
            return self._backward_results(entry, weights)
        return self._capture_backward(key, layer, kwargs, (hidden_states, grad_output), weights, run, statics, record)

    def _capture_backward(self, key: tuple, layer, kwargs: dict, tensors: tuple, weights: Weights, run: Callable,
                          statics: Statics, record) -> torch.Tensor | None:  # fmt: skip
        """The backward pass eagerly (the attention record left whole), then its capture into static buffers shaped
        after its gradients (reading the record's saved storages from the static buffers)."""
        hidden_states, grad_output = tensors
        params = tuple(weights.params)
        if record is not None:
            record.keep = True
        try:
            result = run(hidden_states, grad_output, weights, kwargs)
        finally:
            if record is not None:
                record.keep = False
        layout = None if record is None else kept_buffers.layout(record, kwargs)
        if record is not None and layout is None:
            record.release()
            self.entries[key] = "eager"
            return result
        layout_grads = flat_layout(params, weights.sums)
        flats = {dtype: statics.buffer("grads", hidden_states, shape=(total,), dtype=dtype)
                 for dtype, total in totals(layout_grads).items()}  # fmt: skip
        grad_input = None if result is None else statics.buffer("result", result)
        static = self._load(statics, kwargs, {"x": hidden_states, "grad_output": grad_output},
                            requires_grad=hidden_states.requires_grad)  # fmt: skip
        x, grad = static["x"], static["grad_output"]
        if record is not None:  # the capture reads the record's saved storages from the static buffers
            buffers = self._kept_buffers(statics, layout, hidden_states)
            kept_buffers.load(record, buffers, layout)
            kept_buffers.redirect(record, buffers, statics.kwargs, layout)
            record.keep = True

        def body():
            tape = attention_store.replaying(deque([record])) if record is not None else contextlib.nullcontext()
            with aliased(layer, params) as aliases, tape:
                inner = Weights(aliases)
                input_grad = run(x, grad, inner, statics.kwargs)
            if flat_layout(params, inner.sums) != layout_grads or (input_grad is None) != (grad_input is None):
                raise RuntimeError("the captured pass's gradients are not the eager pass's")
            for index, dtype, offset, numel in layout_grads:
                flats[dtype][offset : offset + numel].copy_(inner.sums[index].reshape(-1))
            if input_grad is not None:
                grad_input.copy_(input_grad)
            del inner, input_grad  # nothing the capture made outlives it

        try:
            graph = self._capture(key, hidden_states.device, body)
        finally:
            if record is not None:
                record.keep = False
                record.release()
        if graph is not None:
            self.entries[key] = Graph(graph, statics, grad_input, layout_grads, kept=layout)
        return result

    def _replay(self, entry: Graph, device: torch.device) -> None:
        """Replay `entry`, the host kept at most RUN_AHEAD replays ahead of the GPU and of the checkpoints' copies.
        Freed of launching the passes, the host would queue a whole pass's layers at once, and the blocks each one
        allocates (the checkpoints' copies back, the parked attention's copies out) could not be reused until the GPU
        reached them: W1's reserved peak was 10.2 GiB at 4,096 tokens and 11.0 at 16,384 unbounded, 6.7 and 7.9 so,
        at the same step time."""
        if len(self.launched) >= RUN_AHEAD:
            for event in self.launched.popleft():
                event.synchronize()
        entry.graph.replay()
        self.replays += 1
        events = [torch.cuda.Event()]
        events[0].record()
        if self.side_stream is not None:
            events.append(torch.cuda.Event())
            events[1].record(self.side_stream(device))
        self.launched.append(events)

    # -- keys, entries, buffers -----------------------------------------------------------------------------------
    def _key(self, kind: str, layer, kwargs: dict, hidden_states: torch.Tensor, extra: tuple) -> tuple | None:
        signature = kwargs_signature(kwargs)
        if signature is None or (layer.training and getattr(getattr(layer, "self_attn", None), "attention_dropout", 0)):
            return None  # keyword objects a key cannot hold, or the attention's dropout (a replay repeats its mask)
        shape = (tensor_signature(hidden_states), signature)
        return kind, shape, id(layer), layer_state(layer), global_state(hidden_states.device), extra

    def _entry(self, key):
        """The key's graph, "capture" when it is due, or None (run eagerly)."""
        if key is None:
            self.ran_eagerly()
            return None
        self.layers.add(key[2])
        found = self.entries.get(key, 0)
        if isinstance(found, Graph):
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
        self.entries = {k: v for k, v in self.entries.items() if not isinstance(v, Graph)}
        self.shapes, self.pool, self.idle = OrderedDict(), None, 0
        self.releases += 1

    def _statics(self, key: tuple, kwargs: dict) -> Statics:
        shape = key[1]
        statics = self.shapes.get(shape)
        if statics is None:
            while len(self.shapes) >= self.max_shapes:
                torch.cuda.current_stream().synchronize()  # no replay of a graph let go is still running
                old, _ = self.shapes.popitem(last=False)
                self.entries = {k: v for k, v in self.entries.items() if k[1] != old}
            statics = self.shapes[shape] = Statics(kwargs, torch.cuda.current_stream())
        self.shapes.move_to_end(shape)
        return statics

    @staticmethod
    def _kept_buffers(statics: Statics, layout: tuple, like: torch.Tensor) -> dict:
        """The static byte buffers of a kept attention record's saved storages (but keyword tensors': those have
        their own), by index."""
        sizes = {index: entry[1] if entry[0] == "data" else 64 for index, entry in enumerate(layout[0])
                 if entry[0] in ("data", "scalar")}  # a scalar's: an address for a GPU scalar, never read  # fmt: skip
        return {index: statics.buffer(f"kept{index}", like, shape=(size,), dtype=torch.uint8)
                for index, size in sizes.items()}  # fmt: skip

    @staticmethod
    def _load(statics: Statics, kwargs: dict, inputs: dict, requires_grad: bool = False) -> dict:
        statics.load_kwargs(kwargs)
        loaded = {}
        with torch.no_grad():
            for name, tensor in inputs.items():
                static = statics.buffer(name, tensor, requires_grad=requires_grad and name == "x")
                static.copy_(tensor)
                loaded[name] = static
        return loaded

    def _backward_results(self, entry: Graph, weights: Weights) -> torch.Tensor | None:
        statics, params = entry.statics, weights.params
        flats = {dtype: statics.buffers[("grads", (total,), dtype)].clone()
                 for dtype, total in totals(entry.layout).items()}  # fmt: skip
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
                captured(graph, self.pool, body)
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

