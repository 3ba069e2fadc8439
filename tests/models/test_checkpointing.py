"""Offloaded gradient checkpointing: the same gradients as plain checkpointing and as none, with the copy path run."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.models.checkpointing import (
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    is_offloaded_checkpointing,
    offload_state,
)
from slimrl.testing import tiny_model
from tests.tolerances import assert_close

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 13, 14, 15, 16, 17, 18]])
MASK = (IDS != 0).long()


def lora_model(arch="llama", dropout=0.0):
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return get_peft_model(tiny_model(arch), config)


def loss_and_grads(model, seed=0):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks for every variant
    loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(expected, actual, label):
    assert_close(actual[0], expected[0], name=f"{label}: loss")
    assert expected[1].keys() == actual[1].keys() and expected[1]
    for name, grad in expected[1].items():
        assert_close(actual[1][name], grad, name=f"{label}: grad of {name}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offloaded_gradients_equal_plain_checkpointing_and_none(arch, dropout):
    model = lora_model(arch, dropout)
    reference = loss_and_grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = loss_and_grads(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=5)  # 16 tokens: MLP tiles of at most 5, so 4 of 4
    assert offload_state(model) is state and (state.offloaded, state.split_recomputes) == (0, 0)
    offloaded = loss_and_grads(model)
    assert state.offloaded == 2  # both decoder layers' inputs went through host memory
    # without dropout the layers are recomputed attention first, then the MLP tile by tile; with dropout, whole
    assert state.split_recomputes == (2 if dropout == 0 else 0)
    assert_same(reference, plain, "plain checkpointing")
    assert_same(reference, offloaded, "offloaded checkpointing")


def test_full_fine_tune_gets_input_gradients_through_offloaded_layers():
    model = tiny_model()
    reference = loss_and_grads(model)
    enable_offloaded_checkpointing(model)
    assert_same(reference, loss_and_grads(model), "full fine-tune")


def test_survives_a_later_gradient_checkpointing_enable_and_can_be_undone():
    model = lora_model()
    state = enable_offloaded_checkpointing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as HF Trainer does
    layers = model.get_base_model().model.layers
    assert all(layer._gradient_checkpointing_func == state.checkpoint for layer in layers)
    base = model.get_base_model()
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x: Trainer's entry point, new keywords
        base.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=1, offload=False)
        assert all(layer._gradient_checkpointing_func == state.checkpoint for layer in layers)
    assert is_offloaded_checkpointing(model)
    disable_offloaded_checkpointing(model)
    assert not is_offloaded_checkpointing(model) and offload_state(model) is None
    assert all(layer._gradient_checkpointing_func != state.checkpoint for layer in layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    offloads = state.offloaded
    loss_and_grads(model)
    assert state.offloaded == offloads  # torch's checkpointing again: nothing goes through the old state


def test_split_recompute_without_tiling_and_bad_tile_size():
    model = lora_model()
    reference = loss_and_grads(model)
    enable_offloaded_checkpointing(model, mlp_tile_tokens=0)
    assert_same(reference, loss_and_grads(model), "untiled split recompute")
    with pytest.raises(ValueError, match="mlp_tile_tokens must be >= 0"):
        enable_offloaded_checkpointing(model, mlp_tile_tokens=-1)


def test_eval_and_no_grad_forwards_do_not_offload():
    model = lora_model()
    state = enable_offloaded_checkpointing(model)
    model.train()
    with torch.no_grad():
        model(input_ids=IDS, attention_mask=MASK)
    assert state.offloaded == 0
    loss_and_grads(model)
    assert state.offloaded == 2  # the same model with grad: both layers offload


@pytest.mark.cuda  # the pinned-memory side-stream path needs CUDA
def test_cuda_offload_matches_plain_checkpointing():
    model = lora_model().cuda()
    global IDS, MASK
    ids, mask = IDS, MASK
    try:
        IDS, MASK = ids.cuda(), mask.cuda()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plain = loss_and_grads(model)
        state = enable_offloaded_checkpointing(model, mlp_tile_tokens=3, min_offload_bytes=0)  # park even these
        assert_same(plain, loss_and_grads(model), "CUDA offload")
        assert state.offloaded == 2 and len(state.side) == 1  # both layers' inputs, copied on one side stream
    finally:
        IDS, MASK = ids, mask


def mlp_call_tokens(model) -> list[int]:
    """Record the token count of every MLP call of the model's decoder layers (a list filled as the model runs)."""
    calls = []
    for layer in model.get_base_model().model.layers:
        layer.mlp.register_forward_hook(lambda module, args, output: calls.append(args[0].numel() // args[0].shape[-1]))
    return calls


def test_two_models_keep_their_own_tiles_and_counters():
    tiled, whole = lora_model(), lora_model()
    reference = loss_and_grads(lora_model())
    tiled_state = enable_offloaded_checkpointing(tiled, mlp_tile_tokens=5)
    whole_state = enable_offloaded_checkpointing(whole, mlp_tile_tokens=0)  # enabled last: it must not retile `tiled`
    tiled_calls, whole_calls = mlp_call_tokens(tiled), mlp_call_tokens(whole)
    assert_same(reference, loss_and_grads(tiled), "tiles of 5")
    assert_same(reference, loss_and_grads(whole), "no tiles")
    # 16 tokens per layer: 4 tiles of 4 (at most 5 each) in the gradient-free forward and again in the recompute, for
    # 2 layers
    assert tiled_calls == [4, 4, 4, 4] * 4
    assert whole_calls == [16] * 4  # the whole sequence at once, forward and recompute, for 2 layers
    assert (tiled_state.offloaded, tiled_state.split_recomputes) == (2, 2)
    assert (whole_state.offloaded, whole_state.split_recomputes) == (2, 2)
    assert offload_state(tiled) is tiled_state and offload_state(whole) is whole_state


@pytest.mark.parametrize(("tokens", "tile", "sizes"), [
    (16, 5, [4, 4, 4, 4]),  # as few tiles as fit, of equal size
    (16, 7, [6, 6, 4]),  # the last one shorter
    (16, 16, [16]), (16, 0, [16]), (0, 8, [0]),  # one piece
    (16640, 8192, [5632, 5632, 5376]),  # W1's 16,384-token row: rounded up to 128 rows, not 8,192 + 8,192 + 256
    (33024, 8192, [6656] * 4 + [6400]),
    (300, 200, [150, 150]),  # rounding to 128 would pass the tile: not rounded
])
def test_mlp_tiles_are_as_few_and_as_even_as_the_tile_allows(tokens, tile, sizes):
    from slimrl.models.recompute import tile_bounds

    bounds = tile_bounds(tokens, tile)
    assert [end - start for start, end in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))  # contiguous, no overlap


def test_uneven_tiles_give_the_untiled_gradients():
    reference = loss_and_grads(lora_model())
    model = lora_model()
    enable_offloaded_checkpointing(model, mlp_tile_tokens=7)
    calls = mlp_call_tokens(model)
    assert_same(reference, loss_and_grads(model), "tiles of 6, 6 and 4")
    assert calls == [6, 6, 4] * 4


def test_a_deep_copy_gets_its_own_state_with_the_same_settings():
    import copy

    model = lora_model()
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=5)
    twin = copy.deepcopy(model)
    twin_state = offload_state(twin)
    assert twin_state is not state and twin_state.mlp_tile_tokens == 5
    loss_and_grads(twin)
    assert (twin_state.offloaded, state.offloaded) == (2, 0)


