"""MXFP4 MoE matmul: the torch reference against an independent per-token loop and against
model.moe.Experts on the dequantized weights; the device-side tile schedule.

The Triton kernels are compared with this reference in tests/kernels/interpreted/ and compiled
for sm_90 in test_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jointrl.kernels import dispatch
from jointrl.kernels import moe_matmul as mm
from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _weights(E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_mxfp4(torch.randn(E, 2 * I, H, generator=g) * 0.2), quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.2)


def test_reference_equals_a_per_token_loop():
    E, H, I, N, k = 5, 64, 32, 23, 3
    (gub, gus), (db, ds) = _weights(E, H, I, seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])  # expert 4 unused
    w = torch.rand(N, k, generator=g)
    with dispatch.backend("torch"):
        y = mm.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds)
    gu = dequantize_mxfp4(gub, gus, torch.float64)
    dn = dequantize_mxfp4(db, ds, torch.float64)
    want = torch.zeros(N, H, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = ids[n, j]
            gate, up = (gu[e] @ x[n].double()).split(I)
            want[n] += w[n, j].double() * (dn[e] @ (F.silu(gate) * up))
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-6  # fp32 against float64


def test_reference_equals_model_experts_on_dequantized_weights():
    from jointrl.model import MoEConfig
    from jointrl.model.moe import Experts

    E, H, I, N, k = 4, 32, 64, 17, 2
    (gub, gus), (db, ds) = _weights(E, H, I, seed=2)
    experts = Experts(MoEConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E))
    experts.gate_up_proj = torch.nn.Parameter(dequantize_mxfp4(gub, gus, torch.float32))
    experts.down_proj = torch.nn.Parameter(dequantize_mxfp4(db, ds, torch.float32))
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(N, H, generator=g), torch.randint(0, E, (N, k), generator=g), torch.rand(N, k, generator=g)
    with dispatch.backend("torch"), torch.no_grad():
        torch.testing.assert_close(mm.moe_experts_mxfp4(x, ids, w, gub, gus, db, ds), experts(x, ids, w),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_schedule_covers_every_row_once(block_m):
    counts = torch.tensor([0, 17, 16, 0, 1, 130, 0])
    offsets = torch.zeros(8, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    A = int(counts.sum())
    expert_T, row_T = mm._tiles(offsets, A, block_m)
    covered = torch.zeros(A, dtype=torch.long)
    for e, r in zip(expert_T.tolist(), row_T.tolist()):
        if e < 0:
            continue
        end = min(r + block_m, int(offsets[e + 1]))
        assert offsets[e] <= r < end
        covered[r:end] += 1
    assert torch.equal(covered, torch.ones(A, dtype=torch.long))
    assert int((expert_T >= 0).sum()) == int(((counts + block_m - 1) // block_m).sum())


def test_expert_counts_without_bincount_equal_bincount():
    """``_counts`` (a scatter-add: no host sync, so a CUDA graph can capture ``_routed``) counts as
    ``torch.bincount`` does, unused experts and the last one included."""
    g = torch.Generator().manual_seed(7)
    for E, A in ((1, 5), (7, 40), (128, 8 * 128)):
        ids_A = torch.randint(0, max(E - 1, 1), (A,), generator=g)  # the last expert unused where E > 1
        assert torch.equal(mm._counts(ids_A, E), torch.bincount(ids_A, minlength=E))


def test_input_validation():
    (gub, gus), (db, ds) = _weights(2, 64, 32, seed=4)
    offsets = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[A, 64\]"):
        mm.moe_swiglu_mxfp4(torch.zeros(2, 32), offsets, gub, gus)
    with pytest.raises(ValueError, match="E \\+ 1"):
        mm.moe_swiglu_mxfp4(torch.zeros(2, 64), offsets[:2], gub, gus)
    with pytest.raises(TypeError, match="uint8"):
        mm.moe_down_mxfp4(torch.zeros(2, 32), offsets, db.float(), ds, torch.ones(2))
    with pytest.raises(ValueError, match="weights_A"):
        mm.moe_down_mxfp4(torch.zeros(2, 32), offsets, db, ds, torch.ones(3))
    with pytest.raises(ValueError, match=r"\[N, k\]"):
        mm.moe_experts_mxfp4(torch.zeros(2, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), gub, gus, db, ds)
