"""Training and inference modes of a FastLanguageModel: train/eval, the KV cache, gradient checkpointing (off, torch's,
or offloaded to host memory) and the tokenizer's padding side. Every switch is skipped when already in place, so the
mode functions are cheap enough to call before every generation or optimisation phase."""

from __future__ import annotations

from slimrl.models import quantization
from slimrl.models.unwrap import hf_model


def checkpointing_is_on(model) -> bool:
    """Whether any module of the (transformers) model checkpoints its activations."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def _checkpointing_enable(model) -> None:
    # newer transformers (5.23 here) renamed the method and deprecated the old name; 5.17 (the GPU machine) has only
    # the old one
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointing_disable(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def set_gradient_checkpointing(model, mode: bool | str | None) -> None:
    """Checkpointing on (True: torch's non-reentrant), on with host offloading ("offload"), off (False), or left as
    it is (None). A no-op when the model is already in that state, so it can run every step."""
    if mode is None:
        return
    base = hf_model(model)
    on = checkpointing_is_on(base)
    if not mode:
        if on:
            _checkpointing_disable(base)
        return
    if mode == "offload":
        try:
            from slimrl.models import checkpointing
        except ImportError as error:
            raise NotImplementedError(
                "use_gradient_checkpointing='offload' needs slimrl.models.checkpointing, which this install lacks; "
                "use use_gradient_checkpointing=True."
            ) from error
        if not (on and checkpointing.is_offloaded_checkpointing(base)):
            _remove_input_grad_hooks(base)
            checkpointing.enable_offloaded_checkpointing(base)
    elif not on:
        _remove_input_grad_hooks(base)
        _checkpointing_enable(base)
    # A checkpointed layer backpropagates into its LoRA weights only if its input requires grad; the embeddings are
    # frozen, so their output is made to.
    quantization.enable_input_grads(base)


def _remove_input_grad_hooks(model) -> None:
    """transformers' checkpointing_enable registers the input-grad hook again and forgets the old handle: dropping
    ours first keeps exactly one hook however many times training mode is re-entered."""
    if getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()


def _set_padding_side(model, side: str) -> None:
    tokenizer = getattr(model, "slimrl_tokenizer", None)
    if tokenizer is not None and tokenizer.padding_side != side:
        tokenizer.padding_side = side


def for_inference(model):
    """Eval mode (no dropout), KV cache on, gradient checkpointing off, tokenizer padding on the left. Returns the
    model."""
    base = hf_model(model)
    if model.training or base.training:
        model.eval()
    config = base.config
    if not config.use_cache:
        config.use_cache = True
    set_gradient_checkpointing(model, False)
    tokenizer = getattr(model, "slimrl_tokenizer", None)
    options = getattr(model, "slimrl_options", None)
    if tokenizer is not None and tokenizer.padding_side != "left":
        if options is not None:  # the side chosen for training, put back by for_training
            options.training_padding_side = tokenizer.padding_side
        tokenizer.padding_side = "left"
    return model


def for_training(model):
    """Train mode, KV cache off, gradient checkpointing as get_peft_model was asked, and the tokenizer's training
    padding side back (left, as TRL's RL trainers pad prompts, unless another was set before for_inference). Returns
    the model."""
    base = hf_model(model)
    # both flags: a fresh peft wrapper says training=True while the model under it is still in from_pretrained's
    # eval mode, where decoder layers skip checkpointing and dropout
    if not (model.training and base.training):
        model.train()
    config = base.config
    if config.use_cache:
        config.use_cache = False
    options = getattr(model, "slimrl_options", None)
    set_gradient_checkpointing(model, getattr(options, "gradient_checkpointing", None))
    _set_padding_side(model, getattr(options, "training_padding_side", "left"))
    return model
