"""What ORPO and CPO share: a chunked step over the micro-batch's pairs through an LM head that never holds the
logits, and the constructor that checks the preference datasets first.

Both TRL trainers run chosen and rejected sequences through one forward (`concatenated_forward`), score each sequence
by its average or summed response log-probability, add a negative log-likelihood on the chosen sequences, and log the
same family of metrics. `PairedChunkedMixin` replaces that one-piece forward: the pairs are split into chunks (both
sequences of a pair always in the same chunk), each chunk runs forward and backward on its own, and every quantity the
loss is divided by (the number of pairs, the NLL's token count) is taken over the whole micro-batch first, so the
summed gradient is TRL's. Log-probabilities come from TRL's fused LM head (`add_fused_lm_head`): tiles of tokens
through the head, with the per-token mean logit for the `logits/*` metrics, and no `[tokens, vocab]` logits kept.

TRL averages `logits/chosen` and `logits/rejected` over every column of the padded micro-batch, padding included, so
by default each chunk runs at the micro-batch's padded width. `drop_chunk_padding=True` lets a chunk stop at its
longest pair (less compute when lengths vary); those two metrics then average over attended tokens only.

The mixin's overrides of TRL's methods, each for one reason (and each keeping TRL's contract, said in a `contract:`
line beside it):
- `__init__`: TRL's signature; checks the datasets' columns and formats before TRL's preprocessing (which would stop
  on a bare KeyError or IndexError, or silently drop a chat prompt paired with plain-text answers), installs TRL's
  fused LM head on the model, and turns on the memory savers.
- `get_batch_loss_metrics`: the pairs run forward and backward in chunks (a pair's two sequences together), through
  the fused LM head, with the loss normalised over the whole micro-batch, so loss, gradient and TRL's metrics are
  TRL's; only one chunk's activations are alive at once and the `[tokens, vocab]` logits never are.
- `compute_loss`: a caller asking for the outputs gets TRL's one-piece loss (the chunked one runs inner backwards).

A trainer using the mixin provides `_pair_settings()` and `_pair_terms(chosen_logps, rejected_logps)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkPlan
from slimrl.trainers.common.preference_inputs import check_preference_dataset
from slimrl.trainers.common.slim_fields import with_slim_fields

SEQUENCE_KEYS = tuple(f"{side}_{key}" for side in ("chosen", "rejected")
                      for key in ("input_ids", "attention_mask", "labels"))  # fmt: skip


def drop_chunk_padding_field() -> Any:
    """The config field ORPOConfig and CPOConfig add beside slimrl's shared ones."""
    return field(
        default=False,
        metadata={
            "help": "Let each chunk of pairs stop at its longest sequence instead of the micro-batch's padded width: "
            "the same loss and gradients with less compute when lengths vary. TRL's logits/chosen and logits/rejected "
            "average the logits over every padded column, padding included; with this on they average over attended "
            "tokens only. False keeps every metric equal to TRL's."
        },
    )


@dataclass(frozen=True)
class PairSettings:
    """Where ORPO and CPO differ in the forward they share."""

    average_logps: bool  # a sequence's score: the mean (True) or the sum of its response tokens' log-probs
    nll_weight: float  # weight of the chosen sequences' NLL in the loss (0: no NLL term, logged as 0)
    nll_on_prompt: bool  # the NLL covers every attended token (ORPO), not only the response (CPO)
    logits_skip_last: bool  # logits/* leave out the last column, as TRL's ORPO does
    padding_value: int  # pads the shorter of chosen and rejected to the pair width (TRL's concatenated_inputs)


