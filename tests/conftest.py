"""Shared fixtures: tiny models and an offline tokenizer. Everything runs on the CPU in fp32."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run through the interpreter where there is no GPU; set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tokenizer():
    from slimrl.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param
