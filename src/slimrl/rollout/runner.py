"""Runs the model for the engine: the prefill of a wave's prompts, the decode step (the body a CUDA graph captures),
sampling into the session's buffers, and the decode loop. The pieces it runs the decoder's forward with
(`GroupedOps`) are chosen once from the resolved `EngineOptions`: plain, compiled, or Triton kernels.

Per rollout wave: prompts are left-padded to a common length P (their real tokens at positions 0..len-1, as
transformers derives them from the attention mask) and prefilled in row blocks into the session's static KV cache;
then each decode step (embed, all layers, LM head, logits processing, sampling, bookkeeping) runs on static buffers
without host syncs, as a replayed graph on CUDA. Finished rows keep running masked until every row is done.
"""

from __future__ import annotations

import logging

import torch

from slimrl.ops.fused import Compiled
from slimrl.rollout.kv_cache import StepContext
from slimrl.rollout.model.llama import Decoder, decode_attention, prefill_attention
from slimrl.rollout.model.reference import EAGER_GROUPED, GroupedOps, prefill_mask, window_mask, window_starts
from slimrl.rollout.options import EngineOptions
from slimrl.rollout.planning import PREFILL_TOKENS
from slimrl.rollout.sampling import SamplingParams, choose_tokens, exponential_noise
from slimrl.rollout.session import Session
from slimrl.rollout.stopping import check_stop_strings

logger = logging.getLogger(__name__)

CHECK_EVERY = 16  # decode steps between looks at "all done" and stop strings


