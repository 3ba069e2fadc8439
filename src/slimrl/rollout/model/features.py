"""What varies between the decoder families the engine's one forward runs, read once from the config (`Recipe`), and
the checks of the Gemma models' settings and modules that `views.check_supported` runs.

Every other supported architecture takes the default recipe, and the forward runs its Llama path untouched (on CUDA
with the fused decode kernels). Gemma 2 and Gemma 3 text differ in data the forward reads: RMSNorm scaling by
(1 + w) in fp32, GeGLU with the tanh GELU, soft-capped attention scores and final logits (Gemma 2), and a RoPE base
per layer type (Gemma 3's sliding layers use a local base). Their sandwich norms are modules
(`views.LayerModules.attn_out_norm` / `mlp_out_norm`) and their scaled embedding is the embedding module's own
(`views.embed_tokens`). Their pieces are the plain functions of `reference.py` (compiled when the engine compiles);
the fused decode kernels implement Llama's norm and SiLU only, so they are not used for them (`Decoder.recipe_ops`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

logger = logging.getLogger(__name__)

GEMMA_TYPES = ("gemma2", "gemma3_text")
# the embedding modules whose forward is the lookup times their `embed_scale` buffer in the weight's dtype
SCALED_EMBEDDINGS = ("Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")
GEMMA_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm")
# attention implementations that take transformers' `softcap` argument and drop it: a Gemma 2 loaded with one of them
# (transformers 5.17 picks SDPA by default) computes uncapped scores in training, so the engine does too
SOFTCAP_DROPPED_BY = ("sdpa",)


@dataclass(frozen=True)
class Recipe:
    """The architecture's choices the forward reads; the defaults are Llama's.

    norm: "llama" (round to the activation dtype, then scale by w) or "gemma" (scale by 1 + w in fp32, then round).
    activation: the gated MLP's, "silu" or "gelu_pytorch_tanh".
    attn_softcap: cap * tanh(scores / cap) on the attention scores before the mask (Gemma 2), or None.
    final_softcap: the same on the logits (Gemma 2), or None.
    rope_layer_types: per layer, the layer type the rotary module takes for its cos/sin (Gemma 3), or None when one
        table serves every layer.
    """

    norm: str = "llama"
    activation: str = "silu"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_layer_types: tuple[str, ...] | None = None

    @property
    def llama_pieces(self) -> bool:
        """The forward's norm and activation are Llama's: the engine's ops (and fused kernels) apply as they are."""
        return self.norm == "llama" and self.activation in ("silu", "swish")


def recipe_for(config) -> Recipe:
    """The recipe of a supported model's config (`views.check_supported` has accepted it)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in GEMMA_TYPES:
        return Recipe()
    gemma3 = model_type == "gemma3_text"
    return Recipe(
        norm="gemma",
        activation=config.hidden_activation,
        # Gemma 3's attention never passes attn_logit_softcapping to its attention function: transformers ignores it
        attn_softcap=None if gemma3 else _attention_softcap(config),
        final_softcap=_cap(config.final_logit_softcapping),
        rope_layer_types=tuple(config.layer_types) if gemma3 else None,
    )


def _cap(value) -> float | None:
    return None if value is None else float(value)


def _attention_softcap(config) -> float | None:
    """Gemma 2's cap on the attention scores as the model computes them: the engine samples from the policy that
    the trainer scores, so where the model's attention implementation drops the cap, so does the engine."""
    cap = _cap(config.attn_logit_softcapping)
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if cap is not None and any(name in implementation for name in SOFTCAP_DROPPED_BY):
        logger.warning("slimrl: this Gemma 2 runs attention with %r, which ignores attn_logit_softcapping=%s; the "
                       "rollout engine follows the model (uncapped scores). Load it with attn_implementation='eager' "
                       "for the capped attention Gemma 2 was trained with.", implementation, cap)  # fmt: skip
        return None
    return cap


# -- what check_supported asks of a Gemma model -------------------------------------------------------------------


def check_gemma_settings(config) -> str | None:
    """The problem with a Gemma config the forward cannot run, or None (the activation and the layer types are
    checked with every architecture's, by `views`)."""
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (an encoder's attention; the engine decodes causally)"
    return None


def sandwich_norms(layer: nn.Module) -> tuple:
    """Gemma's extra norms of a layer (pre- and post-feedforward), () for a Llama-style layer."""
    if not hasattr(layer, "pre_feedforward_layernorm"):
        return ()
    return layer.pre_feedforward_layernorm, getattr(layer, "post_feedforward_layernorm", None)


def is_gemma_norm(module: nn.Module) -> bool:
    return type(module).__name__ in GEMMA_NORMS and hasattr(module, "eps")
