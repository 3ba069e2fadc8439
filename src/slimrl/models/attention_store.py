"""Attention kept from an offloaded checkpoint's first forward, so that the backward does not run it again.

The offloaded checkpoints (models/checkpointing.py) recompute each layer in its backward: the attention block, then
the MLP. For long sequences the attention kernel is the recompute's largest part (its cost grows with the square of
the length; at 32,768 tokens on Qwen2.5-1.5B it is 1.2 s of a 12.4 s step). Here the checkpoint's gradient-free
forward builds the autograd graph of the attention call itself (SDPA, FlashAttention or eager, as the model is
configured; with the repeat of grouped K/V heads when the model does it) from q, k and v, and every tensor that graph
saves is parked in host memory by saved-tensor hooks, as the layer's input is: the output and its log-sum-exp, and
whatever the attention function made of q, k and v (a contiguous copy, K/V heads repeated for the group). What it
saves of q, k and v themselves (views of their storages) is not parked: the recompute in the backward computes q, k
and v again (the projections and the rotary embedding are cheap; the same kernels on the same input, so the same
bits) and the stored graph reads them there, through the same views of the new storages. The recompute takes the
stored output instead of calling attention, and its gradient comes from the stored graph. The stored graph's kernels
are the ones autograd would have run in the recompute, on the same values, so the gradients are bitwise those of the
plain recompute. Parking q, k and v too cost 2.3 times the checkpoints' copies on Qwen2.5-1.5B (a row's q, k, v and
output: 3,584 values a token against the checkpoint's 1,536); the output alone is about one time.

What stays where it is instead of being parked: parameters, the attention mask (shared by every layer) and tensors
under 1 MiB (or the checkpoints' `min_offload_bytes`, if smaller). A tensor is parked with its whole storage (one
copy for several views of it, e.g. SDPA's output and the transposed output the attention function returns) and comes
back with its strides.

`recording(state, records)` around a checkpoint's forward and `replaying(records)` around its recompute switch this
on for one layer call; `attention(interface, ...)` is what slimrl's attention forward (models/fast_lora.py) calls
instead of the attention function. Outside those blocks, or when no record is left, it calls the function itself.

The stored graph's backward runs without autograd's engine (models/node_backprop.py), so it can be captured in a CUDA
graph and run again. For the layer graphs a record's saved storages (`sources`) are what goes in and out of a graph
(models/kept_buffers.py); `capturing()` records without parking, for a capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

import torch

from slimrl.models.node_backprop import backprop

# Tensors under this size (or the checkpoints' min_offload_bytes, if smaller) stay where they are. Kept small: they add
# up over the layers (grouped K and V heads at 32k tokens are 17 MB each per layer, 0.9 GiB over 28 layers).
IN_PLACE_BYTES = 1 << 20
_ACTIVE = threading.local()  # .tape: the Tape of the checkpoint call running on this thread, if any


class _Entry(torch.autograd.Function):
    """Where q, k or v enter a stored graph: a node that holds no tensor (a leaf would keep its GPU memory alive in
    its gradient accumulator), so the input's gradient edge can be asked for later."""

    @staticmethod
    def forward(ctx, tensor, anchor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Parked:
    """One storage copied to host memory (pinned, on the checkpoint's side stream on CUDA) and, once fetched, back."""

    def __init__(self, state, tensor: torch.Tensor):
        raw = _raw(tensor)
        self.device, self.state, self.nbytes = tensor.device, state, raw.numel()
        self.on_device: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        self.redirect: torch.Tensor | None = None  # a static buffer read instead (`kept_buffers.redirect`)
        if tensor.is_cuda:
            self.host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=True)
            side = state.side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                self.host.copy_(raw, non_blocking=True)
            raw.record_stream(side)  # the GPU memory lives until the copy has read it
        else:
            self.host = raw.clone()

    def fetch(self) -> None:
        """Start the copy back (no wait)."""
        if self.on_device is not None:
            return
        if self.device.type != "cuda":
            self.on_device = self.host.clone()
            return
        side = self.state.side_stream(self.device)
        with torch.cuda.stream(side):
            self.on_device = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)

    def storage(self) -> torch.UntypedStorage:
        if self.redirect is not None:
            return self.redirect.untyped_storage()
        self.fetch()
        if self.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.ready)
            self.on_device.record_stream(current)  # made on the side stream, used on this one
            self.ready = None
        return self.on_device.untyped_storage()


