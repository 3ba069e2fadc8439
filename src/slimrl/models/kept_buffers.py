"""A kept attention record's saved storages as the layer graphs (models/layer_graphs.py) move them in and out of a
captured pass: how they lie (`layout`, what a graph is captured with and a record must match to be replayed), copied
into a graph's static byte buffers (`load`), read from them by a capture (`redirect`), and the record of a forward
replayed from a graph, made from them (`from_buffers`). The records themselves are models/attention_store.py's."""

from __future__ import annotations

import torch

from slimrl.models.attention_store import AttentionRecord, _Handle, _Parked, _Resident, raw_storage


def layout(record: AttentionRecord, kwargs: dict) -> tuple | None:
    """How the saved storages lie, as a graph sees them: per source ("kwarg", name, index) for one of the layer
    call's keyword tensors (the mask; it has static buffers of its own), ("scalar",) for an integer scalar (a
    dropout seed or offset, wherever it lies: graphs run no dropout, so it is never read), ("host",) for other
    storages in host memory, else ("data", bytes, parkable); then where the output lies. None: a record a graph
    cannot take."""
    if not isinstance(record.output, _Handle):
        return None
    named = {}
    for name, value in kwargs.items():
        for index, tensor in enumerate(value if isinstance(value, tuple | list) else (value,)):
            if torch.is_tensor(tensor) and tensor.is_contiguous() and tensor.storage_offset() == 0 \
                    and tensor.untyped_storage().nbytes() == tensor.nbytes:  # fmt: skip
                named.setdefault(tensor.untyped_storage().data_ptr(), ("kwarg", name, index))
    entries = tuple(named.get(s.key) or _kind(s) for s in record.sources)
    found = [i for i, s in enumerate(record.sources) if s is record.output.source]
    return (entries, found[0], record.output.spec()) if found else None


def load(record: AttentionRecord, buffers: dict, layout: tuple) -> None:
    """Copy the saved storages that are data into `buffers` (index -> a byte tensor of their size)."""
    for index, entry in enumerate(layout[0]):
        if entry[0] == "data":
            source = record.sources[index]
            buffers[index].copy_(raw_storage(source.storage(), source.device))


def redirect(record: AttentionRecord, buffers: dict, kwargs: dict, layout: tuple) -> None:
    """Read every saved storage from the static buffers from now on (a capture's reads must be of those)."""
    for index, entry in enumerate(layout[0]):
        if entry[0] == "kwarg":
            record.sources[index].redirect = _kwarg(kwargs, entry)
        elif entry[0] == "data" or (entry[0] == "scalar" and record.sources[index].device.type == "cuda"):
            record.sources[index].redirect = buffers[index]  # (a scalar's: an address that stays valid)


def from_buffers(state, buffers: dict, layout: tuple, kwargs: dict) -> AttentionRecord:
    """The record of a forward replayed from a graph: its saved storages copied out of `buffers` (then parked
    as a forward would park them) or, for keyword tensors, the call's own; no stored graph (its recompute runs
    the attention)."""
    record = AttentionRecord(state, [])
    for index, entry in enumerate(layout[0]):
        if entry[0] == "kwarg":
            source = _Resident(_kwarg(kwargs, entry))
        elif entry[0] != "data":  # never read: the record's recompute runs the attention
            source = _Resident(torch.empty(0, dtype=torch.uint8))
        else:
            copy = buffers[index].clone()
            source = _Parked(state, copy) if entry[2] else _Resident(copy)
        source.parkable, source.scalar = entry[0] == "data" and entry[2], entry[0] == "scalar"
        source.key = source.tensor.untyped_storage().data_ptr() if entry[0] == "kwarg" else None
        record.sources.append(source)
    record.output = _Handle(record.sources[layout[1]], None, layout[2])
    return record


def _kwarg(kwargs: dict, entry: tuple) -> torch.Tensor:
    """The keyword tensor a ("kwarg", name, index) entry names: the value itself, or its item of a tuple or list."""
    value = kwargs[entry[1]]
    return value[entry[2]] if isinstance(value, tuple | list) else value


def _kind(source) -> tuple:
    """A saved storage's entry in a layout, unless it is one of the call's keyword tensors."""
    if source.scalar:
        return ("scalar",)
    return ("data", source.nbytes, source.parkable) if source.device.type == "cuda" else ("host",)
