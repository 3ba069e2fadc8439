"""Sampling parameters and the logits processing of one decode step, as pure tensor functions.

Every function takes fp32 logits `[B, V]` and returns new logits (filtered entries are -inf), so the steps compose in
any order and run inside a captured CUDA graph: none of them synchronises with the host. The semantics are those of
transformers' LogitsProcessors (`RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper`, `MinPLogitsWarper`), applied in `generate`'s order: repetition penalty, temperature, top-k, top-p,
min-p. The tests compare each one against those classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOGPROBS_MODES = ("processed", "temperature", "raw")
SAMPLERS = ("race", "multinomial")


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token (vLLM-style names, transformers semantics).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. Negative is an error.
    top_p, top_k, min_p: nucleus, top-k (0, -1 or None = off) and min-p filters, applied after temperature.
    repetition_penalty: transformers' penalty over the prompt's real tokens and the generated tokens (1.0 = off).
    max_tokens: new tokens per sequence when `generate` is not given `max_new_tokens`.
    stop: strings that end a sequence (needs the engine's tokenizer); stop_token_ids: ids that end it, besides the
        model's EOS ids (`generation_config.eos_token_id`), which also end it unless `ignore_eos`.
    seed: seeds the engine's generator for this call; None draws one from torch's default CPU generator, so
        `torch.manual_seed` makes rollouts reproducible.
    sampler: how a token is drawn from the processed distribution.
        "race" (default): argmax(probs / E), E ~ Exp(1) from the engine's own generator: no host sync, so it runs
            inside a captured CUDA graph (and fused, see `kernels.sampler`).
        "multinomial": `torch.multinomial` on torch's default generator, one draw per row and step for every row of
            the batch in prompt order, as transformers' `generate(do_sample=True)` draws: with the same seed and
            logits the engine then samples the same tokens as TRL's transformers path. Eager only (the engine uses
            it without graphs, one wave, no padding rows); `seed` is then ignored: `torch.manual_seed` seeds it.
    logprobs: return the log-probability of each sampled token.
    logprobs_mode: which distribution those log-probs are taken from:
        "processed" (default): the distribution actually sampled from, after repetition penalty, temperature and the
            top-k/top-p/min-p filters (renormalised over the kept tokens). This is what TRL asks vLLM for
            (`logprobs_mode="processed_logprobs"`), so the engine can stand in for TRL's vLLM path. With the filters
            off (TRL's defaults top_p=1, top_k=0, min_p=None) it equals TRL's own `log_softmax(logits / temperature)`.
        "temperature": after penalty and temperature, before the filters (TRL's training-side definition).
        "raw": `log_softmax` of the model's logits, before anything (vLLM's own default, "raw_logprobs").
        For greedy decoding (temperature 0) "processed" and "temperature" both mean the penalised logits, unscaled,
        as in vLLM.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True
    logprobs_mode: str = "processed"
    sampler: str = "race"
    _stop: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to turn nucleus sampling off.")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 / None for off; got {self.top_k}.")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}; use 0.0 to turn it off.")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}.")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}.")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}.")
        object.__setattr__(self, "_stop", tuple(stop))
        if self.stop_token_ids is not None and any(int(t) < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def top_k_value(self) -> int:
        """The top-k filter's k, or 0 when the filter is off."""
        return 0 if self.top_k is None or self.top_k <= 0 else int(self.top_k)

    @property
    def min_p_value(self) -> float:
        return 0.0 if self.min_p is None else float(self.min_p)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: logits of seen tokens are divided by `penalty` if positive, else multiplied.

    logits: [B, V] fp32; seen: [B, V] bool, True for every token already in the sequence.
    """
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature (temperature > 0); 1.0 returns the input untouched."""
    if temperature == 1.0:
        return logits
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits of each row (ties with the k-th are kept, as in transformers); 0 = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: drop the least likely tokens whose total probability is at most 1 - top_p; keep at least one."""
    if top_p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, dim=-1)  # [B, V]
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1.0 - top_p)
    drop_sorted[:, -1] = False  # the most likely token always stays
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the row's largest probability; 0 = off."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    drop = probs < threshold  # the most likely token is never below its own threshold (min_p <= 1)
    return logits.masked_fill(drop, float("-inf"))


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, in transformers' order (the penalty comes before, separately)."""
    logits = apply_temperature(logits, params.temperature)
    logits = apply_top_k(logits, params.top_k_value)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p_value)


def exponential_noise(shape, device, generator: torch.Generator | None = None, out=None) -> torch.Tensor:
    """I.i.d. Exp(1) draws in fp32, never 0 (CUDA's kernel already excludes 0; the CPU one can return it)."""
    noise = out if out is not None else torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    if noise.device.type != "cuda":
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return noise


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, noise: torch.Tensor | None = None):
    """One draw per row from `probs` [B, V] without a host sync: argmax(probs / E) with E ~ Exp(1) i.i.d.

    The "exponential race": token i wins with probability probs[i] / sum(probs), exactly as torch.multinomial, but
    it is an elementwise op plus an argmax, so it can be captured in a CUDA graph. Pass `noise` (from
    `exponential_noise`) to draw outside the graph, or a generator to draw here.
    """
    if noise is None:
        noise = exponential_noise(probs.shape, probs.device, generator)
    return (probs / noise).argmax(dim=-1)


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token of each row and its log-probability (see `SamplingParams.logprobs_mode`).

    logits: [B, V] in the model's dtype or fp32; seen: [B, V] bool (needed when repetition_penalty != 1);
    noise: [B, V] Exp(1) draws (needed unless greedy). Returns (tokens [B] int64, logprobs [B] fp32 or None).
    """
    raw = logits.float()
    x = raw
    if params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    if params.greedy:
        tokens = x.argmax(dim=-1)
        reported = raw if params.logprobs_mode == "raw" else x
    else:
        filtered = apply_filters(x, params)
        lse = torch.logsumexp(filtered, dim=-1, keepdim=True)
        if params.sampler == "multinomial":  # transformers' own draw: softmax, then torch.multinomial
            tokens = torch.multinomial(filtered.softmax(dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = sample(torch.exp(filtered - lse), noise=noise)
        if params.logprobs_mode == "processed":
            if not params.logprobs:
                return tokens, None
            return tokens, filtered.gather(1, tokens[:, None]).squeeze(1) - lse.squeeze(1)
        reported = raw if params.logprobs_mode == "raw" else apply_temperature(x, params.temperature)
    if not params.logprobs:
        return tokens, None
    picked = reported.gather(1, tokens[:, None]).squeeze(1)
    return tokens, picked - torch.logsumexp(reported, dim=-1)
