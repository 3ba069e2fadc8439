"""PPO's rollout buffer and the rollout's tensors, without a model: each micro-step reads the rows its pass's
permutation gives it, divided by its whole mini-batch's token count; the buffer survives a checkpoint's weights_only
load; prompts are left-padded, completions right-padded and cut at the first EOS."""

from __future__ import annotations

import pytest
import torch

from slimrl.trainers.ppo.rollout import (
    ROW_FIELDS,
    RolloutBuffer,
    cut_at_eos,
    penalise_missing_eos,
    rollout_tensors,
)

N, P, T = 8, 3, 5
MICRO, ACCUMULATION, MINI_BATCHES, EPOCHS = 2, 2, 2, 2  # N = 2 x 2 x 2: a mini-batch is 4 rows


def buffer(order: torch.Tensor, completion_lengths: list[int]) -> RolloutBuffer:
    """Every per-sequence field holds its row's index in each position (plus an offset per field), so the rows a
    micro-batch took can be read off any of its fields."""
    rows = torch.arange(N)
    mask = (torch.arange(T) < torch.tensor(completion_lengths)[:, None]).long()
    by_row = {name: (rows[:, None] + 100 * i).expand(N, P if name.startswith("prompt") else T).clone()
              for i, name in enumerate(ROW_FIELDS)}  # fmt: skip
    by_row["completion_mask"] = mask
    return RolloutBuffer(**by_row, order=order)


def test_each_micro_step_reads_its_rows_of_the_pass_permutation_and_its_mini_batch_token_count():
    order = torch.tensor([[3, 1, 4, 0, 7, 5, 2, 6], [6, 2, 5, 7, 0, 4, 1, 3]])  # [epochs, N]
    lengths = [5, 1, 3, 2, 4, 0, 2, 1]  # row 5 has an empty completion
    rollout = buffer(order, lengths)
    position, seen = 0, []
    for epoch in range(EPOCHS):
        for minibatch in range(MINI_BATCHES):
            minibatch_rows = order[epoch, minibatch * 4 : (minibatch + 1) * 4]
            for micro in range(ACCUMULATION):
                batch = rollout.micro_batch(position, MICRO, ACCUMULATION, MINI_BATCHES)
                rows = minibatch_rows[micro * MICRO : (micro + 1) * MICRO]
                assert set(batch) == {*ROW_FIELDS, "minibatch_tokens"}
                for i, name in enumerate(ROW_FIELDS):
                    width = P if name.startswith("prompt") else T
                    assert batch[name].shape == (MICRO, width), name
                    if name != "completion_mask":
                        assert batch[name][:, 0].tolist() == (rows + 100 * i).tolist(), (position, name)
                assert torch.equal(batch["completion_mask"], rollout.completion_mask[rows])
                # the divisor of every micro-step of a mini-batch: all of its completion tokens, not the micro-batch's
                assert batch["minibatch_tokens"].item() == sum(lengths[r] for r in minibatch_rows.tolist())
                seen.append(rows)
                position += 1
        # each pass trains on every row once
        assert sorted(torch.cat(seen[-MINI_BATCHES * ACCUMULATION :]).tolist()) == list(range(N))
    with pytest.raises(IndexError, match="micro_steps_per_rollout"):
        rollout.micro_batch(position, MICRO, ACCUMULATION, MINI_BATCHES)


def test_a_mini_batch_of_empty_completions_divides_by_one():
    order = torch.arange(N).repeat(EPOCHS, 1)
    rollout = buffer(order, [0, 0, 0, 0, 2, 2, 2, 2])  # the first mini-batch has no completion token
    assert rollout.micro_batch(0, MICRO, ACCUMULATION, MINI_BATCHES)["minibatch_tokens"].item() == 1
    assert rollout.micro_batch(2, MICRO, ACCUMULATION, MINI_BATCHES)["minibatch_tokens"].item() == 8


def test_the_buffer_survives_a_weights_only_load_as_its_checkpoint_is_read(tmp_path):
    # ResumableTrainerMixin saves the trainer's `_buffered_inputs` (to_dict) and reads it with weights_only=True
    saved = buffer(torch.stack([torch.randperm(N) for _ in range(EPOCHS)]), [5, 1, 3, 2, 4, 0, 2, 1])
    saved.stopped, saved.metrics = True, {"objective/scores": 0.25, "val/num_eos_tokens": 3.0}
    torch.save({"attributes": {"_buffered_inputs": saved.to_dict()}}, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)["attributes"]["_buffered_inputs"]
    loaded = RolloutBuffer.from_dict(state)
    for name in (*ROW_FIELDS, "order"):
        assert torch.equal(getattr(loaded, name), getattr(saved, name)), name
    assert loaded.stopped is True and loaded.metrics == saved.metrics
    del state["order"]
    with pytest.raises(ValueError, match=r"lacks \['order'\]"):
        RolloutBuffer.from_dict(state)


def test_prompts_are_left_padded_and_completions_right_padded_and_cut_at_the_first_eos():
    eos = [2, 9]
    completions = [cut_at_eos([5, 6, 9, 7, 2], eos), cut_at_eos([8, 8], eos), cut_at_eos([2, 5], eos)]
    assert completions == [[5, 6, 9], [8, 8], [2]]
    tensors = rollout_tensors([[4, 5], [6], [7, 8, 1]], completions, pad=0)
    assert tensors["prompt_ids"].tolist() == [[0, 4, 5], [0, 0, 6], [7, 8, 1]]
    assert tensors["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert tensors["completion_ids"].tolist() == [[5, 6, 9], [8, 8, 0], [2, 0, 0]]
    assert tensors["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    # a rollout of empty completions still has one (padding) column
    assert rollout_tensors([[4]], [[]], pad=0)["completion_mask"].tolist() == [[0]]


def test_a_completion_that_did_not_end_at_an_eos_loses_the_missing_eos_penalty():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0])
    completions = [[5, 2], [5, 6], [], [9]]  # ended by EOS 2; cut at the length limit; empty; ended by EOS 9
    assert penalise_missing_eos(scores, completions, [2, 9], 0.5).tolist() == [1.0, 0.5, 0.5, 1.0]
    assert penalise_missing_eos(scores, completions, [2, 9], None) is scores
