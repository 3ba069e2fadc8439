"""slimrl's XPO trainer: its chunked step against TRL's XPO step written out in one piece (TRL 1.16 has none to
run), alpha=0 giving online DPO's loss on the same pairs, the reference model's completions sampled with the adapter
off, what XPO refuses, and a short training run that improves its own objective."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

import slimrl
from slimrl.testing import EOS, tiny_model, tiny_prompt_dataset, tiny_tokenizer
from slimrl.trainers.xpo.trainer import XPOConfig, XPOTrainer, _xpo_args
from tests.trainers.online_dpo_harness import (
    PAIRS,
    answer_reward,
    build_trainer,
    digit_reward,
    lora_config,
    prompt_batch,
    scripted_generation,
    step,
    token_count_reward,
)
from tests.trainers.run_settings import CPU_RUN
from tests.trainers.step_compare import assert_same_step

ALPHA, BETA = 0.1, 0.1  # alpha large enough for the exploration term to show in the gradients
# TRL's XPO stats in its order; its score stats follow (the pairs are ranked by reward functions)
TRL_XPO_STATS = ["loss/dpo", "loss/xpo", "objective/kl", "objective/entropy", "rewards/chosen", "rewards/rejected",
                 "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
                 "val/model_contain_eos_token", "val/ref_contain_eos_token", "alpha", "beta",
                 "objective/model_scores", "objective/ref_scores", "objective/scores_margin"]  # fmt: skip


def build_xpo(model=None, scripted: bool = True, reward_funcs=None, **config) -> XPOTrainer:
    """XPO on the tiny model with a LoRA adapter (the reference is the policy with it disabled), ranked by the online
    DPO harness's reward functions; `scripted`: `_generate` hands out the harness's completions, rows 0-3 as the
    policy's samples and rows 4-7 as the reference's."""
    settings = dict(output_dir="/tmp/slimrl-test-xpo", per_device_train_batch_size=PAIRS, max_new_tokens=16,
                    max_length=128, alpha=ALPHA, beta=BETA, **CPU_RUN)  # fmt: skip
    settings.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = XPOTrainer(model=tiny_model() if model is None else model,
                             reward_funcs=reward_funcs or [answer_reward, digit_reward, token_count_reward],
                             args=XPOConfig(**settings),
                             train_dataset=tiny_prompt_dataset(), processing_class=tiny_tokenizer(),
                             peft_config=lora_config())  # fmt: skip
    if scripted:
        trainer._generate = scripted_generation(trainer)
    return trainer


def trl_xpo_step(trainer, inputs: dict):
    """TRL's XPO step as TRL wrote it, in one piece: every sequence through TRL's forward (full logits), padding
    zeroed, the pair ranked by the scores (the policy's sample wins ties), mean of DPO + alpha * log pi(y_ref), and
    TRL's stats. Returns (loss, gradients, stats) as `step` does."""
    model, pairs, prompts = trainer.model, PAIRS, inputs["prompt"]
    model.zero_grad(set_to_none=True)
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = trainer._generate(model, prompts)
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    scores = trainer._calculate_rewards_from_functions(prompts=prompts * 2, completions=texts,
                                                       completion_ids_list=completion_ids.tolist(),
                                                       answer=inputs["answer"] * 2)  # fmt: skip
    model_scores, ref_scores = scores[:pairs], scores[pairs:]
    chosen_mask = model_scores >= ref_scores
    assert 0 < chosen_mask.sum() < pairs, "the scripted pairs must be won by both sides"

    def logprobs():
        return trainer._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask) * completion_mask

    policy = logprobs()
    with torch.no_grad(), model.disable_adapter():
        reference = logprobs()
    # policy / reference model's log-probs of the policy's (model_data) and the reference's (ref_data) samples
    (pm, pr), (rm, rr) = policy.chunk(2), reference.chunk(2)
    pm_s, pr_s, rm_s, rr_s = pm.sum(1), pr.sum(1), rm.sum(1), rr.sum(1)
    chosen, chosen_ref = torch.where(chosen_mask, pm_s, pr_s), torch.where(chosen_mask, rm_s, rr_s)
    rejected, rejected_ref = torch.where(~chosen_mask, pm_s, pr_s), torch.where(~chosen_mask, rm_s, rr_s)
    dpo = -F.logsigmoid(BETA * ((chosen - chosen_ref) - (rejected - rejected_ref)))
    xpo = ALPHA * pr_s
    loss = (dpo + xpo).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    chosen_rewards, rejected_rewards = BETA * (chosen - chosen_ref).detach(), BETA * (rejected - rejected_ref).detach()
    eos = (completion_ids == trainer.processing_class.convert_tokens_to_ids(EOS)).any(1).float()
    values = [dpo.mean(), xpo.mean(), ((pm - rm).sum(1) + (pr - rr).sum(1)).mean() / 2,
              (-pm.sum(1).mean() - pr.sum(1).mean()) / 2, chosen_rewards.mean(), rejected_rewards.mean(),
              (chosen_rewards > rejected_rewards).float().mean(), (chosen_rewards - rejected_rewards).mean(),
              chosen.mean() + chosen_ref.mean(), rejected.mean() + rejected_ref.mean(), eos[:pairs].mean(),
              eos[pairs:].mean(), ALPHA, BETA, model_scores.mean(), ref_scores.mean(),
              (model_scores - ref_scores).mean()]  # fmt: skip
    stats = {name: float(value) for name, value in zip(TRL_XPO_STATS, values, strict=True)}
    return loss.detach(), grads, stats


