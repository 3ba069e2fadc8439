"""slimrl's ORPO trainer: TRL's (experimental) ORPOTrainer with a chunked step over the micro-batch's pairs.

The overrides of TRL's methods (the constructor's dataset checks, the chunked `get_batch_loss_metrics`, and a
`compute_loss` that gives callers who want outputs TRL's one-piece loss) are `paired_forward.PairedChunkedMixin`'s,
shared with CPO and listed in that module's docstring. ORPO's own part: the odds-ratio loss (`odds_ratio_terms`, TRL's
formula) and what ORPO's forward reads (`_pair_settings`).
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.

TRL's one-piece loss runs instead (logged once per reason) for encoder-decoder models, the MoE load-balancing loss,
an adapter or wrapper on the LM head, prompt-learning adapters, return_outputs=True, a batch without TRL's collated
keys or whose labels differ from its input ids, and a subclass overriding `concatenated_forward`, `get_batch_logps`
or `odds_ratio_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from trl.experimental import orpo as _trl_orpo

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin
from slimrl.trainers.common.paired_forward import PairedChunkedMixin, PairSettings, drop_chunk_padding_field
from slimrl.trainers.common.slim_fields import SlimFields

__all__ = ["ORPOConfig", "ORPOTrainer", "log1mexp", "odds_ratio_terms"]


@dataclass
class ORPOConfig(SlimFields, _trl_orpo.ORPOConfig):
    """TRL's ORPOConfig (fields and positions unchanged), then slimrl's shared fields, then `drop_chunk_padding`."""

    drop_chunk_padding: bool = drop_chunk_padding_field()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0. Each of the two forms loses precision where the other does not (Maechler, 2012,
    "Accurately computing log(1 - exp(-|a|))"), so the switch is at x = -log 2."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """ORPO's per-pair terms from the average log-probs [b] of the chosen and rejected responses.

    log odds(y) = log p - log(1 - p), with p the response's average token probability; the pair's loss term is
    -beta * log sigmoid(log odds(chosen) - log odds(rejected)). Returns (losses [b], chosen rewards [b], rejected
    rewards [b], log sigmoid of the log-odds ratio [b], the log-odds ratio [b]).
    """
    chosen, rejected = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # [b]
    log_sigmoid = F.logsigmoid(log_odds)  # [b]
    return -beta * log_sigmoid, beta * chosen.detach(), beta * rejected.detach(), log_sigmoid, log_odds


class ORPOTrainer(SlimTrainerMixin, PairedChunkedMixin, ChunkedTrainerMixin, _trl_orpo.ORPOTrainer):
    """TRL's ORPOTrainer whose step runs in chunks of pairs. Same constructor, same results."""

    _trl_trainer = _trl_orpo.ORPOTrainer
    _config_class = ORPOConfig
    _trl_loss_methods = (*PairedChunkedMixin._trl_loss_methods, "odds_ratio_loss")

    def _pair_settings(self) -> PairSettings:
        # ORPO scores a response by its average log-prob, and its NLL covers prompt and response of the chosen
        # sequences (TRL's `cross_entropy_loss` over every attended token); logits/* leave out the last column
        return PairSettings(average_logps=True, nll_weight=1.0, nll_on_prompt=True, logits_skip_last=True,
                            padding_value=self.padding_value)  # fmt: skip

    def _pair_terms(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor):
        losses, chosen_rewards, rejected_rewards, log_sigmoid, log_odds = odds_ratio_terms(
            chosen_logps, rejected_logps, self.beta
        )
        extra = {"log_odds_ratio": log_sigmoid.detach().mean(), "log_odds_chosen": log_odds.detach().mean()}
        return losses, chosen_rewards, rejected_rewards, extra
