"""What a vLLM run computes in: the dtype ``engine.dtype`` resolves to, and the precision of float32 matmuls in
Triton kernels (vLLM's fused MoE among them), which the dtype alone does not fix."""

from __future__ import annotations

import os

from harness.models.load import _DTYPES


def resolve_vllm_dtype(dtype: str, device: str) -> str:
    """``auto`` → bfloat16 on GPUs, float32 on CPU (bf16 kills the CPU worker with SIGILL here)."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"engine.dtype={dtype!r}: expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def float32_dot_precision(dtype: str, device: str) -> str | None:
    """Make a float32 run's Triton matmuls float32 (``TRITON_F32_DEFAULT=ieee``) and say what they are.

    vLLM's fused MoE is a Triton kernel whose ``tl.dot`` on float32 inputs defaults to TF32 on NVIDIA GPUs (10-bit
    mantissas), while its torch matmuls stay float32 (``VLLM_FLOAT32_MATMUL_PRECISION=highest``). So
    ``engine.dtype=float32`` on CUDA was not float32 in the experts: on the H100 (session 24) the embedded model's
    greedy tokens left HF's at a float32 near-tie (top-two logits 0.04 apart). Set before vLLM compiles anything,
    inherited by its worker and server processes; a user's own ``TRITON_F32_DEFAULT`` is kept. Returns the
    precision float32 dots run at on CUDA (recorded in ``describe()``), None where the question does not arise."""
    if dtype != "float32" or device != "cuda":
        return None
    return os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
