"""slimrl's chunked DPO loss against unpatched TRL: same loss, same gradient on every trainable parameter, same
metrics, for every DPO option of TRL 1.16.

Each case builds TRL's trainer and slimrl's on identical weights and feeds both the same collated batch of 8 pairs;
TRL's result is computed once per case and compared with slimrl's at num_chunks 1, 2 and 8 (8 = one pair per chunk).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from tests.distributed.launch import run_two_processes
from tests.tolerances import assert_close
from tests.trainers.dpo_harness import (
    NUM_PAIRS,
    assert_same_curves,
    assert_same_step,
    build_trainer,
    loss_grads_metrics,
    preference_batch,
    preference_dataset,
    train_log,
)
from tests.trainers.trainer_cache import TrainerCache

# (case id, trainer options, accumulation steps). beta is 0.5 unless a case needs margins on both sides of a kink.
CASES = [
    ("sigmoid", dict(), 1),
    ("hinge", dict(loss_type="hinge", beta=6.0), 1),  # some pairs beyond the hinge, some inside
    ("ipo", dict(loss_type="ipo"), 1),
    ("exo_pair", dict(loss_type="exo_pair", label_smoothing=1e-3), 1),
    ("nca_pair", dict(loss_type="nca_pair"), 1),
    ("robust", dict(loss_type="robust", label_smoothing=0.1), 1),
    ("bco_pair", dict(loss_type="bco_pair"), 1),
    ("sppo_hard", dict(loss_type="sppo_hard"), 1),
    ("apo_zero", dict(loss_type="apo_zero"), 1),
    ("apo_down", dict(loss_type="apo_down"), 1),
    # a soft blend: with the default tau (0.05) the loss's curvature multiplies the batch-shape rounding of TRL's own
    # forward past the fp32 bar (see test_one_pair_per_chunk_equals_trl_run_pair_by_pair)
    ("discopop", dict(loss_type="discopop", discopop_tau=0.5), 1),
    ("sft", dict(loss_type="sft"), 1),
    ("sigmoid_norm", dict(loss_type="sigmoid_norm"), 1),
    ("weighted_mpo", dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]), 1),
    ("ld_alpha", dict(ld_alpha=0.5), 1),
    ("forward_kl", dict(f_divergence_type="forward_kl"), 1),
    ("js_divergence", dict(f_divergence_type="js_divergence", loss_type=["sigmoid", "ipo"]), 1),
    ("alpha_divergence", dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3), 1),
    ("label_smoothing_with_sigmoid", dict(loss_type=["sigmoid", "robust"], label_smoothing=0.2), 1),
    ("use_weighting", dict(use_weighting=True, loss_type=["sigmoid", "ipo"]), 1),
    ("precompute_ref_log_probs", dict(precompute_ref_log_probs=True), 1),
    ("grad_accumulation", dict(gradient_accumulation_steps=2), 2),
    ("ref_adapter", dict(reference="ref_adapter"), 1),
    ("ref_model_full_finetune", dict(reference="ref_model"), 1),
    ("qwen2_ld_alpha_wpo", dict(arch="qwen2", ld_alpha=0.3, use_weighting=True), 1),
]

_trainers: dict[str, tuple] = TrainerCache()  # case id -> (slimrl trainer, batch, TRL's result)


def _case(case_id: str, options: dict, accumulation: int):
    """slimrl's trainer for the case, the batch, and TRL's result on it (computed once)."""
    if case_id not in _trainers:
        reference = build_trainer("trl", **options)
        batch = preference_batch(reference)
        expected = loss_grads_metrics(reference, batch, accumulation)
        assert expected[2]["mean_token_accuracy"] > 0, "no chosen token is the model's top-1: accuracy is untested"
        _trainers[case_id] = (build_trainer("slimrl", **options), batch, expected)
    return _trainers[case_id]


# Every case unchunked (1) and one pair per chunk (8); several pairs in each of several chunks (2) for the cases whose
# reduction over pairs differs: the plain loss, weighted losses, accumulation, a full fine-tune's reference and qwen2
# (the other losses are per pair, so a chunk of two pairs sums what two chunks of one sum).
SEVERAL_PAIRS = ("sigmoid", "weighted_mpo", "use_weighting", "grad_accumulation", "ref_model_full_finetune",
                 "qwen2_ld_alpha_wpo")  # fmt: skip
CHUNKED_CASES = [pytest.param(*case, chunks, id=f"{case[0]}-{chunks}") for case in CASES
                 for chunks in ((1, 2, 8) if case[0] in SEVERAL_PAIRS else (1, 8))]  # fmt: skip


@pytest.mark.parametrize("case_id,options,accumulation,num_chunks", CHUNKED_CASES)
def test_chunked_loss_matches_trl(case_id, options, accumulation, num_chunks):
    ours, batch, expected = _case(case_id, options, accumulation)
    ours.args.num_chunks = num_chunks
    actual = loss_grads_metrics(ours, batch, accumulation)
    assert not ours.__dict__.get("_fallback_reasons_logged"), "the chunked path fell back to TRL's loss"
    assert_same_step(expected, actual, f"{case_id}, num_chunks={num_chunks}")


@pytest.mark.parametrize(
    "options,reason",
    [
        (dict(loss_type="aot", label_smoothing=0.1), "loss_type 'aot' sorts log-ratios across the whole micro-batch"),
        (dict(loss_type=["sigmoid", "aot_unpaired"]), "loss_type 'aot_unpaired' sorts log-ratios"),
    ],
    ids=["aot", "aot_unpaired"],
)
def test_batch_sorted_losses_fall_back_to_trl_and_match(options, reason, caplog):
    """aot and aot_unpaired sort the log-ratios of the whole micro-batch: they run through TRL's one-piece loss, with
    a warning saying why, and give TRL's numbers."""
    reference, ours = build_trainer("trl", **options), build_trainer("slimrl", num_chunks=4, **options)
    batch = preference_batch(reference)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = loss_grads_metrics(ours, batch)
    assert any(reason in record.getMessage() and "in one piece" in record.getMessage() for record in caplog.records)
    assert_same_step(loss_grads_metrics(reference, batch), actual, f"fallback {options}")


