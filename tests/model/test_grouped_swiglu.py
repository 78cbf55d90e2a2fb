"""``GroupedSwiGLU`` (model/moe.py): values and gradients equal plain autograd over per-expert
slices, in float64, with experts that get no rows, one row, or every row."""

import pytest
import torch

from jointrl.model.moe import GroupedSwiGLU
from jointrl.rl.learner.expert_parallel import _run_experts


def _reference(x_AH, gate_up_EOH, down_EHI, counts):
    """Per-expert slices through plain autograd (the expert-parallel path's own expert loop)."""
    return _run_experts(x_AH, counts, gate_up_EOH, down_EHI)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [9, 0, 0, 0], [0, 2, 3, 4]])
def test_values_and_gradients_equal_autograd(counts):
    g = torch.Generator().manual_seed(sum(counts) + counts[0])
    E, H, I = len(counts), 12, 5
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((sum(counts), H), (E, 2 * I, H), (E, H, I))]
    dy = torch.randn(sum(counts), H, generator=g, dtype=torch.float64)
    results = []
    for fn in (_reference, GroupedSwiGLU.apply):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = fn(*leaves, counts)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for ref, got, name in zip(*results, ("y", "d_x", "d_gate_up", "d_down")):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.autograd.gradcheck(lambda *t: GroupedSwiGLU.apply(*t, counts),
                                    [t.clone().requires_grad_() for t in tensors])
