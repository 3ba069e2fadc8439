"""The demo's parts: settings checks, greedy evaluation, the per-step line, the plot; distillation's teacher and a
tiny distillation run."""

import json
import os

import pytest
import torch

from slimrl.cli import main
from slimrl.cli.demo import DemoSettings, evaluate, nonfinite_skipped_steps, resolve_device, set_cpu_threads, write_json
from slimrl.cli.demo_algorithms import correct_replies, distillation_teacher
from slimrl.cli.demo_report import accuracy_line, demo_logs, moving_average, plot_history, step_line
from slimrl.data import arithmetic_dataset
from slimrl.rewards import exact_answer_reward, format_reward
from tests.test_cli import TINY_DEMO


def test_default_settings_are_valid_and_bad_ones_name_the_flag():
    DemoSettings().validate()
    DemoSettings(algorithm="distillation").validate()
    with pytest.raises(ValueError, match="--max-completion-length must be at least 1"):
        DemoSettings(max_completion_length=0).validate()
    with pytest.raises(ValueError, match="--difficulty must be one of easy, medium, hard"):
        DemoSettings(difficulty="extreme").validate()
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda"):
        DemoSettings(device="tpu").validate()
    with pytest.raises(ValueError, match="--generation-backend must be one of auto, engine, transformers"):
        DemoSettings(generation_backend="vllm").validate()
    with pytest.raises(ValueError, match="--on-nonfinite must be one of raise, skip"):
        DemoSettings(on_nonfinite="ignore").validate()


def test_device_auto_is_cuda_only_when_there_is_one():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use --device cpu"):
            resolve_device("cuda")


def test_cpu_threads_follow_omp_num_threads_when_it_is_set(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        torch.set_num_threads(1)
        assert set_cpu_threads() == 1  # left alone
        monkeypatch.delenv("OMP_NUM_THREADS")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        assert set_cpu_threads() == cores == torch.get_num_threads()  # every core this process may run on
    finally:
        torch.set_num_threads(before)


def test_step_line_shows_reward_each_reward_function_batch_accuracy_length_loss_and_time():
    logs = {
        "reward": 1.25,
        "rewards/exact_answer_reward/mean": 0.75,
        "rewards/format_reward/mean": 0.5,
        "rewards/format_reward/std": 0.1,
        "completions/mean_length": 9.6,
        "loss": 0.0123,
        "step_time": 5.06,
    }
    line = step_line(12, 50, logs)
    assert line == (
        "step  12/50  reward 1.250  exact_answer 0.750  format 0.500  batch acc  75%  len  9.6  loss +0.0123  5.1s"
    )
    assert "nan" in step_line(1, 1, {"reward": 0.0})  # missing metrics print as nan, not a KeyError
    # distillation logs no reward: the student's entropy in its place, the loss being the divergence to the teacher
    distillation = {"loss": 0.25, "entropy": 1.5, "completions/mean_length": 9.6, "step_time": 5.06}
    assert step_line(3, 50, distillation) == "step   3/50  entropy 1.500  len  9.6  loss +0.2500  5.1s"


def test_moving_average_averages_only_the_steps_so_far():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([], window=5) == []


def test_plot_history_writes_a_png(tmp_path):
    history = [{"step": s, "reward": s / 10, "rewards/exact_answer_reward/mean": s / 20} for s in range(1, 8)]
    summary = {"history": history, "accuracy_before": {"accuracy": 0.4}, "accuracy_after": {"accuracy": 0.6},
               "settings": {"model": "tiny"}, "device": "cpu", "total_seconds": 90}  # fmt: skip
    path = plot_history(summary, tmp_path / "reward.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_scores_greedy_replies_and_leaves_the_model_in_training_mode(tokenizer, monkeypatch):
    from slimrl import FastLanguageModel
    from slimrl.testing import tiny_model

    model = FastLanguageModel.get_peft_model(tiny_model("llama"), r=4, lora_alpha=8, use_gradient_checkpointing=False)
    dataset = arithmetic_dataset(5, seed=0, split="eval")
    # scripted replies instead of a tiny model's noise: right and in format (rows 0-2), wrong but in format (row 3),
    # right but rambling over two lines (row 4)
    answers = dataset["answer"]
    replies = [f"x = {a}" for a in answers[:3]] + ["x = 1234567", f"Let me think.\nIt is {answers[4]}"]
    prompts_seen = []

    def generate(input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert not do_sample and not model.training  # greedy, in eval mode
        prompts_seen.append(len(input_ids))
        start = sum(prompts_seen[:-1])
        rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies[start : start + len(input_ids)]]
        width = max(map(len, rows))
        new = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])
        return torch.cat([input_ids, new], 1)

    monkeypatch.setattr(model, "generate", generate)
    scores = evaluate(model, tokenizer, dataset, max_new_tokens=4, batch_size=2)
    assert prompts_seen == [2, 2, 1]  # batches of 2
    # right: rows 0-2 and 4; one line ending in a number: rows 0-3
    assert scores == {"accuracy": 4 / 5, "in_format": 4 / 5}
    assert model.training