def test_a_gradient_free_forward_computes_what_the_checkpointed_forward_computes():
    # a reference pass or PPO's old log-probs must match the training forward op for op: in bf16 on a GPU the MLP
    # in tiles (and the fused ops) round differently from the whole layer, which moved W4's DPO loss off log 2
    from slimrl.models.checkpointing import gradient_free_forward

    model = lora_model().to(torch.bfloat16)
    enable_offloaded_checkpointing(model, mlp_tile_tokens=5)
    model.train()
    calls = mlp_call_tokens(model)
    with_grad = model(input_ids=IDS, attention_mask=MASK).logits
    tiles_with_grad, calls[:] = list(calls), []
    with torch.no_grad(), gradient_free_forward(model, {"use_reentrant": False}):
        without_grad = model(input_ids=IDS, attention_mask=MASK).logits
    assert tiles_with_grad == calls == [4, 4, 4, 4] * 2  # both layers' MLPs in the same tiles, both times
    assert torch.equal(with_grad.detach(), without_grad)
    assert model.is_gradient_checkpointing  # the checkpoint function stayed installed and nothing was undone


def test_a_forward_the_layer_already_has_is_kept_and_called():
    # accelerate's device-map hooks put an instance forward on a layer; routing gradient-free calls must not drop it
    from accelerate.hooks import ModelHook, add_hook_to_module

    from slimrl.models.checkpointing import gradient_free_forward

    class CountCalls(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(layers.index(module))
            return args, kwargs

    calls, model = [], lora_model()
    layers = hf_layers(model)
    for layer in layers:
        add_hook_to_module(layer, CountCalls())
    hooks = [vars(layer)["forward"] for layer in layers]
    enable_offloaded_checkpointing(model, mlp_tile_tokens=5)
    model.train()
    with_grad = model(input_ids=IDS, attention_mask=MASK).logits
    assert calls == [0, 1]
    with torch.no_grad(), gradient_free_forward(model, {"use_reentrant": False}):
        without_grad = model(input_ids=IDS, attention_mask=MASK).logits
    # the hook's forward is a partial over the layer, so the checkpoint still finds the layer and recomputes it in
    # tiles (computing from the layer's modules, as the recompute with grad does)
    assert torch.equal(with_grad.detach(), without_grad)
    disable_offloaded_checkpointing(model)
    assert [vars(layer).get("forward") for layer in layers] == hooks
    model(input_ids=IDS, attention_mask=MASK)
    assert calls[-2:] == [0, 1]


def hf_layers(model) -> list:
    return [module for module in model.modules() if type(module).__name__.endswith("DecoderLayer")]


def test_without_offloading_a_gradient_free_forward_turns_checkpointing_off_as_trl_does():
    from slimrl.models.checkpointing import gradient_free_forward

    model = lora_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with gradient_free_forward(model, {"use_reentrant": False}):
        assert not model.is_gradient_checkpointing
    assert model.is_gradient_checkpointing


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors the autograd graph of `loss` accumulates into, found by walking it from the loss as DDP's
    search for unused parameters does (find_unused_parameters=True, HF Trainer's default for a PEFT model)."""
    seen, leaves, stack = set(), [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


@pytest.mark.parametrize("tile", [0, 5])
def test_each_trainable_weight_is_in_the_outer_graph_and_gets_one_gradient_per_backward(tile):
    # DDP's reducer finds the weights a backward will reach by walking the graph from the outputs, and takes each
    # weight's gradient once per backward pass: the checkpoint must show every weight in that graph and hand autograd
    # one gradient per weight, however many MLP tiles the recompute ran (the two-GPU crash of issue 29)
    model = lora_model()
    reference = loss_and_grads(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=tile)
    model.zero_grad(set_to_none=True)
    arrivals = {}  # name -> how many times autograd accumulated a gradient into the weight

    def count(name):
        return lambda parameter: arrivals.update({name: arrivals.get(name, 0) + 1})

    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(count(name))
    torch.manual_seed(0)
    loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable <= {id(leaf) for leaf in graph_leaves(loss)}
    loss.backward()
    assert state.split_recomputes == 2
    assert arrivals == {name: 1 for name, p in model.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_same(reference, (loss.detach(), grads), f"tile {tile}")


def test_without_weights_in_the_graph_the_recompute_accumulates_them_itself():
    # FSDP and ZeRO-3 (weights_in_graph=False): their hooks run inside the recompute, which accumulates into .grad as
    # a plain backward does; the gradients are the same, and the weights stay out of the outer graph
    model = lora_model()
    reference = loss_and_grads(model)
    enable_offloaded_checkpointing(model, mlp_tile_tokens=5, weights_in_graph=False)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
    layer_weights = {id(p) for p in model.get_base_model().model.layers.parameters() if p.requires_grad}
    assert layer_weights and not layer_weights & {id(leaf) for leaf in graph_leaves(loss)}
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_same(reference, (loss.detach(), grads), "weights accumulated by the recompute")
