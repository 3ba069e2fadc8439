"""CUDA graphs of the offloaded checkpoints' layer passes (models/layer_graphs.py): what a replay depends on is in its
key (CPU), and on CUDA the graphed training equals the eager one step for step, through weight updates, a reference
pass with the adapter off, a changed LoRA scale, padding and a new shape, with the attention recomputed and kept from
the forward (its saved storages through the graphs' buffers)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.models import layer_graphs
from slimrl.models.checkpointing import enable_offloaded_checkpointing, offload_state
from slimrl.models.graph_keys import global_state, kwargs_signature, layer_state
from slimrl.testing import tiny_model


def lora_model(arch="qwen2"):
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return get_peft_model(tiny_model(arch), config)


def decoder_layers(model) -> list:
    return list(model.base_model.model.model.layers)


def test_kwargs_signature_keys_tensors_by_shape_and_refuses_objects():
    cos, sin = torch.zeros(1, 8, 4), torch.ones(1, 8, 4)
    signature = kwargs_signature({"position_embeddings": (cos, sin), "attention_mask": None, "use_cache": False})
    # the same shapes with other values: the same key (a replay copies the values in)
    assert signature == kwargs_signature({"position_embeddings": (cos + 1, sin * 2), "attention_mask": None,
                                          "use_cache": False})  # fmt: skip
    assert signature != kwargs_signature({"position_embeddings": (torch.zeros(1, 9, 4), sin), "attention_mask": None,
                                          "use_cache": False})  # fmt: skip
    assert signature != kwargs_signature({"position_embeddings": (cos, sin), "attention_mask": torch.ones(1, 1, 8, 8),
                                          "use_cache": False})  # fmt: skip
    assert kwargs_signature({"past_key_values": object()}) is None  # a cache object: no graph


def test_layer_state_sees_what_a_replay_would_miss():
    model = lora_model()
    layer = decoder_layers(model)[0]
    start = layer_state(layer)
    assert layer_state(layer) == start
    with model.disable_adapter():  # a reference pass
        assert layer_state(layer) != start
    assert layer_state(layer) == start
    lora = layer.self_attn.q_proj
    lora.scaling["default"] = 0.5
    assert layer_state(layer) != start
    lora.scaling["default"] = 2.0
    assert layer_state(layer) == start
    weight = lora.lora_A["default"].weight
    with torch.no_grad():
        weight.mul_(2)  # an optimizer step: in place, the same address, the same key
    assert layer_state(layer) == start
    lora.lora_A["default"].weight = torch.nn.Parameter(weight.detach().clone())  # a replaced weight
    assert layer_state(layer) != start
    now = layer_state(layer)
    layer.train(False)
    assert layer_state(layer) != now


def test_global_state_sees_switches_a_layer_reads():
    from slimrl.models.fast_lora import disable_fast_lora, enable_fast_lora

    model = lora_model()
    cpu = torch.device("cpu")
    start = global_state(cpu)
    assert enable_fast_lora(model) > 0
    switched = global_state(cpu)
    assert switched != start  # the fused forwards: other kernels
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert global_state(cpu) != switched
    torch.use_deterministic_algorithms(True)
    try:
        assert global_state(cpu) != switched
    finally:
        torch.use_deterministic_algorithms(False)
    assert disable_fast_lora(model) > 0 and global_state(cpu) != switched


def test_a_key_is_captured_the_second_time_and_counts_stay_bounded():
    graphs = layer_graphs.LayerGraphs()
    key = ("forward", "shape", 1, "state", "switches", ())
    assert graphs._entry(key) is None and graphs._entry(key) == "capture"  # eager once, then captured
    graphs.entries[("forward", "shape", 2, "state", "switches", ())] = "eager"  # a capture that failed stays eager
    assert graphs._entry(("forward", "shape", 2, "state", "switches", ())) is None
    # keys seen once pile up as the shapes change; past KEPT_COUNTS per layer they start again, the rest kept
    for number in range(layer_graphs.KEPT_COUNTS * 2 + 2):
        graphs._entry(("forward", ("shape", number), 1, "state", "switches", ()))
    assert len(graphs.entries) <= layer_graphs.KEPT_COUNTS * len(graphs.layers) + 2
    assert graphs.entries[("forward", "shape", 2, "state", "switches", ())] == "eager"
    assert graphs.idle == layer_graphs.KEPT_COUNTS * 2 + 5  # every pass so far ran eagerly
    assert graphs._entry(None) is None and graphs.idle == layer_graphs.KEPT_COUNTS * 2 + 6  # no key: eager


def test_on_a_cpu_the_setting_changes_nothing():
    model = lora_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = enable_offloaded_checkpointing(model, cuda_graphs=True)
    assert state.cuda_graphs and copy.deepcopy(state).cuda_graphs
    ids = torch.randint(3, 100, (2, 10))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert state.graphs is None and state.split_recomputes == 2
    enable_offloaded_checkpointing(model, cuda_graphs=False)
    assert not offload_state(model).cuda_graphs


# -- CUDA ---------------------------------------------------------------------------------------------------------


def cuda_pair(arch: str, dtype: torch.dtype, attention_tokens: int = 0):
    """The same LoRA model twice on CUDA, fast LoRA and offloaded checkpoints on (the attention kept from sequences
    of `attention_tokens`, 0: never), graphs on in the second."""
    from slimrl.models.fast_lora import enable_fast_lora

    base = lora_model(arch).to("cuda", dtype)
    models = [base, copy.deepcopy(base)]
    for graphs, model in zip((False, True), models, strict=True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        enable_fast_lora(model)
        enable_offloaded_checkpointing(model, mlp_tile_tokens=7, min_offload_bytes=0, cuda_graphs=graphs,
                                       attention_tokens=attention_tokens)  # fmt: skip
        model.train()
    return models


def step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal_steps(eager, graphed, label):
    assert eager[1].keys() == graphed[1].keys() and eager[1]
    assert torch.equal(eager[0], graphed[0]), f"{label}: loss {eager[0].item()} != {graphed[0].item()}"
    for name, grad in eager[1].items():
        difference = (graphed[1][name].float() - grad.float()).abs().max().item()
        assert torch.equal(graphed[1][name], grad), f"{label}: grad of {name} differs by up to {difference}"


@pytest.mark.cuda
@pytest.mark.parametrize("kept", [0, 1], ids=["recomputed", "kept"])
@pytest.mark.parametrize(("arch", "dtype"), [("qwen2", torch.bfloat16), ("llama", torch.float32)])
def test_graphed_training_equals_eager_step_for_step(arch, dtype, kept):
    eager, graphed = cuda_pair(arch, dtype, attention_tokens=kept)
    state = offload_state(graphed)
    layers = len(decoder_layers(graphed))
    generator = torch.Generator().manual_seed(0)

    def batch(rows, length, pad=0):
        ids = torch.randint(3, 100, (rows, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, :pad] = 0
        return ids.cuda(), mask.cuda()

    # two keys (no mask, and a padding mask) alternating: each eager, then captured, then replayed; SGD in place
    # between steps
    for number in range(6):
        ids, mask = batch(2, 12, pad=3 if number % 2 else 0)
        results = [step(model, ids, mask) for model in (eager, graphed)]
        assert_equal_steps(*results, f"step {number}")
        for model, (_, grads) in zip((eager, graphed), results, strict=True):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in grads:
                        param.sub_(0.5 * grads[name])
    # per key and layer: a forward and a backward captured (steps 2 and 3: run eagerly, then captured), replayed in
    # steps 4 and 5
    assert state.graphs.captures == 2 * 2 * layers and state.graphs.failures == 0
    assert state.graphs.replays == 2 * 2 * layers
    assert state.split_recomputes == 6 * layers  # counted once per pass, as without graphs
    assert state.kept_attention == offload_state(eager).kept_attention == 6 * layers * kept

    ids, mask = batch(2, 12)
    with torch.no_grad():  # a reference pass: the adapters off, its own key
        for _ in range(3):
            outputs = []
            for model in (eager, graphed):
                with model.disable_adapter():
                    outputs.append(model(input_ids=ids, attention_mask=mask).logits)
            assert torch.equal(*outputs)
    for model in (eager, graphed):  # a changed scale: new keys, eager until seen again
        for module in model.modules():
            if hasattr(module, "lora_A"):  # peft's LoRA layers (an attention module's `scaling` is its softmax's)
                module.scaling["default"] = 0.75
    for number in range(3):
        assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], f"rescaled step {number}")
    ids, mask = batch(3, 20, pad=5)  # a new shape
    replays = state.graphs.replays
    for number in range(3):
        assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], f"new shape step {number}")
    assert state.graphs.failures == 0 and len(state.graphs.shapes) <= state.graphs.max_shapes
    assert state.graphs.replays == replays + 2 * layers  # its third step replayed
    # the graphs out of use after the reference passes and the rescale were let go, and their buffers with them
    assert state.graphs.releases >= 1
    for number in range(2):  # eager passes only (a shape seen once each time): the graphs and buffers go
        ids, mask = batch(2, 30 + number)
        assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], f"other shape {number}")
    graphs = [v for v in state.graphs.entries.values() if isinstance(v, layer_graphs.Graph)]
    assert not state.graphs.shapes and not graphs


@pytest.mark.cuda
def test_a_backward_meeting_a_replayed_forwards_record_recomputes_and_asks_for_a_recorded_forward():
    eager, graphed = cuda_pair("qwen2", torch.bfloat16, attention_tokens=1)
    state = offload_state(graphed)
    layers = len(decoder_layers(graphed))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    for number in range(3):  # captured in the second step, replayed in the third
        assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], f"step {number}")
    assert state.graphs.replays == 2 * layers and state.graphs.failures == 0
    for key in list(state.graphs.entries):  # the backward passes eager from now on: their forwards still replay
        if key[0] == "backward":
            state.graphs.entries[key] = "eager"
    replays = state.graphs.replays
    # every forward replayed, and its backward recomputed the attention (the record holds no stored graph) and asked
    # for a recorded forward
    assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], "eager backward")
    assert state.graphs.replays == replays + layers and len(state.graphs.unrecorded) == layers
    # the forwards ran eagerly, recording: their backward passes took the stored attention
    kept = state.kept_attention
    assert_equal_steps(*[step(model, ids, mask) for model in (eager, graphed)], "recorded forward")
    assert state.graphs.replays == replays + layers and not state.graphs.unrecorded
    assert state.kept_attention == kept + layers and state.graphs.failures == 0


@pytest.mark.cuda
def test_passes_over_the_token_bound_stay_eager(monkeypatch):
    monkeypatch.setattr(layer_graphs, "MAX_TOKENS", 23)  # 2 x 12 tokens a pass: over it
    eager, graphed = cuda_pair("qwen2", torch.bfloat16, attention_tokens=1)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
    for number in range(3):
        assert_equal_steps(*[step(model, ids, torch.ones_like(ids)) for model in (eager, graphed)], f"step {number}")
    graphs = offload_state(graphed).graphs
    assert graphs is None or (graphs.captures == 0 and graphs.replays == 0)
