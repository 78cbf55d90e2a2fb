"""``kernels/linear_cpu`` against ``F.linear``: every row-tail (1-7 rows past the full blocks), output
widths that are not a multiple of the panel, float64 and float32; a row's result bit for bit the same
alone or among others; the packed layout itself."""

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import linear_cpu


@pytest.fixture(autouse=True)
def kernel():
    if linear_cpu.load_kernel() is None:
        pytest.skip("no C++ toolchain here")


TOL = {torch.float64: 1e-14, torch.float32: 2e-6}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("O,K", [(512, 256), (264, 256), (5, 9), (16, 1)])
def test_linear_equals_f_linear(dtype, N, O, K):
    g = torch.Generator().manual_seed(N * 1000 + O)
    w_OK = torch.randn(O, K, generator=g, dtype=dtype)
    x_NK = torch.randn(N, K, generator=g, dtype=dtype)
    ref = F.linear(x_NK, w_OK)
    out = linear_cpu.linear(x_NK, linear_cpu.pack(w_OK), O)
    assert out.shape == (N, O) and out.dtype == dtype
    assert (out - ref).abs().max() <= TOL[dtype] * ref.abs().max() * K ** 0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_row_is_the_same_alone_or_in_a_crowd(dtype):
    g = torch.Generator().manual_seed(3)
    w_OK = torch.randn(40, 24, generator=g, dtype=dtype)
    x_NK = torch.randn(17, 24, generator=g, dtype=dtype)
    packed = linear_cpu.pack(w_OK)
    crowd = linear_cpu.linear(x_NK, packed, 40)
    for n in range(17):
        assert torch.equal(linear_cpu.linear(x_NK[n:n + 1], packed, 40)[0], crowd[n])
        assert torch.equal(linear_cpu.linear(x_NK[n:], packed, 40)[0], crowd[n])


def test_pack_layout():
    w_OK = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = linear_cpu.pack(w_OK)
    assert packed.shape == (2, 3, linear_cpu.PANEL)
    assert torch.equal(packed[0], w_OK[:16].T)
    assert torch.equal(packed[1, :, :4], w_OK[16:].T) and not packed[1, :, 4:].any()


@pytest.mark.parametrize("O", [264, 16, 5, 33])
def test_pack_into_an_earlier_pack_equals_a_fresh_one(O):
    from jointrl.kernels import moe_cpu

    w = torch.randn(O, 40, dtype=torch.float64)
    panels = linear_cpu.pack(w)
    w2 = torch.randn(O, 40, dtype=torch.float64)
    assert linear_cpu.pack(w2, out=panels) is panels and torch.equal(panels, linear_cpu.pack(w2))
    gate_up, down = torch.randn(3, 2 * O, 24), torch.randn(3, 24, O)
    old = moe_cpu.pack_experts(torch.randn_like(gate_up), torch.randn_like(down))
    new = moe_cpu.pack_experts(gate_up, down, out=old)
    assert all(a is b and torch.equal(a, c) for a, b, c in zip(new, old, moe_cpu.pack_experts(gate_up, down)))


def test_pack_into_panels_of_another_shape_or_dtype_is_refused():
    """Panels of a weight with more outputs would keep the old weights' columns past O (silently stale)."""
    from jointrl.kernels import moe_cpu

    panels = linear_cpu.pack(torch.randn(20, 8))
    for w in (torch.randn(16, 8), torch.randn(20, 4), torch.randn(20, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="is not the panels"):
            linear_cpu.pack(w, out=panels)
    old = moe_cpu.pack_experts(torch.randn(3, 40, 24), torch.randn(3, 24, 20))
    with pytest.raises(ValueError, match="is not the panels"):
        moe_cpu.pack_experts(torch.randn(3, 32, 24), torch.randn(3, 24, 16), out=old)