class _Resident:
    """A saved storage left where it is: small ones, the mask, and every one while a graph is captured."""

    def __init__(self, tensor: torch.Tensor):
        # detached: a tensor the attention node saved of its own outputs holds that node (its grad_fn), which holds
        # this: a cycle through C++ that no collector breaks (the output and log-sum-exp of each call, leaked)
        tensor = tensor.detach()
        self.tensor, self.device, self.nbytes = tensor, tensor.device, tensor.untyped_storage().nbytes()
        self.redirect: torch.Tensor | None = None

    def fetch(self) -> None:  # nothing to bring back
        return

    def storage(self) -> torch.UntypedStorage:
        return (self.tensor if self.redirect is None else self.redirect).untyped_storage()


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under `tensor`, as bytes."""
    return raw_storage(tensor.untyped_storage(), tensor.device)


def raw_storage(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A storage as a byte tensor over all of it (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _View:
    """Where a saved tensor lies in its storage (dtype, offset, size, stride), to be rebuilt over a storage later."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype, self.view = tensor.dtype, (tensor.storage_offset(), tensor.shape, tensor.stride())

    def spec(self) -> tuple:
        return self.dtype, self.view

    def over(self, storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, *self.view)


class _Handle(_View):
    """A saved tensor: its storage's source (`_Parked` or `_Resident`) and the view of it."""

    def __init__(self, source: _Parked | _Resident, tensor: torch.Tensor | None, spec: tuple | None = None):
        if tensor is not None:
            super().__init__(tensor)
        else:
            self.dtype, self.view = spec
        self.source = source

    def tensor(self) -> torch.Tensor:
        return self.over(self.source.storage(), self.source.device)


class _Input(_View):
    """A saved view of q's, k's or v's storage: read at replay from the recompute's q, k or v (`AttentionRecord.live`)
    through the same view."""

    def __init__(self, record: AttentionRecord, index: int, tensor: torch.Tensor):
        super().__init__(tensor)
        self.record, self.index = record, index

    def tensor(self) -> torch.Tensor:
        live = self.record.live[self.index]
        return self.over(live.untyped_storage(), live.device)


