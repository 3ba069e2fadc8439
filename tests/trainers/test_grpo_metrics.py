"""grpo_metrics: the chunk-by-chunk parts of TRL's GRPO metrics, worked out by hand on two sequences, give the same
logged values whether the micro-batch is one chunk or two."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from slimrl.trainers.common.chunked_step import Chunk, add_stats
from slimrl.trainers.grpo.loss import ChunkLossTerms
from slimrl.trainers.grpo.metrics import append_metrics, chunk_metrics, mean_parts

# Row 0 (advantage +1) and row 1 (advantage -1), ratios 0.5, 1.0, 2.0; row 1's last token is padding.
RATIO = torch.tensor([[0.5, 1.0, 2.0], [0.5, 1.0, 2.0]])
ADVANTAGES = torch.tensor([[1.0], [-1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # 5 tokens
ENTROPIES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


class OneProcess:
    """The accelerator of a single process: reduce and gather return their input."""

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


def metrics_for(chunks: list[Chunk]) -> dict:
    totals = {}
    for chunk in chunks:
        rows = chunk.rows
        terms = ChunkLossTerms(per_token_loss=torch.zeros(len(rows), 3), coef_1=RATIO[rows], per_token_kl=None,
                               phi_seq=None)  # fmt: skip
        stats = chunk_metrics("grpo", 0.2, 0.28, terms, ENTROPIES[rows], ADVANTAGES[rows], MASK[rows], chunk, 2)
        totals = add_stats(totals, stats)
    logged = defaultdict(list)  # as TRL keeps self._metrics[mode]
    append_metrics(logged, totals, OneProcess())
    return {name: values[0] for name, values in logged.items()}


@pytest.mark.parametrize("split", [False, True], ids=["one_chunk", "two_chunks"])
def test_clip_ratios_and_entropy_by_hand(split):
    chunks = [Chunk(torch.tensor([0]), 3), Chunk(torch.tensor([1]), 3)] if split else [Chunk(torch.tensor([0, 1]), 3)]
    metrics = metrics_for(chunks)
    # low: ratio < 1 - 0.2 with A < 0: only row 1's first token -> 1 of 5 unmasked tokens
    # high: ratio > 1 + 0.28 with A > 0: only row 0's last token -> 1 of 5; region: either -> 2 of 5
    # per sequence, low: row 0 0/3, row 1 1/2 -> min 0; high: row 0 1/3, row 1 0/2 -> max 1/3
    # entropy: (1 + 2 + 3 + 4 + 5) / 5 = 3 (row 1's padded 6 is not counted)
    order = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "clip_ratio/low_min", "clip_ratio/high_max"]  # fmt: skip
    assert list(metrics) == order  # TRL's order
    assert metrics == pytest.approx({"entropy": 3.0, "clip_ratio/low_mean": 0.2, "clip_ratio/high_mean": 0.2,
                                     "clip_ratio/region_mean": 0.4, "clip_ratio/low_min": 0.0,
                                     "clip_ratio/high_max": 1 / 3})  # fmt: skip


def test_a_sequence_level_value_averages_over_sequences():
    # [b, 1] values (sequence-level importance sampling): a plain mean over the 2 sequences, whatever the mask
    assert mean_parts(torch.tensor([[0.5], [2.0]]), MASK).tolist() == [2.5, 2.0]
