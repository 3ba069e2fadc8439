"""ORPO's and CPO's loss math checked against values worked out by hand, and what their trainers share around it: the
constructor (TRL's signature, the config's fields, the dataset checks that name the fix)."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import otherwise

import dataclasses
import inspect
import math

import pytest
import torch
from datasets import Dataset, DatasetDict

from slimrl.testing import tiny_tokenizer
from slimrl.trainers.cpo.trainer import cpo_pair_terms
from slimrl.trainers.orpo.trainer import log1mexp, odds_ratio_terms
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import lora_tiny_model
from tests.trainers.paired_harness import (
    build_trainer,
    build_with_classes,
    preference_dataset,
    preference_rows,
    trainer_classes,
)

LOG = math.log


def f64(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# -- log(1 - exp(x)) --------------------------------------------------------------------------------------------------


def test_log1mexp_by_hand():
    # log(1 - 1/2) = log(1/2); log(1 - 1/4) = log(3/4)
    assert_close(log1mexp(f64(LOG(0.5), LOG(0.25))), f64(LOG(0.5), LOG(0.75)), "exact")


def test_log1mexp_keeps_precision_at_both_ends():
    """Near 0, 1 - exp(x) ~ -x (the naive form loses digits to 1 - 0.99999...); far below, log(1 - e^x) ~ -e^x,
    which 1 - e^x rounds away entirely."""
    near_zero, far_below = f64(-1e-10), f64(-50.0)
    assert_close(log1mexp(near_zero), torch.log(f64(1e-10 - 0.5e-20)), "exact")
    assert torch.log(1 - torch.exp(far_below)).item() == 0.0  # what the naive form gives
    assert log1mexp(far_below).item() == pytest.approx(-math.exp(-50.0), rel=1e-12)


# -- ORPO -------------------------------------------------------------------------------------------------------------


def test_odds_ratio_terms_by_hand():
    """Pair 1: p(chosen) = 1/2 (odds 1), p(rejected) = 1/4 (odds 1/3): log-odds ratio log 3, log sigmoid = log(3/4).
    Pair 2: p = 1/5 (odds 1/4) against 3/5 (odds 3/2): ratio 1/6, log sigmoid(-log 6) = -log 7."""
    beta = 0.1
    chosen, rejected = f64(LOG(0.5), LOG(0.2)), f64(LOG(0.25), LOG(0.6))
    losses, chosen_rewards, rejected_rewards, log_sigmoid, log_odds = odds_ratio_terms(chosen, rejected, beta)
    assert_close(log_odds, f64(LOG(3.0), -LOG(6.0)), "fp32")
    assert_close(log_sigmoid, f64(LOG(0.75), -LOG(7.0)), "fp32")
    assert_close(losses, f64(-beta * LOG(0.75), beta * LOG(7.0)), "fp32")
    assert_close(chosen_rewards, f64(beta * LOG(0.5), beta * LOG(0.2)), "fp32")
    assert_close(rejected_rewards, f64(beta * LOG(0.25), beta * LOG(0.6)), "fp32")


def test_odds_ratio_gradient_raises_the_chosen_and_lowers_the_rejected():
    chosen, rejected = f64(LOG(0.3)).requires_grad_(), f64(LOG(0.4)).requires_grad_()
    odds_ratio_terms(chosen, rejected, beta=0.5)[0].sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


# -- CPO --------------------------------------------------------------------------------------------------------------

# scores chosen -1, rejected -3 (margin 2) and chosen -2, rejected -1 (margin -1), beta 0.5
CHOSEN, REJECTED, BETA = f64(-1.0, -2.0), f64(-3.0, -1.0), 0.5


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


@pytest.mark.parametrize(
    "loss_type,options,expected",
    [
        # -log sigmoid(beta m): beta m = 1 and -0.5
        ("sigmoid", {}, [softplus(-1.0), softplus(0.5)]),
        # (1 - eps) (-log sigmoid(beta m)) + eps (-log sigmoid(-beta m)), eps = 0.1
        ("sigmoid", {"label_smoothing": 0.1}, [0.9 * softplus(-1.0) + 0.1 * softplus(1.0),
                                               0.9 * softplus(0.5) + 0.1 * softplus(-0.5)]),
        # max(0, 1 - beta m): exactly at the hinge, and past it the other way
        ("hinge", {}, [0.0, 1.5]),
        # (m - 1 / (2 beta))^2 = (m - 1)^2
        ("ipo", {}, [1.0, 4.0]),
        # margin less gamma / beta = 1: beta m' = 0.5 and -1
        ("simpo", {"simpo_gamma": 0.5}, [softplus(-0.5), softplus(1.0)]),
    ],
)  # fmt: skip
def test_cpo_losses_by_hand(loss_type, options, expected):
    losses, chosen_rewards, rejected_rewards = cpo_pair_terms(CHOSEN, REJECTED, loss_type=loss_type, beta=BETA,
                                                              **options)  # fmt: skip
    assert_close(losses, f64(*expected), "fp32", name=f"{loss_type} {options}")
    assert_close(chosen_rewards, BETA * CHOSEN, "exact")
    assert_close(rejected_rewards, BETA * REJECTED, "exact")


def test_alphapo_reward_shaping_by_hand():
    """alpha = 1/2: p = 1/4 gives (1 - 4^(1/2)) / (1/2) = -2, p = 1/16 gives (1 - 16^(1/2)) / (1/2) = -6, margin 4."""
    losses, chosen_rewards, rejected_rewards = cpo_pair_terms(f64(LOG(0.25)), f64(LOG(1 / 16)), loss_type="simpo",
                                                              beta=BETA, alpha=0.5)  # fmt: skip
    assert_close(chosen_rewards, f64(BETA * -2.0), "fp32")
    assert_close(rejected_rewards, f64(BETA * -6.0), "fp32")
    assert_close(losses, f64(softplus(-BETA * 4.0)), "fp32")


def test_alphapo_tends_to_log_prob_rewards_as_alpha_goes_to_zero():
    shaped = cpo_pair_terms(CHOSEN, REJECTED, loss_type="sigmoid", beta=BETA, alpha=1e-7)
    plain = cpo_pair_terms(CHOSEN, REJECTED, loss_type="sigmoid", beta=BETA)
    for a, b in zip(shaped, plain, strict=True):
        assert_close(a, b, "fp32_sum")


def test_unknown_cpo_loss_type_is_an_error():
    with pytest.raises(ValueError, match=r"loss_type 'kto_pair' is not one of"):
        cpo_pair_terms(CHOSEN, REJECTED, loss_type="kto_pair", beta=BETA)


# -- the constructor --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["orpo", "cpo"])
def test_constructor_and_config_keep_trls_positions(algorithm):
    ours, ours_config = trainer_classes(algorithm, "slimrl")
    theirs, theirs_config = trainer_classes(algorithm, "trl")
    parameters = lambda cls: [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()]  # noqa: E731
    assert parameters(ours) == parameters(theirs)
    names = [f.name for f in dataclasses.fields(ours_config)]
    trl_names = [f.name for f in dataclasses.fields(theirs_config)]
    assert names[: len(trl_names)] == trl_names
    assert names[len(trl_names):] == ["num_chunks", "offload_checkpoints", "mlp_tile_tokens", "keep_attention_tokens",
                                      "layer_cuda_graphs", "fast_lora", "on_nonfinite",
                                      "drop_chunk_padding"]  # fmt: skip


@pytest.mark.parametrize("algorithm", ["orpo", "cpo"])
def test_a_trl_config_gains_slimrls_fields(algorithm):
    _, trl_config = trainer_classes(algorithm, "trl")
    trainer_cls, _ = trainer_classes(algorithm, "slimrl")
    args = trl_config(output_dir="/tmp/slimrl-test-paired-config", report_to="none", use_cpu=True, bf16=False)
    trainer = trainer_cls(model=lora_tiny_model(), args=args, train_dataset=preference_dataset(2),
                          processing_class=tiny_tokenizer())  # fmt: skip
    assert (trainer.args.num_chunks, trainer.args.drop_chunk_padding) == ("auto", False)


def _dataset(rows):
    return Dataset.from_list(rows)


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "a", "chosen": "b"}], r"ORPO needs 'chosen', 'rejected'.*'rejected' is missing.*rename_columns"),
        ([{"text": "a", "label": 1}], r"has columns \['text', 'label'\].*'chosen', 'rejected' are missing"),
        # TRL would keep the answers and silently drop the chat prompt
        ([{"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": "no"}],
         r"mixes formats.*'prompt' is conversational, 'chosen' is standard"),
        # TRL stops on an IndexError deep inside Dataset.map
        ([{"prompt": "hi", "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no"}]}], r"mixes formats.*Use one format"),
    ],
    ids=["no_rejected", "no_pair_columns", "chat_prompt_text_answers", "text_prompt_chat_answers"],
)  # fmt: skip
def test_bad_dataset_errors_name_the_fix(rows, message):
    with pytest.raises(ValueError, match=message):
        build_trainer("orpo", "slimrl", dataset=_dataset(rows))


def test_bad_eval_dataset_is_named():
    bad = {"dev": _dataset([{"prompt": "a", "chosen": "b"}])}
    with pytest.raises(ValueError, match=r"eval_dataset\['dev'\] has columns \['prompt', 'chosen'\]"):
        build_with_classes(*trainer_classes("cpo", "slimrl"), "cpo", eval_dataset=bad)


def test_dataset_dict_asks_for_a_split():
    splits = DatasetDict({"train": _dataset(preference_rows(2))})
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\].*train_dataset=dataset\['train'\]"):
        build_trainer("cpo", "slimrl", dataset=splits)


def test_missing_train_dataset_keeps_trls_error():
    trainer_cls, config_cls = trainer_classes("orpo", "slimrl")
    args = config_cls(output_dir="/tmp/slimrl-test-paired-config", report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"`train_dataset` is required"):
        trainer_cls(model=lora_tiny_model(), args=args)
