"""Gemma 2 and Gemma 3 text through the engine's one forward: its pieces against transformers' modules, its logits
and greedy rollouts against transformers' own (fp32, live LoRA), and the CUDA paths it takes (fused decode kernels
off, the Triton LoRA and attention kernels on) in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from slimrl.ops.fused import Compiled
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.kv_cache import StaticKVCache
from slimrl.rollout.model.llama import Decoder, decode_attention, prefill_attention
from slimrl.rollout.model.reference import EAGER_GROUPED, gelu_tanh_mul, gemma_rms_norm, prefill_mask
from slimrl.rollout.model.views import embed_tokens, supports
from tests.rollout.helpers import (
    GREEDY,
    PROMPTS,
    assert_greedy_matches_generate,
    build,
    hf_greedy,
    left_pad,
    no_eos,
    step_the_adapter,
    with_lora,
)
from tests.tolerances import assert_close

ARCHS = ["gemma2", "gemma3"]


@pytest.mark.parametrize("module", ["gemma2", "gemma3"])
def test_gemma_norm_and_geglu_are_transformers_own(module):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP, Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm

    norm_class, mlp_class = (Gemma2RMSNorm, Gemma2MLP) if module == "gemma2" else (Gemma3RMSNorm, Gemma3MLP)
    gen = torch.Generator().manual_seed(0)
    norm = norm_class(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=gen))
    x = torch.randn(3, 8, generator=gen).bfloat16()  # bf16: Gemma scales before rounding, Llama after
    assert torch.equal(gemma_rms_norm(x, norm.weight.bfloat16(), 1e-6), norm.bfloat16()(x))
    mlp = mlp_class(build(module).config)
    gate, up = torch.randn(2, 5, 128, generator=gen)
    assert torch.equal(gelu_tanh_mul(gate, up), mlp.act_fn(gate) * up)
    # x * sqrt(hidden), the scale rounded to bf16 first (sqrt(72) = 8.485 is 8.5 in bf16)
    embed = build(module, dtype=torch.bfloat16, hidden_size=72).get_input_embeddings()
    ids = torch.tensor([1, 7, 200])
    expected = embed(ids)
    embed.register_forward_pre_hook(lambda *args: pytest.fail("looked up from the weight, no hooks (FSDP, ZeRO-3)"))
    assert torch.equal(embed_tokens(embed, ids), expected) and expected.dtype == torch.bfloat16


# Gemma 3 4B and up: linear RoPE scaling on the global layers only
SCALED_GLOBAL_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip


@pytest.mark.parametrize("arch, settings", [("gemma2", {}), ("gemma3", {}), ("gemma3", SCALED_GLOBAL_ROPE)])
def test_forward_gives_transformers_logits_over_a_padded_batch(arch, settings):
    # sandwich norms, scaled embeddings, Gemma 3's local RoPE base on its sliding layer, Gemma 2's soft-capped
    # attention scores and logits: any of them missed moves the logits
    model = with_lora(build(arch, **({"rope_parameters": settings} if settings else {})))
    decoder = Decoder(model)
    prompts = [[5, 9, 11, 4, 7, 8, 13], [20, 21, 22]]
    ids, attention_mask = left_pad(prompts)
    batch, length = ids.shape
    cache = StaticKVCache(decoder.num_layers, batch, decoder.kv_heads, 16, decoder.head_dim, decoder.dtype, "cpu")
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0).reshape(-1)
    cos, sin = (table.index_select(0, positions) for table in decoder.rope_tables(length))
    mask = prefill_mask(attention_mask.bool(), decoder.dtype)

    def attend(layer, q, k, v):
        return prefill_attention(decoder, cache, layer, slice(0, batch), q, k, v, mask, batch, length)

    with torch.no_grad():
        ours = decoder.logits(decoder.forward(ids.reshape(-1), cos, sin, attend)).view(batch, length, -1)
        theirs = model(input_ids=ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert_close(ours[real], theirs[real], "fp32_sum", name=f"{arch} logits")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_a_live_lora_matches_generate(arch):
    assert_greedy_matches_generate(with_lora(no_eos(build(arch))))


@pytest.mark.parametrize("arch", ARCHS)
def test_sliding_layers_past_their_window_match_generate(arch):
    # layer 0 slides over 4 tokens, layer 1 is global; prompt + completion reach 19 tokens
    model = with_lora(no_eos(build(arch, sliding_window=4)))
    assert Decoder(model).windows == [4, None]
    expected = hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    assert RolloutEngine(model, max_seq_len=64).generate(PROMPTS, GREEDY, 12).completion_ids == expected
    wide = with_lora(no_eos(build(arch)))
    assert hf_greedy(wide, PROMPTS, 12, eos_token_id=None) != expected, "the window changes the output"


def test_an_optimizer_step_on_the_adapter_reaches_the_next_rollout():
    model = with_lora(no_eos(build("gemma3")))
    engine = RolloutEngine(model)
    before = engine.generate(PROMPTS, GREEDY, max_new_tokens=8).completion_ids
    step_the_adapter(model, lr=20.0)
    after = engine.generate(PROMPTS, GREEDY, max_new_tokens=8).completion_ids
    assert after == hf_greedy(model, PROMPTS, 8, eos_token_id=None)
    assert after != before


def test_gemma_takes_its_own_pieces_without_fused_kernels_and_llama_keeps_the_given_ops():
    # on CUDA the runner hands the forward compiled pieces and a FusedDecode, whose kernels implement Llama's norm
    # and SiLU: Gemma's forward swaps in its own pieces, compiled alike, and drops the fused kernels
    fused = object()
    ops = EAGER_GROUPED._replace(fused=fused)
    compiled = ops._replace(**{name: Compiled(getattr(ops, name)) for name in ops._fields[:4]})
    assert Decoder(build("llama")).recipe_ops(compiled) is compiled
    decoder = Decoder(build("gemma3"))
    eager, own = decoder.recipe_ops(ops), decoder.recipe_ops(compiled)
    assert eager.fused is None and own.fused is None and own.add_lora is ops.add_lora
    assert eager.rms_norm is gemma_rms_norm and eager.silu_mul is gelu_tanh_mul
    assert isinstance(own.rms_norm, Compiled) and own.rms_norm.fn is gemma_rms_norm
    assert decoder.recipe_ops(compiled).rms_norm is own.rms_norm  # compiled once, not per forward


def test_softcapped_decode_beside_the_attention_kernel_reads_the_live_columns():
    # with the Triton decode kernel bound the runner keeps no mask; Gemma 2's eager attention builds its own
    decoder = Decoder(build("gemma2"))
    gen = torch.Generator().manual_seed(0)
    cache = StaticKVCache(1, 2, decoder.kv_heads, 8, decoder.head_dim, torch.float32, "cpu")
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    q = torch.randn(2, decoder.heads, decoder.head_dim, generator=gen)
    starts, column = torch.tensor([1, 4]), torch.tensor([5])
    live = (torch.arange(8)[None] >= starts[:, None]) & (torch.arange(8)[None] <= column)
    mask = torch.zeros(2, 1, 1, 8).masked_fill_(~live[:, None, None], float("-inf"))

    def kernel(*args):
        raise AssertionError("the Triton kernel cannot soft-cap the scores")

    stale = torch.zeros(2, 1, 1, 8)
    with_kernel = decode_attention(decoder, cache, 0, column, q, None, None, stale, kernel, starts)
    assert torch.equal(with_kernel, decode_attention(decoder, cache, 0, column, q, None, None, mask))


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's interpreter on a CPU model")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_kernel_settings_match_generate_in_the_interpreter(arch):
    # past the sliding layer's window too: the Triton decode kernel reads from each row's windowed start
    model = with_lora(no_eos(build(arch, sliding_window=4)))
    engine = RolloutEngine(model, max_seq_len=64, triton_lora=True, triton_attention=True, fused_decode=True)
    assert engine.runner.attention is not None and engine.runner.fused is not None
    out = engine.generate(PROMPTS[:2], GREEDY, max_new_tokens=6)
    assert out.completion_ids == hf_greedy(model, PROMPTS[:2], 6, eos_token_id=None)


def test_what_the_engine_cannot_run_of_gemma_is_refused_with_the_reason():
    supported, why = supports(build("gemma3", use_bidirectional_attention=True))
    assert not supported and "use_bidirectional_attention" in why
    supported, why = supports(build("gemma2", hidden_activation="gelu"))
    assert not supported and "'gelu'" in why
    assert supports(with_lora(build("gemma2"))) == (True, "")


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_defaults_match_generate_and_see_an_in_place_adapter_update(arch):
    # the engine's CUDA defaults: a captured decode graph, compiled pieces (Gemma's own), the Triton LoRA and
    # attention kernels, the fused decode kernels bound but bypassed for Gemma; past the sliding layer's window
    # (Gemma 2 with eager attention, capped scores, as `build` makes it on every transformers version)
    import os

    model = with_lora(no_eos(build(arch, sliding_window=4))).cuda()
    # conftest runs Triton in its interpreter for CPU kernel tests; torch.compile's kernels need the real one
    engine = RolloutEngine(model, max_seq_len=64, compile=os.environ.get("TRITON_INTERPRET", "0") != "1")
    assert engine.options.cuda_graphs and engine.runner.fused is not None

    def generated(new_tokens: int = 12) -> list[list[int]]:
        ids, mask = left_pad(PROMPTS)
        with torch.no_grad():
            out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    first = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
    assert first == generated()
    with torch.no_grad():  # an in-place edit, as an optimizer step makes
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-2.0)
    again = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
    assert again == generated() and again != first


def test_gemma2_under_sdpa_the_engine_follows_the_models_uncapped_attention(caplog):
    # transformers 5.17 loads Gemma 2 with SDPA by default, whose attention drops attn_logit_softcapping (5.2x raise
    # instead): the trainer scores uncapped attention there, so the engine must sample from it too and say how to
    # get the capped one
    model = with_lora(no_eos(build("gemma2")))
    assert Decoder(model).recipe.attn_softcap == 1.0
    capped = hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    model.config._attn_implementation = "sdpa"
    with caplog.at_level("WARNING", logger="slimrl.rollout.model.features"):
        engine = RolloutEngine(model, max_seq_len=64)
    assert engine.decoder.recipe.attn_softcap is None and "attn_implementation='eager'" in caplog.text
    # what SDPA computes on 5.17: eager attention without the cap
    model.config._attn_implementation = "eager"
    for layer in model.base_model.model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    assert uncapped != capped, "the cap changes transformers' own output at these settings"
    assert engine.generate(PROMPTS, GREEDY, 12).completion_ids == uncapped