class Runner:
    """The decoder with the kernels its options chose; the engine drives it wave by wave."""

    def __init__(self, decoder: Decoder, options: EngineOptions, pad_token_id: int, tokenizer=None):
        self.decoder, self.options, self.pad_token_id, self.tokenizer = decoder, options, pad_token_id, tokenizer
        self.device = decoder.device
        self.generator = torch.Generator(device=self.device)
        ops = EAGER_GROUPED
        if options.compile:
            ops = GroupedOps(*(Compiled(fn) for fn in ops[:4]), ops.add_lora)
        self.choose = Compiled(choose_tokens) if options.compile else choose_tokens
        if options.triton_lora:
            from slimrl.rollout.kernels.lora import GroupedLoRA

            ops = ops._replace(add_lora=GroupedLoRA(tf32=options.tf32_adapters, ordered=options.deterministic))
        self.ops = ops
        self.attention = self.sampler = self.fused = None
        self.prefilled_rows = 0  # rows the latest prefill's forward ran (distinct prompts when shared)
        if options.triton_attention:
            from slimrl.rollout.kernels import attention

            self.attention = attention
        if options.fused_sampling:
            from slimrl.rollout.kernels import sampler

            self.sampler = sampler
        if options.fused_decode:
            from slimrl.rollout.fused_ops import FusedDecode

            d = decoder
            self.fused = FusedDecode(d.heads, d.kv_heads, d.head_dim, ops.add_lora, tf32=options.tf32_adapters,
                                     ordered=options.deterministic, choices=options.kernel_choices)  # fmt: skip

    def reads_prefix_in_place(self) -> bool:
        """Whether the decode step's attention reads a shared prompt cache's prefix where it lies (the Triton kernel);
        the plain paths (SDPA, soft-capped scores) gather each row's prompt into a new tensor (`StaticKVCache.rows`)."""
        d = self.decoder
        kernel = self.attention is not None and self.attention.can_run(d.head_dim, d.dtype)
        return kernel and d.recipe.attn_softcap is None

    def fused_sampling_applies(self, params: SamplingParams) -> bool:
        return self.sampler is not None and self.sampler.applies(params)

    # -- prefill -------------------------------------------------------------------------------------------------

    def prefill(self, session: Session, grouped: tuple, length: int) -> torch.Tensor:
        """Run the wave's rows through the model in row blocks; return the last position's logits [batch, V].
        grouped: (distinct prompts, the rows holding each) of the session's rows (`wave_rows`: a bucket's idle rows
        hold the one-token prompt [pad]), from `group_rows` with `share_prompt_prefill`, else (every row's prompt,
        None). A prompt that several rows hold (GRPO's G copies) runs once: its K/V go into each of those rows
        (`SharedRows`) and its logits are repeated; no random draw happens here, so every row samples as it would
        without it."""
        block = max(1, PREFILL_TOKENS // length)
        distinct, members = grouped
        self.prefilled_rows = len(distinct)
        if session.prefix_len:  # the shared prompt cache: each distinct prompt's K/V go to its one prefix row
            if members is None or len(distinct) > session.prefix_rows:
                raise RuntimeError("a session with a shared prompt cache needs the wave's prompts grouped to fit it")
            session.source.copy_(torch.tensor(row_sources(members)))
            logits = self._prefill_rows(session, distinct, length, block, PrefixRows(session.cache))
            return logits.index_select(0, session.source)
        if members is None or len(distinct) == session.batch:  # (then `distinct` is every row's prompt, in order)
            return self._prefill_rows(session, distinct, length, block, session.cache)
        shared = SharedRows(session.cache, members, block, self.device)
        return self._prefill_rows(session, distinct, length, block, shared).index_select(0, shared.source)

    def _prefill_rows(self, session: Session, prompts, length: int, block: int, cache) -> torch.Tensor:
        """The prefill's forward over `prompts` (left-padded to `length`) in blocks of `block` rows, each block's
        K/V handed to `cache.write_prompt`; the last position's logits [len(prompts), V]."""
        decoder, device, batch = self.decoder, self.device, len(prompts)
        padded = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        real_host = torch.zeros((batch, length), dtype=torch.bool)
        for r, tokens in enumerate(prompts):
            padded[r, length - len(tokens) :] = torch.tensor(tokens)
            real_host[r, length - len(tokens) :] = True
        padded, real = padded.to(device), real_host.to(device)
        positions = (real.long().cumsum(-1) - 1).clamp_min_(0)  # transformers: cumsum of the attention mask - 1
        logits = torch.empty(batch, decoder.vocab_size, dtype=decoder.dtype, device=device)
        ops = self.ops if self.fused is None else self.ops._replace(fused=self.fused.bind(None))  # no step context:
        # q/k/v stay unfused in a prefill; SwiGLU takes the LoRA update in its epilogue
        for start in range(0, batch, block):
            rows = slice(start, min(batch, start + block))
            b = rows.stop - rows.start
            masks = prefill_masks(decoder.windows, real_host[rows].all(), real[rows], decoder.dtype)
            cos = session.cos.index_select(0, positions[rows].reshape(-1))
            sin = session.sin.index_select(0, positions[rows].reshape(-1))

            def attend(layer, q, k, v, rows=rows, masks=masks, b=b):
                mask = masks[_effective(decoder.windows[layer], length)]
                return prefill_attention(decoder, cache, layer, rows, q, k, v, mask, b, length)

            hidden = decoder.forward(padded[rows].reshape(-1), cos, sin, attend, ops, self.options.compile)
            logits[rows] = decoder.logits(hidden.view(b, length, -1)[:, -1])
        return logits

    # -- one step ------------------------------------------------------------------------------------------------

    def fill_noise(self, session: Session) -> None:
        if session.noise is not None:
            exponential_noise(None, None, self.generator, out=session.noise)

    def finish_step(self, session: Session, logits: torch.Tensor) -> None:
        """Choose the next tokens from logits [B, V] and advance every buffer; no host sync (graph-safe)."""
        params = session.params
        if self.options.compile and logits.shape[0] > 1:
            for t in (logits, session.seen, session.noise):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        if session.fused_sampling:
            tokens, logprobs = self.sampler.choose(logits, params, session.seed, session.step)
            logprobs = logprobs if params.logprobs else None
        else:
            tokens, logprobs = self.choose(logits, params, session.seen, session.noise)
        tokens = torch.where(session.done, self.pad_token_id, tokens)
        session.out_tokens.index_copy_(1, session.step, tokens[:, None])
        if logprobs is not None:
            session.out_logprobs.index_copy_(1, session.step, logprobs[:, None])
        if session.seen is not None:
            session.seen.scatter_(1, tokens[:, None], True)
        session.step.add_(1)
        finished = session.step >= session.max_new
        if session.stop_ids is not None:
            finished = finished | (tokens[:, None] == session.stop_ids[None, :]).any(dim=-1)
        session.done.logical_or_(finished)
        session.tokens.copy_(tokens)
        session.positions.add_(1)
        session.column.add_(1)

    def decode_step(self, session: Session) -> None:
        """One token for every row: the body that is captured as a CUDA graph."""
        decoder = self.decoder
        kernel = self._attention_kernel(session)
        # the column written: past a shared prompt cache, of the rows' own columns
        write_column = session.column - session.prefix_len if session.prefix_len else session.column
        if kernel is None:
            session.mask.index_fill_(3, session.column, 0.0)  # the new token's own column becomes visible
        # per sliding window: the mask cut to it (SDPA), or each row's first column inside it (the Triton kernel)
        masks, starts = {None: session.mask}, {None: session.starts}
        for window in {w for w in decoder.windows if w is not None and w < session.seq_len}:
            if kernel is None:
                masks[window] = window_mask(session.mask, session.column, window)
            else:
                starts[window] = window_starts(session.starts, session.column, window)
        cos = session.cos.index_select(0, session.positions)
        sin = session.sin.index_select(0, session.positions)
        unfused = []

        def attend(layer, q, k, v):
            if k is not None or decoder.recipe.attn_softcap is not None:  # (soft-capped attention reads the cache
                unfused.append(layer)  # as tensors, not through the table)
            window = _effective(decoder.windows[layer], session.seq_len)
            return decode_attention(decoder, session.cache, layer, session.column, q, k, v, masks.get(window),
                                    kernel, starts.get(window), write_column, session.source)  # fmt: skip

        ops = self.ops
        if self.fused is not None:
            if session.scratch is None:
                session.scratch = self.fused.new_scratch()
            own_columns = session.seq_len - session.prefix_len
            context = StepContext(session.table, session.anchor, write_column, own_columns, session.scratch)
            ops = ops._replace(fused=self.fused.bind(context))
        hidden = decoder.forward(session.tokens, cos, sin, attend, ops, self.options.compile)
        self.finish_step(session, decoder.logits(hidden))
        # the cache was reached only through the table: a graph of this step survives a new cache
        session.step_bakes_cache = kernel is None or bool(unfused)

    def _attention_kernel(self, session: Session):
        """Triton decode attention reading the cache through the session's table, or None (SDPA with the mask)."""
        module = self.attention
        if module is None or not module.can_run(self.decoder.head_dim, self.decoder.dtype):
            return None

        def kernel(q, keys, values, starts, end, scale, layer):
            tiles = module.launch_tiles(q.shape[0], q.dtype, q.shape[-1])
            splits = self.options.attention_splits or module.context_splits(q.shape[0], keys.shape[1],
                                                                            session.seq_len, q.device)  # fmt: skip
            if splits > 1 and session.scratch is None:  # (kept with the graph, as the fused kernels' split-K scratch)
                session.scratch = module.SplitScratch()
            prefix = None
            if session.prefix_len:  # (its tensors give the strides; the kernel finds them through the table)
                cache = session.cache
                prefix = module.Prefix(session.source, session.prefix_len, cache.prefix_keys[layer],
                                       cache.prefix_values[layer], session.prefix_table)  # fmt: skip
            return module.decode_attention(q, keys, values, starts, end, scale, layer, session.table, session.anchor,
                                           prefix=prefix, splits=splits, scratch=session.scratch, **tiles)  # fmt: skip

        return kernel

    # -- the loop ------------------------------------------------------------------------------------------------

    def decode(self, session: Session, count: int, max_steps: int, params: SamplingParams) -> int:
        """Run decode steps until every row is done or max_steps tokens exist; return the tokens per row made.
        On CUDA "all done" is read one check late, so the GPU never waits for the host."""
        on_cuda = self.device.type == "cuda"
        pending = None  # (event, flag) of the previous check
        checked = [0] * count
        every_step = params.sampler == "multinomial"  # as transformers: no step (no draw) once every row is done
        step = 1
        while step < max_steps:
            if every_step and bool(session.done.all()):
                break
            self.fill_noise(session)
            if session.graph is not None:
                session.graph.replay()
            else:
                self.decode_step(session)
            step += 1
            if params.stop_strings and (every_step or (step % CHECK_EVERY == 0 and step < max_steps)):
                check_stop_strings(session, self.tokenizer, count, step, checked)
            if step % CHECK_EVERY or step >= max_steps or every_step:
                continue
            if not on_cuda:
                if bool(session.done.all()):
                    break
                continue
            if pending is not None:
                pending[0].synchronize()
                if bool(pending[1]):
                    break
            pending = _all_done_flag(session)
        return step


def _effective(window: int | None, length: int) -> int | None:
    """The window a layer's attention needs over `length` columns: None (plain causal) when it covers them all."""
    return window if window is not None and window < length else None


def prefill_masks(windows, unpadded: bool, real: torch.Tensor, dtype: torch.dtype) -> dict:
    """The prefill's additive masks of a row block, by effective window (None: global): for global layers None when
    no row is padded (plain causal attention, SDPA's flash kernels), else the padded causal mask."""
    length = real.shape[1]
    masks = {None: None if unpadded else prefill_mask(real, dtype)}
    for window in {_effective(w, length) for w in windows} - {None}:
        masks[window] = prefill_mask(real, dtype, window)
    return masks


def wave_rows(prompts: list[list[int]], batch: int, pad_token_id: int) -> list[list[int]]:
    """The prompts of a wave's `batch` rows: rows past len(prompts) (a bucket's idle rows) hold [pad]."""
    return [prompts[r] if r < len(prompts) else [pad_token_id] for r in range(batch)]


def group_rows(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The distinct prompts in the order they first appear, and for each the rows that hold it."""
    first: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    for row, prompt in enumerate(prompts):
        group = first.setdefault(tuple(prompt), len(members))
        if group == len(members):
            members.append([])
        members[group].append(row)
    return [prompts[rows[0]] for rows in members], members


def row_sources(members: list[list[int]]) -> list[int]:
    """Each row's distinct prompt (its index in `members`, the rows of each distinct prompt)."""
    source = [0] * sum(map(len, members))
    for j, rows in enumerate(members):
        for row in rows:
            source[row] = j
    return source


class SharedRows:
    """The cache as a prefill of distinct prompts sees it: the K/V of distinct prompt j go into every cache row of
    `members[j]`. `source` (int64 [batch], on the device) is each row's distinct prompt.

    A block's writes are rounds of `StaticKVCache.write_prompt_rows`: round g writes each prompt's K/V into its g-th
    row, so no copy of the block's K/V is made when every prompt has at least g + 1 rows (GRPO's groups of G). The
    row indices are made on the host and copied to the device at once, before the prefill's first launch."""

    def __init__(self, cache, members: list[list[int]], block: int, device: torch.device):
        self.cache = cache
        indices = [row_sources(members)]  # every index list, copied to the device together
        plan = {}  # block start -> per round (position in `indices` of the picked prompts or None, of the rows)
        for start in range(0, len(members), block):
            groups, plan[start] = members[start : start + block], []
            for g in range(max(map(len, groups))):
                picked = [j for j, rows in enumerate(groups) if len(rows) > g]
                indices.append([groups[j][g] for j in picked])
                plan[start].append((None if len(picked) == len(groups) else len(indices), len(indices) - 1))
                if len(picked) < len(groups):
                    indices.append(picked)
        flat = torch.tensor([i for part in indices for i in part]).to(device)
        on_device = flat.split([len(part) for part in indices])
        self.source = on_device[0]
        self.rounds = {start: [(None if p is None else on_device[p], on_device[r]) for p, r in rounds]
                       for start, rounds in plan.items()}  # fmt: skip

    def write_prompt(self, layer: int, rows: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        for picked, targets in self.rounds[rows.start]:
            k, v = (keys, values) if picked is None else (keys.index_select(0, picked), values.index_select(0, picked))
            self.cache.write_prompt_rows(layer, targets, k, v)


class PrefixRows:
    """The cache as a prefill of distinct prompts sees it with a shared prompt cache: block `rows` of the distinct
    prompts go to the same prefix rows (`StaticKVCache.write_prefix`), once each."""

    def __init__(self, cache):
        self.cache = cache

    def write_prompt(self, layer: int, rows: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.cache.write_prefix(layer, rows, keys, values)


def _all_done_flag(session: Session) -> tuple:
    """(event, pinned flag) that will say whether every row is done, copied without waiting."""
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(session.done.all(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event, flag
