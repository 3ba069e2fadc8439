"""Builders and references the rollout tests share: tiny models of every supported architecture, left padding,
transformers' own greedy decoding, and a full-forward statement of sampled tokens' log-probs."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from slimrl.rollout.sampling import SamplingParams
from slimrl.testing import tiny_config, tiny_model

# three prompts of different lengths: the batch is left-padded
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
GREEDY = SamplingParams(temperature=0.0)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter


def build(arch: str, seed: int = 0, **overrides):
    """A tiny model of any supported architecture (llama and qwen2 from slimrl.testing, qwen3 and mistral here)."""
    if arch in ("llama", "qwen2"):
        return tiny_model(arch, seed=seed, **overrides).eval()
    from transformers import MistralConfig, Qwen3Config

    common = dict(tiny_config("llama").to_dict(), **overrides)
    common = {k: common[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                     "pad_token_id", "eos_token_id", "tie_word_embeddings")}  # fmt: skip
    config = Qwen3Config(head_dim=16, **common) if arch == "qwen3" else MistralConfig(sliding_window=None, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 3
    return model.eval()


def with_lora(model, seed: int = 1):
    """All-linear LoRA with non-zero B (init_lora_weights=False), so the adapter changes every projection."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        return get_peft_model(model, config).eval()


def left_pad(prompts, pad=0):
    length = max(map(len, prompts))
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_greedy(model, prompts, new_tokens, **kwargs):
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[:, ids.shape[1] :].tolist()


def no_eos(model):
    model.generation_config.eos_token_id = None
    return model


def full_forward_logprobs(model, prompts, completions, temperature, top_k=0):
    """log_softmax of the (temperature-scaled, top-k-filtered) logits of each completion token, from one forward of
    the whole sequence: what TRL recomputes for the policy."""
    result = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        result.append(logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0])
    return result


def likely_eos(model, prompts, logit: float = 3.0):
    """Point lm_head's EOS row (id 3) at the prompts' mean final hidden state, so EOS has logit ~`logit` there and
    some sampled rows end early."""
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1][:, -1]
        direction = hidden.mean(0)
        model.get_output_embeddings().weight[3] = logit * direction / direction.square().sum()
    model.generation_config.eos_token_id = 3
    return model


def sampled_by_generate(model, prompts, new_tokens, **filters):
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True,
                             pad_token_id=0, top_k=filters.get("top_k", 0), top_p=filters.get("top_p", 1.0),
                             temperature=filters.get("temperature", 1.0))  # fmt: skip
    rows = out[:, ids.shape[1] :].tolist()
    return [row[: row.index(3) + 1] if 3 in row else row for row in rows]

