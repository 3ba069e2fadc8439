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
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interpreter_speed

    interpreter_speed.install()

# One thread: the tiny models gain nothing from a second, and two OpenMP threads per process spin against any other
# load on a 2-core machine (measured: the trainer parity tests 6-10x slower in wall time on a busy box).
torch.set_num_threads(int(os.environ.get("SLIMRL_TEST_THREADS", "1")))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: runs only where CUDA is (scripts/gpu_check.sh collects these on the GPU machine)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs CUDA: run scripts/gpu_check.sh on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(needs_gpu)


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Garbage collections during a test walk only what the test allocated (tests/frozen_heap.py): a full pass over
    the half million objects of the imported stack costs about 0.6 s, and every Trainer.train() starts with one."""
    from tests.frozen_heap import frozen_heap

    with frozen_heap():
        yield


@pytest.fixture
def tokenizer():
    from slimrl.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param
