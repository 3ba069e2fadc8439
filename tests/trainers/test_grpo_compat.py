"""TRL's public GRPO surface through slimrl's trainer: every field TRL 1.16's GRPOConfig declares is set to a value
other than its default in some run below (or has a written reason why not, itself tested), and every argument of
GRPOTrainer.__init__ is passed; each run trains two steps with slimrl's trainer and with unpatched TRL on the same
inputs and seed, and the logged metrics must agree. A field TRL adds later fails `test_every_field_is_covered`."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import transformers
import trl
from datasets import Dataset

from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from tests.trainers.grpo_harness import build_trainer, lora_tiny_model
from tests.trainers.test_grpo_train_parity import NOT_COMPARED

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in str(text)) / 4 for text in completions]


def length_reward(completions, **kwargs):
    return [-abs(len(str(text)) - 6) / 6 for text in completions]


def conversational(n: int = 16) -> Dataset:
    return tiny_prompt_dataset(n, conversational=True)


# Each run: non-default GRPOConfig values, and what else it needs (a model path, an eval set, two reward functions).
RUNS: dict[str, dict] = {
    "sampling": dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                     generation_kwargs={"sequence_bias": {(3,): 4.0}}),
    "batches": dict(generation_batch_size=16, shuffle_dataset=False, pad_to_multiple_of=8, num_iterations=2),
    "steps_per_generation": dict(steps_per_generation=2, cache_implementation="static"),
    "clipping": dict(loss_type="grpo", epsilon=0.3, epsilon_high=0.28, delta=1.5, importance_sampling_level="sequence",
                     beta=0.04, use_bias_correction_kl=False),
    "sapo": dict(loss_type="sapo", sapo_temperature_neg=1.2, sapo_temperature_pos=0.9),
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    "rewards": dict(reward_weights=[0.5, 2.0], multi_objective_aggregation="normalize_then_sum", scale_rewards="batch"),
    "masks": dict(mask_truncated_completions=True, top_entropy_quantile=0.5, off_policy_mask_threshold=0.5),
    "entropy": dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_min=0.001, entropy_coef_max=0.5,
                    entropy_coef_delta=0.01, entropy_target=0.5),
    "logging": dict(log_completions=True, num_completions_to_print=2, log_unique_prompts=True, log_multimodal=False),
    "model_from_a_path": dict(disable_dropout=True, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "float32"},
                              trust_remote_code=True, beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.5,
                              ref_model_sync_steps=1),
    # a mixture-of-experts model: the load-balancing loss runs through TRL's one-piece loss (slimrl says so)
    "mixture_of_experts": dict(router_aux_loss_coef=0.01),
    "evaluation": dict(num_generations_eval=2, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4),
    "chat": dict(chat_template_kwargs={"greeting": "hello"}),
    # vLLM, DeepSpeed and importance-sampling settings only act with use_vllm / DeepSpeed: TRL accepts and ignores
    # them otherwise, and so must slimrl
    "inert_without_vllm": dict(vllm_mode="server", vllm_model_impl="transformers", vllm_enable_sleep_mode=True,
                               vllm_structured_outputs_regex=r"\d+", vllm_server_base_url="http://127.0.0.1:9",
                               vllm_server_host="127.0.0.1", vllm_server_port=9, vllm_server_timeout=1.0,
                               vllm_group_port=9, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=64,
                               vllm_tensor_parallel_size=2, vllm_importance_sampling_correction=False,
                               vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                               vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_cap=4.0,
                               ds3_gather_for_generation=False),
    # a cache of 16 pages (the default sizes it from the machine's memory: 90 of the run's 110 s filling it on CPU)
    "continuous_batching": dict(use_transformers_continuous_batching=True,
                                transformers_continuous_batching_config={"max_batch_tokens": 256, "num_blocks": 16}),
}  # fmt: skip

# Fields no run sets to another value, and why; each reason is checked by a test below.
REASONS = {
    "use_vllm": "vLLM is not installed here (a GPU-only optional dependency): both trainers raise the same ImportError",
    "log_completions_hub_repo": "pushes completions to the Hugging Face Hub, which this machine cannot reach; both "
    "configs accept the value",
    "use_transformers_paged": "deprecated alias of use_transformers_continuous_batching in TRL 1.16: both configs "
    "map it the same way",
    "max_tool_calling_iterations": "acts only with tools: tests/trainers/test_grpo_agents.py runs tools on both "
    "backends; here both configs accept the value",
    "num_generations": "every run uses 4 (the default is 8)",
    "max_completion_length": "every run uses 6 (the default is 512)",
}


def tiny_moe():
    """A 2-layer Qwen2-MoE (4 experts, 2 per token) that returns its router logits."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    base = tiny_model("qwen2").config.to_dict()
    shape = {k: base[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "max_position_embeddings", "pad_token_id", "eos_token_id")}
    config = Qwen2MoeConfig(**shape, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                            shared_expert_intermediate_size=32, num_experts_per_tok=2, output_router_logits=True,
                            router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def run_settings(name: str) -> tuple[dict, dict]:
    """(config, build_trainer keywords) for one run."""
    config = dict(RUNS[name])
    kwargs: dict = {"reward_funcs": digit_reward}
    if name == "rewards":
        kwargs["reward_funcs"] = [digit_reward, length_reward]
    if name == "chat":
        kwargs["dataset"] = conversational()
    return config, kwargs


def train_logs(kind: str, name: str, tmp_path) -> list[dict]:
    config, kwargs = run_settings(name)
    if name in ("model_from_a_path", "mixture_of_experts"):
        path = tmp_path / name
        if not path.exists():
            (tiny_moe() if name == "mixture_of_experts" else tiny_model("qwen2")).save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
        kwargs["model"] = str(path)
    trainer_kwargs = {}
    if name == "evaluation":
        trainer_kwargs["eval_dataset"] = tiny_prompt_dataset(4)
    trainer = build_trainer(kind, max_steps=2, logging_steps=1, learning_rate=5e-3, seed=7, max_completion_length=6,
                            per_device_train_batch_size=8, output_dir=str(tmp_path / kind),
                            trainer_kwargs=trainer_kwargs, **kwargs, **config)  # fmt: skip
    trainer.train()
    return trainer.state.log_history


def assert_same_logs(reference: list[dict], ours: list[dict]) -> None:
    assert len(ours) == len(reference)
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        missing = set(expected) - NOT_COMPARED - set(actual)
        assert not missing, f"entry {step}: slimrl did not log {missing}"
        for key, value in expected.items():
            if key in NOT_COMPARED or key.endswith(("_runtime", "_per_second")) or not isinstance(value, float):
                continue
            assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), f"entry {step}: {key}"


