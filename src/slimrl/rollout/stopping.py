"""Where a completion ends, and what the engine refuses to hand back.

Sequences stop at an EOS / stop token (included in the completion, as vLLM and transformers do), at a stop string (the
completion ends with the token that completes the string: vLLM keeps that token's id and only trims the text), or at
their own max token count. During decoding, rows whose newest text holds a stop string are marked done (re-decoding
only a window of recent tokens); the exact cut happens once the rollout is over (`completions`).
"""

from __future__ import annotations

import math

import torch

from slimrl.rollout.sampling import SamplingParams
from slimrl.rollout.session import Session

STOP_WINDOW = 32  # tokens before the newest ones re-decoded when looking for stop strings during decoding


def check_stop_strings(session: Session, tokenizer, count: int, step: int, checked: list[int]) -> None:
    """Mark rows whose newest text contains a stop string as done (the exact cut is made by `completions`)."""
    done = session.done[:count].cpu()
    active = [r for r in range(count) if not done[r]]
    if not active:
        return
    tokens = session.out_tokens[:count, :step].cpu()
    hits = []
    for r in active:
        window = tokens[r, max(0, checked[r] - STOP_WINDOW) : step].tolist()
        checked[r] = step
        text = tokenizer.decode(window, skip_special_tokens=True)
        if any(s in text for s in session.params.stop_strings):
            hits.append(r)
    if hits:
        session.done[torch.tensor(hits, device=session.done.device)] = True


def completions(tokens, logprobs, limits, params: SamplingParams, stop_ids, tokenizer) -> list:
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
            hit = stop_string_end(tokenizer, row[:end], params.stop_strings)
            if hit is not None:
                end, reason = hit, "stop"
        out.append((row[:end], logprobs[r][:end] if logprobs is not None else None, reason))
    return out


def stop_string_end(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> int | None:
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
        from slimrl.ops.finite import nonfinite_tensors

        broken = nonfinite_tensors(list(model.named_parameters())) if model is not None else []
        cause = (f"the model's weights hold NaN or infinite values ({', '.join(broken)}): an earlier optimizer step "
                 "wrote them; resume from the last good checkpoint" if broken else
                 "the weights are finite, so this is a numeric fault of the engine: please report it, and generate "
                 "with generation_backend='transformers' meanwhile")  # fmt: skip
        raise EngineOutputError(f"Rollout engine: sequence {index} has {what}; {cause}.")