def test_hinge_with_wpo_weights_matches_trl_in_eval():
    """TRL 1.16 scales the hinge loss by WPO's weights in place, which breaks its backward; slimrl trains it. Its
    loss and metrics equal TRL's where TRL can compute them (eval, no grad), and its gradient does not depend on the
    chunking."""
    options = dict(loss_type="hinge", use_weighting=True, beta=6.0)
    reference, ours = build_trainer("trl", **options), build_trainer("slimrl", num_chunks=3, **options)
    batch = preference_batch(reference)
    expected = loss_grads_metrics(reference, batch, train=False)
    assert_same_step(expected, loss_grads_metrics(ours, batch, train=False), "hinge + WPO, eval", train=False)
    chunked = loss_grads_metrics(ours, batch)  # num_chunks=3: training, where TRL's backward fails
    ours.args.num_chunks = 1
    assert_close(chunked[0], expected[0], name="hinge + WPO, training loss")
    assert_same_step(loss_grads_metrics(ours, batch), chunked, "hinge + WPO, 3 chunks against 1")


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_eval_loss_and_metrics_match_trl(num_chunks):
    """In eval mode (no grad) the chunked loss and the eval metrics agree with TRL's."""
    ours, batch, _ = _case("ld_alpha", dict(ld_alpha=0.5), 1)
    reference = build_trainer("trl", ld_alpha=0.5)
    ours.args.num_chunks = num_chunks
    expected = loss_grads_metrics(reference, batch, train=False)
    actual = loss_grads_metrics(ours, batch, train=False)
    assert not ours.__dict__.get("_fallback_reasons_logged")
    assert_same_step(expected, actual, f"eval, num_chunks={num_chunks}", train=False)


def test_one_pair_per_chunk_equals_trl_run_pair_by_pair():
    """With one pair per chunk, slimrl's gradient is TRL's summed over single-pair batches (each padded to its own
    width, as a chunk is) to fp32 rounding, also for DiscoPOP at its default tau, whose curvature amplifies how
    TRL's own batched forward rounds differently from a one-pair forward."""
    options = dict(loss_type="discopop")
    reference, ours = build_trainer("trl", **options), build_trainer("slimrl", num_chunks=NUM_PAIRS, **options)
    _, grads, _ = loss_grads_metrics(ours, preference_batch(reference, greedy_pairs=()))
    summed = {}
    for pair in range(NUM_PAIRS):
        _, pair_grads, _ = loss_grads_metrics(reference, reference.data_collator([reference.train_dataset[pair]]))
        for name, grad in pair_grads.items():
            summed[name] = summed.get(name, 0) + grad / NUM_PAIRS
    assert grads.keys() == summed.keys()
    for name, grad in summed.items():
        scale = grad.abs().max()
        assert_close(grads[name] / scale, grad / scale, "grad_fp32", name=f"grad of {name}")