def test_nonfinite_skipped_steps_lists_the_steps_whose_update_was_dropped():
    history = [{"step": 1, "nonfinite_skipped": 0.0}, {"step": 2, "nonfinite_skipped": 1.0}, {"step": 3}]
    assert nonfinite_skipped_steps(history) == [2]


def test_write_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "metrics.json"
    write_json(path, {"history": [1]})
    write_json(path, {"history": [1, 2]})
    assert json.loads(path.read_text()) == {"history": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no partial file left behind


def test_an_adapter_with_nonfinite_weights_is_not_saved_and_the_refusal_is_recorded(tmp_path, monkeypatch):
    from slimrl import FastLanguageModel, NonFiniteError
    from slimrl.cli.demo import _save_adapter

    def refuse(*args, **kwargs):
        raise NonFiniteError("these weights hold NaN")

    monkeypatch.setattr(FastLanguageModel, "save_lora", refuse)
    summary = {"nonfinite_error": None}
    assert _save_adapter(None, None, tmp_path, summary) is None
    assert summary["nonfinite_error"] == {"during": "saving", "step": None, "message": "these weights hold NaN"}


def test_ppo_logs_take_the_names_grpo_and_rloo_log():
    logs = {"loss": 0.5, "objective/scores": 1.25, "rewards/exact_answer_reward": 0.5, "objective/kl": 0.1}
    assert demo_logs(logs) == {"loss": 0.5, "objective/scores": 1.25, "rewards/exact_answer_reward/mean": 0.5,
                               "objective/kl": 0.1, "reward": 1.25}  # fmt: skip
    grpo = {"loss": 0.5, "reward": 1.0, "rewards/exact_answer_reward/mean": 0.5}
    assert demo_logs(grpo) is grpo  # GRPO's and RLOO's logs as they are
    with pytest.raises(ValueError, match="--algorithm must be one of grpo, rloo, ppo, distillation"):
        DemoSettings(algorithm="dpo").validate()


def test_the_teachers_sft_rows_are_the_demos_training_prompts_with_correct_replies_in_format():
    rows = correct_replies(6, seed=3)
    assert rows["prompt"] == arithmetic_dataset(6, seed=3, split="train")["prompt"]  # the same problems and prompts
    replies = [completion[-1]["content"] for completion in rows["completion"]]
    answers = arithmetic_dataset(6, seed=3, split="train")["answer"]
    assert exact_answer_reward(replies, answers) == [1.0] * 6 and format_reward(replies) == [1.0] * 6
    assert all(completion[-1]["role"] == "assistant" for completion in rows["completion"])


def test_a_teacher_from_an_adapter_is_the_base_with_that_adapter_merged_and_frozen(tmp_path, tokenizer):
    from peft import PeftModel

    from slimrl import FastLanguageModel
    from slimrl.testing import tiny_model

    trained = FastLanguageModel.get_peft_model(tiny_model("llama"), r=4, lora_alpha=8, use_gradient_checkpointing=False)
    with torch.no_grad():  # a trained adapter: LoRA's B starts at zero, which would leave the base unchanged
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    trained.save_pretrained(tmp_path / "adapter")
    teacher = distillation_teacher(tiny_model("llama"), tokenizer, tmp_path, "cpu", adapter=str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 40, 77, 123, 9]])
    with torch.no_grad():
        expected, base = trained.eval()(ids).logits, tiny_model("llama")(ids).logits
        logits = teacher(ids).logits
    assert torch.allclose(logits, expected, atol=1e-5) and not torch.allclose(logits, base, atol=1e-3)
    assert not isinstance(teacher, PeftModel) and not teacher.training
    assert not any(param.requires_grad for param in teacher.parameters())


def test_distillation_demo_on_a_tiny_model_distils_from_its_teacher_and_reports_the_divergence(tmp_path, capsys):
    out = tmp_path / "distillation"
    assert main([*TINY_DEMO, "--algorithm", "distillation", "--teacher-steps", "1", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["settings"]["teacher_steps"] == 1
    assert "teacher: tiny + 1 SFT steps on correct answers" in printed
    assert accuracy_line("teacher:", metrics["teacher_accuracy"]) in printed
    assert {metrics["teacher_accuracy"]["accuracy"] * 4} <= {0.0, 1.0, 2.0, 3.0, 4.0}  # k of 4 problems
    step_lines = [line for line in printed.splitlines() if "/2  entropy" in line]
    assert len(step_lines) == 2 and not any("nan" in line for line in step_lines)
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    for entry in metrics["history"]:  # the divergence to a teacher that differs from the student, and the timings
        assert entry["loss"] > 0 and entry["entropy"] > 0 and entry["completions/mean_length"] > 0
        assert entry["generation_s"] > 0 and entry["reward_s"] == 0 and entry["training_s"] > 0
    assert "mean divergence to the teacher (loss), first 5 steps" in printed
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "reward.png").is_file()
    assert not (out / "trainer").exists()  # the teacher's and the student's empty TRL output dir removed
