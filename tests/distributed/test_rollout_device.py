"""The rollout device on the CPU: the engine in a process of its own (gloo between the two), fed only the adapter.

A tiny Llama with LoRA trains with GRPO for a few steps at a large learning rate (so the adapter visibly moves):
- after each optimizer step, at the rollout, the engine process holds the trainer's adapter bit for bit, and each
  sync moves exactly the adapter's bytes (also logged as rollout/sync_bytes);
- with async_generation, the rollout of step k was sampled by the adapter of step k - 1 (rollout/staleness 1), its
  sampling log-probs are that stale policy's own (recomputed here from a snapshot of it), and TRL's importance
  sampling ratio exp(old - sampling), truncated at TRL's bounds, is what the loss received;
- a 4-bit (and an 8-bit) base travels packed and is loaded back pre-quantised: the engine process's model is the
  trainer's bit for bit (the same greedy completions and log-probs as an engine over the trainer's own model);
- bad settings are refused before training, naming the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerCallback

from slimrl.rollout.engine import RolloutEngine, SamplingParams
from slimrl.testing import tiny_model, tiny_tokenizer
from slimrl.trainers.rollouts.engine_rollouts import EngineRolloutMixin
from tests.distributed.preloaded_engines import use_preloaded_engine_processes
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import build_trainer


def length_reward(completions, **kwargs):
    return [-abs(len(text) - 6) / 6 for text in completions]


def adapter_of(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]


class Snapshots(TrainerCallback):
    """The adapter after each optimizer step, by global step (0: before the first)."""

    def __init__(self, trainer):
        self.trainer, self.by_step = trainer, {0: adapter_of(trainer)}

    def on_step_end(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = adapter_of(self.trainer)


@pytest.fixture
def engine_processes(monkeypatch):
    """Engine processes forked from a server that imported their modules once (preloaded_engines.py): the same
    engine, fed the same way, without a fresh interpreter's imports per test."""
    use_preloaded_engine_processes(monkeypatch)


def remote_trainer(**config):
    settings = dict(reward_funcs=length_reward, generation_device="cpu", max_steps=3, logging_steps=1,
                    max_completion_length=6, learning_rate=0.05, temperature=1.0, seed=5)  # fmt: skip
    settings.update(config)
    return build_trainer("slimrl", **settings)


@pytest.mark.usefixtures("engine_processes")
def test_the_engine_process_holds_the_trainers_adapter_and_each_sync_moves_only_the_adapter(monkeypatch):
    trainer = remote_trainer()
    held_at_rollouts = []
    original = EngineRolloutMixin._remote_rollout

    def check(self, prompt_ids):
        output = original(self, prompt_ids)
        held_at_rollouts.append(all(torch.equal(a, b) for a, b in zip(self.rollout_engine.adapter_held(),
                                                                      adapter_of(self), strict=True)))  # fmt: skip
        return output

    monkeypatch.setattr(EngineRolloutMixin, "_remote_rollout", check)
    try:
        trainer.train()
        engine = trainer.rollout_engine
        assert held_at_rollouts == [True, True, True]
        adapter_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        assert engine.sync_bytes == [adapter_bytes] * 3  # one sync per optimizer step, the adapter only
        assert engine.model_bytes > 10 * adapter_bytes  # the whole model went once, at the start
        assert engine.describe()["transport"] == "gloo"
        logged = [e["rollout/sync_bytes"] for e in trainer.state.log_history if "rollout/sync_bytes" in e]
        assert logged == [adapter_bytes] * 3
        assert [e["rollout/staleness"] for e in trainer.state.log_history if "rollout/staleness" in e] == [0, 0, 0]
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    finally:
        trainer.rollout_engine.close()
    assert not engine.process.is_alive()


@pytest.mark.usefixtures("engine_processes")
@pytest.mark.parametrize("bits", [4, 8, None])
def test_the_engine_process_rebuilds_the_trainers_model_and_a_quantised_base_travels_packed(tmp_path, bits):
    if bits is not None:
        pytest.importorskip("bitsandbytes")
    from slimrl import FastLanguageModel

    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    load = {f"load_in_{bits}bit": True} if bits else {}
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path / "tiny"), dtype=torch.float32, **load)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    trainer = remote_trainer(model=model, max_steps=2)
    try:
        trainer.train()
        engine = trainer.rollout_engine
        facts = engine.engine_facts()
        policy = trainer.model
        assert facts["quantized"] == (bits is not None)
        assert facts["state_bytes"] == sum(t.numel() * t.element_size() for t in policy.state_dict().values())
        unquantised = sum(t.numel() * t.element_size() for t in tiny_model("llama").state_dict().values())
        assert (engine.model_bytes < unquantised) == (bits is not None)  # a quantised base went packed
        engine.sync(trainer.state.global_step)  # the last optimizer step came after the last rollout
        assert all(torch.equal(a, b) for a, b in zip(engine.adapter_held(), adapter_of(trainer), strict=True))
        assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # the adapter moved
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
        greedy = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
        remote = engine.generate(prompts, greedy, max_new_tokens=6)
        policy.eval()
        local = RolloutEngine(policy).generate(prompts, greedy, max_new_tokens=6)
        assert remote.completion_ids == local.completion_ids
        for got, want in zip(remote.logprobs, local.logprobs, strict=True):
            assert_close(torch.tensor(got), torch.tensor(want), "engine_logprobs", name="remote vs local log-probs")
    finally:
        trainer.rollout_engine.close()