@pytest.fixture(scope="module")
def trainer():
    return build_xpo()


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_chunked_step_matches_trls_xpo_in_one_piece(trainer, num_chunks):
    """Loss, every LoRA gradient and every TRL stat (names in TRL's order) at 1, 2 and 8 chunks (8 > 4 pairs: one
    pair per chunk), each chunk through the fused LM head, equal TRL's one-piece XPO on the same completions."""
    trainer.args.num_chunks = num_chunks
    expected = trl_xpo_step(trainer, prompt_batch())
    assert expected[2]["objective/kl"] != 0.0, "the policy equals the reference: nothing to compare"
    assert expected[2]["val/ref_contain_eos_token"] < 1.0, "one reference completion lacks EOS (its padding)"
    assert_same_step(expected, step(trainer, prompt_batch()), f"num_chunks={num_chunks}", nonzero_reference=True)


def test_a_reason_for_one_chunk_runs_the_micro_batch_as_one_chunk(trainer, monkeypatch, caplog):
    """Active dropout or DataParallel: XPO has no TRL step to fall back on, so the micro-batch runs as one chunk
    whatever num_chunks asks, with one warning naming the reason, and the same results."""
    trainer.args.num_chunks = 8
    monkeypatch.setattr(trainer, "_one_chunk_reason", lambda: "dropout is active")
    chunk_pairs, chunk_loss = [], trainer._chunk_loss

    def spy(*args):
        chunk_pairs.append(args[3].rows.numel())
        return chunk_loss(*args)

    monkeypatch.setattr(trainer, "_chunk_loss", spy)
    expected = trl_xpo_step(trainer, prompt_batch())
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        assert_same_step(expected, step(trainer, prompt_batch()), "one chunk")
    assert chunk_pairs == [PAIRS]
    assert "dropout is active (XPO runs the micro-batch as one chunk)" in caplog.text


def test_alpha_zero_is_online_dpo_on_the_same_pairs():
    """With alpha=0 XPO's loss and gradients are online DPO's for the same two completions per prompt."""
    xpo = build_xpo(alpha=0.0, num_chunks=2)
    online_dpo = build_trainer("slimrl", beta=BETA, num_chunks=2)
    online_dpo._generate = scripted_generation(online_dpo)
    for (name, ours), (_, theirs) in zip(xpo.model.named_parameters(), online_dpo.model.named_parameters(),
                                         strict=True):  # fmt: skip
        assert torch.equal(ours, theirs), f"{name}: the two trainers start from different weights"
    loss, grads, stats = step(xpo, prompt_batch())
    assert stats["loss/xpo"] == 0.0
    assert_same_step(step(online_dpo, prompt_batch())[:2] + ({},), (loss, grads, {}), "alpha=0 vs online DPO",
                     nonzero_reference=True)  # fmt: skip


