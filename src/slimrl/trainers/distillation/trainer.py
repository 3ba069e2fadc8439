"""slimrl's distillation trainer: TRL's stable DistillationTrainer with the student's rollouts from slimrl's engine
and a chunked training step.

TRL's loss is the generalised JSD between the student's and the teacher's next-token distributions (`beta` 0: forward
KL, 1: reverse KL), summed over the completion tokens of the loss mask and divided by one count: the generation
batch's loss tokens in training (`num_items_in_batch`, over the processes), the micro-batch's in evaluation. A sum
over sequences divided by a count known before the first chunk, so it splits into chunks of sequences exactly.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; gives a plain trl.DistillationConfig slimrl's fields; after TRL's setup it checks the
  datasets' 'prompt' column, sets up the memory savers and picks the rollout backend.
- `_generate_single_turn` (from `EngineRolloutMixin`, trainers/rollouts/engine_rollouts.py, shared with GRPO and
  RLOO): the student's completions from slimrl's engine (live weights and LoRA, no copy) when that backend is chosen.
- `compute_loss`: runs the micro-batch in chunks of sequences. Per chunk the student's backbone runs with grad, the
  teacher's under no_grad in eval mode, and TRL's own divergence (`_compute_loss`: both LM heads projected tile by
  tile, never a [B, T, V] logits tensor) is divided by the micro-batch's normaliser, so the summed gradient is TRL's;
  only one chunk's activations (student and teacher) are alive at once. Logs TRL's `entropy` from the chunks' sums.
  Multimodal batches run through TRL's one-piece loss instead (logged once).
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.
Everything else (generation bookkeeping, tool calls, vLLM, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

import torch
import trl

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_chunks, take
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.dataset_checks import check_prompt_datasets
from slimrl.trainers.distillation.config import DistillationConfig
from slimrl.trainers.rollouts.engine_rollouts import EngineRolloutMixin
from slimrl.trainers.rollouts.rollout_fields import with_rollout_fields

__all__ = ["DistillationConfig", "DistillationTrainer"]

ENTROPY = "entropy"  # [student entropy summed over the loss tokens, loss-token count]
# per-token tensors of TRL's generated batch, cut to a chunk's width (the prompt's are kept whole)
COMPLETION_KEYS = ("completion_ids", "completion_mask", "tool_mask")


class DistillationTrainer(SlimTrainerMixin, ChunkedTrainerMixin, EngineRolloutMixin, trl.DistillationTrainer):
    """TRL's DistillationTrainer whose student rollouts may come from slimrl's engine and whose training step runs in
    chunks of sequences. Same constructor, same results."""

    single_turn_returns_logprobs = False  # TRL's distillation `_generate_single_turn` returns completion ids only

    def __init__(self, model, teacher_model=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None, tools=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's DistillationConfig named as TRL
        # names it; TRL's own errors keep their text
        args = with_rollout_fields(args, model, DistillationConfig, "Distillation")
        check_prompt_datasets(train_dataset, eval_dataset, "distillation")
        super().__init__(model, teacher_model, args, train_dataset, eval_dataset, processing_class, callbacks,
                         optimizers, quantization_config, peft_config, tools)  # fmt: skip
        self._apply_memory_savers()
        self._choose_generation_backend()

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: TRL's scalar loss (already scaled for accumulation, `loss_is_scaled_for_ga`) whose backward()
        # completes TRL's gradient (earlier chunks already backpropagated), TRL's `entropy` appended to
        # self._metrics[mode] once per micro-batch; eval under no_grad unchanged; (loss, None) with return_outputs
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's own one-piece loss, or None when chunking applies."""
        if return_outputs:
            return "return_outputs=True asks for the outputs of the whole micro-batch"
        if is_multimodal(inputs):
            return "multimodal inputs are not chunked yet"
        if self.teacher_model is None:
            return "there is no local teacher model (a subclass supplies the teacher another way)"
        return None

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The micro-batch's sequences in chunks by length; every chunk's divergence sum over TRL's normaliser."""
        completion_mask = inputs["completion_mask"]  # [N, T]
        lengths = (inputs["prompt_mask"].sum(1) + completion_mask.sum(1)).tolist()
        chunks = plan_chunks(completion_mask, self._num_chunks_for(lengths, completion_mask.device))
        return ChunkPlan(chunks, normaliser=self._loss_normaliser(inputs, num_items_in_batch))

    def _loss_normaliser(self, inputs, num_items_in_batch):
        """What TRL divides the micro-batch's divergence sum by (its `compute_loss` and `_chunked_divergence_loss`):
        in training the generation batch's loss tokens over the processes (DDP averages the gradients), else the
        `num_items_in_batch` passed in, else the micro-batch's own loss tokens (at least 1)."""
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            return inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if num_items_in_batch is not None:
            return num_items_in_batch
        return loss_mask(inputs).sum().clamp(min=1)

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of TRL's loss (with grad) through TRL's `_compute_loss` on the chunk's rows: the student's
        backbone with grad, the teacher's under no_grad, the divergence over the plan's normaliser; and the detached
        parts of TRL's entropy metric."""
        part = chunk_rows(inputs, chunk)
        unwrapped = self.accelerator.unwrap_model(model)
        # through the DDP/FSDP wrapper's forward, as TRL's compute_loss routes the whole micro-batch
        loss, entropy_sum, valid = self._forward_redirection(model, unwrapped, self._compute_loss, unwrapped, part,
                                                             plan.normaliser)  # fmt: skip
        return loss, {ENTROPY: torch.stack([entropy_sum.float(), valid.float()])}

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals: ChunkStats) -> None:
        """TRL's `entropy`: the loss tokens' summed student entropy over their count, across processes (one [1, 2]
        gather, so gather_for_metrics treats the pair as TRL treats its two scalars)."""
        entropy_sum, valid = self.accelerator.gather_for_metrics(totals[ENTROPY][None]).sum(0).tolist()
        self._metrics[mode]["entropy"].append(entropy_sum / valid if valid > 0 else 0.0)


def loss_mask(inputs) -> torch.Tensor:
    """[N, T] the completion tokens TRL trains on: the completion mask, without tool results in multi-turn batches."""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def chunk_rows(inputs, chunk: Chunk) -> dict:
    """The chunk's rows of TRL's generated micro-batch: prompts whole, per-token completion tensors cut to the chunk's
    width (right padding beyond its longest completion dropped); per-batch values (`num_items_in_batch`) left out."""
    width = inputs["completion_ids"].size(1)
    part = {key: take(inputs[key], chunk, -1) for key in ("prompt_ids", "prompt_mask")}
    for key in COMPLETION_KEYS:
        if inputs.get(key) is not None:
            part[key] = take(inputs[key], chunk, width)
    return part
