"""One rollout shape's device state (`Session`: the KV cache, the decode step's static buffers, its captured graph)
and the engine's store of them (`Sessions`): the shape in use, and the graphs of up to IDLE_GRAPHS other shapes,
whose caches are freed but whose graphs stay valid (they read the cache through an address table), so rollouts whose
shape alternates replay instead of capturing again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slimrl.rollout.kv_cache import StaticKVCache, table_entries
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.sampling import SamplingParams

# captured decode graphs kept for shapes not in use (their caches freed): a training run's rollouts alternate between
# a few cache lengths as completion lengths change, and a re-capture costs far more than a replay
IDLE_GRAPHS = 4


class Session:
    """Everything one rollout shape needs on the device: the cache, the decode-step buffers, the captured graph."""

    def __init__(self, decoder: Decoder, batch: int, seq_len: int, params: SamplingParams, stop_ids,
                 fused_sampling: bool, prefix: tuple[int, int] | None = None):  # fmt: skip
        """seq_len: the columns every row sees; prefix: (rows, columns) of a shared prompt cache (`kv_cache`), whose
        columns are the first of those seq_len, or None (each row holds its prompt)."""
        device, vocab = decoder.device, decoder.vocab_size
        self.batch, self.seq_len, self.params = batch, seq_len, params
        self.prefix_rows, self.prefix_len = prefix or (0, 0)
        if self.prefix_len >= seq_len:
            raise ValueError(f"a prefix of {self.prefix_len} columns leaves none of {seq_len} to decode into")
        self.decoder = decoder
        self.cache = None
        # where the cache tensors are (K then V per layer, from `anchor`), for kernels that must not bake addresses
        # into a graph; the prefix's in their own table
        self.table = torch.zeros(2 * decoder.num_layers, dtype=torch.long, device=device)
        self.prefix_table = torch.zeros(2 * decoder.num_layers, dtype=torch.long, device=device) if prefix else None
        self.source = torch.zeros(batch, dtype=torch.long, device=device)  # each row's prefix row
        self.anchor = torch.zeros(1, dtype=decoder.dtype, device=device)
        self.ensure_cache()
        self.cos, self.sin = decoder.rope_tables(seq_len)  # [S, D]
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, **long)  # the input token of the next step
        self.positions = torch.zeros(batch, **long)  # its RoPE position (real tokens before it)
        self.column = torch.zeros(1, **long)  # its cache column, shared by all rows (left padding)
        self.starts = torch.zeros(batch, **long)  # first real column of each row (its left padding)
        self.step = torch.zeros(1, **long)  # new tokens produced so far
        self.max_new = torch.zeros(batch, **long)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.mask = torch.zeros(batch, 1, 1, seq_len, dtype=decoder.dtype, device=device)  # additive
        self.out_tokens = torch.zeros(batch, seq_len, **long)
        self.out_logprobs = torch.zeros(batch, seq_len, dtype=torch.float32, device=device)
        self.stop_ids = torch.tensor(sorted(stop_ids), **long) if stop_ids else None
        penalised = params.repetition_penalty != 1
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device) if penalised else None
        # the fused sampler draws its noise in registers from (seed + step); the plain one reads a noise tensor
        self.fused_sampling = fused_sampling
        self.seed = torch.zeros(1, **long)
        plain_noise = not params.greedy and not fused_sampling and params.sampler == "race"
        self.noise = torch.empty(batch, vocab, dtype=torch.float32, device=device) if plain_noise else None
        self.scratch = None  # the fused kernels' split-K scratch, kept with the graph that bakes its address
        self.graph = None
        self.graph_bakes_cache = True  # until a capture shows every cache access went through the table
        self.step_bakes_cache = True  # what the latest traced decode step did (see `runner.Runner.decode_step`)
        self.fingerprint = None
        self.key = None

    def ensure_cache(self) -> None:
        """Allocate the KV cache if `release` freed it, and point the address table at it."""
        if self.cache is not None:
            return
        d = self.decoder
        self.cache = StaticKVCache(d.num_layers, self.batch, d.kv_heads, self.seq_len - self.prefix_len, d.head_dim,
                                   d.dtype, d.device, self.prefix_rows, self.prefix_len)  # fmt: skip
        self.table.copy_(torch.tensor(table_entries(self.cache, self.anchor), dtype=torch.long))
        if self.prefix_table is not None:
            self.prefix_table.copy_(torch.tensor(table_entries(self.cache, self.anchor, prefix=True)))

    def reset_for_capture(self) -> None:
        """Harmless values for the warm-up steps before a capture (they write the rows' first own column, which
        prefill or the first decode step overwrites)."""
        for buf in (self.tokens, self.positions, self.column, self.step, self.max_new, self.starts):
            buf.zero_()
        self.column.fill_(self.prefix_len)
        self.done.fill_(True)
        self.mask.fill_(float("-inf"))
        if self.noise is not None:
            self.noise.fill_(1.0)

    def start(self, prompts: list[list[int]], max_new: list[int], length: int, pad_id: int) -> None:
        """Initial state for a rollout of these prompts (rows past len(prompts) are idle padding rows), left-padded
        to `length`; with a shared prefix they end where the rows' own columns begin (prefix_len)."""
        device, batch = self.tokens.device, self.batch
        length = self.prefix_len or length
        lengths = torch.tensor([len(p) for p in prompts] + [1] * (batch - len(prompts)), device=device)
        limits = torch.tensor(list(max_new) + [0] * (batch - len(prompts)), device=device)
        # the prefill's last token sits at column P-1, position len-1; `finish_step` advances both
        self.positions.copy_(lengths - 1)
        self.column.fill_(length - 1)
        self.starts.copy_(length - lengths)
        self.step.zero_()
        self.max_new.copy_(limits)
        self.done.copy_(limits <= 0)
        columns = torch.arange(self.seq_len, device=device)
        real = (columns[None, :] >= length - lengths[:, None]) & (columns[None, :] < length)
        self.mask.fill_(float("-inf")).masked_fill_(real[:, None, None, :], 0.0)
        if self.seen is not None:
            self.seen.zero_()
            rows = [r for r, p in enumerate(prompts) for _ in p]
            cols = [t for p in prompts for t in p]
            self.seen[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True

    def free(self) -> None:
        self.graph = None
        self.cache = None


def sampling_key(params: SamplingParams) -> tuple:
    """The settings a captured decode step bakes in (stop strings and seed are handled outside the graph)."""
    return (
        params.temperature,
        params.top_k_value,
        params.top_p,
        params.min_p_value,
        params.repetition_penalty,
        params.logprobs,
        params.logprobs_mode,
        params.sampler,
    )


class Sessions:
    """The session in use (its cache allocated unless released) and idle ones kept for their graphs."""

    def __init__(self) -> None:
        self.current: Session | None = None
        self._idle: dict[tuple, Session] = {}

    def get(self, key: tuple, new: Callable[[], Session]) -> Session:
        """The session of this shape with its cache allocated: the current one, an idle one, or `new()`. Only one
        cache exists at a time: the previous shape's is freed first."""
        session = self.current
        if session is None or session.key != key:
            if session is not None:
                self._park(session)
            session = self._idle.pop(key, None)
            if session is None:
                session = new()
                session.key = key
            self.current = session
        session.ensure_cache()
        return session

    def release(self, keep_graph: bool = True) -> None:
        """Free the current cache; graphs that outlive it stay unless keep_graph is False (then everything goes)."""
        if not keep_graph:
            for session in self._idle.values():
                session.free()
            self._idle.clear()
        session = self.current
        if session is None:
            return
        if keep_graph and session.graph is not None and not session.graph_bakes_cache:
            session.cache = None
            return
        session.free()
        self.current = None

    def held_bytes(self) -> int:
        """Bytes of the current cache (what a new wave frees before allocating its own)."""
        return self.current.cache.nbytes if self.current is not None and self.current.cache is not None else 0

    def _park(self, session: Session) -> None:
        if session.graph is None or session.graph_bakes_cache:
            session.free()
            return
        session.cache = None
        self._idle[session.key] = session
        while len(self._idle) > IDLE_GRAPHS:
            self._idle.pop(next(iter(self._idle))).free()
