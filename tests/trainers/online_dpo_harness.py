"""Builds TRL's and slimrl's online DPO trainers on identical tiny models, scripted generations both see, and the
three ways to rank a pair: reward functions, a reward model, and a pairwise judge."""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig
from trl.experimental import online_dpo as trl_online_dpo

import slimrl
from slimrl.testing import EOS, tiny_config, tiny_model, tiny_prompt_dataset, tiny_tokenizer
from slimrl.trainers.online_dpo.step import rank_pairs
from tests.trainers.run_settings import CPU_RUN

PAIRS = 4  # prompts per micro-batch: 8 completions
# the completions `scripted_generation` hands out, rows i and 4 + i completing prompt i: ragged lengths, digits and
# answers for the rewards to tell apart, one completion without EOS (it runs to the longest width)
COMPLETIONS = ["3 apples 8", "9", "It is 7", "hm", "nine", "2+2=4 and 7", "", "1 2 3 4 5 6 7 8 9"]
NO_EOS_ROW = 7
# A random tiny model almost never samples EOS; this logit bias makes many sampled completions end early.
EOS_BIAS = {"sequence_bias": {(3,): 4.0}}


def answer_reward(completions, answer, **kwargs):
    """1 where the completion contains the row's answer (the dataset's extra column, repeated per completion)."""
    return [float(expected in text) for text, expected in zip(completions, answer, strict=True)]


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / 4 for text in completions]


def token_count_reward(completion_ids, **kwargs):
    return [-abs(len(ids) - 6) / 6 for ids in completion_ids]


class ConciseJudge:
    """A pairwise judge with the interface TRL's judges had (`BasePairwiseJudge.judge`; TRL 1.16 ships no judge):
    for each prompt and its two completions, the index of the preferred one. Prefers the shorter completion, the
    first on a tie."""

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        return [int(len(second) < len(first)) for first, second in completions]


def judge_reward(judge):
    """A reward function for TRL 1.16's online DPO (which takes reward functions, not judges) that ranks each pair
    by `judge`: 1 for the completion it prefers, 0 for the other. The trainer passes the generation in block layout,
    so completion i and completion B + i answer prompt i."""

    def reward(prompts, completions, **kwargs):
        pairs = len(prompts) // 2
        preferred = judge.judge(prompts[:pairs], list(zip(completions[:pairs], completions[pairs:], strict=True)))
        rewards = [0.0] * len(completions)
        for i, choice in enumerate(preferred):
            rewards[i + pairs * choice] = 1.0
        return rewards

    reward.__name__ = f"{type(judge).__name__}_reward"
    return reward


def tiny_reward_model(seed: int = 3):
    """A randomly initialised 2-layer Llama sequence classifier with one label, the same for the same seed."""
    from transformers import AutoModelForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForSequenceClassification.from_config(tiny_config(num_labels=1))


def lora_config(**overrides) -> LoraConfig:
    # init_lora_weights=False makes B non-zero: every LoRA matrix gets a gradient and the policy differs from the
    # reference (its adapter disabled) from the first step
    settings = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    settings.update(overrides)
    return LoraConfig(**settings)