def test_reference_completions_come_from_the_policy_with_its_adapter_off():
    """Greedy decoding: rows 0-3 are what the policy (adapter on) generates, rows 4-7 what the base model (adapter
    off) generates, and the two differ."""
    trainer = build_xpo(scripted=False, generation_backend="transformers", generation_kwargs={"do_sample": False},
                        max_new_tokens=6)  # fmt: skip
    prompts = prompt_batch()["prompt"]
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = trainer._generate(trainer.model, prompts)
    model, eos = trainer.model, trainer.processing_class.convert_tokens_to_ids(EOS)

    def greedy() -> list[list[int]]:
        output = model.generate(input_ids=prompt_ids[:PAIRS], attention_mask=prompt_mask[:PAIRS], do_sample=False,
                                max_new_tokens=6, eos_token_id=eos, pad_token_id=0)  # fmt: skip
        rows = output[:, prompt_ids.size(1) :].tolist()
        return [row[: row.index(eos) + 1] if eos in row else row for row in rows]

    with torch.no_grad():
        policy = greedy()
        with model.disable_adapter():
            reference = greedy()
    got = [row[mask.bool()].tolist() for row, mask in zip(completion_ids, completion_mask, strict=True)]
    assert got[:PAIRS] == policy and got[PAIRS:] == reference
    assert policy != reference, "the adapter changes nothing: the test would not tell the halves apart"


def test_engine_samples_as_transformers_generate_with_the_adapter_off():
    """Off CUDA the engine draws as transformers' generate does, for the policy and for the reference (the engine
    reads peft's adapter switch): the same seed gives the same layout and ids from both backends."""
    results = {}
    for backend in ("transformers", "engine"):
        trainer = build_xpo(scripted=False, generation_backend=backend, max_new_tokens=6, temperature=0.9)
        torch.manual_seed(5)
        results[backend] = trainer._generate(trainer.model, prompt_batch()["prompt"])[:4]
    for engine, transformers in zip(results["engine"], results["transformers"], strict=True):
        assert torch.equal(engine, transformers)


def test_what_xpo_cannot_do_fails_with_the_fix():
    model = tiny_model()
    settings = dict(output_dir="/tmp/slimrl-test-xpo", report_to="none")
    with pytest.raises(ValueError, match="use_vllm=False"):
        _xpo_args(XPOConfig(**settings, use_vllm=True), model)
    with pytest.raises(ValueError, match="choose another optimizer"):
        _xpo_args(XPOConfig(**settings, optim="lomo"), model)
    config = slimrl.OnlineDPOConfig(**settings)
    config.loss_type = "hinge"
    with pytest.raises(ValueError, match="loss_type is one of"):
        _xpo_args(config, model)
    config.loss_type = "ipo"
    assert _xpo_args(config, model).alpha == 1e-5, "an online DPO config gains TRL's default alpha"


def test_alpha_schedule_follows_the_epoch(trainer):
    trainer._alpha = [0.2, 0.05]
    try:
        for epoch, expected in ((None, 0.2), (0.5, 0.2), (1.25, 0.05), (7.0, 0.05)):
            trainer.state.epoch = epoch
            assert trainer.alpha == expected, f"epoch {epoch}"
    finally:
        trainer._alpha, trainer.state.epoch = ALPHA, None


def test_training_raises_the_reward_margin_of_its_pairs():
    """A few optimizer steps with a toy reward (digits in the completion) on the scripted completions, so every step
    ranks the same pairs: the loss falls and the implicit reward margin of chosen over rejected rises (0.09 to 0.29
    in 5 steps here)."""
    trainer = build_xpo(reward_funcs=[digit_reward], alpha=1e-3, max_steps=5, logging_steps=1, learning_rate=2e-2,
                        num_chunks=2)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
    margins, losses = [entry["rewards/margins"] for entry in logs], [entry["loss"] for entry in logs]
    assert len(logs) == 5 and all(entry["alpha"] == 1e-3 for entry in logs)
    assert margins[-1] > margins[0] + 0.1 and margins[-1] == max(margins), f"margins {margins}"
    assert losses[-1] < losses[0], f"loss {losses}"