@pytest.mark.usefixtures("engine_processes")
def test_the_rollout_device_reproduces_a_run_from_the_trainers_seed():
    """The engine process's sampling seed is drawn from the trainer's seeded generator, so a run repeats."""
    logs = []
    for _ in range(2):
        trainer = remote_trainer(max_steps=2)
        try:
            trainer.train()
        finally:
            trainer.rollout_engine.close()
        logs.append([(e["reward"], e["loss"], e["completions/mean_length"]) for e in trainer.state.log_history
                     if "loss" in e])  # fmt: skip
    assert logs[0] == logs[1]


def expected_ratio(mode: str, old, sampling, mask, low, high):
    """TRL's importance-sampling ratio, worked out here for the two modes tested."""
    if mode == "token_truncate":
        return torch.exp(old - sampling).clamp(low, high)
    ratio = torch.exp(((old - sampling) * mask).sum(-1, keepdim=True))  # sequence_mask: one ratio per sequence
    return ratio.masked_fill((ratio > high) | (ratio < (low if low is not None else 0.0)), 0.0)


@pytest.mark.usefixtures("engine_processes")
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_async_generation_samples_from_the_previous_step_and_corrects_by_importance_sampling(monkeypatch, mode):
    trainer = remote_trainer(async_generation=True, vllm_importance_sampling_mode=mode)
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    batches = []
    original = type(trainer)._generate_and_score_completions

    def record(self, inputs):
        output = original(self, inputs)
        batches.append((self.state.global_step, {k: v.detach().clone() for k, v in output.items()
                                                 if isinstance(v, torch.Tensor)}))  # fmt: skip
        return output

    monkeypatch.setattr(type(trainer), "_generate_and_score_completions", record)
    try:
        trainer.train()
    finally:
        trainer.rollout_engine.close()
    staleness = [e["rollout/staleness"] for e in trainer.state.log_history if "rollout/staleness" in e]
    assert staleness == [0, 1, 1]  # the first step's rollout waits; later ones were sampled a step behind
    # an adapter sync as each step sends the next step's rollout ahead; the last step sends none (nothing follows it)
    synced = [e.get("rollout/sync_bytes", 0) > 0 for e in trainer.state.log_history if "loss" in e]
    assert synced == [True, True, False] and trainer.rollout_engine.pending is None
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    for step, batch in batches[1:]:
        stale, current = snapshots.by_step[step - 1], snapshots.by_step[step]
        assert any(not torch.equal(a, b) for a, b in zip(stale, current, strict=True))
        mask = batch["completion_mask"].bool()
        sampled_by_stale = policy_logps(trainer, stale, batch)
        assert_close(batch["sampling_per_token_logps"][mask], sampled_by_stale[mask], "engine_logprobs",
                     name=f"step {step}: sampling log-probs are the stale policy's")  # fmt: skip
        assert_close(batch["old_per_token_logps"][mask], policy_logps(trainer, current, batch)[mask],
                     "engine_logprobs", name=f"step {step}: old log-probs are the trained policy's")  # fmt: skip
        ratio = batch["importance_sampling_ratio"]
        expected = expected_ratio(mode, batch["old_per_token_logps"], batch["sampling_per_token_logps"], mask, low,
                                  high)  # fmt: skip
        assert ratio.shape == expected.shape
        assert_close(ratio, expected, "engine_logprobs", name=f"step {step}: importance sampling ratio")
        assert (ratio - 1).abs().max() > 1e-3  # the correction does something
    logged = [e for e in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in e]
    assert len(logged) == 3


def policy_logps(trainer, adapter: list[torch.Tensor], batch) -> torch.Tensor:
    """Per-token log-probs of the batch's completions under `adapter`, by the training forward (at the rollout's
    temperature, as TRL scores them)."""
    model = copy.deepcopy(trainer.model).eval()
    with torch.no_grad():
        for param, value in zip((p for p in model.parameters() if p.requires_grad), adapter, strict=True):
            param.copy_(value)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].size(1))
    return logps


