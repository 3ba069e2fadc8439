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
    if arch == "phi3":  # fused qkv_proj and gate_up_proj; no sliding window
        from transformers import Phi3Config

        config = Phi3Config(sliding_window=None, **common)
    if arch in GEMMA_ARCHS:
        config = gemma_config(arch, common, overrides)
    if arch in MOE_ARCHS:
        config = moe_config(arch, common, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Gemma 2's capped attention scores need eager attention: transformers 5.17 picks SDPA (which drops the cap)
        # and 5.2x eager, so it is named here for the tests to mean the same model everywhere
        attention = {"attn_implementation": "eager"} if arch == "gemma2" else {}
        model = AutoModelForCausalLM.from_config(config, **attention)
        if arch in GEMMA_ARCHS:  # Gemma's norms start at zero (scale 1 + 0): random ones make each norm matter
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.data.normal_(0.0, 0.5)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 3
    return model.eval()


GEMMA_ARCHS = ("gemma2", "gemma3")


def gemma_config(arch: str, common: dict, overrides: dict):
    """A tiny Gemma 2 / Gemma 3 text config: a sliding then a global layer (a window longer than the tests'
    sequences unless `sliding_window` is given), query_pre_attn_scalar other than head_dim, Gemma 3's local and
    global RoPE bases apart; for Gemma 2, weights and caps at a scale where the soft-capping changes the scores."""
    from transformers import Gemma2Config, Gemma3TextConfig

    settings = dict(common, head_dim=16, query_pre_attn_scalar=24, sliding_window=64, hidden_activation=
                    "gelu_pytorch_tanh", layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    if arch == "gemma2":
        settings.update(initializer_range=0.2, attn_logit_softcapping=1.0, final_logit_softcapping=4.0)
    settings.update(overrides)
    return Gemma2Config(**settings) if arch == "gemma2" else Gemma3TextConfig(**settings)


MOE_ARCHS = ("qwen3_moe", "mixtral")


def moe_config(arch: str, common: dict, overrides: dict):
    """A tiny Qwen3-MoE / Mixtral config: 4 experts, top-2 (Qwen3-MoE without renormalising the top-k weights,
    Mixtral always renormalises); Qwen3-MoE's layers are all sparse unless `mlp_only_layers` says otherwise."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if arch == "mixtral":
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **common)
    settings = dict(common, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    settings.update({k: v for k, v in overrides.items() if k in ("head_dim", "norm_topk_prob", "mlp_only_layers")})
    return Qwen3MoeConfig(**settings)


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
    ids, mask = (t.to(model.device) for t in left_pad(prompts))
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


def step_the_adapter(model, lr: float, keep=lambda name: True) -> list[torch.nn.Parameter]:
    """One SGD step on the adapter weights whose names `keep` accepts, pushing every prompt of PROMPTS towards token
    77 at its last position; the model is back in eval mode after. Returns the stepped parameters."""
    params = [p for n, p in model.named_parameters() if "lora_" in n and keep(n)]
    assert params, "no adapter weight matched"
    optimizer = torch.optim.SGD(params, lr=lr)
    ids, mask = left_pad(PROMPTS)
    model.train()
    (-model(input_ids=ids, attention_mask=mask).logits[:, -1, 77].mean()).backward()
    optimizer.step()
    model.eval()
    return params


def prefill_logits(decoder, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The engine's logits [P, V] for one unpadded prompt ids [1, P] through `decoder`'s prefill, and the cache
    (16 columns) it filled."""
    from slimrl.rollout.kv_cache import StaticKVCache
    from slimrl.rollout.model.llama import prefill_attention

    length = ids.shape[1]
    cache = StaticKVCache(decoder.num_layers, 1, decoder.kv_heads, 16, decoder.head_dim, decoder.dtype, "cpu")
    cos, sin = decoder.rope_tables(length)

    def attend(layer, q, k, v):
        return prefill_attention(decoder, cache, layer, slice(0, 1), q, k, v, None, 1, length)

    with torch.no_grad():
        return decoder.logits(decoder.forward(ids.reshape(-1), cos, sin, attend)), cache


def assert_greedy_matches_generate(model, new_tokens: int = 12) -> None:
    """fp32 greedy from the engine equals transformers' `generate` on the left-padded PROMPTS, with the model's adapter
    and with it disabled, and the adapter changes the output (so the comparison saw it)."""
    from slimrl.rollout.engine import RolloutEngine

    engine = RolloutEngine(model)
    with_adapter = engine.generate(PROMPTS, GREEDY, max_new_tokens=new_tokens).completion_ids
    assert with_adapter == hf_greedy(model, PROMPTS, new_tokens, eos_token_id=None)
    with model.disable_adapter():
        base = engine.generate(PROMPTS, GREEDY, max_new_tokens=new_tokens).completion_ids
        assert base == hf_greedy(model, PROMPTS, new_tokens, eos_token_id=None)
    assert base != with_adapter, "the adapter should change the greedy output"
