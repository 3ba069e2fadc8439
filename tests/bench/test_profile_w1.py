"""bench/profile_w1.py sorts CUDA kernels into families by name; the GPU run itself is a benchmark (no CPU test)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("datasets")  # grpo_memory (imported by the script) builds TRL trainers


def load():
    path = Path(__file__).resolve().parents[2] / "bench" / "profile_w1.py"
    spec = importlib.util.spec_from_file_location("profile_w1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", "gemm"),
        ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("Memcpy DtoH (Device -> Pinned)", "copy/offload"),
        ("triton_red_fused__to_copy_mean_mul_pow_rsqrt_0", "norm"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "log-softmax/loss"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernels_fall_into_their_family(name, expected):
    assert load().family(name) == expected
