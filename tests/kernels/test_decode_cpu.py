"""The per-row decode kernels of ``kernels/decode_cpu`` against their torch references (the model's
own arithmetic): awkward shapes (one row, odd widths, D not a multiple of the vector width, k = 1
and k = E), float64 and float32, with and without q/k-norm; the KV write lands in exactly the
given slots and nowhere else."""

import pytest
import torch

from jointrl.kernels import decode_cpu
from jointrl.model.norm import RMSNorm
from jointrl.model.rope import rotate_half
from jointrl.model.routing import TopKRouter
from jointrl.model import MoEConfig


@pytest.fixture(autouse=True)
def kernel():
    if decode_cpu.load_kernel() is None:  # the public functions then are the references
        pytest.skip("no C++ toolchain here")


TOL = {torch.float64: 1e-13, torch.float32: 2e-6}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,H", [(1, 256), (7, 60), (33, 5)])
def test_rms_norm_equals_the_model_norm(dtype, N, H):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(H, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=g, dtype=dtype))
    x_NH = torch.randn(N, H, generator=g, dtype=dtype) * 3
    ref = norm(x_NH).detach()
    out = decode_cpu.rms_norm(x_NH, norm.weight.detach(), norm.eps)
    assert (out - ref).abs().max() <= TOL[dtype] * ref.abs().max()
    assert torch.equal(decode_cpu.rms_norm_torch(x_NH, norm.weight.detach(), norm.eps), ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,Hq,Hkv,D,normed", [(1, 4, 2, 64, True), (5, 3, 3, 6, True), (9, 2, 1, 18, False)])
def test_qk_norm_rope_store_equals_norm_rope_and_index_copy(dtype, N, Hq, Hkv, D, normed):
    g = torch.Generator().manual_seed(1)
    P = 3 * N + 2
    qkv_NF = torch.randn(N, (Hq + 2 * Hkv) * D, generator=g, dtype=dtype)
    w_GD = torch.randn(Hq + Hkv, D, generator=g, dtype=dtype) if normed else None
    angle_ND = torch.rand(N, D, generator=g, dtype=dtype) * 6
    cos_ND, sin_ND = angle_ND.cos(), angle_ND.sin()
    slot_N = torch.randperm(P, generator=g)[:N]
    kv_ref = torch.full((P, 2, Hkv, D), float("nan"), dtype=dtype)
    kv_out = kv_ref.clone()
    # the reference by the model's modules: per-head RMSNorm, rotate_half RoPE
    qk_NGD = qkv_NF[:, :(Hq + Hkv) * D].view(N, Hq + Hkv, D)
    if normed:
        qk_NGD = w_GD * (qk_NGD * torch.rsqrt(qk_NGD.pow(2).mean(-1, keepdim=True) + 1e-6))
    qk_NGD = qk_NGD * cos_ND[:, None] + rotate_half(qk_NGD) * sin_ND[:, None]
    q_ref = qk_NGD[:, :Hq]
    kv_ref[slot_N, 0] = qk_NGD[:, Hq:]
    kv_ref[slot_N, 1] = qkv_NF[:, (Hq + Hkv) * D:].view(N, Hkv, D)
    q_out = decode_cpu.qk_norm_rope_store(qkv_NF, w_GD, 1e-6, cos_ND, sin_ND, kv_out, slot_N, Hq, Hkv)
    scale = qkv_NF.abs().max()
    assert q_out.shape == (N, Hq, D)
    assert (q_out - q_ref).abs().max() <= TOL[dtype] * scale * 10
    written = torch.zeros(P, dtype=torch.bool)
    written[slot_N] = True
    assert kv_out[~written].isnan().all()  # nothing outside the slots
    assert (kv_out[written] - kv_ref[written]).abs().max() <= TOL[dtype] * scale * 10
    kv_t = torch.full_like(kv_ref, float("nan"))
    q_t = decode_cpu.qk_norm_rope_store_torch(qkv_NF, w_GD, 1e-6, cos_ND, sin_ND, kv_t, slot_N, Hq, Hkv)
    assert torch.allclose(q_t, q_ref, rtol=0, atol=TOL[dtype] * scale * 10)
    assert torch.allclose(kv_t[written], kv_ref[written], rtol=0, atol=TOL[dtype] * scale * 10)


@pytest.mark.parametrize("normed", [True, False])
def test_qk_norm_rope_store_rounds_into_a_bfloat16_cache_as_torch_does(normed):
    """A bfloat16 cache under float32 (rollout.kv_dtype): the stored keys and values are the kernel's
    float32 results rounded as ``.to(torch.bfloat16)`` rounds -- v bit for bit, k within one bfloat16 ulp
    of the torch reference (its float32 k may differ in the last bits before the rounding)."""
    g = torch.Generator().manual_seed(3)
    N, Hq, Hkv, D, P = 7, 4, 2, 64, 40
    qkv_NF = torch.randn(N, (Hq + 2 * Hkv) * D, generator=g)
    w_GD = torch.randn(Hq + Hkv, D, generator=g) if normed else None
    angle_ND = torch.rand(N, D, generator=g) * 6
    cos_ND, sin_ND = angle_ND.cos(), angle_ND.sin()
    slot_N = torch.randperm(P, generator=g)[:N]
    kv_out = torch.zeros(P, 2, Hkv, D, dtype=torch.bfloat16)
    kv_t = kv_out.clone()
    q_out = decode_cpu.qk_norm_rope_store(qkv_NF, w_GD, 1e-6, cos_ND, sin_ND, kv_out, slot_N, Hq, Hkv)
    q_t = decode_cpu.qk_norm_rope_store_torch(qkv_NF, w_GD, 1e-6, cos_ND, sin_ND, kv_t, slot_N, Hq, Hkv)
    assert q_out.dtype == torch.float32 and (q_out - q_t).abs().max() <= 1e-5 * qkv_NF.abs().max()
    assert torch.equal(kv_out[:, 1], kv_t[:, 1])
    k_out, k_t = kv_out[:, 0].float(), kv_t[:, 0].float()
    assert ((k_out - k_t).abs() <= k_t.abs() * 2 ** -7).all()
    # the kernel's own float32 keys, rounded by torch, are exactly what it stored
    kv_f = torch.zeros(P, 2, Hkv, D)
    decode_cpu.qk_norm_rope_store(qkv_NF, w_GD, 1e-6, cos_ND, sin_ND, kv_f, slot_N, Hq, Hkv)
    assert torch.equal(kv_f.to(torch.bfloat16), kv_out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("N,E,k,normalize,scale", [(1, 16, 2, True, 1.0), (13, 5, 1, False, 1.0),
                                                  (6, 8, 8, True, 2.5), (40, 60, 3, False, 1.0)])
def test_route_softmax_topk_equals_the_router(dtype, N, E, k, normalize, scale):
    cfg = MoEConfig(hidden_size=12, num_experts=E, num_experts_per_tok=k, norm_topk_prob=normalize,
                    routed_scaling_factor=scale)
    router = TopKRouter(cfg).to(dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, 12, generator=g, dtype=dtype))
    x_NH = torch.randn(N, 12, generator=g, dtype=dtype)
    with torch.no_grad():
        logits_NE, _, ids_ref, w_ref = router(x_NH)
    ids_Nk, w_Nk = decode_cpu.route_softmax_topk(logits_NE, k, normalize, scale)
    assert torch.equal(ids_Nk, ids_ref)
    assert (w_Nk - w_ref).abs().max() <= TOL[dtype] * max(scale, 1.0)
    ids_t, w_t = decode_cpu.route_softmax_topk_torch(logits_NE, k, normalize, scale)
    assert torch.equal(ids_t, ids_ref) and torch.allclose(w_t, w_ref, rtol=0, atol=TOL[dtype] * max(scale, 1.0))