def build_trainer(kind: str, reward_funcs=None, ranking: str = "functions", peft: str = "config", model=None,
                  **config):  # fmt: skip
    """kind: "trl" (unpatched TRL) or "slimrl". ranking: "functions", "reward_model" or "judge" (when reward_funcs
    is None). peft: "config" (TRL wraps the model; the reference is the policy with its adapter disabled) or
    "model" (a PeftModel is passed; TRL deep-copies it as the reference model). model: the causal LM (default
    `tiny_model()`). Extra keyword arguments go to the config (`lora_dropout` to the LoRA config)."""
    trainer_cls, config_cls = (
        (trl_online_dpo.OnlineDPOTrainer, trl_online_dpo.OnlineDPOConfig)
        if kind == "trl"
        else (slimrl.OnlineDPOTrainer, slimrl.OnlineDPOConfig)
    )
    processing_classes = None
    if reward_funcs is None:
        reward_funcs = {
            "functions": [answer_reward, digit_reward, token_count_reward],
            "reward_model": tiny_reward_model(),
            "judge": judge_reward(ConciseJudge()),
        }[ranking]
        if ranking == "reward_model":
            processing_classes = tiny_tokenizer()  # TRL would download the reward model's tokenizer otherwise
    settings = dict(
        output_dir=config.pop("output_dir", "/tmp/slimrl-test-online-dpo"),
        per_device_train_batch_size=PAIRS,
        max_new_tokens=16,
        max_length=128,
        **CPU_RUN,
    )
    lora = lora_config(lora_dropout=config.pop("lora_dropout", 0.0))
    settings.update(config)
    if kind == "trl":
        settings.pop("num_chunks", None)
    model = tiny_model() if model is None else model
    if peft == "model":
        from peft import get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = get_peft_model(model, lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            reward_funcs=reward_funcs,
            args=config_cls(**settings),
            train_dataset=tiny_prompt_dataset(),
            processing_class=tiny_tokenizer(),
            reward_processing_classes=processing_classes,
            peft_config=lora if peft == "config" else None,
        )


def prompt_batch(start: int = 0) -> dict:
    """A collated micro-batch as the trainer's dataloader gives it: PAIRS prompts and their answers."""
    rows = tiny_prompt_dataset()[start : start + PAIRS]
    return {"prompt": rows["prompt"], "answer": rows["answer"]}


def scripted_generation(trainer, completions: list[str] = COMPLETIONS, no_eos_row: int = NO_EOS_ROW):
    """A stand-in for `trainer._generate` that returns TRL's generation layout for the given prompts with these
    completions (EOS after each but `no_eos_row`, padding after EOS), so TRL and slimrl rank and score the same
    sequences."""
    tokenizer = trainer.processing_class
    eos = tokenizer.convert_tokens_to_ids(EOS)

    def generate(model, prompts, images=None):
        assert len(prompts) * 2 == len(completions), "one scripted completion per generated row"
        encoded = tokenizer(text=prompts, return_tensors="pt", padding=True, padding_side="left",
                            add_special_tokens=False)  # fmt: skip
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if i == no_eos_row else [eos])
                for i, text in enumerate(completions)]  # fmt: skip
        width = max(len(row) for row in rows)
        completion_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            completion_ids[i, : len(row)] = torch.tensor(row)
            completion_mask[i, : len(row)] = 1
        return (encoded["input_ids"].repeat(2, 1), encoded["attention_mask"].repeat(2, 1), completion_ids,
                completion_mask, None)  # fmt: skip

    return generate


def perturb_policy(trainer, seed: int = 0, scale: float = 0.05) -> None:
    """Move the trained LoRA weights off their initial values the same way in every trainer given the same seed, so a
    deep-copied reference model differs from the policy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(trainer.model.named_parameters(), key=lambda item: item[0]):
            if param.requires_grad:
                param.add_(scale * torch.randn(param.shape, generator=g))


def step(trainer, inputs: dict, seed: int = 0):
    """One `training_step` (generation, ranking, forward and backward) from a fixed RNG state: the returned loss,
    each trainable parameter's gradient, and the last value of each stat TRL logs."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer.stats = {name: [] for name in trainer.stats}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = trainer.training_step(model, {key: list(value) for key, value in inputs.items()})
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads, {name: values[-1] for name, values in trainer.stats.items() if values}


def scripted_chosen_rows(trainer, inputs: dict) -> list[int]:
    """The row of each pair's chosen completion when `trainer` ranks the scripted completions of `inputs` (TRL's
    reward code), to check that a case ranks in both directions."""
    prompts = inputs["prompt"]
    _, _, completion_ids, _, _ = scripted_generation(trainer)(trainer.model, prompts)
    completions = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    rewards = trainer._calculate_rewards_from_functions(
        prompts=prompts * 2, completions=completions, completion_ids_list=completion_ids.tolist(),
        answer=inputs["answer"] * 2,
    )  # fmt: skip
    return rank_pairs(rewards, len(prompts))[0].tolist()
