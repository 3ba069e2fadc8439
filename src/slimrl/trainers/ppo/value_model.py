"""The policy and its value function as the one module PPOTrainer trains (`PolicyAndValue`).

The value function is either
- a value head on the policy (`value_model=None`): a linear layer on the policy's final hidden states, read from the
  same forward pass as the log-probs, so it costs no extra pass; the value loss also trains the policy's adapter
  (a shared actor-critic, as TRL's old `AutoModelForCausalLMWithValueHead`); or
- a separate model: any transformers model with a decoder (a `*ForSequenceClassification` with one label brings its
  own `score` head; for any other, such as a small causal LM, a fresh value head reads its final hidden states). It
  may carry its own LoRA adapter; its forward runs beside the policy's in each chunk.

Both are registered in one `nn.Module`, so the HF Trainer's optimizer, gradient clipping, zero_grad, DDP wrapping and
checkpoints cover the policy and the value function alike. What one forward of a chunk keeps: the policy's final
hidden states at the completion positions [b, t, H] (the LM head runs in vocabulary tiles, recomputed in backward: no
[b, t, V] logits), and, with a separate value model, its hidden states at the same positions.

Saved layout (`save`/`load`): the policy as `save_pretrained` writes it (the adapter, or the full weights) at the
top of the directory, a separate value model under `value_model/`, and a value head of slimrl's own in
`value_head.safetensors`.

Beside the module: how the policy is loaded (`load_policy`, `load_weights`), the other models PPO keeps
(`reference_model`) and `disable_dropout`. The rollout's tensors, its gradient-free scoring pass and its buffer are in
rollout.py.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn

from slimrl.models.unwrap import unwrap_model

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_MODEL_DIR = "value_model"


class ValueHead(nn.Module):
    """Linear(hidden, 1) in fp32, zero-initialised: every value starts at 0, so the first advantages are the plain
    discounted rewards, and the head does not push the policy's states anywhere before it has learnt something."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.summary(states.to(self.summary.weight.dtype)).squeeze(-1)  # [b, t, H] -> [b, t] fp32


def hidden_size(model: nn.Module) -> int:
    config = unwrap_model(model).config
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).hidden_size


def completion_states(model: nn.Module, input_ids, attention_mask, logits_to_keep: int) -> torch.Tensor:
    """The final hidden states [b, t, H] at the positions that predict the last `logits_to_keep` tokens of each row.

    Positions count real tokens only (left padding does not shift them), as transformers' `generate` and slimrl's
    engine number them, so the training forward scores exactly what was sampled."""
    backbone = unwrap_model(model).base_model  # the decoder stack under the LM (or classification) head
    position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # fmt: skip
    return hidden[:, -logits_to_keep - 1 : -1]


# vocabulary columns per tile of the LM head: TRL's own tile (trl/trainer/utils.py, _CHUNKED_LOGPROB_CHUNK_SIZE)
LM_HEAD_TILE = 32768


def policy_logprobs(model: nn.Module, input_ids, attention_mask, logits_to_keep: int, temperature: float,
                    with_entropy: bool = False):  # fmt: skip
    """(log-probs [b, t] fp32 of the last `logits_to_keep` tokens at `temperature`, their entropies [b, t] or None
    (only logged: no gradient flows back through them), the states [b, t, H] that predicted them).

    The LM head runs through TRL's chunked log-prob function (trl.kernels.ChunkedLogProbFunction, the one behind
    GRPO's fused LM head): tiles of the vocabulary folded into an online logsumexp, recomputed in backward, so the
    chunk's [b, t, V] logits never exist; what it keeps is the states."""
    from trl.kernels import ChunkedLogProbFunction

    causal_lm = unwrap_model(model)
    states = completion_states(model, input_ids, attention_mask, logits_to_keep)
    head, (softcap, scale) = causal_lm.get_output_embeddings(), _logit_transform(causal_lm.config)
    flat = states.reshape(-1, states.size(-1)).to(head.weight.dtype)  # [b * t, H]
    targets = input_ids[:, -logits_to_keep:].reshape(-1)  # [b * t]
    logps, entropies, *_ = ChunkedLogProbFunction.apply(flat, head.weight, head.bias, targets, temperature,
                                                        LM_HEAD_TILE, softcap, scale,
                                                        ("entropy",) if with_entropy else ())  # fmt: skip
    shape = states.shape[:2]
    return logps.float().view(shape), None if entropies is None else entropies.detach().float().view(shape), states


def _logit_transform(config) -> tuple[float | None, float]:
    """(final_logit_softcapping, logit_scale) of the model's logits, which its own forward applies after the head."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(text, name, None) is not None:
            raise NotImplementedError(f"slimrl's PPO does not apply the config's `{name}` to the logits yet.")
    scale = getattr(text, "logit_scale", None)
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


def _score_layer(model: nn.Module) -> nn.Module | None:
    """A `*ForSequenceClassification` model's own one-label head, if it has one."""
    score = getattr(unwrap_model(model), "score", None)
    return score if isinstance(score, nn.Linear) and score.out_features == 1 else None


