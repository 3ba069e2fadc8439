"""FastLanguageModel on the GPU: a 4-bit (NF4) load of a W1-shaped model saved to disk, LoRA training steps and the
merged 16-bit save, beside the plain baseline (transformers bf16 load + peft LoRA) in the same run.

    python bench/load_4bit.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

MODEL_DIR = Path("/tmp/slimrl-w1-model")


def save_w1_model() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slimrl.testing import tiny_tokenizer

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(MODEL_DIR)
    tiny_tokenizer().save_pretrained(MODEL_DIR)


def peak() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def train_steps(model, steps: int = 3, tokens: int = 1024) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(10, 151936, (4, tokens), device="cuda", generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    return losses


def run(kind: str, out: Path) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if kind == "slimrl_4bit":
        from slimrl import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(str(MODEL_DIR), load_in_4bit=True, max_seq_length=2048)
        result = {"load_s": round(time.perf_counter() - start, 2), "load_peak_GiB": peak(),
                  "resident_GiB": round(torch.cuda.memory_allocated() / 2**30, 3)}  # fmt: skip
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, device_map={"": "cuda"})
        result = {"load_s": round(time.perf_counter() - start, 2), "load_peak_GiB": peak(),
                  "resident_GiB": round(torch.cuda.memory_allocated() / 2**30, 3)}  # fmt: skip
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result["losses"] = train_steps(model)
    torch.cuda.synchronize()
    result.update(train_s=round(time.perf_counter() - start, 2), train_peak_GiB=peak())
    if kind == "slimrl_4bit":
        from transformers import AutoModelForCausalLM

        from slimrl import FastLanguageModel

        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        merged_dir = out / "merged"
        FastLanguageModel.save_merged(model, None, merged_dir, dtype=torch.bfloat16, overwrite=True)
        result.update(merge_s=round(time.perf_counter() - start, 2), merge_peak_GiB=peak())
        reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16, device_map={"": "cuda"})
        ids = torch.randint(10, 151936, (1, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        FastLanguageModel.for_inference(model)
        with torch.no_grad():
            a = model.generate(ids, max_new_tokens=16, do_sample=False)
            b = reloaded.generate(ids, max_new_tokens=16, do_sample=False)
        result["merged_greedy_tokens_equal"] = int((a == b).sum()) - 32
        result["merged_greedy_tokens_total"] = 16
        shutil.rmtree(merged_dir, ignore_errors=True)
        del reloaded
    del model
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    import peft
    import transformers

    save_w1_model()
    report = {"gpu": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
              "transformers": transformers.__version__, "peft": peft.__version__}}  # fmt: skip
    for kind in ("baseline_bf16", "slimrl_4bit"):
        report[kind] = run(kind, out)
        print(json.dumps({kind: report[kind]}), flush=True)
    (out / "load_4bit.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
