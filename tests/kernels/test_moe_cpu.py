"""The CPU MoE kernels (``moe_experts`` on the model's layout, ``moe_experts_packed`` on panels) against
the per-expert torch loop of ``model.moe.Experts`` (the path the learner trains through): awkward shapes
(one token, experts left without tokens, k = 1 and 3, widths not a multiple of the vector width or of
the panel), tokens crowding onto experts at batch 1, 2 and 32, float64 and float32; and which path
Experts takes."""

import pytest
import torch

from jointrl.kernels import moe_cpu
from jointrl.kernels.ops import kernels_for
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


def run(kind: str, ex: Experts, x_NH, ids_Nk, w_Nk):
    """``moe_experts`` on the model's layout ("rows") or ``moe_experts_packed`` on ``pack_experts``' panels."""
    if kind == "rows":
        return moe_cpu.moe_experts(x_NH, ids_Nk, w_Nk, ex.gate_up_proj, ex.down_proj)
    return moe_cpu.moe_experts_packed(x_NH, ids_Nk, w_Nk, *moe_cpu.pack_experts(ex.gate_up_proj, ex.down_proj),
                                      ex.down_proj.shape[2])


def reference(ex: Experts, x_NH, ids_Nk, w_Nk):
    with torch.enable_grad():  # gradients wanted: Experts takes the per-expert loop
        ref = ex(x_NH.clone().requires_grad_(), ids_Nk, w_Nk)
    assert ref.grad_fn is not None
    return ref.detach()


KINDS = ["rows", "packed"]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,k,E,H,I", [(1, 2, 16, 64, 32), (7, 1, 5, 60, 30), (33, 3, 8, 20, 9), (4, 2, 16, 8, 4),
                                     (50, 2, 3, 64, 36), (32, 2, 16, 256, 128)])
def test_kernel_equals_the_per_expert_loop(kind, dtype, N, k, E, H, I):
    ex = experts(E, H, I, dtype)
    g = torch.Generator().manual_seed(1)
    x_NH = torch.randn(N, H, generator=g, dtype=dtype)
    ids_Nk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w_Nk = torch.rand(N, k, generator=g, dtype=dtype)
    ref = reference(ex, x_NH, ids_Nk, w_Nk)
    assert (run(kind, ex, x_NH, ids_Nk, w_Nk) - ref).abs().max() < TOL[dtype] * ref.abs().max()


def routings(N: int, E: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """ids [N, 2] where the tokens crowd onto experts in different ways."""
    spread = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)])
    return {
        "spread": spread,  # a few tokens per expert (decode at batch 32: ~4)
        "all on expert 0": torch.stack([torch.zeros(N, dtype=torch.long), spread[:, 1].clamp(min=1)], 1),
        "all on experts 3 and 5": torch.tensor([[3, 5]] * N),  # each chosen by every token, the rest idle
        "one token on expert E-1": torch.cat([torch.tensor([[E - 1, 0]]), torch.randint(0, E - 1, (N - 1, 2),
                                                                                          generator=g)])[:N],
        "two tokens share their pair": torch.cat([torch.tensor([[2, 7], [7, 2]]), spread])[:N],
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N", [1, 2, 32])
def test_tokens_sharing_experts(kind, dtype, N):
    """Several tokens on one expert, an expert chosen by every token, by one token, and experts left idle, at
    batch 1, 2 and 32 (bench_moe's shape: H 256, I 128, 16 experts)."""
    ex = experts(16, 256, 128, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    x_NH = torch.randn(N, 256, generator=g, dtype=dtype)
    w_Nk = torch.rand(N, 2, generator=g, dtype=dtype)
    for name, ids_Nk in routings(N, 16, g).items():
        ref = reference(ex, x_NH, ids_Nk, w_Nk)
        err = (run(kind, ex, x_NH, ids_Nk, w_Nk) - ref).abs().max()
        assert err < TOL[dtype] * ref.abs().max(), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it(kind, dtype):
    """Bit for bit (rollout.batch_invariant relies on it): alone, or sharing its experts with 1-40 others."""
    ex = experts(4, 64, 32, dtype)
    g = torch.Generator().manual_seed(2)
    x_NH = torch.randn(41, 64, generator=g, dtype=dtype)
    ids_Nk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(41)])
    w_Nk = torch.rand(41, 2, generator=g, dtype=dtype)
    alone = run(kind, ex, x_NH[:1], ids_Nk[:1], w_Nk[:1])
    for n in (2, 3, 5, 6, 7, 13, 41):
        crowd = run(kind, ex, x_NH[:n].flip(0), ids_Nk[:n].flip(0), w_Nk[:n].flip(0))
        assert torch.equal(crowd[-1], alone[0])


