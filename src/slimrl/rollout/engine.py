"""slimrl's built-in rollout engine: batched generation with the training model's own weights, in place.

`RolloutEngine(model).generate(prompts, SamplingParams(...), max_new_tokens)` decodes a batch of token-id prompts
with our own Llama-family forward (`llama.py`) over the live modules, so a LoRA adapter updated by the optimizer is
used by the next rollout with no merge, copy or re-capture. Per rollout:

1. prompts are left-padded to a common length P (their real tokens at positions 0..len-1, as transformers derives
   them from the attention mask) and prefilled in row blocks into a static KV cache (`kv_cache.py`), allocated for
   this rollout's shape and kept until `release()` or a differently shaped rollout;
2. each decode step (embed, all layers, LM head, logits processing, sampling, bookkeeping) runs on static buffers
   without host syncs; on CUDA it is captured once as a CUDA graph per (batch bucket, cache length, sampling
   settings) and replayed. On CUDA the step is cut for few launches (`Decoder.forward_grouped`): each residual add
   fused with the norm after it, each layer's projections through `fused_decode` (base GEMM or cuBLAS, LoRA, RoPE,
   the cache write and SwiGLU fused), one Triton launch per layer for attention over each row's live cache columns
   (`attention_kernel.py`) and the fused sampler (`sampling_kernel.py`); these Triton kernels are launched with
   programmatic dependent launch on Hopper (`pdl.py`: each may be scheduled while the one before finishes); the
   cache is reached through an address table, so the graph outlives `release()`;
3. sequences stop at an EOS / stop token (included in the completion, as vLLM and transformers do), at a stop
   string (the completion ends with the token that completes the string: vLLM keeps that token's id and only trims
   the text), or at their own max token count; finished rows keep running masked until every row is done.

Log-probs: see `SamplingParams.logprobs_mode` (default: of the distribution actually sampled from, vLLM's
"processed_logprobs" as TRL configures it).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from slimrl.rollout import llama
from slimrl.rollout.kv_cache import StaticKVCache, StepContext, kv_bytes_per_token, table_entries
from slimrl.rollout.sampling import SamplingParams, choose_tokens, exponential_noise

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 16384  # prompt tokens per prefill block: bounds the prefill's activation memory
CHECK_EVERY = 16  # decode steps between looks at "all done" and stop strings
SEQ_ROUND = 128  # cache lengths are rounded up to this, so rollouts of similar length reuse one captured graph
# captured decode graphs kept for shapes not in use (their caches freed): a training run's rollouts alternate between
# a few cache lengths as completion lengths change, and a re-capture costs far more than a replay
IDLE_GRAPHS = 4
STOP_WINDOW = 32  # tokens before the newest ones re-decoded when looking for stop strings during decoding


def supports(model) -> tuple[bool, str]:
    """(True, "") if the engine can run this model, else (False, reason) naming what is unsupported."""
    return llama.supports(model)


@dataclass
class RolloutOutput:
    """Per sequence, in the order of the prompts: the prompt, completion ids, their log-probs, why it ended.

    completion_ids include the EOS / stop token that ended a sequence. finish_reason is "stop" (EOS, stop token or
    stop string) or "length" (its max token count or the engine's max_seq_len). logprobs is None when
    `SamplingParams.logprobs` is False.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    finish_reason: list[str]
    stats: dict = field(default_factory=dict)


def _bucket(batch: int) -> int:
    """Batch sizes share captured graphs by bucket: 1, 2, 4, 8, then multiples of 8."""
    if batch <= 8:
        return 1 << (batch - 1).bit_length()
    return 8 * math.ceil(batch / 8)


class _Session:
    """Everything one rollout shape needs on the device: the cache, the decode-step buffers, the captured graph."""

    def __init__(
        self, decoder: llama.Decoder, batch: int, seq_len: int, params: SamplingParams, stop_ids, fused_sampling: bool
    ):
        device, vocab = decoder.device, decoder.vocab_size
        self.batch, self.seq_len, self.params = batch, seq_len, params
        self.decoder = decoder
        self.cache = None
        # where the cache tensors are (K then V per layer, from `anchor`), for kernels that must not bake addresses
        # into a graph
        self.table = torch.zeros(2 * decoder.num_layers, dtype=torch.long, device=device)
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
        self.step_bakes_cache = True  # what the latest traced decode step did (see `_decode_step`)
        self.fingerprint = None
        self.key = None

    def ensure_cache(self) -> None:
        """Allocate the KV cache if `release` freed it, and point the address table at it."""
        if self.cache is not None:
            return
        d = self.decoder
        self.cache = StaticKVCache(d.num_layers, self.batch, d.kv_heads, self.seq_len, d.head_dim, d.dtype, d.device)
        self.table.copy_(torch.tensor(table_entries(self.cache, self.anchor), dtype=torch.long))

    def reset_for_capture(self) -> None:
        """Harmless values for the warm-up steps before a capture (they write cache column 0, which prefill
        overwrites)."""
        for buf in (self.tokens, self.positions, self.column, self.step, self.max_new, self.starts):
            buf.zero_()
        self.done.fill_(True)
        self.mask.fill_(float("-inf"))
        if self.noise is not None:
            self.noise.fill_(1.0)

    def start(self, prompts: list[list[int]], max_new: list[int], length: int, pad_id: int) -> None:
        """Initial state for a rollout of these prompts (rows past len(prompts) are idle padding rows)."""
        device, batch = self.tokens.device, self.batch
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


class _Compiled:
    """torch.compile'd functions; on a compile error the eager function takes over (once, with a warning)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=None)
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same math, eager
                if torch.cuda.is_current_stream_capturing():
                    raise
                logger.warning("torch.compile failed for %s (%s); running it eagerly.", self.fn.__name__, err)
                self.failed = True
        return self.fn(*args, **kwargs)


class RolloutEngine:
    """Generates with a Llama-family model's live weights (LoRA included) through a static cache and CUDA graphs.

    model: a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM, possibly peft-wrapped, possibly with
        bitsandbytes 4/8-bit Linear layers. It is read, never modified or copied.
    max_batch_size: most sequences decoded together; more prompts are decoded in successive waves.
    max_seq_len: longest prompt + completion; default the model's max_position_embeddings.
    gpu_memory_utilization: if set, the fraction of the GPU's memory the process may use with the cache allocated;
        batches that would exceed it are split into waves.
    tokenizer: needed only for stop strings.
    cuda_graphs / compile: default on for CUDA, off on CPU (the eager path is the same math).
    tf32_adapters: on CUDA, when the model computes in bf16/fp16 but its LoRA weights are fp32 (peft's default),
        let those adapter matmuls use TF32 during rollouts (8x faster prefill; TF32's 10-bit mantissa is still
        finer than the bf16 base weights). Off: exact fp32 adapter math, as peft. An fp32 model is never affected.
    grouped_decode: decode with `Decoder.forward_grouped` (projections sharing an input applied together, LoRA as
        two Triton launches per group on CUDA, residual adds fused into norms). Default: on CUDA when Triton is
        installed. On CPU it can be turned on to run the same structure with plain-PyTorch pieces. Prefill uses
        the same structure when it is on.
    triton_attention: decode attention with `attention_kernel` (reads each row's live cache columns once) instead
        of SDPA with a mask. Default: on CUDA when Triton is installed.
    fused_decode: with grouped_decode, run each layer's projections through `fused_decode` (base GEMM, LoRA, RoPE,
        cache writes and SwiGLU fused; about 14 launches per layer instead of 24). With it and triton_attention,
        the captured decode graph reads the KV cache through an address table, so `release()` frees the cache and
        the next rollout of the same shape replays the same graph. Default: on CUDA when Triton is installed.
    fused_sampling: for settings without top-k/top-p/min-p/repetition penalty (TRL's defaults), sample and take
        log-probs with `sampling_kernel` (one pass over the logits, noise drawn in registers) instead of the plain
        functions of `sampling.py` (same distribution, other random draws). Default: on CUDA when Triton is installed.

    deterministic: the output depends only on the inputs and the seed: partial sums that the kernels split over
        several GPU programs are added in a fixed order (`lora_kernels.shrink_(ordered=True)`) instead of by
        atomics, whose order varies from run to run and with it the last bits of the logits, and so, now and then,
        a sampled token. slimrl's trainers turn it on (GRPOConfig.deterministic_rollouts); its cost is in
        docs/benchmarks.md.

    On CPU, the Triton options may be turned on under TRITON_INTERPRET=1 (the tests run the kernels that way).
    What `generate` returns is checked: token ids inside the vocabulary and finite log-probs, else `EngineOutputError`.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 256,
        max_seq_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        tokenizer=None,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        tf32_adapters: bool = True,
        grouped_decode: bool | None = None,
        triton_attention: bool | None = None,
        fused_decode: bool | None = None,
        fused_sampling: bool | None = None,
        deterministic: bool = False,
    ):
        supported, why = supports(model)
        if not supported:
            raise ValueError(f"The rollout engine cannot run this model: {why}. Generate with transformers instead.")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
        self.model = model
        self.decoder = llama.Decoder(model)
        self.device = self.decoder.device
        on_cuda = self.device.type == "cuda"
        if (cuda_graphs or compile) and not on_cuda:
            raise ValueError("cuda_graphs and compile need the model on a CUDA device; leave them at None on CPU.")
        self.use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.use_compile = on_cuda if compile is None else compile
        self.tf32 = tf32_adapters and on_cuda and self.decoder.dtype in (torch.bfloat16, torch.float16)
        config = self.decoder.causal_lm.config
        self.max_seq_len = int(max_seq_len or getattr(config, "max_position_embeddings", 4096))
        self.max_batch_size = max_batch_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tokenizer = tokenizer
        generation_config = getattr(self.decoder.causal_lm, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(generation_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids or [0])[0]
        self._generator = torch.Generator(device=self.device)
        self.deterministic = deterministic
        self._session: _Session | None = None  # the shape in use (its cache allocated unless released)
        self._idle: dict[tuple, _Session] = {}  # other shapes' sessions whose graphs outlive their caches
        if self.use_compile:
            self._blocks = llama.Blocks(*(_Compiled(fn) for fn in llama.EAGER_BLOCKS))
            self._choose = _Compiled(choose_tokens)
        else:
            self._blocks, self._choose = llama.EAGER_BLOCKS, choose_tokens
        triton_here = _triton_available() and (on_cuda or _interpreting())
        self.grouped_decode = (on_cuda and _triton_available()) if grouped_decode is None else grouped_decode
        if triton_attention is None:
            triton_attention = on_cuda and _triton_available()
        if fused_decode is None:
            fused_decode = self.grouped_decode and on_cuda and _triton_available()
        if fused_sampling is None:
            fused_sampling = on_cuda and _triton_available()
        checks = (("triton_attention", triton_attention), ("fused_decode", fused_decode))
        for name, wanted in (*checks, ("fused_sampling", fused_sampling)):
            if wanted and not triton_here:
                raise ValueError(f"{name} needs Triton and the model on a CUDA device (or TRITON_INTERPRET=1).")
        if fused_decode and not self.grouped_decode:
            raise ValueError("fused_decode=True needs grouped_decode=True.")
        self._grouped = self._grouped_ops(triton_here) if self.grouped_decode else None
        self._attention_kernel = None
        if triton_attention:
            from slimrl.rollout import attention_kernel

            self._attention_kernel = attention_kernel
        self._sampling_kernel = None
        if fused_sampling:
            from slimrl.rollout import sampling_kernel

            self._sampling_kernel = sampling_kernel
        self._fused = None
        if fused_decode:
            from slimrl.rollout.fused_decode import FusedDecode

            d = self.decoder
            self._fused = FusedDecode(d.heads, d.kv_heads, d.head_dim, self._grouped.add_lora, tf32=self.tf32,
                                      ordered=deterministic)  # fmt: skip
        self.last_stats: dict = {}

    def _grouped_ops(self, triton_here: bool) -> llama.GroupedOps:
        ops = llama.EAGER_GROUPED
        if self.use_compile:
            ops = llama.GroupedOps(*(_Compiled(fn) for fn in ops[:4]), ops.add_lora)
        if triton_here:
            from slimrl.rollout import lora_kernels

            ops = ops._replace(add_lora=lora_kernels.GroupedLoRA(tf32=self.tf32, ordered=self.deterministic))
        return ops

    # -- public ------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int | list[int] | None = None
    ) -> RolloutOutput:
        """Complete each prompt (a list of token ids). max_new_tokens (one int or one per prompt) defaults to
        `params.max_tokens`; it is capped so prompt + completion fit in max_seq_len."""
        prompts = [list(map(int, p)) for p in prompts]
        limits = self._limits(prompts, params, max_new_tokens)
        stop_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer: pass RolloutEngine(model, tokenizer=...).")
        transformers_draws = params.sampler == "multinomial"  # draws on torch's own generator, in prompt order
        if not transformers_draws:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            self._generator.manual_seed(seed)
        results: list = [None] * len(prompts)
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "decode_steps": 0, "waves": 0}
        order = list(range(len(prompts)))
        if not transformers_draws:
            order.sort(key=lambda i: -len(prompts[i]))  # similar lengths pad less
        tf32_before = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before or self.tf32
            with torch.no_grad():
                for wave in self._waves(order, prompts, limits):
                    prompts_w, limits_w = [prompts[i] for i in wave], [limits[i] for i in wave]
                    outs = self._run_wave(prompts_w, limits_w, params, stop_ids, stats)
                    for i, out in zip(wave, outs, strict=True):
                        results[i] = out
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before
        self.last_stats = stats
        return RolloutOutput(
            prompt_ids=prompts,
            completion_ids=[r[0] for r in results],
            logprobs=[r[1] for r in results] if params.logprobs else None,
            finish_reason=[r[2] for r in results],
            stats=stats,
        )

    def release(self, keep_graph: bool = True) -> None:
        """Free the KV cache so training gets its memory back; the next `generate` allocates it again.

        When the captured decode graph reads the cache through the address table (`fused_decode` with
        `triton_attention`), it is kept with its small step buffers (keep_graph=True) and replayed by the next
        rollout of the same shape: no re-capture; so are the graphs of up to IDLE_GRAPHS other shapes used before.
        Otherwise, or with keep_graph=False, the graphs and every buffer are freed too."""
        if not keep_graph:
            for session in self._idle.values():
                session.free()
            self._idle.clear()
        session = self._session
        if session is None:
            return
        if keep_graph and session.graph is not None and not session.graph_bakes_cache:
            session.cache = None
            return
        session.free()
        self._session = None

    def _park(self, session: _Session) -> None:
        """Put a session out of use: its cache is freed, its graph kept (if it outlives the cache) for a later rollout
        of its shape; the oldest kept graph goes beyond IDLE_GRAPHS."""
        if session.graph is None or session.graph_bakes_cache:
            session.free()
            return
        session.cache = None
        self._idle[session.key] = session
        while len(self._idle) > IDLE_GRAPHS:
            self._idle.pop(next(iter(self._idle))).free()

    # -- planning ------------------------------------------------------------------------------------------------

    def _limits(self, prompts, params: SamplingParams, max_new_tokens) -> list[int]:
        if not prompts:
            raise ValueError("generate needs at least one prompt.")
        vocab = self.decoder.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token.")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}).")
            if len(p) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens, leaving no room under max_seq_len={self.max_seq_len}; "
                    "truncate prompts or raise max_seq_len."
                )
        if max_new_tokens is None:
            max_new_tokens = params.max_tokens
        if max_new_tokens is None:
            raise ValueError("Say how many tokens to generate: max_new_tokens=... or SamplingParams(max_tokens=...).")
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts.")
        if any(m < 0 for m in max_new_tokens):
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        window = self.decoder.sliding_window
        longest = max(len(p) + m for p, m in zip(prompts, max_new_tokens, strict=True))
        if window is not None and min(longest, self.max_seq_len) > window:
            raise ValueError(
                f"sequences of up to {longest} tokens exceed the model's sliding window ({window}), which the engine "
                "does not implement; generate with transformers or shorten max_new_tokens."
            )
        return [min(int(m), self.max_seq_len - len(p)) for p, m in zip(prompts, max_new_tokens, strict=True)]

    def _rows_that_fit(self, seq_len: int) -> int:
        """How many rows of this cache length fit in the gpu_memory_utilization budget (max_batch_size if none)."""
        if self.gpu_memory_utilization is None or self.device.type != "cuda":
            return self.max_batch_size
        d = self.decoder
        per_row = seq_len * (kv_bytes_per_token(d.num_layers, d.kv_heads, d.head_dim, d.dtype) + 12)
        per_row += d.vocab_size * 16  # logits, fp32 copies and noise of the sampling step
        if self._session is not None and self._session.cache is not None:
            held = self._session.cache.nbytes
        else:
            held = 0
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = self.gpu_memory_utilization * total - (torch.cuda.memory_allocated(self.device) - held)
        rows = int(budget // per_row)
        if rows < 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for even one sequence of "
                f"{seq_len} tokens; raise it, or lower max_seq_len / max_new_tokens."
            )
        return min(rows, self.max_batch_size)

    def _waves(self, order, prompts, limits):
        start = 0
        while start < len(order):
            first = order[start]
            seq_len = len(prompts[first]) + max(limits[i] for i in order[start:])
            rows = self._rows_that_fit(min(self.max_seq_len, seq_len))
            yield order[start : start + rows]
            start += rows

    # -- one wave ----------------------------------------------------------------------------------------------

    def _session_for(self, batch: int, seq_len: int, params: SamplingParams, stop_ids) -> _Session:
        key = (batch, seq_len, _sampling_key(params), tuple(sorted(stop_ids)))
        session = self._session
        if session is None or session.key != key:
            if session is not None:
                self._park(session)  # one cache at a time: the old one is freed before the new one is allocated
            session = self._idle.pop(key, None)
            if session is None:
                fused = self._sampling_kernel is not None and self._sampling_kernel.applies(params)
                session = _Session(self.decoder, batch, seq_len, params, stop_ids, fused)
                session.key = key
            self._session = session
        session.ensure_cache()
        return session

    def _run_wave(self, prompts, limits, params: SamplingParams, stop_ids, stats) -> list:
        count = len(prompts)
        length = max(len(p) for p in prompts)
        longest = length + max(limits)  # left padding: a short prompt's completion can reach past max_seq_len columns
        seq_len = max(longest, min(self.max_seq_len, SEQ_ROUND * math.ceil(longest / SEQ_ROUND)))
        eager_draws = params.sampler == "multinomial"  # torch.multinomial over exactly these rows, every step
        session = self._session_for(count if eager_draws else _bucket(count), seq_len, params, stop_ids)
        stats["waves"] += 1

        if self.use_graphs and not eager_draws:
            tick = time.perf_counter()
            if session.graph is None or session.fingerprint != self._graph_inputs(session):
                self._capture(session)
                session.fingerprint = self._graph_inputs(session)
                stats["captures"] = stats.get("captures", 0) + 1
            stats["capture_s"] += time.perf_counter() - tick

        tick = _now(self.device)
        session.start(prompts, limits, length, self.pad_token_id)
        if session.fused_sampling:  # this wave's Philox key, from the engine's seeded generator (no host sync)
            session.seed.copy_(torch.randint(0, 2**31, (1,), generator=self._generator, device=self.device))
        logits = self._prefill(session, prompts, length)
        self._fill_noise(session)
        self._finish_step(session, logits)
        del logits
        stats["prefill_s"] += _now(self.device) - tick

        tick = _now(self.device)
        steps = self._decode(session, prompts, max(limits), params)
        stats["decode_s"] += _now(self.device) - tick
        stats["decode_steps"] += steps - 1
        return self._collect(session, count, steps, limits, params, stop_ids)

    def _prefill(self, session: _Session, prompts, length: int) -> torch.Tensor:
        """Run the prompts through the model in row blocks; return the last position's logits [batch, V]."""
        decoder, device = self.decoder, self.device
        batch = session.batch
        padded = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        real = torch.zeros((batch, length), dtype=torch.bool)
        for r in range(batch):
            tokens = prompts[r] if r < len(prompts) else [self.pad_token_id]
            padded[r, length - len(tokens) :] = torch.tensor(tokens)
            real[r, length - len(tokens) :] = True
        real_host = real
        padded, real = padded.to(device), real.to(device)
        positions = (real.long().cumsum(-1) - 1).clamp_min_(0)  # transformers: cumsum of the attention mask - 1
        logits = torch.empty(batch, decoder.vocab_size, dtype=decoder.dtype, device=device)
        block = max(1, PREFILL_TOKENS // length)
        for start in range(0, batch, block):
            rows = slice(start, min(batch, start + block))
            b = rows.stop - rows.start
            # no padding in this block: causal attention without a mask (flash kernels); else the padded mask
            mask = None if real_host[rows].all() else llama.prefill_mask(real[rows], decoder.dtype)
            cos = session.cos.index_select(0, positions[rows].reshape(-1))
            sin = session.sin.index_select(0, positions[rows].reshape(-1))

            def attend(layer, q, k, v, rows=rows, mask=mask, b=b):
                return llama.prefill_attention(decoder, session.cache, layer, rows, q, k, v, mask, b, length)

            ids = padded[rows].reshape(-1)
            if self._grouped is not None:
                ops = self._grouped
                if self._fused is not None:  # no step context: q/k/v stay unfused; SwiGLU takes LoRA in its epilogue
                    ops = ops._replace(fused=self._fused.bind(None))
                hidden = decoder.forward_grouped(ids, cos, sin, attend, ops, self.use_compile)
            else:
                hidden = decoder.forward(ids, cos, sin, attend, self._blocks, mark_dynamic=self.use_compile)
            last = hidden.view(b, length, -1)[:, -1]
            logits[rows] = decoder.logits(last)
        return logits

    def _fill_noise(self, session: _Session) -> None:
        if session.noise is not None:
            exponential_noise(None, None, self._generator, out=session.noise)

    def _finish_step(self, session: _Session, logits: torch.Tensor) -> None:
        """Choose the next tokens from logits [B, V] and advance every buffer; no host sync (graph-safe)."""
        params = session.params
        if self.use_compile and logits.shape[0] > 1:
            for t in (logits, session.seen, session.noise):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        if session.fused_sampling:
            tokens, logprobs = self._sampling_kernel.choose(logits, params, session.seed, session.step)
            logprobs = logprobs if params.logprobs else None
        else:
            tokens, logprobs = self._choose(logits, params, session.seen, session.noise)
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

    def _decode_step(self, session: _Session) -> None:
        """One token for every row: the body that is captured as a CUDA graph."""
        decoder = self.decoder
        module = self._attention_kernel
        kernel = None
        if module and module.can_run(decoder.head_dim, decoder.dtype):

            def kernel(q, keys, values, starts, end, scale, layer):
                tiles = self._attention_tiles(q)
                return module.decode_attention(
                    q, keys, values, starts, end, scale, layer, session.table, session.anchor, **tiles
                )

        if kernel is None:
            session.mask.index_fill_(3, session.column, 0.0)  # the new token's own column becomes visible
        cos = session.cos.index_select(0, session.positions)
        sin = session.sin.index_select(0, session.positions)
        unfused = []

        def attend(layer, q, k, v):
            if k is not None:
                unfused.append(layer)
            return llama.decode_attention(
                decoder, session.cache, layer, session.column, q, k, v, session.mask, kernel, session.starts
            )

        if self._grouped is not None:
            ops = self._grouped
            if self._fused is not None:
                if session.scratch is None:
                    session.scratch = self._fused.new_scratch()
                context = StepContext(session.table, session.anchor, session.column, session.seq_len, session.scratch)
                ops = ops._replace(fused=self._fused.bind(context))
            hidden = decoder.forward_grouped(session.tokens, cos, sin, attend, ops, self.use_compile)
        else:
            hidden = decoder.forward(session.tokens, cos, sin, attend, self._blocks, mark_dynamic=self.use_compile)
        self._finish_step(session, decoder.logits(hidden))
        # the cache was reached only through the table: a graph of this step survives a new cache
        session.step_bakes_cache = kernel is None or bool(unfused)

    def _graph_inputs(self, session: _Session) -> tuple:
        """What the session's graph bakes in: the model's tensors, and the cache's unless it reads them through the
        table."""
        cache = (session.cache.data_ptrs(),) if session.graph_bakes_cache else ()
        return self.decoder.fingerprint() + cache

    @staticmethod
    def _attention_tiles(q: torch.Tensor) -> dict:
        """Decode-attention launch settings by batch size (bench/rollout.py --tune on an H100, W1's shapes)."""
        if q.shape[0] <= 64 and q.element_size() <= 2:  # fp32 tiles of 128 columns exceed the shared memory
            return {"block_s": 128, "num_warps": 8}
        return {"block_s": 64, "num_warps": 4}

    def _capture(self, session: _Session) -> None:
        """Warm up (compiles, lazy inits) on a side stream, then capture one decode step."""
        session.graph = None
        session.reset_for_capture()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_step(session)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        session.reset_for_capture()
        # a private pool of its own: the replaced graph's pool may be gone with it (reusing that handle trips the
        # caching allocator), and one graph lives at a time anyway
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            self._decode_step(session)
        session.graph = graph
        session.graph_bakes_cache = session.step_bakes_cache

    def _decode(self, session: _Session, prompts, max_steps: int, params: SamplingParams) -> int:
        """Run decode steps until every row is done or max_steps tokens exist; return the tokens per row made."""
        count = len(prompts)
        on_cuda = self.device.type == "cuda"
        pending = None  # (event, flag) of the previous check: read one period late so the GPU never waits on us
        checked = [0] * count
        every_step = params.sampler == "multinomial"  # as transformers: no step (no draw) once every row is done
        step = 1
        while step < max_steps:
            if every_step and bool(session.done.all()):
                break
            self._fill_noise(session)
            if session.graph is not None:
                session.graph.replay()
            else:
                self._decode_step(session)
            step += 1
            if every_step and params.stop_strings:
                self._check_stop_strings(session, count, step, checked)
            if step % CHECK_EVERY or step >= max_steps or every_step:
                continue
            if params.stop_strings:
                self._check_stop_strings(session, count, step, checked)
            if not on_cuda:
                if bool(session.done.all()):
                    break
                continue
            if pending is not None:
                pending[0].synchronize()
                if bool(pending[1]):
                    break
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            flag.copy_(session.done.all(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pending = (event, flag)
        return step

    def _check_stop_strings(self, session: _Session, count: int, step: int, checked: list[int]) -> None:
        """Mark rows whose newest text contains a stop string as done (exact truncation happens in _collect)."""
        done = session.done[:count].cpu()
        active = [r for r in range(count) if not done[r]]
        if not active:
            return
        tokens = session.out_tokens[:count, :step].cpu()
        hits = []
        for r in active:
            window = tokens[r, max(0, checked[r] - STOP_WINDOW) : step].tolist()
            checked[r] = step
            text = self.tokenizer.decode(window, skip_special_tokens=True)
            if any(s in text for s in session.params.stop_strings):
                hits.append(r)
        if hits:
            session.done[torch.tensor(hits, device=self.device)] = True

    def _collect(self, session: _Session, count: int, steps: int, limits, params: SamplingParams, stop_ids) -> list:
        tokens = session.out_tokens[:count, :steps].tolist()
        logprobs = session.out_logprobs[:count, :steps].tolist() if params.logprobs else None
        out = self._completions(tokens, logprobs, limits, params, stop_ids)
        check_output(out, self.decoder.vocab_size, self.model)
        return out

    def _completions(self, tokens, logprobs, limits, params: SamplingParams, stop_ids) -> list:
        """Per row (completion ids, their log-probs or None, finish reason): cut at the row's limit, its first stop
        token or its stop string."""
        out = []
        for r in range(len(tokens)):
            row = tokens[r][: limits[r]]
            end, reason = len(row), "length"
            for i, t in enumerate(row):
                if t in stop_ids:
                    end, reason = i + 1, "stop"
                    break
            if params.stop_strings:
                hit = _stop_string_end(self.tokenizer, row[:end], params.stop_strings)
                if hit is not None:
                    end, reason = hit, "stop"
            out.append((row[:end], logprobs[r][:end] if logprobs is not None else None, reason))
        return out


class EngineOutputError(RuntimeError):
    """The engine produced something it must not hand to a trainer: a token id outside the vocabulary or a NaN /
    infinite log-prob."""


def check_output(rows: list, vocab_size: int, model=None) -> None:
    """Raise EngineOutputError unless every completion's ids are in [0, vocab_size) and its log-probs are finite.
    rows: (ids, log-probs or None, finish reason) per sequence, as `_collect` builds them."""
    for index, (ids, logprobs, _) in enumerate(rows):
        bad_ids = [t for t in ids if not 0 <= t < vocab_size]
        bad_logprobs = logprobs is not None and not all(math.isfinite(v) for v in logprobs)
        if not bad_ids and not bad_logprobs:
            continue
        what = f"token ids {bad_ids[:3]} outside [0, {vocab_size})" if bad_ids else "a NaN or infinite log-prob"
        from slimrl.trainers.finite import nonfinite_tensors

        broken = nonfinite_tensors(list(model.named_parameters())) if model is not None else []
        cause = (f"the model's weights hold NaN or infinite values ({', '.join(broken)}): an earlier optimizer step "
                 "wrote them; resume from the last good checkpoint" if broken else
                 "the weights are finite, so this is a numeric fault of the engine: please report it, and generate "
                 "with generation_backend='transformers' meanwhile")  # fmt: skip
        raise EngineOutputError(f"Rollout engine: sequence {index} has {what}; {cause}.")


def _stop_string_end(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> int | None:
    """The fewest leading tokens whose text contains a stop string, or None (binary search over prefixes)."""

    def hit(n: int) -> bool:
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not tokens or not hit(len(tokens)):
        return None
    low, high = 1, len(tokens)
    while low < high:
        mid = (low + high) // 2
        if hit(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _sampling_key(params: SamplingParams) -> tuple:
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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
