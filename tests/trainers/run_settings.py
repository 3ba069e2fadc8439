"""Settings every CPU test run of a trainer shares: no reports, no checkpoints, fp32 on the CPU, no progress bar;
and a spy on the rollout engine's generate calls."""

from __future__ import annotations

CPU_RUN = dict(report_to="none", save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True)


def spy_on_engine_generate(monkeypatch) -> list[tuple]:
    """Record (prompts, temperature, sampler, logprobs, max_new_tokens) of every RolloutEngine.generate call."""
    from slimrl.rollout.engine import RolloutEngine

    calls = []
    original = RolloutEngine.generate

    def spy(self, prompts, params, max_new_tokens=None):
        calls.append((len(prompts), params.temperature, params.sampler, params.logprobs, max_new_tokens))
        return original(self, prompts, params, max_new_tokens)

    monkeypatch.setattr(RolloutEngine, "generate", spy)
    return calls