def test_chunks_hold_whole_pairs_cut_to_their_width():
    """Each policy forward holds both sequences of its pairs (chosen rows, then their rejected rows) and only the
    columns its longest pair uses: right padding beyond is dropped."""
    ours, batch, _ = _case("sigmoid", dict(), 1)
    ours.args.num_chunks = 3
    seen = []
    backbone = ours.model.get_base_model().model
    handle = backbone.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"]),
                                                with_kwargs=True)  # fmt: skip
    try:
        loss_grads_metrics(ours, batch)
    finally:
        handle.remove()
    policy = seen[0::2]  # each chunk runs the policy's forward, then the reference's (adapter off)
    assert [ids.size(0) for ids in policy] == [6, 6, 4]  # 8 pairs in 3 chunks: 3, 3 and 2 pairs
    full = batch["input_ids"]
    used = batch["attention_mask"].sum(dim=1)  # right padding: the used columns of each row
    for ids in policy:
        half = ids.size(0) // 2
        rows = [int((full[:, : ids.size(1)] == row).all(dim=1).nonzero()[0]) for row in ids]
        assert rows[half:] == [r + full.size(0) // 2 for r in rows[:half]], "a pair was split across chunks"
        assert ids.size(1) == max(int(used[r]) for r in rows), "the chunk kept columns none of its rows uses"
    assert sum(ids.size(1) for ids in policy) < 3 * full.size(1)


def test_left_padded_batch_matches_trl():
    """TRL's collator pads on the right; a collator that pads on the left ends every row at the last column, so each
    chunk keeps the full width (positions unchanged) and the result is still TRL's."""
    ours, right_padded, _ = _case("sigmoid", dict(), 1)
    shifts = right_padded["attention_mask"].size(1) - right_padded["attention_mask"].sum(dim=1)  # [2B] pad columns
    batch = {key: torch.stack([row.roll(int(shift)) for row, shift in zip(value, shifts, strict=True)])
             for key, value in right_padded.items()}  # fmt: skip
    assert (batch["attention_mask"][:, -1] == 1).all() and (batch["attention_mask"][:, 0] == 0).any()
    reference = build_trainer("trl")
    ours.args.num_chunks = 3
    assert_same_step(loss_grads_metrics(reference, batch), loss_grads_metrics(ours, batch), "left padding")


def test_train_curve_matches_trl_with_gradient_accumulation():
    """trainer.train() for 3 optimizer steps of 2 accumulated micro-batches: the same logged curve as TRL."""
    config = dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.1])
    assert_same_curves(train_log("trl", **config), train_log("slimrl", num_chunks=2, **config))


def test_two_process_ddp_training_matches_trl(tmp_path):
    """Data-parallel training (2 CPU processes, gloo): the chunks' inner backward passes skip the all-reduce and the
    metrics are gathered across processes as TRL gathers them; the logged curve is TRL's."""
    out = tmp_path / "logs.json"
    run_two_processes("tests.trainers.dpo_harness", [str(out)], 29547, timeout=600)
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2
    assert_same_curves(logs["trl"], logs["slimrl"], steps=2)


def _mean_logit(prediction) -> dict:
    return {"mean_logit": float(np.mean(prediction.predictions))}


@pytest.mark.parametrize("compute_metrics", [None, _mean_logit], ids=["loss_only", "compute_metrics"])
def test_evaluate_matches_trl(compute_metrics, caplog):
    """trainer.evaluate(): chunked when only the loss is asked for; with compute_metrics TRL's path builds the
    logits (a warned fallback). Both report TRL's numbers."""
    results = {}
    for kind, extra in (("trl", {}), ("slimrl", dict(num_chunks=2))):
        trainer = build_trainer(kind, per_device_eval_batch_size=4,
                                trainer_kwargs=dict(compute_metrics=compute_metrics), **extra)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
            results[kind] = trainer.evaluate(preference_dataset())
    fell_back = any("return_outputs=True" in record.getMessage() for record in caplog.records)
    assert fell_back is (compute_metrics is not None)
    compared = [name for name in results["trl"] if not any(w in name for w in ("runtime", "per_second", "_time"))]
    assert len(compared) >= 12 and ("eval_mean_logit" in compared) is (compute_metrics is not None)
    for name in compared:
        assert results["slimrl"][name] == pytest.approx(results["trl"][name], rel=1e-5, abs=1e-6), name
