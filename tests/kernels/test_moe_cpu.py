"""The CPU MoE kernel against the per-expert torch loop of ``model.moe.Experts`` (the path the
learner trains through): awkward shapes (one token, experts left without tokens, k = 1 and 3,
widths not a multiple of the vector width), float64 and float32; and which path Experts takes."""

import pytest
import torch

from jointrl.kernels import moe_cpu
from jointrl.model import MoEConfig
from jointrl.model.moe import Experts


@pytest.fixture(autouse=True)
def kernel():
    if moe_cpu.load_kernel() is None:  # Experts then keeps its torch loop (use_kernel is False)
        pytest.skip("no C++ toolchain here")


def experts(E: int, H: int, I: int, dtype: torch.dtype, seed: int = 0) -> Experts:
    ex = Experts(MoEConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g, dtype=dtype) * 0.3)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g, dtype=dtype) * 0.3)
    return ex


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("N,k,E,H,I", [(1, 2, 16, 64, 32), (7, 1, 5, 60, 30), (33, 3, 8, 20, 9), (4, 2, 16, 8, 4),
                                     (50, 2, 3, 64, 36)])
def test_kernel_equals_the_per_expert_loop(dtype, tol, N, k, E, H, I):
    ex = experts(E, H, I, dtype)
    g = torch.Generator().manual_seed(1)
    x_NH = torch.randn(N, H, generator=g, dtype=dtype)
    ids_Nk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w_Nk = torch.rand(N, k, generator=g, dtype=dtype)
    out = moe_cpu.moe_experts(x_NH, ids_Nk, w_Nk, ex.gate_up_proj, ex.down_proj)
    with torch.enable_grad():  # gradients wanted: Experts takes the per-expert loop
        ref = ex(x_NH.requires_grad_(), ids_Nk, w_Nk)
    assert ref.grad_fn is not None
    assert (out - ref.detach()).abs().max() < tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it(dtype):
    """Bit for bit (rollout.batch_invariant relies on it): alone, or sharing its experts with 1-40 others."""
    ex = experts(4, 64, 32, dtype)
    g = torch.Generator().manual_seed(2)
    x_NH = torch.randn(41, 64, generator=g, dtype=dtype)
    ids_Nk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(41)])
    w_Nk = torch.rand(41, 2, generator=g, dtype=dtype)
    alone = moe_cpu.moe_experts(x_NH[:1], ids_Nk[:1], w_Nk[:1], ex.gate_up_proj, ex.down_proj)
    for n in (2, 3, 5, 41):
        crowd = moe_cpu.moe_experts(x_NH[:n].flip(0), ids_Nk[:n].flip(0), w_Nk[:n].flip(0), ex.gate_up_proj,
                                    ex.down_proj)
        assert torch.equal(crowd[-1], alone[0])


def test_experts_takes_the_kernel_for_inference_with_few_rows_per_expert(monkeypatch):
    ex = experts(4, 16, 8, torch.float64)
    x_NH, ids_Nk, w_Nk = torch.randn(3, 16, dtype=torch.float64), torch.tensor([[0, 1], [1, 2], [3, 0]]), \
        torch.rand(3, 2, dtype=torch.float64)
    calls = []
    monkeypatch.setattr(moe_cpu, "moe_experts", lambda *a: calls.append(1) or torch.zeros(3, 16, dtype=torch.float64))
    with torch.no_grad():
        ex(x_NH, ids_Nk, w_Nk)
        assert calls == [1]
        monkeypatch.setattr(moe_cpu, "MAX_ROWS_PER_EXPERT", 1)  # 6 assignments > 1 per expert x 4: the loop
        ex(x_NH, ids_Nk, w_Nk)
        assert calls == [1]


def test_bad_expert_id_is_an_error():
    ex = experts(4, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        moe_cpu.moe_experts(torch.zeros(1, 16), torch.tensor([[0, 4]]), torch.ones(1, 2), ex.gate_up_proj,
                            ex.down_proj)
