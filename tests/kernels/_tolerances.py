"""Tolerances and tier markers shared by the kernel tests (DESIGN's fp32 and bf16 rules).

The CPU tier runs the kernels under the Triton interpreter (TRITON_INTERPRET=1, set by the root
conftest when no CUDA device is present); the GPU tier needs CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

cpu_tier = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tier runs the kernels under TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 agreement to ≈1e-5 relative to the tensor's scale (DESIGN's fp32 tolerance)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        actual,
        expected,
        rtol=1e-5,
        atol=1e-5 * scale,
        msg=lambda m: f"{what} differs beyond fp32 rounding: {m}",
    )


def assert_bf16_within_torch_bound(
    ours: torch.Tensor, torch_bf16: torch.Tensor, truth: torch.Tensor, what: str
):
    """Our error against the fp32 truth may be at most 2× torch's own bf16 path's (DESIGN's bf16 rule)."""
    err_ours = (ours.float() - truth).abs().max().item()
    err_torch = (torch_bf16.float() - truth).abs().max().item()
    floor = 1e-6 * truth.abs().max().item()
    assert err_ours <= 2 * err_torch + floor, (
        f"{what}: max error {err_ours:.4g} vs fp32 should be ≤ 2 × torch bf16's {err_torch:.4g}"
    )