@pytest.mark.parametrize(
    "config,message",
    [
        (dict(generation_device="cuda:7"), "does not exist"),
        (dict(generation_device="tpu"), "is not a device"),
        (dict(async_generation=True), "set generation_device"),
        (dict(generation_device="cpu", generation_backend="transformers"), "cannot be combined"),
        (dict(generation_device="cpu", async_generation=True, num_iterations=2), "num_iterations=1"),
    ],
    ids=["missing-cuda-device", "not-a-device", "async-without-device", "other-backend", "num-iterations"],
)
def test_bad_rollout_device_settings_are_refused_before_training(config, message):
    with pytest.raises(ValueError, match=message):
        build_trainer("slimrl", reward_funcs=length_reward, **config)


@pytest.mark.parametrize("config_name", ["GRPOConfig", "RLOOConfig"])
def test_with_a_rollout_device_the_trainer_counts_one_training_gpu(config_name, tmp_path):
    # one process seeing two GPUs: HF counts both (n_gpu 2) and would wrap the model in nn.DataParallel, which TRL's
    # trainers refuse; the second GPU is the engine's (seen on two H200s, issue 22)
    import slimrl

    config_class = getattr(slimrl, config_name)
    with_device = config_class(output_dir=str(tmp_path), generation_device="cpu", use_cpu=True, report_to="none")
    without = config_class(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for config in (with_device, without):
        assert config.n_gpu == 0  # the CPU: devices set up as HF does
        config._n_gpu = 2  # what HF's setup counts with two GPUs visible and no launcher
    assert with_device.n_gpu == 1 and without.n_gpu == 2


@pytest.mark.usefixtures("engine_processes")
def test_rloo_trains_with_a_rollout_device_and_refuses_stale_rollouts():
    """RLOO shares the rollout-device path; async_generation is refused there (TRL's RLOO has no importance-sampling
    correction for stale log-probs)."""
    from tests.trainers import rloo_harness

    settings = dict(reward_funcs=length_reward, generation_device="cpu", max_steps=2, logging_steps=1,
                    max_completion_length=6, learning_rate=0.05, seed=5)  # fmt: skip
    with pytest.raises(ValueError, match="importance sampling.*RLOOTrainer does not"):
        rloo_harness.build_trainer("slimrl", async_generation=True, **settings)
    trainer = rloo_harness.build_trainer("slimrl", **settings)
    try:
        trainer.train()
        engine = trainer.rollout_engine
        adapter_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        assert engine.sync_bytes == [adapter_bytes] * 2
        engine.sync(trainer.state.global_step)
        assert all(torch.equal(a, b) for a, b in zip(engine.adapter_held(), adapter_of(trainer), strict=True))
    finally:
        trainer.rollout_engine.close()


def test_an_engine_error_is_raised_in_the_trainer_and_an_engine_death_is_named():
    """Its engine process is spawned as the trainer's is (a fresh interpreter); the other tests' come from the fork
    server of preloaded_engines.py."""
    from slimrl.distributed.remote_engine import RemoteRolloutEngine
    from tests.trainers.grpo_harness import lora_tiny_model

    engine = RemoteRolloutEngine(lora_tiny_model().eval(), "cpu", 64)
    greedy = SamplingParams(temperature=0.0)
    try:
        with pytest.raises(RuntimeError, match="engine raised while generating(.|\n)*outside \\[0, "):
            engine.generate([[5, 6, 10**6]], greedy, max_new_tokens=4)  # a token id past the vocabulary
        assert engine.pending is None
        assert len(engine.generate([[5, 6, 7]], greedy, max_new_tokens=4).completion_ids[0]) == 4  # still serving
        engine.process.kill()
        died = r"engine process on cpu exited \(code -9\) while receiving a rollout request"
        with pytest.raises(RuntimeError, match=died):
            engine.generate([[5, 6, 7]], greedy, max_new_tokens=4)
    finally:
        engine.close()


def test_a_model_without_an_adapter_or_with_several_training_processes_is_refused():
    from slimrl.distributed.remote_engine import check_generation_device

    with pytest.raises(ValueError, match="only the LoRA adapter.*get_peft_model"):
        build_trainer("slimrl", model=tiny_model("llama"), reward_funcs=length_reward, generation_device="cpu")
    lora = build_trainer("slimrl", reward_funcs=length_reward).model
    assert check_generation_device("cpu", lora) == torch.device("cpu")
    with pytest.raises(ValueError, match="2 training process.*rollout_device.yaml"):
        check_generation_device("cpu", lora, num_processes=2)
    with pytest.raises(ValueError, match="with sharded weights.*fsdp2.yaml"):
        check_generation_device("cpu", lora, sharded=True)


def test_tensors_go_over_nccl_only_between_two_different_gpus(monkeypatch):
    """NCCL refuses two ranks on one GPU, and the CPU has no NCCL: those stay on gloo. (The NCCL path itself needs
    two GPUs; it is exercised by the two-GPU runs of bench/scaling.py, not here.)"""
    import torch.distributed as dist

    from slimrl.distributed.transport import tensor_backend

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert tensor_backend(torch.device("cuda:0"), torch.device("cuda:1")) == "nccl"
    assert tensor_backend(torch.device("cuda:1"), torch.device("cuda", 0)) == "nccl"
    assert tensor_backend(torch.device("cuda:0"), torch.device("cuda:0")) == "gloo"
    assert tensor_backend(torch.device("cuda"), torch.device("cuda:0")) == "gloo"
    assert tensor_backend(torch.device("cpu"), torch.device("cuda:1")) == "gloo"
    assert tensor_backend(torch.device("cpu"), torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert tensor_backend(torch.device("cuda:0"), torch.device("cuda:1")) == "gloo"


def test_sharded_training_is_recognised_for_fsdp_and_zero3_only():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from slimrl.distributed.sharded import sharded_training

    def accelerator(kind, stage=None):
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
            zero_stage=stage)))  # fmt: skip

    assert sharded_training(accelerator(DistributedType.FSDP))
    assert sharded_training(accelerator(DistributedType.DEEPSPEED, 3))
    assert not sharded_training(accelerator(DistributedType.DEEPSPEED, 2))
    assert not sharded_training(accelerator(DistributedType.MULTI_GPU))
    assert not sharded_training(accelerator(DistributedType.NO))