def _layout(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What q, k and v must share with their recomputed twins for `_Input` to read the same elements: each one's
    place in its storage, and which of them share a storage."""
    places = [(t.dtype, t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.untyped_storage().nbytes())
              for t in tensors]  # fmt: skip
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    return places, [[a == b for b in pointers] for a in pointers]


class AttentionRecord:
    """One attention call's graph, built by the checkpoint's forward, with its saved tensors parked (but those of q,
    k and v: the recompute's are read instead). `capturing`: nothing is parked (a layer graph's capture); a record
    made by `from_buffers` holds the saved storages and no graph."""

    def __init__(self, state, keep: list[torch.Tensor], inputs: tuple[torch.Tensor, ...] = (),
                 capturing: bool = False):  # fmt: skip
        self.state, self.capturing = state, capturing
        self.kept_storages = {t.untyped_storage().data_ptr() for t in keep if torch.is_tensor(t)}
        # q, k and v: the index of the first one on each storage, and how each lies in its storage
        self.input_storages: dict[int, int] = {}
        for index, tensor in enumerate(inputs):
            self.input_storages.setdefault(tensor.untyped_storage().data_ptr(), index)
        self.input_layout = _layout(inputs)
        self.live: tuple[torch.Tensor, ...] = ()  # the recompute's q, k and v, set by the replay
        self.sources: list = []  # the saved storages (_Parked or _Resident), in the order they were first saved
        self.by_storage: dict[int, int] = {}  # a saved storage's address when saved -> its index in `sources`
        self.inputs: list = []
        self.output_edge = None
        self.output: _Handle | None = None
        self.keep = False  # True: the backward leaves the record whole (a layer graph captures with it next)
        self.recording: list[torch.Tensor] = []  # the saved tensors, referenced until the call is recorded

    def pack(self, tensor: torch.Tensor):
        """Saved-tensor hook: park the tensor, or keep it as it is (parameters, the mask, small tensors)."""
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.input_storages:
            return _Input(self, self.input_storages[storage.data_ptr()], tensor)
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        parkable = not (storage.data_ptr() in self.kept_storages
                        or tensor.nbytes < min(self.state.min_offload_bytes, IN_PLACE_BYTES))  # fmt: skip
        if parkable and storage.nbytes() > 2 * tensor.nbytes:  # a view of a much larger buffer: park what it shows
            tensor = tensor.clone()
            storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.by_storage:
            resident = self.capturing or not parkable
            source = _Resident(tensor) if resident else _Parked(self.state, tensor)
            # an integer scalar (a dropout seed or offset: on the host eagerly, on the GPU in a capture)
            source.parkable, source.key, source.scalar = parkable, key, not tensor.is_floating_point() and \
                tensor.numel() <= 2  # fmt: skip
            self.by_storage[key] = len(self.sources)
            self.sources.append(source)
            self.recording.append(tensor)  # no other tensor can take this address while the call is recorded
        return _Handle(self.sources[self.by_storage[key]], tensor)

    @staticmethod
    def unpack(packed):
        return packed.tensor() if isinstance(packed, _View) else packed

    def take_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The recompute's q, k and v, for the stored graph to read; they must lie in their storages as the
        forward's did (the same code made them), which is checked, not assumed."""
        layout = _layout(inputs)
        if layout != self.input_layout:
            raise RuntimeError("slimrl's kept attention: the recompute's q, k and v are laid out unlike the forward's "
                               f"({layout} against {self.input_layout}); set keep_attention_tokens=0 to recompute "
                               "the attention, and report this")  # fmt: skip
        self.live = tuple(t.detach() for t in inputs)

    def fetch(self, output_only: bool = False) -> None:
        """Start bringing the parked storages back: the output's alone (the recompute's replay needs it first), or
        all of them."""
        if isinstance(self.output, _Handle):
            self.output.source.fetch()
        for source in () if output_only else self.sources:
            source.fetch()

    def release(self) -> None:
        self.sources, self.by_storage, self.inputs, self.live = [], {}, [], ()
        self.output_edge = self.output = None


class _Replayed(torch.autograd.Function):
    """The recompute's attention: the stored output forward, the stored graph's gradient backward."""

    @staticmethod
    def forward(ctx, record: AttentionRecord, query, key, value):
        ctx.record = record
        record.take_inputs((query, key, value))
        output = AttentionRecord.unpack(record.output).detach()
        record.fetch()  # the rest (the log-sum-exp, copies the function made) comes back during the MLP's recompute
        return output

    @staticmethod
    def backward(ctx, grad):
        record, ctx.record = ctx.record, None
        grads = backprop(record.output_edge, grad, record.inputs)
        if not record.keep:
            record.release()
        return None, *grads


class Tape:
    """The records of one checkpoint call: appended by its forward, taken in the same order by its recompute."""

    def __init__(self, state, records: deque, replay: bool, capturing: bool = False):
        self.state, self.records, self.replay, self.capturing = state, records, replay, capturing

    def record(self, interface, module, query, key, value, mask, kwargs):
        record = AttentionRecord(self.state, [mask], (query, key, value), capturing=self.capturing)
        anchor = torch.empty(0, device=query.device, requires_grad=True)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(record.pack, record.unpack):
            inputs = [_Entry.apply(t.detach(), anchor) for t in (query, key, value)]
            output, weights = interface(module, *inputs, mask, **kwargs)
            record.output = record.pack(output)
        record.inputs = [torch.autograd.graph.get_gradient_edge(t) for t in inputs]
        record.output_edge = torch.autograd.graph.get_gradient_edge(output)
        record.recording = []
        self.records.append(record)
        return output.detach(), None if weights is None else weights.detach()


def attention(interface, module, query, key, value, mask, **kwargs):
    """`interface(module, query, key, value, mask, **kwargs)` (transformers' attention function signature), stored by
    a recording checkpoint forward and replayed by its recompute (see the module docstring)."""
    tape = getattr(_ACTIVE, "tape", None)
    if tape is None:
        return interface(module, query, key, value, mask, **kwargs)
    if not tape.replay:
        return tape.record(interface, module, query, key, value, mask, kwargs)
    # no record (another attention forward ran in the forward), or one without a stored graph (a replayed
    # forward's, whose backward was not replayed): compute it
    record = tape.records.popleft() if tape.records else None
    if record is None or record.output_edge is None:
        return interface(module, query, key, value, mask, **kwargs)
    return _Replayed.apply(record, query, key, value), None


def active_tape() -> Tape | None:
    """The tape of the checkpoint call running on this thread, if it keeps its attention."""
    return getattr(_ACTIVE, "tape", None)


@contextlib.contextmanager
def recording(state, records: deque):
    """Store the attention calls inside the block (a checkpoint's gradient-free forward) into `records`."""
    with _active(Tape(state, records, replay=False)):
        yield


@contextlib.contextmanager
def capturing(state) -> Iterator[deque]:
    """Record the attention calls inside the block (a layer graph's capture) without parking anything; yields the
    records."""
    records: deque = deque()
    with _active(Tape(state, records, replay=False, capturing=True)):
        yield records


@contextlib.contextmanager
def replaying(records: deque):
    """Replay `records` for the attention calls inside the block (the same checkpoint's recompute)."""
    with _active(Tape(None, records, replay=True)):
        yield


@contextlib.contextmanager
def _active(tape: Tape | None):
    previous = getattr(_ACTIVE, "tape", None)
    _ACTIVE.tape = tape
    try:
        yield
    finally:
        _ACTIVE.tape = previous


def fetch_outputs(records) -> None:
    """Start copying back the stored outputs of `records` (None: nothing kept)."""
    for record in records or ():
        record.fetch(output_only=True)
