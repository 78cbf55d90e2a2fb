"""MXFP4 Triton kernels == the torch reference, bit for bit (interpreter; see conftest).

The reference itself is pinned to an independent scalar encoder in tests/kernels/test_mxfp4.py.
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import mxfp4 as m

RULES = ("floor", "ceil")
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _awkward(rows: int, k: int, seed: int) -> torch.Tensor:
    """Blocks spread over 2^-140 .. 2^20 (fp32 subnormals included), plus special blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    x = torch.randn(rows, k, generator=g)
    x *= 2.0 ** torch.randint(-140, 20, (rows, nb), generator=g).repeat_interleave(32, dim=1).float()
    x[0, 3] = float("nan")
    x[1, -1] = float("inf")
    x[2, :32] = float("-inf")
    x[3] = 0.0
    x[4, ::2] = -0.0
    x[5, :32] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4) * 2.0**-3  # every tie
    x[6, :32] = torch.tensor([6.0, 7.9, 1.5000001, -1.5, 3e-39, -1e-45, 2.0**-126, 0.0] * 4)  # clip, ceil edge, subnormals
    x[7, :32] = torch.randn(32, generator=g) * 1e-39  # a block of subnormals only (scale byte 0)
    x[8, :32] = torch.tensor([3.4e38, -3.4e38] * 16)  # largest fp32
    return x


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns, except that NaNs only need to be NaN where the reference is NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    iv = INT_VIEW[want.dtype]
    assert torch.equal(got.view(iv)[~nan], want.view(iv)[~nan])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(65, 96), (3, 21, 64), (9, 32)], ids=str)
def test_quantize_is_bit_exact(rule, dtype, shape):
    x = _awkward(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1], seed=sum(shape)).to(dtype)
    x = x.reshape(shape)
    blocks, scales = m._quantize_mxfp4_triton(x, m.ScaleRule(rule))
    want_blocks, want_scales = m._quantize_mxfp4_torch(x, m.ScaleRule(rule))
    assert torch.equal(scales, want_scales)
    assert torch.equal(blocks, want_blocks)


def test_quantize_non_contiguous_input():
    x = _awkward(64, 96, seed=1)[:, :64].t()  # [64, 64], strides (1, 96)
    got = m._quantize_mxfp4_triton(x, m.ScaleRule.FLOOR)
    want = m._quantize_mxfp4_torch(x, m.ScaleRule.FLOOR)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_every_byte_at_every_scale_is_bit_exact(dtype):
    scale_bytes = [0, 1, 2, 100, 127, 128, 200, 252, 253, 254, 255]  # 253+ overflow at high codes, 255 NaN
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).repeat(len(scale_bytes), 1)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).repeat_interleave(16)[:, None]
    blocks, scales = blocks.reshape(11, 16, 16), scales.reshape(11, 16, 1)  # leading dims
    _same_bits(m._dequantize_mxfp4_triton(blocks, scales, dtype), m._dequantize_mxfp4_torch(blocks, scales, dtype))


@pytest.mark.parametrize("rule", RULES)
def test_round_trip_through_both_kernels(rule):
    x = _awkward(70, 128, seed=5)
    blocks, scales = m._quantize_mxfp4_triton(x, m.ScaleRule(rule))
    want = m._dequantize_mxfp4_torch(*m._quantize_mxfp4_torch(x, m.ScaleRule(rule)), torch.float32)
    _same_bits(m._dequantize_mxfp4_triton(blocks, scales, torch.float32), want)


def test_public_functions_run_the_kernels(monkeypatch):
    x = _awkward(12, 64, seed=6)
    want = m._quantize_mxfp4_torch(x, m.ScaleRule.CEIL)
    want_out = m._dequantize_mxfp4_torch(*want, torch.bfloat16)

    def boom(*args):
        raise AssertionError("the torch reference ran under the triton backend")

    monkeypatch.setattr(m, "_quantize_mxfp4_torch", boom)
    monkeypatch.setattr(m, "_dequantize_mxfp4_torch", boom)
    blocks, scales = m.quantize_mxfp4(x, "ceil")
    assert torch.equal(blocks, want[0]) and torch.equal(scales, want[1])
    _same_bits(m.dequantize_mxfp4(blocks, scales, torch.bfloat16), want_out)
    assert m.quantize_mxfp4(torch.zeros(0, 64))[0].shape == (0, 32)  # empty: no launch
    assert m.dequantize_mxfp4(*m.quantize_mxfp4(torch.zeros(4, 0)), torch.float32).shape == (4, 0)


def test_float64_falls_back_to_the_reference(monkeypatch):
    x = _awkward(12, 64, seed=7).double()
    x[1, :32] = 0.0
    x[1, 0], x[1, 1] = 4.0, 0.25 + 2.0**-40  # only float64 sees this above the 0.25 tie
    calls = []
    monkeypatch.setattr(m, "_quantize_mxfp4_triton", lambda *a: calls.append(a))
    blocks, scales = m.quantize_mxfp4(x)
    assert not calls
    assert torch.equal(blocks, m._quantize_mxfp4_torch(x, m.ScaleRule.FLOOR)[0])
