"""The engine on a GPU: deterministic rollouts, and captured graphs kept across shapes that alternate."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.sampling import SamplingParams
from tests.rollout.helpers import GREEDY, PROMPTS, build, left_pad, no_eos, with_lora

pytestmark = pytest.mark.cuda  # CUDA graphs and the Triton kernels need CUDA


def bf16_lora_model(layers: int = 2):
    model = with_lora(no_eos(build("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=512, num_hidden_layers=layers)))  # fmt: skip
    return model.to("cuda", torch.bfloat16)


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return [torch.randint(4, 250, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("rows, new_tokens", [(8, 48), (64, 48), (8, 300), (16, 200)])
def test_deterministic_engine_repeats_its_rollouts_bit_for_bit(rows, new_tokens):
    # the longer rollouts split each row's attention columns over programs (`attention.context_splits`: 3 of 384
    # columns at 8 rows, 2 of 256 at 16), whose sums meet in split order
    from slimrl.rollout.kernels.attention import context_splits

    model = bf16_lora_model()
    engine = RolloutEngine(model, deterministic=True)
    params = SamplingParams(temperature=1.0, seed=5)
    batch = prompts(rows)
    first = engine.generate(batch, params, max_new_tokens=new_tokens)
    session = engine.sessions.current
    split = context_splits(rows, 2, session.seq_len, session.table.device) > 1
    assert split == (new_tokens > 48)
    assert (session.scratch is not None and session.scratch.holds("cuda", "attention")) == split
    for _ in range(3):
        again = engine.generate(batch, params, max_new_tokens=new_tokens)
        assert again.completion_ids == first.completion_ids
        assert again.logprobs == first.logprobs
    fresh = RolloutEngine(model, deterministic=True).generate(batch, params, max_new_tokens=new_tokens)
    assert fresh.completion_ids == first.completion_ids and fresh.logprobs == first.logprobs


def test_alternating_shapes_replay_their_kept_graphs():
    model = bf16_lora_model()
    engine = RolloutEngine(model)
    params = SamplingParams(temperature=1.0, seed=1)
    batch = prompts(8)
    shapes = [20, 300, 20, 300, 20]  # cache lengths 128 and 384 after rounding
    captures = []
    for new_tokens in shapes:
        out = engine.generate(batch, params, max_new_tokens=new_tokens)
        engine.release()
        captures.append(out.stats.get("captures", 0))
    assert captures == [1, 1, 0, 0, 0], captures


def test_cuda_graph_decode_matches_generate_and_stays_live():
    import os

    model = with_lora(no_eos(build("qwen2"))).cuda()
    # conftest runs Triton in its interpreter for CPU kernel tests; torch.compile's kernels need the real one
    compiled = os.environ.get("TRITON_INTERPRET", "0") != "1"
    engine = RolloutEngine(model, compile=compiled)
    assert engine.options.cuda_graphs
    prompts_cuda = PROMPTS
    out = engine.generate(prompts_cuda, GREEDY, max_new_tokens=16)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    assert out.completion_ids == ref[:, ids.shape[1] :].tolist()
    graph = engine.sessions.current.graph
    with torch.no_grad():  # an in-place edit, as an optimizer step makes: the captured graph must see it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    again = engine.generate(prompts_cuda, GREEDY, max_new_tokens=16)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    assert engine.sessions.current.graph is graph, "an in-place weight update must not need a new capture"
    assert again.completion_ids == ref[:, ids.shape[1] :].tolist()
    assert again.completion_ids != out.completion_ids



def test_shared_prompt_cache_on_the_whole_cuda_path():
    """GRPO-shaped rollouts with the shared prompt cache (one copy of each prompt, `kv_cache`) through the captured
    graph, the fused q/k/v kernel and the Triton attention reading the prefix through its table: the completions of
    the cache with a copy per row (fp32 greedy equal to generate's too, and bf16 sampling with deterministic
    kernels), and the graph replayed after release() frees both caches."""
    import os

    from tests.rollout.test_shared_cache import ROWS, prefix_of

    compiled = os.environ.get("TRITON_INTERPRET", "0") != "1"
    model = with_lora(no_eos(build("qwen2", num_attention_heads=2, num_key_value_heads=1, head_dim=32))).cuda()
    shared = RolloutEngine(model, compile=compiled)
    separate = RolloutEngine(model, compile=compiled, share_prompt_cache=False)
    assert shared.options.fused_decode and shared.options.triton_attention
    ids, mask = left_pad(ROWS)
    with torch.no_grad():
        ref = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    got = shared.generate(ROWS, GREEDY, 12).completion_ids
    assert prefix_of(shared) == (4, 256)
    assert got == separate.generate(ROWS, GREEDY, 12).completion_ids == ref[:, ids.shape[1] :].tolist()

    model = bf16_lora_model()
    params = SamplingParams(temperature=1.0, seed=3)
    # bf16 draws compared bit for bit: one attention program per row and kv head in both (by default each layout's
    # split count follows its own column count, 384 here and 256 with copies, so their sums may round apart)
    shared = RolloutEngine(model, deterministic=True, attention_splits=1)
    separate = RolloutEngine(model, deterministic=True, share_prompt_cache=False, attention_splits=1)
    first = shared.generate(ROWS, params, 40)
    assert first.completion_ids == separate.generate(ROWS, params, 40).completion_ids
    assert not shared.sessions.current.graph_bakes_cache, "the graph reads both caches through their tables"
    shared.release()
    again = shared.generate(ROWS, params, 40)
    assert again.stats.get("captures", 0) == 0 and again.completion_ids == first.completion_ids
    assert again.stats["kv_cache_bytes"] < separate.last_stats["kv_cache_bytes"]