class PolicyAndValue(nn.Module):
    """`policy` (a causal LM, LoRA or full) and its value function; `forward` scores a chunk of sequences."""

    def __init__(self, policy: nn.Module, value_model: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        own_score = _score_layer(value_model) if value_model is not None else None
        self.value_head = None if own_score is not None else ValueHead(hidden_size(value_model or policy))
        if self.value_head is not None:
            device = next(policy.parameters()).device
            self.value_head.to(device)

    @property
    def config(self):
        """The policy's config: what the HF Trainer reads (use_cache, model card, memory model)."""
        return self.policy.config

    @property
    def dtype(self) -> torch.dtype:
        return unwrap_model(self.policy).dtype

    def forward(self, input_ids, attention_mask, logits_to_keep: int, temperature: float, with_entropy: bool = False):
        """(log-probs [b, t], entropies [b, t] or None, values [b, t]) of the last `logits_to_keep` tokens: the
        policy's at `temperature`, and the value of the state before each token."""
        logps, entropies, states = policy_logprobs(self.policy, input_ids, attention_mask, logits_to_keep, temperature,
                                                   with_entropy)  # fmt: skip
        if self.value_model is not None:
            states = completion_states(self.value_model, input_ids, attention_mask, logits_to_keep)
        if self.value_head is not None:
            return logps, entropies, self.value_head(states)
        score = _score_layer(self.value_model)
        return logps, entropies, score(states.to(score.weight.dtype)).float().squeeze(-1)  # [b, t, 1] -> [b, t]

    @contextlib.contextmanager
    def reference(self):
        """The policy with its LoRA adapter disabled: the reference model, no copy."""
        with self.policy.disable_adapter():
            yield

    # -- what the HF Trainer calls on its model -----------------------------------------------------------------

    def activation_checkpointing_enable(self, **kwargs) -> None:
        for model in (self.policy, self.value_model):
            if model is not None and hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(**kwargs)

    gradient_checkpointing_enable = activation_checkpointing_enable

    def save(self, directory: str) -> None:
        """The policy (adapter or full weights), a separate value model under value_model/, our value head."""
        os.makedirs(directory, exist_ok=True)
        self.policy.save_pretrained(directory)
        if self.value_model is not None:
            self.value_model.save_pretrained(os.path.join(directory, VALUE_MODEL_DIR))
        if self.value_head is not None:
            from safetensors.torch import save_file

            state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.value_head.state_dict().items()}
            save_file(state, os.path.join(directory, VALUE_HEAD_FILE))

    def load(self, directory: str) -> None:
        """Load what `save` wrote (the trainable weights of a checkpoint) into this module, in place."""
        load_weights(self.policy, directory)
        if self.value_model is not None:
            load_weights(self.value_model, os.path.join(directory, VALUE_MODEL_DIR))
        if self.value_head is not None:
            from safetensors.torch import load_file

            self.value_head.load_state_dict(load_file(os.path.join(directory, VALUE_HEAD_FILE)))


def load_weights(model: nn.Module, directory: str) -> None:
    """Load a `save_pretrained` directory into `model` in place: a peft adapter into its adapter, full weights
    (one file or shards) into the model. Keys the model lacks are an error; keys the file lacks (tied weights) are
    not."""
    from safetensors.torch import load_file

    adapter = os.path.join(directory, "adapter_model.safetensors")
    if hasattr(model, "peft_config") and os.path.isfile(adapter):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapter))
        unexpected = list(getattr(result, "unexpected_keys", []))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        result = model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")), strict=False)
        unexpected = list(result.unexpected_keys)
    else:
        from transformers.trainer_utils import load_sharded_checkpoint

        unexpected = list(load_sharded_checkpoint(model, directory, strict=False).unexpected_keys)
    if unexpected:
        raise ValueError(f"{directory} holds weights this model does not have: {unexpected[:5]}")


# -- the other models ------------------------------------------------------------------------------------------------


def load_policy(model, processing_class, peft_config):
    """The policy (loaded from a name if need be, LoRA added from peft_config) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model)
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model, processing_class


def reference_model(policy: nn.Module, ref_model: nn.Module | None, kl_coef: float) -> nn.Module | None:
    """The reference model to keep: the one given; none for a LoRA policy (its adapter is disabled instead) or when
    the KL penalty is off; else a frozen copy of the policy as it is now."""
    if ref_model is None and (hasattr(policy, "disable_adapter") or kl_coef == 0):
        return None
    reference = ref_model if ref_model is not None else copy.deepcopy(policy)
    reference.requires_grad_(False)
    return reference


def disable_dropout(module: nn.Module | None) -> None:
    """Dropout off (LoRA's included): PPO's ratio compares two forward passes, which must agree."""
    for layer in module.modules() if module is not None else ():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0


__all__ = ["PolicyAndValue", "ValueHead", "completion_states", "disable_dropout", "load_policy", "load_weights",
           "policy_logprobs", "reference_model"]  # fmt: skip