def trl_own_fields() -> list[str]:
    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return [f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in inherited]


def test_every_field_is_covered():
    covered = {field for config in RUNS.values() for field in config} | set(REASONS)
    uncovered = [name for name in trl_own_fields() if name not in covered]
    assert not uncovered, f"GRPOConfig fields no run sets and no reason covers: {uncovered}"
    defaults = trl.GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False)
    for name, config in RUNS.items():
        for field, value in config.items():
            if field in {f.name for f in dataclasses.fields(trl.GRPOConfig)}:
                assert getattr(defaults, field) != value, f"run {name} sets {field} to its default"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_run_logs_what_trl_logs(name, tmp_path):
    reference = train_logs("trl", name, tmp_path)
    ours = train_logs("slimrl", name, tmp_path)
    assert_same_logs(reference, ours)
    assert any("loss" in entry for entry in ours)


def test_fields_that_need_what_this_machine_lacks_behave_as_in_trl():
    """use_vllm: the same error as TRL; the other reasons' fields: accepted by both configs with the same value."""
    settings = dict(output_dir="/tmp/slimrl-compat", use_cpu=True, bf16=False, report_to="none")
    import slimrl

    errors = []
    for config_cls, trainer_cls in ((trl.GRPOConfig, trl.GRPOTrainer), (slimrl.GRPOConfig, slimrl.GRPOTrainer)):
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the same exception as TRL's is the point
            trainer_cls(model=lora_tiny_model(), reward_funcs=digit_reward, train_dataset=tiny_prompt_dataset(),
                        args=config_cls(**settings, use_vllm=True), processing_class=tiny_tokenizer())  # fmt: skip
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
    values = dict(log_completions_hub_repo="user/completions", max_tool_calling_iterations=3)
    for config_cls in (trl.GRPOConfig, slimrl.GRPOConfig):
        for field, value in values.items():
            assert getattr(config_cls(**settings, log_completions=True, **{field: value}), field) == value
        with pytest.raises(ValueError, match="log_completions_hub_repo is set, but log_completions is False"):
            config_cls(**settings, log_completions_hub_repo="user/completions")
    for config_cls in (trl.GRPOConfig, slimrl.GRPOConfig):
        with pytest.warns(FutureWarning, match="use_transformers_paged"):
            mapped = config_cls(**settings, use_transformers_paged=True)
        assert mapped.use_transformers_continuous_batching


# -- GRPOTrainer.__init__: every argument -----------------------------------------------------------------------------


def init_arguments() -> list[str]:
    import inspect

    return [p for p in inspect.signature(trl.GRPOTrainer.__init__).parameters if p != "self"]


def test_constructor_has_trls_signature():
    import inspect

    import slimrl

    ours = inspect.signature(slimrl.GRPOTrainer.__init__).parameters
    theirs = inspect.signature(trl.GRPOTrainer.__init__).parameters
    assert list(ours)[:5] == list(theirs)[:5], "the positional order of TRL's first arguments"
    assert ours["reward_funcs"].default is None and ours["args"].default is None


