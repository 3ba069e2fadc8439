"""slimrl's process reward model (PRM) trainer: a transformers Trainer that teaches a token-classification model
(AutoModelForTokenClassification, num_labels=2) to score each reasoning step as correct or not.

TRL 1.16 ships no PRMTrainer; this is slimrl's own, with the constructor, config names, dataset format and logged
metrics of TRL's last one (0.2x): rows of `prompt`, `completions` (steps) and `labels` (one bool per step), tokenised
at construction (`tokenize_row`, inputs.py: each step's label on the separator token after it, -100 elsewhere);
logged `loss` in training, `eval_loss` and `eval_accuracy` (over the labelled steps) in evaluation. One step:

  collated rows [N, T] (right-padded) --> _plan_micro_batch: chunks of rows by length; the normaliser, the
  micro-batch's labelled-token count, fixed before the first chunk --> _chunk_loss: the chunk's rows (cut to its
  longest) through the model, cross-entropy summed over its labelled tokens / the normaliser --> backward (inner
  chunks here, the last by the Trainer)

so only one chunk's activations live at once and the summed gradient is the one-piece mean's (loss.py).

Overrides of transformers' Trainer, each for one reason (its contract kept, said in a `contract:` line):
- `compute_loss`: the chunked loss through the chunk-plan protocol (common/chunked_trainer.py); batches it cannot
  split exactly run through the Trainer's own one-piece loss (the model's cross-entropy), with a logged reason.
- `log`: adds slimrl's per-step metrics (`nonfinite_skipped` with on_nonfinite='skip').
`SlimTrainerMixin` adds the NaN guards and the attention-backend choice around every step.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate import PartialState
from datasets import Dataset, Features, Sequence, Value
from torch import nn
from transformers import Trainer
from transformers.modeling_outputs import TokenClassifierOutput

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import row_lengths, shards_sequences
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length, take
from slimrl.trainers.common.chunked_trainer import ChunkedLoss, ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.prm.config import PRMConfig
from slimrl.trainers.prm.inputs import IGNORE_INDEX, PRMCollator, check_prm_columns, tokenize_row
from slimrl.trainers.prm.loss import labelled_tokens, micro_batch_loss, step_nll_sum

__all__ = ["PRMConfig", "PRMTrainer", "step_accuracy"]

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")  # per-row tensors [N, T]
TOKENISED = Features({"input_ids": Sequence(Value("int64")), "labels": Sequence(Value("int64"))})  # labels not bool
LOGITS = "logits"  # the micro-batch's logits [N, T, C], assembled from the chunks in evaluation


def step_accuracy(eval_pred) -> dict[str, float]:
    """TRL's PRM metric: the share of labelled steps whose argmax class is the label (logged as eval_accuracy)."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids  # [N, T, C], [N, T] (-100: no label)
    logits = logits[0] if isinstance(logits, tuple) else logits
    labelled = labels != IGNORE_INDEX
    return {"accuracy": float((logits.argmax(-1)[labelled] == labels[labelled]).mean())}