@dataclass(frozen=True)
class PairedBatch(ChunkPlan):
    """A micro-batch of B pairs, concatenated as TRL does (chosen rows, then rejected rows), and what every chunk's
    share of the loss is divided by, computed before the first chunk: the normaliser is the pair count B."""

    input_ids: torch.Tensor  # [2B, T]
    attention_mask: torch.Tensor  # [2B, T]
    labels: torch.Tensor  # [2B, T] -100 outside the responses
    targets: torch.Tensor  # [2B, T] the next token of each position (0 in the last column)
    full_width: bool  # every chunk runs at the padded width T (TRL's logits/* need the padding columns)
    nll_tokens: torch.Tensor  # [] the NLL's token count over the micro-batch's chosen rows
    logit_tokens: torch.Tensor  # [2] the positions logits/chosen and logits/rejected average over

    @property
    def num_pairs(self) -> int:
        return self.normaliser


def fused_head_obstacle(model) -> str | None:
    """Why TRL's fused LM head cannot serve `model` (then the loss runs in one piece), or None after installing it."""
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if is_peft_model(model) else model
    if getattr(base.config, "is_encoder_decoder", False):
        return "encoder-decoder models run through TRL's path"
    peft_config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    if getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning adapters add virtual tokens that the chunked forward does not place"
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # an adapter or wrapper on the head would be bypassed by the fused kernel
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return f"the LM head is a {kind}, not the plain torch.nn.Linear the fused head reads"
    if not getattr(base, "_slimrl_fused_lm_head", False):
        add_fused_lm_head(base, outputs=("log_probs", "mean_logits"))
        base._slimrl_fused_lm_head = True
    return None