def test_pack_experts_is_linear_cpus_pack_per_expert():
    from jointrl.kernels import linear_cpu

    gate_up, down = torch.randn(3, 40, 24, dtype=torch.float64), torch.randn(3, 24, 20, dtype=torch.float64)
    gate_up_p, down_p = moe_cpu.pack_experts(gate_up, down)
    assert gate_up_p.shape == (3, 3, 24, 16) and down_p.shape == (3, 2, 20, 16)
    for e in range(3):
        assert torch.equal(gate_up_p[e], linear_cpu.pack(gate_up[e])) and torch.equal(down_p[e], linear_cpu.pack(down[e]))


def test_experts_takes_the_kernel_for_inference_with_few_rows_per_expert(monkeypatch):
    """On the ``cpu`` kernel backend (the model hands its table to ``Experts``); the ``torch`` one keeps the loop."""
    if moe_cpu.load_kernel() is None:
        pytest.skip("the C++ kernels did not build here")
    ex = experts(4, 16, 8, torch.float64)
    calls = []
    monkeypatch.setattr(moe_cpu, "moe_experts", lambda *a: calls.append(1) or torch.zeros(3, 16, dtype=torch.float64))
    with torch.no_grad():
        ex(torch.randn(3, 16, dtype=torch.float64), torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.rand(3, 2, dtype=torch.float64))
    assert calls == []  # a module built alone has the torch table
    ex.kernels = kernels_for("cpu")
    x_NH, ids_Nk, w_Nk = torch.randn(3, 16, dtype=torch.float64), torch.tensor([[0, 1], [1, 2], [3, 0]]), \
        torch.rand(3, 2, dtype=torch.float64)
    with torch.no_grad():
        ex(x_NH, ids_Nk, w_Nk)
        assert calls == [1]
        monkeypatch.setattr(moe_cpu, "MAX_ROWS_PER_EXPERT", 1)  # 6 assignments > 1 per expert x 4: the loop
        ex(x_NH, ids_Nk, w_Nk)
        assert calls == [1]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_expert_id_is_an_error(kind):
    ex = experts(4, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        run(kind, ex, torch.zeros(1, 16), torch.tensor([[0, 4]]), torch.ones(1, 2))


@pytest.mark.parametrize("grid,N,k,E,H,I", [("mxfp4", 1, 2, 16, 64, 32), ("mxfp4", 32, 2, 16, 256, 128),
                                             ("bfloat16", 7, 1, 5, 60, 30), ("bfloat16", 33, 3, 8, 20, 9)])
def test_bfloat16_panels_of_mxfp4_experts_give_the_float32_panels_result_bit_for_bit(grid, N, k, E, H, I):
    """MXFP4-dequantized weights are exactly bfloat16s (as are weights rounded to bfloat16, for widths MXFP4's
    32-blocks do not divide): ``pack_experts_bf16`` stores the same numbers as ``pack_experts`` in half the
    bytes, and ``moe_experts_packed`` over them returns the float32 panels' output bit for bit (odd widths and
    idle experts included). A weight that is not a bfloat16 is refused."""
    from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    ex = experts(E, H, I, torch.float32)
    with torch.no_grad():
        for w in (ex.gate_up_proj, ex.down_proj):
            w.copy_(dequantize_mxfp4(*quantize_mxfp4(w), dtype=torch.float32) if grid == "mxfp4" else w.bfloat16())
    g = torch.Generator().manual_seed(2)
    x_NH = torch.randn(N, H, generator=g)
    ids_Nk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w_Nk = torch.rand(N, k, generator=g)
    panels32 = moe_cpu.pack_experts(ex.gate_up_proj, ex.down_proj)
    panels16 = tuple(torch.empty(s, dtype=torch.bfloat16) for s in moe_cpu.panel_shapes(ex.gate_up_proj, ex.down_proj))
    assert moe_cpu.pack_experts_bf16(ex.gate_up_proj, ex.down_proj, panels16)
    assert all(torch.equal(a.float(), b) for a, b in zip(panels16, panels32))
    assert torch.equal(moe_cpu.moe_experts_packed(x_NH, ids_Nk, w_Nk, *panels16, I),
                       moe_cpu.moe_experts_packed(x_NH, ids_Nk, w_Nk, *panels32, I))
    with torch.no_grad():
        ex.down_proj[-1, -1, -1] = 1.0 + 2.0 ** -10  # one weight off the bfloat16 grid (7 mantissa bits)
    assert not moe_cpu.pack_experts_bf16(ex.gate_up_proj, ex.down_proj, panels16)
    with pytest.raises(RuntimeError, match="bfloat16 panels under a float32 x"):
        moe_cpu.moe_experts_packed(x_NH.double(), ids_Nk, w_Nk.double(), *panels16, I)
