"""slimrl's built-in rollout engine: batched generation with the training model's own weights, in place.

`RolloutEngine(model).generate(prompts, SamplingParams(...), max_new_tokens)` decodes a batch of token-id prompts
with the engine's own forward (`model/llama.py`: Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, Qwen3-MoE, Mixtral) over the
live modules, so a LoRA adapter updated by the
optimizer is used by the next rollout with no merge, copy or re-capture. A rollout: validate the requests and plan
waves that fit the memory budget (`planning.py`); per wave, take the session of its shape (`session.py`: static KV
cache and step buffers), capture its decode step as a CUDA graph once (`cuda_graph.py`), prefill (a prompt that
several rows hold, once), decode and collect (`runner.py`), cutting each completion at its stop token or string
(`stopping.py`). Which kernels run is decided by `EngineOptions` (`options.py`); `describe()` reports it.

Log-probs: see `SamplingParams.logprobs_mode` (default: of the distribution actually sampled from, vLLM's
"processed_logprobs" as TRL configures it). What `generate` returns is checked: token ids inside the vocabulary and
finite log-probs, else `EngineOutputError`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from slimrl.rollout import cuda_graph, planning
from slimrl.rollout.model.lengths import engine_max_seq_len
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.model.moe import StagedFactors
from slimrl.rollout.model.views import supports
from slimrl.rollout.options import EngineOptions
from slimrl.rollout.runner import Runner, group_rows, wave_rows
from slimrl.rollout.sampling import SamplingParams
from slimrl.rollout.session import Session, Sessions, sampling_key
from slimrl.rollout.stopping import EngineOutputError, check_output, completions

__all__ = ["EngineOptions", "EngineOutputError", "RolloutEngine", "RolloutOutput", "supports"]


@dataclass
class RolloutOutput:
    """Per sequence, in the order of the prompts: the prompt, completion ids, their log-probs, why it ended.

    completion_ids include the EOS / stop token that ended a sequence. finish_reason is "stop" (EOS, stop token or
    stop string) or "length" (its max token count or the engine's max_seq_len). logprobs is None when
    `SamplingParams.logprobs` is False.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    finish_reason: list[str]
    stats: dict = field(default_factory=dict)


class RolloutEngine:
    """Generates with a Llama-family model's live weights (LoRA included) through a static cache and CUDA graphs.

    model: a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM, possibly peft-wrapped, possibly with
        bitsandbytes 4/8-bit Linear layers. It is read, never modified or copied.
    max_batch_size: most sequences decoded together; more prompts are decoded in successive waves.
    max_seq_len: longest prompt + completion; default the model's max_position_embeddings.
    gpu_memory_utilization: if set, the fraction of the GPU's memory the process may use with the cache allocated:
        each wave takes as many rows (and so as big a KV cache) as fit in it beside what the process has allocated
        already (`planning.rows_that_fit`); more prompts go to further waves, and an error says so when not one
        row fits. None: waves of max_batch_size rows whatever memory is free. Not applied off CUDA. slimrl's
        trainers pass FastLanguageModel.from_pretrained's value (default 0.5).
    tokenizer: needed only for stop strings.
    cap_completions: True (default): a completion that would pass max_seq_len is cut there (finish_reason
        "length"). False: such a request is an error naming the prompt, its length, the limit and the fix; slimrl's
        trainers use it, so that no completion is cut shorter than they asked without a word.
    options, **flags: an `EngineOptions`, or its fields as keywords (cuda_graphs, compile, tf32_adapters,
        triton_lora, triton_attention, fused_decode, fused_sampling, deterministic, kernel_choices); unset ones are
        decided by the device.
    """

    def __init__(self, model, max_batch_size: int = 256, max_seq_len: int | None = None,
                 gpu_memory_utilization: float | None = None, tokenizer=None, options: EngineOptions | None = None,
                 cap_completions: bool = True, **flags):  # fmt: skip
        supported, why = supports(model)
        if not supported:
            raise ValueError(f"The rollout engine cannot run this model: {why}. Generate with transformers instead.")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
        self.model = model
        self.decoder = Decoder(model)
        self.staged = StagedFactors()  # MoE experts' LoRA factors laid out once per rollout (moe.StagedFactors)
        self.device = self.decoder.device
        self.options = dataclasses.replace(options or EngineOptions(), **flags).resolve(self.device, self.decoder.dtype)
        self.max_seq_len = engine_max_seq_len(self.decoder.causal_lm, max_seq_len)
        self.cap_completions = cap_completions
        self.max_batch_size = max_batch_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tokenizer = tokenizer
        generation_config = getattr(self.decoder.causal_lm, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = getattr(generation_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids or [0])[0]
        self.runner = Runner(self.decoder, self.options, self.pad_token_id, tokenizer)
        if self.options.share_prompt_cache is None:  # on where the attention reads the prompt's copy in place
            self.options.share_prompt_cache = self.runner.reads_prefix_in_place()
        self.sessions = Sessions()
        self.last_stats: dict = {}

    def describe(self) -> dict:
        """The engine's resolved settings and shapes, for logs and benchmarks."""
        d = self.decoder
        session = self.sessions.current
        return {**self.options.describe(), "device": str(self.device), "dtype": str(d.dtype).removeprefix("torch."),
                "layers": d.num_layers, "heads": d.heads, "kv_heads": d.kv_heads, "head_dim": d.head_dim,
                "vocab_size": d.vocab_size, "max_seq_len": self.max_seq_len, "max_batch_size": self.max_batch_size,
                "gpu_memory_utilization": self.gpu_memory_utilization, "kv_cache_bytes": self.sessions.held_bytes(),
                "graph_captured": bool(session and session.graph)}  # fmt: skip

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 max_new_tokens: int | list[int] | None = None) -> RolloutOutput:  # fmt: skip
        """Complete each prompt (a list of token ids). max_new_tokens (one int or one per prompt) defaults to
        `params.max_tokens`; it is capped so prompt + completion fit in max_seq_len (with cap_completions=False, a
        request past it is an error)."""
        prompts = [list(map(int, p)) for p in prompts]
        d = self.decoder
        limits = planning.request_limits(prompts, params, max_new_tokens, d.vocab_size, self.max_seq_len,
                                         self.cap_completions)  # fmt: skip
        stop_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer: pass RolloutEngine(model, tokenizer=...).")
        order = list(range(len(prompts)))
        if params.sampler != "multinomial":  # (multinomial draws on torch's own generator, in prompt order)
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            self.runner.generator.manual_seed(seed)
            order.sort(key=lambda i: -len(prompts[i]))  # similar lengths pad less
        results: list = [None] * len(prompts)
        # prefill_rows: rows the prefill's forward ran (each wave's distinct prompts with share_prompt_prefill);
        # kv_cache_bytes (set per wave): the largest wave's cache
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "decode_steps": 0, "waves": 0, "prefill_rows": 0}
        tf32_before = torch.backends.cuda.matmul.allow_tf32
        self.staged.begin()  # adapters may have changed since the last rollout: refresh the staged factors
        d.staged = self.staged
        try:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before or self.options.tf32_adapters
            with torch.no_grad():
                for wave in planning.waves(order, prompts, limits, self._rows_that_fit):
                    outs = self._run_wave([prompts[i] for i in wave], [limits[i] for i in wave], params, stop_ids,
                                          stats)  # fmt: skip
                    for i, out in zip(wave, outs, strict=True):
                        results[i] = out
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32_before
            d.staged = None
        self.last_stats = stats
        return RolloutOutput(prompts, [r[0] for r in results], [r[1] for r in results] if params.logprobs else None,
                             [r[2] for r in results], stats)  # fmt: skip

    def release(self, keep_graph: bool = True) -> None:
        """Free the KV cache so training gets its memory back; the next `generate` allocates it again.

        When the captured decode graph reads the cache through the address table (`fused_decode` with
        `triton_attention`), it is kept with its small step buffers (keep_graph=True) and replayed by the next
        rollout of the same shape: no re-capture; so are the graphs of a few other shapes used before
        (`session.IDLE_GRAPHS`). Otherwise, or with keep_graph=False, the graphs and every buffer are freed too."""
        self.sessions.release(keep_graph)
        self.staged.clear()  # a graph that read them captures again (their addresses are in its fingerprint)

    # -- one wave ------------------------------------------------------------------------------------------------

    def _rows_that_fit(self, prompt_length: int, longest_limit: int, distinct) -> int:
        # the cache a wave gets has cache_length columns (rounded up to share graphs), so rows are counted at that;
        # with the shared prompt cache, at its layout for the wave's distinct prompts
        columns = planning.cache_length(prompt_length + longest_limit, 0, self.max_seq_len)
        shared = None
        if self.options.share_prompt_prefill and self.options.share_prompt_cache:
            shared = planning.SharedPlan(prompt_length, longest_limit, distinct, self.max_seq_len)
        return planning.rows_that_fit(self.decoder, columns, self.max_batch_size, self.gpu_memory_utilization,
                                      self.sessions.held_bytes(), shared)  # fmt: skip

    def _session(self, batch: int, seq_len: int, params: SamplingParams, stop_ids, prefix) -> Session:
        key = (batch, seq_len, prefix, sampling_key(params), tuple(sorted(stop_ids)))
        fused = self.runner.fused_sampling_applies(params)
        return self.sessions.get(key, lambda: Session(self.decoder, batch, seq_len, params, stop_ids, fused, prefix))

    def _run_wave(self, prompts, limits, params: SamplingParams, stop_ids, stats) -> list:
        count, length = len(prompts), max(len(p) for p in prompts)
        seq_len = planning.cache_length(length, max(limits), self.max_seq_len)
        eager_draws = params.sampler == "multinomial"  # torch.multinomial over exactly these rows, every step
        batch = count if eager_draws else planning.bucket(count)
        rows = wave_rows(prompts, batch, self.pad_token_id)
        # (distinct prompts, the rows holding each) with share_prompt_prefill: grouped once, for the cache and prefill
        grouped = group_rows(rows) if self.options.share_prompt_prefill else (rows, None)
        prefix = None
        if grouped[1] is not None and self.options.share_prompt_cache:
            distinct = len(grouped[0])
            shared = planning.shared_prefix(batch, distinct, length, max(limits), self.max_seq_len)
            if distinct < batch and shared is not None:
                prefix, seq_len = shared
        session = self._session(batch, seq_len, params, stop_ids, prefix)
        stats["waves"] += 1
        stats["kv_cache_bytes"] = max(stats.get("kv_cache_bytes", 0), session.cache.nbytes)
        runner = self.runner
        if self.options.cuda_graphs and not eager_draws:
            tick = time.perf_counter()
            if cuda_graph.ensure_captured(self.decoder, session, runner.decode_step, self.device):
                stats["captures"] = stats.get("captures", 0) + 1
            stats["capture_s"] += time.perf_counter() - tick
        tick = _now(self.device)
        session.start(prompts, limits, length, self.pad_token_id)
        if session.fused_sampling:  # this wave's Philox key, from the engine's seeded generator (no host sync)
            session.seed.copy_(torch.randint(0, 2**31, (1,), generator=runner.generator, device=self.device))
        logits = runner.prefill(session, grouped, length)  # a prompt several rows hold runs once (options)
        stats["prefill_rows"] += runner.prefilled_rows
        runner.fill_noise(session)
        runner.finish_step(session, logits)
        del logits
        stats["prefill_s"] += _now(self.device) - tick
        tick = _now(self.device)
        steps = runner.decode(session, count, max(limits), params)
        stats["decode_s"] += _now(self.device) - tick
        stats["decode_steps"] += steps - 1
        tokens = session.out_tokens[:count, :steps].tolist()
        logprobs = session.out_logprobs[:count, :steps].tolist() if params.logprobs else None
        out = completions(tokens, logprobs, limits, params, stop_ids, self.tokenizer)
        check_output(out, self.decoder.vocab_size, self.model)
        return out


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