def test_args_none_builds_slimrls_config_named_as_trl_names_it():
    from trl.trainer.utils import get_config_model_id

    import slimrl

    model = lora_tiny_model()
    trainer = slimrl.GRPOTrainer(model=model, reward_funcs=digit_reward, train_dataset=tiny_prompt_dataset(),
                                 processing_class=tiny_tokenizer())  # fmt: skip
    assert isinstance(trainer.args, slimrl.GRPOConfig)
    assert trainer.args.output_dir.endswith(f"{get_config_model_id(model.config).split('/')[-1]}-GRPO")
    if not torch.cuda.is_available():  # TRL's default config asks for bf16, which a CPU lacks; slimrl's falls back
        assert trainer.args.bf16 is False
        with pytest.raises(ValueError, match="doesn't support bf16"):
            trl.GRPOTrainer(model=lora_tiny_model(), reward_funcs=digit_reward, train_dataset=tiny_prompt_dataset(),
                            processing_class=tiny_tokenizer())  # fmt: skip


def test_no_reward_source_raises_trls_error():
    import slimrl

    for trainer_cls in (trl.GRPOTrainer, slimrl.GRPOTrainer):
        with pytest.raises(ValueError, match="No reward source provided"):
            trainer_cls(model=lora_tiny_model(), train_dataset=tiny_prompt_dataset(), processing_class=tiny_tokenizer(),
                        args=trl.GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False))  # fmt: skip


ARGUMENT_RUNS = {
    # argument -> how a run passes it (beyond model, reward_funcs, args, train_dataset, processing_class, which
    # every run passes)
    "eval_dataset": "a dict of two eval sets",
    "reward_processing_classes": "a reward model with its own tokenizer",
    "callbacks": "a callback that counts steps",
    "optimizers": "an SGD optimizer and a constant schedule",
    "peft_config": "a LoraConfig applied by the trainer",
}
ARGUMENT_REASONS = {
    "quantization_config": "bitsandbytes quantisation of a model loaded from a path: "
    "tests/models/test_quantization.py covers slimrl's 4-bit path; TRL's own passes the config to from_pretrained "
    "untouched by slimrl",
    "tools": "tests/trainers/test_grpo_agents.py (engine and transformers backends)",
    "rollout_func": "tests/trainers/test_grpo_agents.py",
    "environment_factory": "tests/trainers/test_grpo_agents.py (one and several environments, environment rewards)",
}


def test_every_argument_is_covered():
    covered = {"model", "reward_funcs", "args", "train_dataset", "processing_class"} | set(ARGUMENT_RUNS)
    covered |= set(ARGUMENT_REASONS)
    assert [a for a in init_arguments() if a not in covered] == []


def argument_run(kind: str, argument: str, tmp_path) -> tuple[list[dict], dict]:
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, TrainerCallback

    extra: dict = {}
    observed = {"steps": 0}
    reward_funcs = digit_reward
    model = None
    if argument == "eval_dataset":
        # eval batches of 4 rows are one prompt's 4 generations: "b" is evaluated in two batches, "a" in one
        extra["eval_dataset"] = {"a": tiny_prompt_dataset(1), "b": tiny_prompt_dataset(2)}
    elif argument == "reward_processing_classes":
        config = tiny_model("llama").config
        config.num_labels = 1
        torch.manual_seed(0)
        reward_model = AutoModelForSequenceClassification.from_config(config)
        reward_funcs = [digit_reward, reward_model]
        extra["reward_processing_classes"] = [None, tiny_tokenizer()]
    elif argument == "callbacks":

        class Count(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                observed["steps"] += 1

        extra["callbacks"] = [Count()]
    elif argument == "peft_config":
        model = tiny_model("llama")
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = build_trainer(kind, model=model, reward_funcs=reward_funcs, max_steps=2, logging_steps=1, seed=7,
                            learning_rate=5e-3, max_completion_length=6, output_dir=str(tmp_path / kind),
                            eval_strategy="steps" if argument == "eval_dataset" else "no", eval_steps=1,
                            per_device_eval_batch_size=4, trainer_kwargs=extra)  # fmt: skip
    if argument == "optimizers":
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        trainer.optimizer, trainer.lr_scheduler = optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1)
    trainer.train()
    return trainer.state.log_history, observed


@pytest.mark.parametrize("argument", sorted(ARGUMENT_RUNS))
def test_argument_trains_as_in_trl(argument, tmp_path):
    reference, _ = argument_run("trl", argument, tmp_path)
    ours, observed = argument_run("slimrl", argument, tmp_path)
    assert_same_logs(reference, ours)
    if argument == "callbacks":
        assert observed["steps"] == 2
    if argument == "eval_dataset":
        assert any("eval_a_loss" in entry for entry in ours) and any("eval_b_loss" in entry for entry in ours)
    if argument == "optimizers":
        assert all(entry["learning_rate"] == 0.1 for entry in ours if "learning_rate" in entry)
