"""``RoutedSwiGLU`` (kernels/moe_experts.py, the reference ``model.moe.Experts`` calls through its kernel
table): values and gradients equal plain autograd over per-expert slices (gather, experts, routing
weights, scatter back), in float64, with experts that get no rows, one row, or every row."""

import pytest
import torch

from jointrl.kernels.moe_experts import RoutedSwiGLU
from jointrl.rl.learner.expert_parallel import _run_experts


def _reference(x_NH, weights_Nk, gate_up_EOH, down_EHI, order_A, token_A, counts):
    """Per-expert slices through plain autograd (the expert-parallel path's own expert loop)."""
    y_AH = _run_experts(x_NH[token_A], counts, gate_up_EOH, down_EHI)
    y_AH = y_AH * weights_Nk.reshape(-1)[order_A, None]
    return torch.zeros_like(x_NH).index_add_(0, token_A, y_AH)


@pytest.mark.parametrize("ids", [[[0, 2], [2, 3], [0, 2], [2, 0], [0, 2]],  # expert 1 idle, expert 3 one row
                                 [[1, 1], [1, 1], [1, 1]],                   # one expert takes every row
                                 [[3, 1], [2, 1], [3, 2], [1, 3]]])          # expert 0 idle
def test_values_and_gradients_equal_autograd(ids):
    ids_Nk = torch.tensor(ids)
    N, k = ids_Nk.shape
    E, H, I = 4, 12, 5
    g = torch.Generator().manual_seed(N * k)
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((N, H), (N, k), (E, 2 * I, H), (E, H, I))]
    order_A = torch.argsort(ids_Nk.reshape(-1), stable=True)
    routing = (order_A, order_A // k, torch.bincount(ids_Nk.reshape(-1), minlength=E).tolist())
    dout = torch.randn(N, H, generator=g, dtype=torch.float64)
    results = []
    for fn in (_reference, RoutedSwiGLU.apply):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = fn(*leaves, *routing)
        y.backward(dout)
        results.append([y.detach()] + [t.grad for t in leaves])
    for ref, got, name in zip(*results, ("y", "d_x", "d_weights", "d_gate_up", "d_down")):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.autograd.gradcheck(lambda *t: RoutedSwiGLU.apply(*t, *routing),
                                    [t.clone().requires_grad_() for t in tensors])


def test_under_autocast_the_matmuls_run_in_bfloat16_and_gradients_keep_float32():
    """``learner.autocast``: ``Experts`` under CPU autocast passes bfloat16 to ``RoutedSwiGLU``, whose values and
    gradients then stay within bfloat16's rounding of float32 autograd's (rel. 3e-2 of each tensor's largest
    entry) and come back in float32, the parameters' dtype. A float64 model is left alone: autocast does not
    cast float64, and neither does the expert path (bit for bit the same)."""
    from jointrl.model import MoEConfig
    from jointrl.model.moe import Experts

    E, H, I, N, k = 4, 64, 32, 24, 2
    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    g = torch.Generator().manual_seed(0)
    x_NH, w_Nk = torch.randn(N, H, generator=g), torch.rand(N, k, generator=g)
    ids_Nk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    dout = torch.randn(N, H, generator=g)
    results = {}
    for dtype, amp in ((torch.float32, False), (torch.float32, True), (torch.float64, False), (torch.float64, True)):
        ex = Experts(cfg).to(dtype)
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=torch.Generator().manual_seed(2)) * 0.2)
        x, w = x_NH.to(dtype).clone().requires_grad_(), w_Nk.to(dtype).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = ex(x, ids_Nk, w)
        y.backward(dout.to(dtype))
        results[dtype, amp] = [y.detach(), x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad]
    for ref, got, name in zip(results[torch.float32, False], results[torch.float32, True],
                              ("y", "d_x", "d_weights", "d_gate_up", "d_down")):
        assert got.dtype == torch.float32, name
        assert (got - ref).abs().max() <= 3e-2 * ref.abs().max(), name
        assert not torch.equal(got, ref), name  # it did run in bfloat16
    for ref, got in zip(results[torch.float64, False], results[torch.float64, True]):
        assert torch.equal(got, ref)


def test_padded_rows_bounds_the_sizes_and_the_extra_rows():
    """Expert row counts rounded for oneDNN's per-shape kernel cache: never fewer rows, at most 7 more up to 64
    and 1/8 more past it, and few sizes (56 for every count up to 4096)."""
    from jointrl.kernels.moe_experts import padded_rows

    assert padded_rows(0) == 0
    for c in range(1, 4097):
        p = padded_rows(c)
        assert c <= p <= max(c + 7, c * 9 // 8 + 1), (c, p)
        assert padded_rows(p) == p  # a padded size is its own size
    assert len({padded_rows(c) for c in range(1, 4097)}) == 56


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_experts_give_the_unpadded_values_and_gradients(dtype, monkeypatch):
    """In bfloat16 / float16 each expert's rows are padded with zero tokens of routing weight 0 (padded_layout);
    values and every gradient equal the unpadded computation (bit for bit here; asserted to 1e-3 of each
    tensor's largest entry, far below what a misplaced row would change)."""
    from jointrl.kernels import moe_experts as moe

    E, H, I, N, k = 8, 64, 32, 300, 2
    g = torch.Generator().manual_seed(0)
    ids_Nk = torch.randint(0, E - 2, (N, k), generator=g)  # experts 6 and 7 idle
    x, w = torch.randn(N, H, generator=g), torch.rand(N, k, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    order_A = torch.argsort(ids_Nk.reshape(-1), stable=True)
    counts = torch.bincount(ids_Nk.reshape(-1), minlength=E).tolist()
    assert moe.padded_layout(counts, order_A, N, k) is not None  # the counts do get padded
    dout = torch.randn(N, H, generator=g)
    results = {}
    for pad in (True, False):
        if not pad:
            monkeypatch.setattr(moe, "_pads", lambda w: False)
        leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
        y = moe.RoutedSwiGLU.apply(*leaves, order_A, order_A // k, counts, dtype)
        y.backward(dout)
        results[pad] = [y.detach()] + [t.grad for t in leaves]
    for got, ref, name in zip(results[True], results[False], ("y", "d_x", "d_weights", "d_gate_up", "d_down")):
        assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape, name
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), name
    assert results[True][3][E - 2:].abs().sum() == 0 and results[True][4][E - 2:].abs().sum() == 0  # idle experts