class PairedChunkedMixin:
    """ORPO's and CPO's constructor checks and chunked `get_batch_loss_metrics`, and their chunk plan (the protocol of
    trainers/common/chunked_trainer.py). Goes after SlimTrainerMixin, before ChunkedTrainerMixin and TRL's trainer in
    the bases."""

    _trl_trainer: type  # TRL's class: a subclass that overrides one of its loss methods keeps TRL's path
    _config_class: type  # slimrl's config of the algorithm
    _trl_loss_methods: tuple[str, ...] = ("concatenated_forward", "get_batch_logps")
    _one_piece_request: str | None = None
    _fused_head_obstacle: str | None = None

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, peft_config=None, compute_metrics=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None or a TRL config gets slimrl's fields
        algorithm = self._trl_trainer._name
        args = with_slim_fields(args, model, self._config_class, algorithm)
        # before TRL's preprocessing, which stops on a bare KeyError or IndexError (or silently drops a chat prompt
        # paired with plain-text answers); None is left to TRL's own error
        evals = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
        named = [("train_dataset", train_dataset)] + [(f"eval_dataset[{k!r}]" if k else "eval_dataset", dataset)
                                                      for k, dataset in evals.items()]  # fmt: skip
        for name, dataset in named:
            if dataset is not None:
                check_preference_dataset(dataset, name, algorithm)
        super().__init__(
            model, args, data_collator, train_dataset, eval_dataset, processing_class, model_init, callbacks,
            optimizers, preprocess_logits_for_metrics, peft_config, compute_metrics,
        )  # fmt: skip
        self._fused_head_obstacle = fused_head_obstacle(self.model)
        self._apply_memory_savers()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: TRL's (loss, or (loss, metrics)); asked for outputs, TRL's one-piece loss (no inner backward)
        self._one_piece_request = "compute_loss was asked to return outputs" if return_outputs else None
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._one_piece_request = None

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        # contract: TRL's (loss, float metrics); the loss's backward() completes TRL's gradient (inner chunks done)
        reason = self._one_piece_reason(batch, return_outputs=self._one_piece_request is not None)
        if reason is not None:
            self._log_fallback(reason)
            return super().get_batch_loss_metrics(model, batch, train_eval)
        result = self._chunked_loss(model, batch, train_eval)
        return result.loss, result.metrics

    def _one_piece_reason(self, batch, return_outputs: bool) -> str | None:
        if return_outputs:
            return self._one_piece_request or "compute_loss was asked to return outputs"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        if self._fused_head_obstacle is not None:
            return self._fused_head_obstacle
        for name in self._trl_loss_methods:
            if getattr(type(self), name) is not getattr(self._trl_trainer, name):
                return f"{type(self).__name__} overrides {name}"
        missing = [key for key in SEQUENCE_KEYS if not isinstance(batch.get(key), torch.Tensor)]
        if missing:
            return f"the batch lacks {missing} (a collator other than TRL's DPODataCollatorWithPadding)"
        if any(key.endswith("pixel_values") for key in batch):
            return "multimodal inputs are not chunked"
        if self._pair_settings().nll_on_prompt and _labels_differ(batch):
            # one forward scores both: ORPO's NLL reads the input ids, its sequence scores read the labels
            return "the batch's labels differ from its input ids on response tokens"
        return None

    def _plan_micro_batch(self, model, batch, mode: str, num_items_in_batch=None) -> PairedBatch:
        """TRL's concatenation of the micro-batch, its chunk plan and the micro-batch-wide normalisers."""
        settings = self._pair_settings()
        joined = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=settings.padding_value,
                                          device=self.accelerator.device)  # fmt: skip
        input_ids = joined["concatenated_input_ids"]  # [2B, T]
        attention_mask = joined["concatenated_attention_mask"]  # [2B, T]
        labels = joined["concatenated_labels"]  # [2B, T]
        pairs, width = batch["chosen_labels"].size(0), input_ids.size(1)
        labelled = labels != -100
        next_ids = torch.where(labelled, labels, input_ids)[:, 1:]  # [2B, T-1] CPO's NLL and the scores use labels
        positions = torch.arange(1, width + 1, device=input_ids.device)
        last = ((attention_mask.bool() | labelled) * positions).amax(1)  # [2B] last attended column + 1
        pair_lengths = torch.maximum(last[:pairs], last[pairs:]).cpu()  # [B], the one host sync of the plan
        full_width = not self.args.drop_chunk_padding
        units = [2 * (width if full_width else int(n)) for n in pair_lengths]
        chunks = plan_by_length(pair_lengths, self._num_chunks_for(units, input_ids.device))
        nll_mask = attention_mask[:pairs, 1:].bool() if settings.nll_on_prompt else labelled[:pairs, 1:]
        columns = width - 1 if settings.logits_skip_last else width
        attended = attention_mask[:, :columns].float() if not full_width else torch.ones_like(input_ids[:, :columns])
        logit_tokens = torch.stack([attended[:pairs].sum(), attended[pairs:].sum()]).float()  # [2] chosen, rejected
        return PairedBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            targets=torch.cat([next_ids, torch.zeros_like(next_ids[:, :1])], 1),
            chunks=chunks,
            normaliser=pairs,
            full_width=full_width,
            nll_tokens=nll_mask.sum().float(),
            logit_tokens=logit_tokens,
        )

    def _chunk_loss(self, model, batch, paired: PairedBatch, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its detached scores, NLL sum and logit sums."""
        settings = self._pair_settings()
        pairs, n = paired.num_pairs, chunk.rows.numel()
        width = paired.input_ids.size(1) if paired.full_width else chunk.width
        rows = torch.cat([chunk.rows, chunk.rows + pairs]).to(paired.input_ids.device)  # [2b] chosen, then rejected
        attention_mask = paired.attention_mask[rows, :width]  # [2b, w]
        # Besides the decoder's activations, the fused head keeps per token of the chunk the final hidden state it
        # saves for backward (hidden size x dtype bytes) and fp32 log-prob and mean logit (8 bytes); the logits exist
        # one tile of tokens x vocabulary slice at a time.
        output = model(input_ids=paired.input_ids[rows, :width], attention_mask=attention_mask,
                       shift_labels=paired.targets[rows, :width], fused_lm_head=True)  # fmt: skip
        logps = output.log_probs[:, :-1]  # [2b, w-1] fp32, log-prob of each next token
        response = paired.labels[rows, 1:width] != -100  # [2b, w-1]
        scores = logps.masked_fill(~response, 0.0).sum(-1)  # [2b]
        if settings.average_logps:
            scores = scores / response.sum(-1)
        chosen, rejected = scores[:n], scores[n:]  # [b] each
        losses = self._pair_terms(chosen, rejected)[0]  # [b]
        loss = losses.sum() / pairs
        nll = torch.zeros((), device=logps.device)
        if settings.nll_weight != 0:
            nll_mask = attention_mask[:n, 1:].bool() if settings.nll_on_prompt else response[:n]
            nll = -logps[:n].masked_fill(~nll_mask, 0.0).sum()
            loss = loss + settings.nll_weight * nll / paired.nll_tokens
        mean_logits = output.mean_logits  # [2b, w] fp32, each position's logits averaged over the vocabulary
        full = paired.input_ids.size(1)
        columns = full - 1 if settings.logits_skip_last else full  # of the padded batch; a chunk may have fewer
        if not paired.full_width:
            mean_logits = mean_logits.masked_fill(attention_mask == 0, 0.0)
        logit_sums = torch.stack([mean_logits[:n, :columns].sum(), mean_logits[n:, :columns].sum()])
        stats = {
            "chosen_logps": chunk.spread(chosen.detach(), pairs),
            "rejected_logps": chunk.spread(rejected.detach(), pairs),
            "nll": nll.detach(),
            "logit_sums": logit_sums.detach(),
        }
        return loss, stats

    def _log_chunk_metrics(self, mode: str, batch, paired: PairedBatch, totals: ChunkStats) -> dict[str, float]:
        """TRL's metrics, in TRL's order and with its reductions, from the chunks' summed stats; returned, for TRL's
        compute_loss or prediction_step to store (eval ones prefixed "eval_", as TRL's)."""
        prefix = "eval_" if mode == "eval" else ""
        gather = self.accelerator.gather_for_metrics
        chosen_logps, rejected_logps = totals["chosen_logps"], totals["rejected_logps"]  # [B] each
        _, chosen_rewards, rejected_rewards, extra = self._pair_terms(chosen_logps, rejected_logps)
        logits_chosen, logits_rejected = totals["logit_sums"] / paired.logit_tokens
        nll = totals["nll"] / paired.nll_tokens if self._pair_settings().nll_weight != 0 else totals["nll"]
        metrics = {
            "rewards/chosen": gather(chosen_rewards).mean(),
            "rewards/rejected": gather(rejected_rewards).mean(),
            "rewards/accuracies": gather((chosen_rewards > rejected_rewards).float()).mean(),
            "rewards/margins": gather(chosen_rewards - rejected_rewards).mean(),
            "logps/rejected": gather(rejected_logps).mean(),
            "logps/chosen": gather(chosen_logps).mean(),
            "logits/rejected": gather(logits_rejected).mean(),
            "logits/chosen": gather(logits_chosen).mean(),
            "nll_loss": gather(nll).mean(),
            **{name: gather(value).mean() for name, value in extra.items()},
        }
        return {f"{prefix}{name}": value.item() for name, value in metrics.items()}

    def _pair_settings(self) -> PairSettings:
        raise NotImplementedError

    def _pair_terms(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor):
        """(per-pair losses [b] whose mean enters the loss, chosen rewards [b], rejected rewards [b], extra metrics:
        name -> per-process scalar)."""
        raise NotImplementedError


def _labels_differ(batch) -> bool:
    """Whether a label other than -100 differs from the input id at its position (one host sync for both sides)."""
    differ = []
    for side in ("chosen", "rejected"):
        labels, input_ids = batch[f"{side}_labels"], batch[f"{side}_input_ids"]
        if labels.shape != input_ids.shape:
            return True
        differ.append(((labels != -100) & (labels != input_ids)).any())
    return bool(torch.stack(differ).any())
