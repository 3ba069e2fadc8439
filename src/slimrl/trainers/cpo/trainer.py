"""slimrl's CPO trainer: TRL's (experimental) CPOTrainer with a chunked step over the micro-batch's pairs.

Its overrides of TRL's methods (`__init__`, `get_batch_loss_metrics`, `compute_loss`) come from
`paired_forward.PairedChunkedMixin`, written once for CPO and ORPO and described there: dataset checks before TRL's
preprocessing, and chunks of whole pairs through TRL's fused LM head, normalised so loss and gradient are TRL's.
Here: the loss of each `loss_type` (`cpo_pair_terms`, TRL's formulas: sigmoid, hinge, ipo, simpo, and AlphaPO's reward
shaping with `alpha`) and what CPO's forward reads (`_pair_settings`). `SlimTrainerMixin` (trainers/common/base.py) adds
the NaN guards and the attention-backend choice around every step.

TRL's one-piece loss runs instead (logged once per reason) for encoder-decoder models, the MoE load-balancing loss,
an adapter or wrapper on the LM head, prompt-learning adapters, return_outputs=True, a batch without TRL's collated
keys, a loss_type this module does not know, and a subclass overriding `concatenated_forward`, `get_batch_logps` or
`cpo_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from trl.experimental import cpo as _trl_cpo

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin
from slimrl.trainers.common.paired_forward import PairedChunkedMixin, PairSettings, drop_chunk_padding_field
from slimrl.trainers.common.slim_fields import SlimFields

__all__ = ["CPOConfig", "CPOTrainer", "LOSS_TYPES", "cpo_pair_terms"]

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")  # "alphapo" is simpo with alpha, set by CPOConfig
AVERAGED_LOSSES = ("ipo", "simpo")  # these score a response by its average log-prob, the others by the sum


@dataclass
class CPOConfig(SlimFields, _trl_cpo.CPOConfig):
    """TRL's CPOConfig (fields and positions unchanged), then slimrl's shared fields, then `drop_chunk_padding`."""

    drop_chunk_padding: bool = drop_chunk_padding_field()


def cpo_pair_terms(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, loss_type: str, beta: float,
                   label_smoothing: float = 0.0, simpo_gamma: float = 0.0,
                   alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """CPO's per-pair terms from the response scores [b] (summed or average log-probs): (losses [b], chosen rewards
    [b], rejected rewards [b]).

    With alpha != 0 each score s becomes AlphaPO's reward (1 - exp(s)^-alpha) / alpha. The margin m is chosen minus
    rejected (minus simpo_gamma / beta for simpo); sigmoid and simpo: -(1 - eps) log sig(beta m) - eps log sig(-beta m)
    with eps = label_smoothing; hinge: max(0, 1 - beta m); ipo: (m - 1 / (2 beta))^2. Rewards are beta times the
    (shaped) scores.
    """
    if alpha != 0.0:
        chosen = (1 - chosen_logps.exp().pow(-alpha)) / alpha
        rejected = (1 - rejected_logps.exp().pow(-alpha)) / alpha
    else:
        chosen, rejected = chosen_logps, rejected_logps
    margin = chosen - rejected  # [b]
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            margin = margin - simpo_gamma / beta
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


class CPOTrainer(SlimTrainerMixin, PairedChunkedMixin, ChunkedTrainerMixin, _trl_cpo.CPOTrainer):
    """TRL's CPOTrainer whose step runs in chunks of pairs. Same constructor, same results."""

    _trl_trainer = _trl_cpo.CPOTrainer
    _config_class = CPOConfig
    _trl_loss_methods = (*PairedChunkedMixin._trl_loss_methods, "cpo_loss")

    def _one_piece_reason(self, batch, return_outputs: bool) -> str | None:
        if self.loss_type not in LOSS_TYPES:
            return f"loss_type {self.loss_type!r} is not one slimrl chunks ({', '.join(LOSS_TYPES)})"
        return super()._one_piece_reason(batch, return_outputs)

    def _pair_settings(self) -> PairSettings:
        # CPO's NLL (weight cpo_alpha, none at 0) covers the chosen responses only; logits/* cover every column
        return PairSettings(average_logps=self.loss_type in AVERAGED_LOSSES, nll_weight=self.cpo_alpha,
                            nll_on_prompt=False, logits_skip_last=False, padding_value=self.pad_token_id)  # fmt: skip

    def _pair_terms(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor):
        losses, chosen_rewards, rejected_rewards = cpo_pair_terms(
            chosen_logps, rejected_logps, loss_type=self.loss_type, beta=self.beta,
            label_smoothing=self.label_smoothing, simpo_gamma=getattr(self, "simpo_gamma", 0.0), alpha=self.alpha,
        )  # fmt: skip
        return losses, chosen_rewards, rejected_rewards, {}
