"""slimrl's PPOTrainer on tiny models: TRL 0.x's metrics, finite; resume == straight; the chunked step and gradient
accumulation change nothing but the summation order; early stop on target_kl; the value model variants; settings
that cannot work are refused with the fix in the message."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback

from slimrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer
from slimrl.trainers.ppo import value_model as vm
from slimrl.trainers.ppo.trainer import PPOConfig, PPOTrainer
from slimrl.trainers.ppo.value_model import VALUE_HEAD_FILE, PolicyAndValue
from tests.tolerances import assert_close

TRL_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
               "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var",
               "val/num_eos_tokens", "lr", "episode")  # fmt: skip
NOT_COMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: the tiny models' ops last microseconds, so a second thread only adds waiting for each other
    (a lot of it on a busy machine: these tests ran 2-5x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 for text in completions]


def answer_reward(completions, answer, **kwargs):  # reads a dataset column, as GRPO's reward functions do
    return [float(a in text) for text, a in zip(completions, answer, strict=True)]


def lora_policy(seed: int = 1):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # init_lora_weights=False: B is not zero, so the policy differs from its reference from the start
        return get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                       init_lora_weights=False))  # fmt: skip


def build(model=None, output_dir="/tmp/slimrl-test-ppo", trainer_kwargs=None, reward_funcs=None, dataset=None,
          **config) -> PPOTrainer:  # fmt: skip
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    num_mini_batches=2, num_ppo_epochs=2, response_length=6, max_steps=4, logging_steps=1,
                    learning_rate=5e-3, kl_coef=0.1, seed=3, report_to="none", save_strategy="no", use_cpu=True,
                    disable_tqdm=True, num_chunks=1)  # fmt: skip
    settings.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PPOTrainer(model or lora_policy(), reward_funcs or [digit_reward, answer_reward], PPOConfig(**settings),
                          dataset or tiny_prompt_dataset(16), tiny_tokenizer(), **(trainer_kwargs or {}))  # fmt: skip


class WeightSnapshots(TrainerCallback):
    """The trainable weights after every optimizer step."""

    def __init__(self):
        self.taken: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.taken.append(torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad]).clone())


def step_logs(trainer: PPOTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def trainable(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_few_steps_log_trl_ppo_metrics_with_finite_values():
    trainer = build()
    before = trainable(trainer)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 4
    for entry in logs:
        assert set(TRL_METRICS) <= set(entry), f"missing {set(TRL_METRICS) - set(entry)}"
        assert all(math.isfinite(entry[name]) for name in TRL_METRICS), entry
    # one rollout of 4 x 2 mini-batches = 8 prompts, trained on for 2 epochs x 2 mini-batches = 4 steps
    assert [entry["episode"] for entry in logs] == [8, 8, 8, 8]
    # the first step of a rollout scores it with the very forward that trains: ratio exactly 1, approximate KL 0
    assert_close(logs[0]["val/ratio"], 1.0, "fp32", name="first ratio")
    assert logs[0]["policy/approxkl_avg"] < 1e-10
    # the adapter (init_lora_weights=False) moves the policy off the reference: a KL to penalise
    assert logs[0]["objective/kl"] != 0.0 and logs[0]["objective/non_score_reward"] != 0.0
    after = trainable(trainer)
    assert any("value_head" in name for name in after)
    assert all(not torch.equal(before[name], after[name]) for name in after), "every trainable tensor learns"


def test_checkpoint_and_resume_log_the_same_values_as_a_straight_run(tmp_path):
    # one rollout spans 4 steps (2 epochs x 2 mini-batches): the checkpoint at step 2 falls inside it, so the
    # resumed run must get the rollout buffer back rather than generate a new one
    straight = build(output_dir=tmp_path / "straight", max_steps=6, save_strategy="steps", save_steps=2)
    straight.train()
    resumed = build(output_dir=tmp_path / "resumed", max_steps=6, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    # the resumed run's history starts with the checkpoint's two entries
    expected, actual = step_logs(straight)[2:], step_logs(resumed)[2:]
    assert len(actual) == len(expected) == 4
    for want, got in zip(expected, actual, strict=True):
        for name, value in want.items():
            if name not in NOT_COMPARED:
                assert_close(got[name], value, "fp32", name=f"step {want['step']} {name}")
    for name, tensor in trainable(straight).items():
        assert_close(trainable(resumed)[name], tensor, "fp32", name=name)


def test_gradient_accumulation_and_chunks_change_only_the_summation_order():
    # the same mini-batch of 8 sequences as one micro-batch in one piece, or as 2 micro-batches of 2 chunks each:
    # every chunk divides by the whole mini-batch's token count, so the gradient (and so the curve) is the same
    whole = build(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_mini_batches=1, max_steps=3)
    whole.train()
    split = build(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1, max_steps=3,
                  num_chunks=2)  # fmt: skip
    split.train()
    for want, got in zip(step_logs(whole), step_logs(split), strict=True):
        for name in ("loss", "grad_norm", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "val/ratio"):
            assert_close(got[name], want[name], "fp32_sum", name=f"step {want['step']} {name}")


def test_target_kl_drops_the_step_past_it_and_skips_the_rest_of_the_rollout(monkeypatch):
    forwards, snapshots = [], WeightSnapshots()
    original = PPOTrainer.compute_loss

    def counting(self, model, inputs, *args, **kwargs):
        forwards.append(self.state.global_step)
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, "compute_loss", counting)
    # a large learning rate moves the policy past an approximate KL of 1e-9 in its first step
    trainer = build(target_kl=1e-9, learning_rate=0.05, max_steps=8, trainer_kwargs={"callbacks": [snapshots]})
    trainer.train()
    weights = snapshots.taken
    # the KL is measured in a step's forward: 0 in a rollout's first step (the policy that sampled it), past the
    # target in the second, whose update is then dropped; the rollout's last 2 steps run no forward at all
    assert forwards == [0, 1, 4, 5]
    moved = [not torch.equal(after, before) for before, after in zip(weights[:-1], weights[1:], strict=True)]
    assert moved == [False, False, False, True, False, False, False]  # only the second rollout's first step
    logs = step_logs(trainer)
    assert [entry["episode"] for entry in logs] == [8] * 4 + [16] * 4
    assert [entry["step"] for entry in logs if "loss/policy_avg" in entry] == [1, 2, 5, 6]
    assert all(math.isfinite(entry["objective/scores"]) for entry in logs)  # rollout metrics on every step


def test_a_nan_loss_is_caught_before_the_optimizer_step(monkeypatch):
    from slimrl.ops.finite import NonFiniteError

    original = PPOTrainer._chunk_loss

    def poisoned(self, model, inputs, plan, chunk):  # the second step's loss is NaN
        loss, stats = original(self, model, inputs, plan, chunk)
        return (loss * math.nan if self.state.global_step == 1 else loss), stats

    monkeypatch.setattr(PPOTrainer, "_chunk_loss", poisoned)
    snapshots = WeightSnapshots()
    trainer = build(max_steps=3, trainer_kwargs={"callbacks": [snapshots]})
    with pytest.raises(NonFiniteError, match="Optimizer step 2"):
        trainer.train()
    # raised before the optimizer wrote anything: the weights are those after step 1
    assert len(snapshots.taken) == 1
    now = torch.cat([p.flatten() for p in trainable(trainer).values()])
    assert torch.equal(now, snapshots.taken[0])
    skipping = build(max_steps=3, on_nonfinite="skip")
    skipping.train()
    assert [entry["nonfinite_skipped"] for entry in step_logs(skipping)] == [0.0, 1.0, 0.0]


def test_a_separate_value_model_trains_and_round_trips_through_save(tmp_path):
    from transformers import LlamaForSequenceClassification

    from slimrl.testing import tiny_config

    value_model = LlamaForSequenceClassification(tiny_config(num_labels=1))
    trainer = build(trainer_kwargs={"value_model": value_model}, max_steps=2, output_dir=tmp_path)
    assert trainer.model.value_head is None  # the classifier's own `score` head gives the values
    before = value_model.score.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, value_model.score.weight)
    trainer.save_model(str(tmp_path / "saved"))
    fresh = PolicyAndValue(lora_policy(), LlamaForSequenceClassification(tiny_config(num_labels=1)))
    fresh.load(str(tmp_path / "saved"))
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    # a causal LM as the value model gets a value head of its own on its final hidden states, zero at first
    with_lm = PolicyAndValue(lora_policy(), tiny_model(seed=2))
    logps, _, values = with_lm(torch.tensor([[4, 5, 6, 7]]), torch.ones(1, 4, dtype=torch.long), 2, 1.0)
    assert with_lm.value_head is not None and logps.shape == values.shape == (1, 2)
    assert values.abs().sum() == 0


def test_save_model_writes_the_adapter_and_the_value_head(tmp_path):
    trainer = build(max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / VALUE_HEAD_FILE).is_file()
    fresh = PolicyAndValue(lora_policy(seed=5))
    fresh.load(str(tmp_path))
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    trainer.model.eval()
    with torch.no_grad():
        for want, got in zip(trainer.model(ids, mask, 3, 0.7), fresh(ids, mask, 3, 0.7), strict=True):
            assert want is None and got is None or torch.equal(want, got)


def test_a_full_model_with_a_kl_penalty_gets_a_frozen_reference_copy():
    trainer = build(model=tiny_model(), max_steps=2, learning_rate=1e-3)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    reference = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert all(torch.equal(p, reference[n]) for n, p in trainer.ref_model.named_parameters())
    assert build(model=tiny_model(), kl_coef=0.0).ref_model is None  # no penalty, no copy


def test_reward_models_and_conversational_prompts():
    from transformers import LlamaForSequenceClassification

    from slimrl.rewards import completion_text
    from slimrl.testing import tiny_config

    seen = {}

    def message_reward(prompts, completions, answer, **kwargs):
        seen.update(prompt=prompts[0], completion=completions[0], answer=answer[0])
        return [float(len(completion_text(c)) > 2) for c in completions]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        judge = LlamaForSequenceClassification(tiny_config(num_labels=1)).eval()
    trainer = build(reward_funcs=[judge, message_reward], reward_weights=[0.5, 2.0],
                    dataset=tiny_prompt_dataset(16, conversational=True))  # fmt: skip
    rows = [trainer.train_dataset[i] for i in range(3)]
    prompts = [row["prompt"] for row in rows]
    completion_ids = [[52, 53, 3], [54, 3], [55, 56, 57]]
    scores, means = trainer._scores(rows, prompts, completion_ids)
    # a conversational dataset gets assistant messages, the dataset's other columns by name
    assert seen["completion"][0]["role"] == "assistant" and seen["prompt"] == prompts[0] and seen["answer"] == "3"
    # the reward model scores the whole conversation, rendered by the chat template, as its own tokenizer reads it
    tokenizer = tiny_tokenizer()
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    chats = [tokenizer.apply_chat_template(p + [{"role": "assistant", "content": t}], tokenize=False)
             for p, t in zip(prompts, texts, strict=True)]  # fmt: skip
    with torch.no_grad():
        judged = torch.stack([judge(**tokenizer(text, return_tensors="pt")).logits[0, 0] for text in chats])
    lengths = torch.tensor([float(len(t) > 2) for t in texts])
    assert_close(scores, 0.5 * judged + 2.0 * lengths, "fp32_sum", name="weighted scores")
    assert set(means) == {"rewards/LlamaForSequenceClassification", "rewards/message_reward"}


def test_chunked_lm_head_log_probs_equal_the_plain_reference():
    # the training forward's log-probs and entropies (vocabulary tiles, no [b, t, V] logits) against the plain
    # formula on the full logits, at a temperature, for left-padded rows
    from slimrl.trainers.ppo import losses as pm
    from slimrl.trainers.ppo.value_model import completion_states, policy_logprobs

    policy = lora_policy()
    ids = torch.tensor([[0, 0, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    logps, entropies, _ = policy_logprobs(policy, ids, mask, 3, 0.7, with_entropy=True)
    with torch.no_grad():
        logits = policy.get_output_embeddings()(completion_states(policy, ids, mask, 3)).float() / 0.7
    assert_close(logps, pm.selected_logprobs(logits, ids[:, -3:]), "fp32_sum", name="log-probs")
    assert_close(entropies, pm.entropy_from_logits(logits), "fp32_sum", name="entropies")
    # left padding does not shift the positions: the padded row scores as the same tokens without the padding
    alone, _, _ = policy_logprobs(policy, ids[:1, 2:], mask[:1, 2:], 3, 0.7)
    assert_close(alone, logps[:1], "fp32_sum", name="unpadded row")


def test_engine_backend_samples_what_transformers_generate_samples_on_cpu():
    # the engine's "multinomial" sampler draws as generate(do_sample=True) does: same seed, same rollout
    rollouts = {}
    for backend in ("engine", "transformers"):
        trainer = build(generation_backend=backend)
        assert trainer.generation_backend == backend
        torch.manual_seed(0)
        rollouts[backend] = trainer._generate([[4, 5, 6], [7, 8, 9, 10]])
    assert rollouts["engine"] == rollouts["transformers"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"generation_backend": "vllm"}, "generation_backend must be one of"),
        ({"num_ppo_epochs": 0}, "num_ppo_epochs must be at least 1"),
        ({"kl_estimator": "k2"}, "kl_estimator must be one of"),
        ({"cliprange": 0.0}, "cliprange must be > 0"),
        ({"lam": 1.5}, "lam must be in"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"target_kl": 0.0}, "target_kl must be > 0"),
        ({"eval_strategy": "steps"}, "eval_strategy='no'"),
    ],
)
def test_settings_that_cannot_work_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", **changes)


def test_a_dataset_smaller_than_one_rollout_is_refused():
    with pytest.raises(ValueError, match="fewer than one rollout's 32"):
        build(per_device_train_batch_size=16)  # 16 x 1 x 2 mini-batches = 32 prompts > 16 in the dataset


def test_rollout_arithmetic_and_total_episodes():
    config = PPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=3)  # fmt: skip
    assert (config.rollout_batch_size, config.steps_per_rollout) == (16, 6)
    trainer = build(total_episodes=20)  # rollouts of 8: 3 rollouts of 4 steps
    assert trainer.args.max_steps == 12


def test_without_a_kl_penalty_no_reference_forward_runs_and_no_kl_is_logged(monkeypatch):
    calls = []
    reference = vm.PolicyAndValue.reference

    def counted(self):
        calls.append(1)
        return reference(self)

    monkeypatch.setattr(vm.PolicyAndValue, "reference", counted)
    trainer = build(kl_coef=0.0, max_steps=2)
    trainer.train()
    assert calls == [] and all("objective/kl" not in entry for entry in step_logs(trainer))
    assert all(entry["objective/non_score_reward"] == 0.0 for entry in step_logs(trainer))
    build(kl_coef=0.1, max_steps=1).train()  # with the penalty, the adapter is disabled for the reference
    assert calls, "the reference pass disables the adapter"
