"""The Unsloth side of bench/grpo_memory.py: W1's training phase through Unsloth's patched GRPOTrainer, in a process of
its own (Unsloth patches transformers and TRL when imported, and needs its own TRL), on the weights grpo_memory.py
saved from the model its other sides ran, with the same inputs (grpo_memory.make_inputs) and the same measurement: two
iterations of compute_loss + backward, the second timed, peak from torch.cuda.max_memory_allocated.

Unsloth is set up as its users set it up for long contexts: bf16 base, LoRA r=64 (alpha 64) on the seven projections,
`use_gradient_checkpointing="unsloth"` (its offloaded checkpoints), and the trainer's gradient checkpointing enabled
as HF Trainer's loop enables it. Its LoRA is its own initialisation (random_state 0), so its grad norm is not
comparable with the other sides'; its loss is (with beta 0 and no old log-probs, the loss depends only on the
advantages and the masks).

    PYTHONPATH=<unsloth site>:bench python bench/unsloth_side.py MODEL_DIR OUT.json [--repeats=N] 1024 4096 ...

`save_model` (called by grpo_memory.py, in its process) writes MODEL_DIR: the base weights without the LoRA, the
config, and a word-level tokenizer over the model's whole vocabulary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_model(peft_model, directory: Path) -> None:
    """The base model under `peft_model` (LoRA left out, tied weights once) and a tokenizer over its vocabulary (only
    its size and special ids matter: the measured steps take token ids, never text)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    base = peft_model.get_base_model()
    state = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        if name == "lm_head.weight" and base.config.tie_word_embeddings:
            continue
        state[name.replace(".base_layer.", ".")] = tensor.detach().contiguous().cpu()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(base.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t1", eos_token="t2")
    tokenizer.save_pretrained(directory)


def unsloth_trainer(model_dir: str, max_length: int):
    from unsloth import FastLanguageModel, PatchFastRL  # first: it patches what it imports after

    PatchFastRL("grpo", FastLanguageModel)
    import torch
    from datasets import Dataset
    from grpo_memory import B, P
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(model_dir, max_seq_length=max_length + P, load_in_4bit=False,
                                                         dtype=torch.bfloat16)  # fmt: skip
    model = FastLanguageModel.get_peft_model(model, r=64, lora_alpha=64, target_modules=TARGETS,
                                             use_gradient_checkpointing="unsloth", random_state=0)  # fmt: skip
    args = GRPOConfig(output_dir="/tmp/bench-unsloth", per_device_train_batch_size=B, num_generations=B,
                      report_to="none", bf16=True, save_strategy="no", loss_type="dapo", beta=0.0,
                      max_completion_length=max_length)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "t5 t6"}] * 16),
                          processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    return trainer


def measure(trainer, length: int, vocab: int, repeats: int = 1) -> dict:
    import torch
    from common import timed_iterations
    from grpo_memory import make_inputs

    model = trainer.model
    inputs = make_inputs(length, vocab)
    inputs["ref_per_token_logps"] = None

    def iteration():
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, dict(inputs))
        loss.backward()
        return loss

    gc_ms: list[float] = []
    seconds, every, loss = timed_iterations(iteration, repeats, gc_ms)
    grads = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
    result = {"peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2), "s": round(seconds, 3),
              "loss": loss.item(), "grad_norm": torch.stack(grads).sum().sqrt().item()}  # fmt: skip
    return {**result, "s_each": every, "gc_ms_each": gc_ms} if repeats > 1 else result


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    repeats = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--repeats=")), 1))
    argv = [a for a in argv if not a.startswith("--repeats=")]
    model_dir, out, lengths = argv[0], Path(argv[1]), [int(x) for x in argv[2:]]
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trainer = unsloth_trainer(model_dir, max(lengths))
    import torch
    import trl
    import unsloth

    report = {"versions": {"unsloth": unsloth.__version__, "trl": trl.__version__, "torch": torch.__version__},
              "results": {}}  # fmt: skip
    vocab = trainer.model.config.vocab_size
    for length in lengths:
        try:
            report["results"][f"unsloth_L{length}"] = measure(trainer, length, vocab, repeats)
        except torch.OutOfMemoryError:
            report["results"][f"unsloth_L{length}"] = "OOM"
        trainer.model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        print(json.dumps({f"unsloth_L{length}": report["results"][f"unsloth_L{length}"]}), flush=True)
        out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