def test_an_engine_process_that_dies_before_connecting_is_reported_at_once():
    import time
    from types import SimpleNamespace

    from slimrl.distributed.transport import ENGINE_UP, trainer_store, wait_for_engine

    store = trainer_store()
    dead = SimpleNamespace(is_alive=lambda: False, exitcode=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited \(code 1\) before it connected"):
        wait_for_engine(store, dead, poll_s=0.01)
    assert time.monotonic() - start < 5
    store.set(ENGINE_UP, "1")  # once the engine has reached the store, a process that ended since is the channel's
    wait_for_engine(store, dead)


def test_the_trainers_remote_engine_refuses_instead_of_capping_completions(monkeypatch):
    # as the in-process engine (trainers/rollouts/generation.local_engine): a prompt whose completion would be cut
    # short of max_completion_length is an error at its rollout, never a silently shorter completion
    import slimrl.distributed.remote_engine as remote

    built = {}

    class Recorder:
        def __init__(self, model, device, max_seq_len=None, **engine_options):
            built.update(device=device, **engine_options)

    monkeypatch.setattr(remote, "RemoteRolloutEngine", Recorder)
    trainer = build_trainer("slimrl", reward_funcs=length_reward, generation_device="cpu")
    assert isinstance(trainer._engine(), Recorder)
    assert built["device"] == "cpu" and built["cap_completions"] is False


def _trainer_that_vanishes(port: int) -> None:
    """A forked 'trainer': joins the channel, sends one request, and ends without "stop" (as a killed trainer does)."""
    import os

    from slimrl.distributed.transport import Channel, engine_store

    Channel(engine_store("127.0.0.1", port), rank=0).send_object({"op": "describe"})
    os._exit(0)


def test_the_engine_stops_with_one_line_when_its_trainer_vanishes(capfd):
    import multiprocessing

    from slimrl.distributed.rollout_server import next_message
    from slimrl.distributed.transport import Channel, trainer_store

    store = trainer_store()  # this process plays the engine's end; its peer is the forked trainer
    trainer = multiprocessing.get_context("fork").Process(target=_trainer_that_vanishes, args=(store.port,))
    trainer.start()
    channel = Channel(store, rank=1)
    assert next_message(channel) == {"op": "describe"}
    trainer.join(timeout=30)
    assert next_message(channel) is None  # the trainer's socket closed: no gloo traceback, the engine stops
    err = capfd.readouterr().err
    assert "the trainer process closed its connection without stopping the engine" in err
    assert "Traceback" not in err


def test_the_engine_raises_what_is_not_a_vanished_trainer():
    from types import SimpleNamespace

    from slimrl.distributed.rollout_server import next_message

    def broken():
        raise RuntimeError("unpickling failed")

    with pytest.raises(RuntimeError, match="unpickling failed"):
        next_message(SimpleNamespace(recv_object=broken))
