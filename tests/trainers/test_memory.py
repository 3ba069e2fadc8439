"""num_chunks="auto": the memory model's choices on synthetic numbers."""

import torch
from transformers import Qwen2Config

from slimrl.trainers.memory import bytes_per_token, choose_num_chunks

W1 = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2)  # fmt: skip
GIB = 2**30


def test_offloading_and_tiling_lower_the_per_token_cost():
    plain = bytes_per_token(W1, torch.bfloat16, offloaded=False, tiled_mlp=False)
    offloaded = bytes_per_token(W1, torch.bfloat16, offloaded=True, tiled_mlp=False)
    both = bytes_per_token(W1, torch.bfloat16)
    assert plain > offloaded > both > 0
    assert plain - offloaded == 26 * 1536 * 2  # 28 layer checkpoints -> 2 on the GPU
    assert bytes_per_token(W1, torch.float32) == 2 * both - 8  # fp32 doubles all but the fp32 log-probs


def test_everything_fits_in_one_chunk_when_memory_is_plenty():
    choice = choose_num_chunks(W1, [1280] * 8, free_bytes=60 * GIB)
    assert choice.num_chunks == 1 and "1 chunk(s)" in choice.explanation


def test_more_chunks_with_less_memory_and_longer_sequences():
    lengths = [2000] * 8
    roomy = choose_num_chunks(W1, lengths, free_bytes=60 * GIB).num_chunks
    tight = choose_num_chunks(W1, lengths, free_bytes=GIB // 4).num_chunks
    longer = choose_num_chunks(W1, [4 * n for n in lengths], free_bytes=60 * GIB).num_chunks
    assert roomy == 1 and 1 < tight <= 8 and roomy < longer <= 8


def test_chunks_hold_about_the_target_tokens_even_when_memory_is_plenty():
    assert choose_num_chunks(W1, [33024] * 8, free_bytes=70 * GIB).num_chunks == 8
    assert choose_num_chunks(W1, [4352] * 8, free_bytes=70 * GIB).num_chunks == 2


def test_never_more_chunks_than_sequences_and_warns_when_one_does_not_fit():
    choice = choose_num_chunks(W1, [10**7] * 3, free_bytes=1 * GIB)
    assert choice.num_chunks == 3 and "may not fit" in choice.explanation


def test_the_largest_chunk_fits_the_budget_when_it_can():
    lengths = [100, 100, 100, 100, 5000, 5000]
    choice = choose_num_chunks(W1, lengths, free_bytes=int(6000 * bytes_per_token(W1, torch.bfloat16) / 0.85))
    per_chunk = -(-len(lengths) // choice.num_chunks)
    assert sum(sorted(lengths, reverse=True)[:per_chunk]) * choice.bytes_per_token <= choice.budget_bytes


def test_empty_batch():
    assert choose_num_chunks(W1, [], free_bytes=GIB).num_chunks == 1
