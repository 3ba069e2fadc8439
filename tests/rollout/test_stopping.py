"""Where completions end, and what the engine refuses to hand back."""

from __future__ import annotations

import pytest

from slimrl.rollout.sampling import SamplingParams
from slimrl.rollout.stopping import EngineOutputError, check_output, completions, stop_string_end
from slimrl.testing import tiny_tokenizer
from tests.rollout.helpers import build


def test_check_output_names_token_ids_outside_the_vocabulary():
    check_output([([1, 2], [-0.5, -1.0], "length")], vocab_size=3)  # a valid row passes
    with pytest.raises(EngineOutputError, match=r"sequence 1 has token ids \[7\] outside \[0, 5\)"):
        check_output([([1], None, "stop"), ([2, 7], None, "length")], vocab_size=5)
    with pytest.raises(EngineOutputError, match="sequence 0 has a NaN or infinite log-prob; the weights are finite"):
        check_output([([1], [float("-inf")], "stop")], vocab_size=5, model=build("llama"))


def test_completions_end_at_the_limit_the_first_stop_token_or_the_stop_string():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("ab\ncd", add_special_tokens=False)["input_ids"]  # 5 byte tokens
    rows = [[7, 8, 3, 9, 9], [7, 8, 9, 9, 9], ids]
    logprobs = [[-1.0] * 5 for _ in rows]
    params = SamplingParams(stop=["\n"])
    out = completions(rows, logprobs, [5, 2, 5], params, {3}, tokenizer)
    assert out[0] == ([7, 8, 3], [-1.0] * 3, "stop")  # EOS-like stop id, included
    assert out[1] == ([7, 8], [-1.0] * 2, "length")  # its own limit
    assert out[2] == (ids[:3], [-1.0] * 3, "stop")  # ends with the token that completes "\n"
    assert stop_string_end(tokenizer, ids, ("\n",)) == 3 and stop_string_end(tokenizer, ids, ("zz",)) is None
