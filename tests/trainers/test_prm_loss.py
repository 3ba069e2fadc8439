"""The PRM's tokenisation (trainers/prm/inputs.py) and loss (trainers/prm/loss.py), against values worked out by hand.

Token ids of slimrl.testing's byte tokenizer: 4 special tokens, then the 256 bytes in the order of their ByteLevel
characters. The printable ASCII bytes '!'..'~' (33..126) come first, as themselves: id = ord(c) - 33 + 4 = ord(c) - 29
('Q' 52, '?' 34, 'a' 68, 'b' 69, 'c' 70, '.' 17). Then the other characters below U+0100 (12 + 82 = 94 more, so 188
in all), then U+0100 + n for the n-th unprintable byte: '\\n' (byte 10, n = 10) is 4 + 188 + 10 = 202, ' ' (byte 32,
n = 32) is 4 + 188 + 32 = 224.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.testing import tiny_tokenizer
from slimrl.trainers.prm.inputs import PRMCollator, tokenize_row
from slimrl.trainers.prm.loss import labelled_tokens, micro_batch_loss, step_nll_sum
from tests.tolerances import assert_close

X = -100  # no label
ROW = {"prompt": "Q?", "completions": ["ab", "c"], "labels": [True, False]}


def tokenise(row=ROW, tokenizer=None, separator="\n", max_length=None, max_prompt_length=None,
             max_completion_length=None, last_only=False, is_eval=False) -> dict:  # fmt: skip
    return tokenize_row(row, tokenizer or tiny_tokenizer(), separator, max_length, max_prompt_length,
                        max_completion_length, last_only, is_eval)  # fmt: skip


def bos_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.bos_token = "<|endoftext|>"  # id 1
    return tokenizer


def test_each_steps_label_sits_on_the_separator_after_it():
    """'Q?' -> [52, 34]; 'ab' + '\\n' -> [68, 69, 202] labelled 1 on 202; 'c' + '\\n' -> [70, 202] labelled 0."""
    row = tokenise()
    assert row["input_ids"] == [52, 34, 68, 69, 202, 70, 202]
    assert row["labels"] == [X, X, X, X, 1, X, 0]


def test_train_on_last_step_only_keeps_the_last_label_in_training_rows_only():
    assert tokenise(last_only=True)["labels"] == [X, X, X, X, X, X, 0]
    assert tokenise(last_only=True, is_eval=True)["labels"] == [X, X, X, X, 1, X, 0]  # evaluation scores every step


def test_a_separator_of_several_tokens_carries_the_label_on_its_last():
    """'. ' -> [17, 224]: 'ab. ' = [68, 69, 17, 224] labelled on 224, 'c. ' = [70, 17, 224]."""
    row = tokenise(separator=". ")
    assert row["input_ids"] == [52, 34, 68, 69, 17, 224, 70, 17, 224]
    assert row["labels"] == [X, X, X, X, X, 1, X, X, 0]


def test_bos_and_truncation():
    """BOS (id 1) opens the prompt: [1, 52, 34]. max_prompt_length=2 keeps its last two, [52, 34] (the BOS goes, as
    in TRL); max_completion_length=4 keeps [68, 69, 202, 70] (labels X X 1 X); max_length=5 cuts the row to
    [52, 34, 68, 69, 202]."""
    assert tokenise(tokenizer=bos_tokenizer())["input_ids"] == [1, 52, 34, 68, 69, 202, 70, 202]
    row = tokenise(tokenizer=bos_tokenizer(), max_prompt_length=2, max_completion_length=4)
    assert row == {"input_ids": [52, 34, 68, 69, 202, 70], "labels": [X, X, X, X, 1, X]}
    row = tokenise(tokenizer=bos_tokenizer(), max_prompt_length=2, max_completion_length=4, max_length=5)
    assert row == {"input_ids": [52, 34, 68, 69, 202], "labels": [X, X, X, X, 1]}


@pytest.mark.parametrize(("row", "message"), [
    ({**ROW, "labels": [True]}, r"2 steps in 'completions' but 1 values in 'labels'"),
    ({**ROW, "completions": "ab"}, r"'completions' must be a non-empty list of step strings"),
    ({**ROW, "labels": [True, 0.5]}, r"'labels' holds 0.5"),
    ({**ROW, "prompt": [{"role": "user", "content": "Q?"}]}, r"string 'prompt'"),
])  # fmt: skip
def test_rows_it_cannot_read_are_refused_with_the_fix(row, message):
    with pytest.raises(ValueError, match=message):
        tokenise(row)


def test_the_collator_pads_on_the_right_with_no_label():
    batch = PRMCollator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [X, X, 1]},
                                         {"input_ids": [8], "labels": [0]}])  # fmt: skip
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[X, X, 1], [0, X, X]]


def test_the_loss_is_the_mean_cross_entropy_over_labelled_tokens():
    """Labels [X, 1, 0]; logits [5, -5] (unlabelled: no part), [0, 0] (target 1: -log 1/2 = ln 2) and [ln 3, 0]
    (p0 = 3/4, target 0: -log 3/4). Mean over 2: (ln 2 + ln 4/3) / 2 = ln(8/3) / 2. d/dlogits = (softmax -
    onehot) / 2: [0, 0], [1/4, -1/4], [-1/8, 1/8]."""
    logits = torch.tensor([[[5.0, -5.0], [0.0, 0.0], [math.log(3.0), 0.0]]], requires_grad=True)
    labels = torch.tensor([[X, 1, 0]])
    assert labelled_tokens(labels).item() == 2
    loss = micro_batch_loss(step_nll_sum(logits, labels), labelled_tokens(labels))
    loss.backward()
    assert_close(loss, math.log(8 / 3) / 2, name="loss")
    assert_close(logits.grad, [[[0.0, 0.0], [0.25, -0.25], [-0.125, 0.125]]], name="d loss / d logits")


def test_a_chunks_share_is_divided_by_the_micro_batchs_count_not_its_own():
    """Row A: one labelled token, logits [0, 0] (ln 2); row B: three (3 ln 2): mean ln 2 over the 4 tokens. A's
    chunk alone contributes ln 2 / 4 (not its own mean, ln 2); the two chunks sum to ln 2."""
    zeros = torch.zeros(1, 3, 2)
    a, b = torch.tensor([[X, X, 0]]), torch.tensor([[1, 0, 1]])
    share_a = micro_batch_loss(step_nll_sum(zeros, a), torch.tensor(4))
    share_b = micro_batch_loss(step_nll_sum(zeros, b), torch.tensor(4))
    assert_close(share_a, math.log(2) / 4, name="A's share")
    assert_close(share_a + share_b, math.log(2), name="the micro-batch's mean")


def test_a_micro_batch_with_no_label_left_has_loss_zero_not_nan():
    logits = torch.zeros(1, 2, 2, requires_grad=True)
    loss = micro_batch_loss(step_nll_sum(logits, torch.full((1, 2), X)), torch.tensor(0))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum().item() == 0.0
