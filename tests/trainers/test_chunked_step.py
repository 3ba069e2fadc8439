"""chunked_step: chunk plans worked out by hand on a small mask, `take` and `Chunk.spread`, and `run_chunks` (one
backward per inner chunk under no_sync, the summed loss and stats, the same gradient as one piece)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from slimrl.trainers.common.chunked_step import Chunk, add_stats, plan_chunks, run_chunks, take
from tests.tolerances import assert_close

# Six completions of up to 5 tokens. A row's length is its last unmasked column + 1 (right padding is what a chunk
# can drop; a hole inside a completion is not padding).
MASK = torch.tensor([
    [1, 1, 1, 0, 0],  # row 0: length 3
    [1, 0, 0, 0, 0],  # row 1: length 1
    [1, 1, 1, 1, 1],  # row 2: length 5
    [0, 0, 0, 0, 0],  # row 3: length 0 (an empty completion)
    [1, 0, 1, 0, 0],  # row 4: length 3 (a hole at column 1, e.g. a tool's output masked out)
    [1, 1, 1, 1, 0],  # row 5: length 4
])  # fmt: skip
# Rows by length (a stable sort, so equal lengths keep their order): 3 (0), 1 (1), 0 (3), 4 (3), 5 (4), 2 (5).


def plan(num_chunks: int, mask: torch.Tensor = MASK) -> list[tuple[list[int], int]]:
    return [(chunk.rows.tolist(), chunk.width) for chunk in plan_chunks(mask, num_chunks)]


def test_three_chunks_group_rows_by_length():
    # torch.tensor_split of the 6 sorted rows into 3: [3, 1], [0, 4], [5, 2]; widths: the longest in each chunk,
    # at least 2 columns: max(0, 1, 2) = 2, max(3, 3) = 3, max(4, 5) = 5
    assert plan(3) == [([3, 1], 2), ([0, 4], 3), ([5, 2], 5)]


def test_four_chunks_take_near_equal_numbers_of_rows():
    # 6 rows into 4: sizes 2, 2, 1, 1 -> [3, 1], [0, 4], [5], [2]; widths 2, 3, 4, 5
    assert plan(4) == [([3, 1], 2), ([0, 4], 3), ([5], 4), ([2], 5)]


def test_one_chunk_keeps_the_batch_order_and_full_width():
    assert plan(1) == [([0, 1, 2, 3, 4, 5], 5)]


def test_more_chunks_than_rows_gives_one_row_each_with_a_two_column_floor():
    # capped at 6 chunks; rows 3 (length 0) and 1 (length 1) still get 2 columns
    assert plan(10) == [([3], 2), ([1], 2), ([0], 3), ([4], 3), ([5], 4), ([2], 5)]
    assert plan(0) == plan(1)  # fewer than one chunk means one


def test_a_single_column_batch_is_not_widened():
    assert plan(2, torch.tensor([[1], [0], [1]])) == [([1, 0], 1), ([2], 1)]  # lengths 1, 0, 1 sorted: 1, 0, 2


def test_take_cuts_per_token_tensors_to_the_chunk_width_and_keeps_per_sequence_ones():
    chunk = Chunk(rows=torch.tensor([4, 0]), width=3)
    tokens = torch.arange(30).reshape(6, 5)  # [N, T]
    assert take(tokens, chunk, 5).tolist() == [[20, 21, 22], [0, 1, 2]]
    assert take(torch.arange(6), chunk, 5).tolist() == [4, 0]  # [N]
    assert take(torch.arange(6).unsqueeze(1), chunk, 5).tolist() == [[4], [0]]  # [N, 1]: not a per-token tensor
    assert take(None, chunk, 5) is None


def test_spread_puts_per_sequence_values_at_their_rows():
    chunks = plan_chunks(MASK, 3)
    values = [torch.tensor([10.0 * r for r in chunk.rows.tolist()]) for chunk in chunks]
    total = sum(chunk.spread(v, 6) for chunk, v in zip(chunks, values, strict=True))
    assert total.tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]  # every row once, in the micro-batch's order
    nan = Chunk(rows=torch.tensor([1]), width=2).spread(torch.tensor([float("nan")]), 3)
    assert nan.isnan().tolist() == [False, True, False]


def test_add_stats_sums_by_name_and_keeps_the_first_order():
    totals = add_stats({}, {"b": torch.tensor(1.0), "a": torch.tensor([1.0, 2.0])})
    totals = add_stats(totals, {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor(2.0), "c": torch.tensor(5.0)})
    assert list(totals) == ["b", "a", "c"]
    assert totals["b"].item() == 3.0 and totals["a"].tolist() == [4.0, 6.0] and totals["c"].item() == 5.0


# -- run_chunks ---------------------------------------------------------------------------------------------------


class Recorder:
    """A chunk loss sum_i w * x_i over the chunk's rows, with the calls around it recorded."""

    def __init__(self, x: torch.Tensor):
        self.x, self.w = x, torch.tensor(2.0, requires_grad=True)
        self.events: list[str] = []
        self.in_no_sync = False

    def chunk_loss(self, chunk: Chunk):
        loss = (self.w * self.x[chunk.rows]).sum()
        self.events.append(f"loss {chunk.rows.tolist()}")
        return loss, {"sum": loss.detach(), "rows": torch.tensor(float(len(chunk.rows)))}

    def backward(self, loss: torch.Tensor) -> None:
        self.events.append(f"backward{' (no_sync)' if self.in_no_sync else ''}")
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        yield
        self.in_no_sync = False


def test_inner_chunks_are_backpropagated_under_no_sync_and_the_last_is_left_to_the_caller():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    recorder = Recorder(x)
    chunks = [Chunk(torch.tensor([0, 1]), 2), Chunk(torch.tensor([2]), 2), Chunk(torch.tensor([3, 4]), 2)]
    loss, totals = run_chunks(chunks, recorder.chunk_loss, recorder.backward, recorder.no_sync)
    assert recorder.events == ["loss [0, 1]", "backward (no_sync)", "loss [2]", "backward (no_sync)", "loss [3, 4]"]
    # 2 * (1 + 2) + 2 * 3 + 2 * (4 + 5) = 6 + 6 + 18 = 30; the first two chunks' gradient (1 + 2 + 3 = 6) is in
    assert loss.item() == 30.0 and recorder.w.grad.item() == 6.0
    loss.backward()  # the caller's backward completes it: d/dw = 1 + 2 + 3 + 4 + 5 = 15, as in one piece
    assert recorder.w.grad.item() == 15.0
    assert totals["sum"].item() == 30.0 and totals["rows"].item() == 5.0


@pytest.mark.parametrize("grad", [True, False])
def test_one_chunk_or_no_grad_runs_every_chunk_without_inner_backward(grad):
    x = torch.tensor([1.0, 2.0, 3.0])
    recorder = Recorder(x)
    chunks = (
        [Chunk(torch.tensor([0, 1, 2]), 2)] if grad else [Chunk(torch.tensor([0]), 2), Chunk(torch.tensor([1, 2]), 2)]
    )
    with torch.set_grad_enabled(grad):
        loss, totals = run_chunks(chunks, recorder.chunk_loss, recorder.backward, recorder.no_sync)
    assert not any(event.startswith("backward") for event in recorder.events)
    assert_close(loss, torch.tensor(12.0), name="loss")  # 2 * (1 + 2 + 3)
    assert totals["rows"].item() == 3.0 and loss.requires_grad == grad
