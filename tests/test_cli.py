"""The `slimrl` command: `slimrl demo` end to end on a tiny model, --version, --help and bad settings."""

import json

import pytest

from slimrl.cli import build_parser, main


def test_demo_on_a_tiny_model_writes_adapter_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--model", "tiny", "--steps", "2", "--eval-size", "4", "--num-generations", "4",
                 "--max-completion-length", "8", "--output-dir", str(out), "--device", "cpu"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy before" in printed and "held-out accuracy after" in printed
    assert "step   1/2  reward" in printed and "step   2/2  reward" in printed
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    for entry in metrics["history"]:
        assert {"reward", "rewards/exact_answer_reward/mean", "rewards/format_reward/mean", "loss"} <= entry.keys()
    assert 0.0 <= metrics["accuracy_after"]["accuracy"] <= 1.0 and metrics["settings"]["steps"] == 2
    assert str(out / "metrics.json") in printed and str(out / "reward.png") in printed


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and "slimrl 0.1.0" in capsys.readouterr().out
    assert "demo" in build_parser().format_help()
    assert main([]) == 2 and "usage: slimrl" in capsys.readouterr().out  # no command: the help, not a traceback


@pytest.mark.parametrize(
    "flags,message",
    [(["--num-generations", "1"], "--num-generations must be at least 2"), (["--steps", "0"], "--steps must be"),
     (["--eval-size", "1000"], "use at most"), (["--learning-rate", "0"], "--learning-rate must be positive")],
)  # fmt: skip
def test_invalid_demo_settings_exit_with_a_message(flags, message, capsys):
    assert main(["demo", "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err