class PRMTrainer(SlimTrainerMixin, ChunkedTrainerMixin, Trainer):
    """A process reward model: a token-classification head scoring each reasoning step. TRL 0.2x's constructor."""

    _tag_names = ["trl", "prm"]
    loss_is_scaled_for_ga = False  # the loss is the micro-batch's mean: the Trainer divides it by the accumulation
    tokenize_row = staticmethod(tokenize_row)

    def __init__(self, model=None, args: PRMConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, peft_config=None):  # fmt: skip
        if train_dataset is None:
            raise ValueError("PRMTrainer needs a train_dataset: rows of 'prompt', 'completions' (steps) and 'labels'.")
        model = _load_model(model, peft_config)
        if args is None:
            name = model.config._name_or_path if model is not None else "model"
            args = PRMConfig(f"{(name or 'model').split('/')[-1]}-PRM")
        if not isinstance(args, PRMConfig):
            raise TypeError(f"args must be a slimrl PRMConfig (the PRM's settings live there), got "
                            f"{type(args).__name__}.")  # fmt: skip
        if model is not None and args.disable_dropout:
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        if data_collator is None:
            data_collator = PRMCollator(_pad_token_id(processing_class))
        with PartialState().main_process_first():  # one process tokenises, the others read its cache
            train_dataset = _tokenise(train_dataset, "train_dataset", processing_class, args, is_eval=False)
            if isinstance(eval_dataset, dict):
                eval_dataset = {key: _tokenise(value, f"eval_dataset[{key!r}]", processing_class, args, True)
                                for key, value in eval_dataset.items()}  # fmt: skip
            else:
                eval_dataset = _tokenise(eval_dataset, "eval_dataset", processing_class, args, is_eval=True)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                         compute_metrics=compute_metrics or step_accuracy, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)  # fmt: skip
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._apply_memory_savers()

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: the micro-batch's mean cross-entropy over its labelled tokens, a scalar whose backward() completes
        # its gradient (earlier chunks already backpropagated); with return_outputs, outputs whose logits are the
        # model's [N, T, C]. num_items_in_batch (the accumulated batch's label count) is not used: the loss is the
        # micro-batch's mean on both paths (loss_is_scaled_for_ga=False), the model's own included
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, None)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through the Trainer's one-piece loss (the model's own cross-entropy), or None."""
        if return_outputs and torch.is_grad_enabled():
            return "return_outputs=True with gradients asks for logits attached to the graph of the whole batch"
        if inputs.get("labels") is None or inputs.get("input_ids") is None:
            return "the batch has no 'input_ids' or no 'labels' (a custom collator?)"
        unknown = sorted(key for key, value in inputs.items() if key not in MODEL_INPUT_KEYS and value is not None)
        if unknown:
            return f"the batch carries inputs slimrl does not know how to split ({', '.join(unknown)})"
        if self.args.label_smoothing_factor != 0 or self.compute_loss_func is not None:
            return "label_smoothing_factor or compute_loss_func replaces the cross-entropy over the whole batch"
        if shards_sequences(self.accelerator):
            return "context or sequence parallelism shards each sequence across ranks"
        return None

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkPlan:
        """The micro-batch's rows in chunks by length; every chunk's cross-entropy over the micro-batch's count of
        labelled tokens."""
        lengths = row_lengths(inputs)  # [N] host: a row's labels all lie before its last attended column
        chunks = plan_by_length(lengths, self._num_chunks_for(lengths.tolist(), inputs["input_ids"].device))
        return ChunkPlan(chunks, normaliser=labelled_tokens(inputs["labels"]))

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """The chunk's summed cross-entropy over the micro-batch's labelled-token count; in evaluation (no grad) also
        its logits, placed at its rows of the micro-batch's [N, T, C]."""
        rows, width = inputs["input_ids"].shape
        chunk_inputs = {key: take(inputs[key], chunk, width) for key in MODEL_INPUT_KEYS if inputs.get(key) is not None}
        labels = chunk_inputs.pop("labels")  # [b, w]
        logits = model(**chunk_inputs).logits  # [b, w, C]: the backbone and the head over the chunk's rows only
        nll = step_nll_sum(logits, labels)
        stats = {"nll": nll.detach()}
        if not torch.is_grad_enabled():
            full = logits.new_zeros(rows, width, logits.size(-1))  # [N, T, C]; other chunks fill their rows
            full[chunk.rows.to(full.device), : chunk.width] = logits.detach()
            stats[LOGITS] = full
        return micro_batch_loss(nll, plan.normaliser), stats

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals: ChunkStats) -> None:
        """Nothing to add: TRL's PRM logged only the Trainer's loss (the value returned) and, in evaluation,
        compute_metrics' accuracy over the logits `_chunk_outputs` hands back."""
        return None

    def _chunk_outputs(self, result: ChunkedLoss) -> TokenClassifierOutput:
        """The model's outputs for the Trainer's prediction_step: logits [N, T, C] assembled from the chunks."""
        return TokenClassifierOutput(logits=result.totals[LOGITS])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # contract: the Trainer's; a training log also carries slimrl's step metrics, averaged since the last log
        metrics = self._metrics["train"]
        if "loss" in logs and metrics:
            logs = {**logs, **{name: sum(values) / len(values) for name, values in metrics.items() if values}}
            metrics.clear()
        super().log(logs, start_time)


def _load_model(model, peft_config):
    """The model to train: a token-classification model with at least two labels, wrapped by peft when asked."""
    if isinstance(model, str):
        from transformers import AutoModelForTokenClassification

        model = AutoModelForTokenClassification.from_pretrained(model, num_labels=2)
    if model is not None and getattr(model.config, "num_labels", 2) < 2:
        raise ValueError(f"The model has num_labels={model.config.num_labels}, but a PRM classifies each step as "
                         "incorrect (0) or correct (1): load it with AutoModelForTokenClassification.from_pretrained("
                         "name, num_labels=2).")  # fmt: skip
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model


def _pad_token_id(processing_class) -> int:
    if processing_class is None:
        raise ValueError("PRMTrainer needs processing_class (the tokenizer) to tokenise the rows and pad the batches, "
                         "or a data_collator and an already tokenised dataset.")  # fmt: skip
    pad = processing_class.pad_token_id
    pad = processing_class.eos_token_id if pad is None else pad
    if pad is None:
        raise ValueError("The tokenizer has neither a pad nor an EOS token to pad batches with; set "
                         "tokenizer.pad_token.")  # fmt: skip
    return pad


def _tokenise(dataset, name: str, tokenizer, args: PRMConfig, is_eval: bool):
    """`dataset` as token ids and labels (`tokenize_row` on each row); an already tokenised one as it is."""
    if dataset is None or check_prm_columns(dataset, name):
        return dataset
    if tokenizer is None:
        raise ValueError(f"{name} holds untokenised rows, so PRMTrainer needs processing_class (the tokenizer).")
    fn_kwargs = dict(tokenizer=tokenizer, step_separator=args.step_separator, max_length=args.max_length,
                     max_prompt_length=args.max_prompt_length, max_completion_length=args.max_completion_length,
                     train_on_last_step_only=args.train_on_last_step_only, is_eval=is_eval)  # fmt: skip
    extra = {}
    if isinstance(dataset, Dataset):
        extra = dict(num_proc=args.dataset_num_proc, desc=f"Tokenizing {name.split('[')[0].split('_')[0]} dataset")
    return dataset.map(tokenize_row, fn_kwargs=fn_kwargs, remove_columns=dataset.column_names, features=TOKENISED,
                       **extra)  # fmt: skip
