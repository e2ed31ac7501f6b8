"""The native kernels (services/runtime/native) against the torch path they replace, op by op, in
float32, bfloat16 and float16: element-wise results equal to the bit where the torch path rounds the
same way, reductions (the norm's sum of squares, attention) within float32 rounding.

The extension is built once per machine (the session fixture compiles it when the sources changed,
about a minute on 2 cores); without a C++ compiler on PATH the module is skipped."""

from __future__ import annotations

import shutil

import pytest
import torch

from services.runtime import native
from services.runtime.model import rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="session")
def ops():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the native kernels cannot be built (the torch path runs)")
    native.build()
    assert native.loaded()
    return torch.ops.tandem


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 within reduction-order rounding; 16-bit types within one unit in the last place."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(ops, dtype):
    torch.manual_seed(0)
    x, weight = torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    _close(got, rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalizes(ops, dtype):
    torch.manual_seed(1)
    hidden, delta, weight = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype), torch.randn(576).to(dtype)
    want_hidden = hidden + delta
    got = ops.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, want_hidden)  # the residual add rounds as torch's does
    _close(got, rms_norm(want_hidden, weight, 1e-6), dtype)


def test_norm_rejects_a_weight_of_the_wrong_size(ops):
    with pytest.raises(RuntimeError, match=r"the last dim of x \(576\) must equal the weight's size \(64\)"):
        ops.rms_norm(torch.randn(2, 576), torch.randn(64), 1e-5)
