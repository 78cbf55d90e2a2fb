"""KDA: parity with transformers' kimi_linear (torch fallback), chunked ≡ recurrent, state carry-over."""

from __future__ import annotations

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import (
    KimiLinearDeltaAttention,
    chunk_kimi_delta_attention,
)

from jointrl.model import MoEConfig
from jointrl.kernels.kda import kda_chunk_torch as kda_chunked
from jointrl.kernels.kda import kda_recurrent_torch as kda_recurrent
from jointrl.model.kda import KimiDeltaAttention, l2norm

CFG = MoEConfig(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)


def _inputs(B: int, T: int, N: int, K: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)
    q, k, v = l2norm(rnd(B, T, N, K)), l2norm(rnd(B, T, N, K)), rnd(B, T, N, K)
    g = -torch.rand(B, T, N, K, generator=gen, dtype=dtype) * 0.7   # decays in (0.5, 1]
    beta = torch.rand(B, T, N, generator=gen, dtype=dtype)
    return q, k, v, g, beta, rnd(B, N, K, K)


def _hf_layer(seed: int = 0) -> tuple[KimiLinearDeltaAttention, KimiDeltaAttention]:
    hf_cfg = KimiLinearConfig(hidden_size=CFG.hidden_size, linear_num_heads=4, linear_head_dim=16,
                              linear_conv_kernel_dim=4, num_hidden_layers=1, rms_norm_eps=1e-6)
    hf = KimiLinearDeltaAttention(hf_cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ours = KimiDeltaAttention(CFG, 0)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in hf.named_parameters()]
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("T", [1, 37, 130])
def test_layer_equals_transformers_kimi_linear(T):
    hf, ours = _hf_layer()
    x = torch.randn(2, T, CFG.hidden_size, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        ref = hf(x)
        y, _, _ = ours.step(x)
        y_rec, _, _ = ours.step(x, recurrent=True)
    assert (y - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    assert (y_rec - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_chunked_op_equals_transformers_chunk_kda_with_state():
    q, k, v, g, beta, s0 = _inputs(2, 100, 3, 8, seed=1, dtype=torch.float32)
    ref_o, ref_s = chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=64, initial_state=s0,
                                              output_final_state=True)
    o, s = kda_chunked(q, k, v, g, beta, s0, chunk=64)
    assert (o - ref_o).abs().max() < 1e-4 and (s - ref_s).abs().max() < 1e-4


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_equals_recurrent_fp64(T):
    q, k, v, g, beta, s0 = _inputs(2, T, 3, 8, seed=T)
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, s0)
    o_chk, s_chk = kda_chunked(q, k, v, g, beta, s0, chunk=64)
    assert o_rec.shape == o_chk.shape == (2, T, 3, 8)
    assert (o_rec - o_chk).abs().max() < 1e-10
    assert (s_rec - s_chk).abs().max() < 1e-10



@pytest.mark.parametrize("decay, chunk", [(0.7, 16), (30.0, 64), (200.0, 64)])
def test_chunked_gradients_equal_recurrent_fp64(decay, chunk):
    """Training differentiates the chunked form: its gradients (every input, the initial state
    included) equal the token-by-token recurrence's. The decays cover each form of the decayed
    products: decay 0.7 factored; 30 (a mean log-decay of 15 a token) spans more than 600 in a
    64-token chunk but not in its 32-token halves, which are factored; 200 spans more than 600
    even in 8 tokens, which takes the direct form (64 -> 32 -> 16 -> 8)."""
    q, k, v, g, beta, s0 = _inputs(2, 70, 3, 8, seed=7)
    g = g * (decay / 0.7)
    results = []
    for form in (lambda *x: kda_recurrent(*x), lambda *x: kda_chunked(*x, chunk=chunk)):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
        o, s = form(*inputs)
        (o.square().sum() + s.square().sum()).backward()
        results.append([o.detach(), s.detach()] + [x.grad for x in inputs])
    for ref, got in zip(*results, strict=True):
        assert (ref - got).abs().max() < 1e-10 * max(1.0, ref.abs().max().item())

@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_layer_chunked_equals_recurrent_and_split_prefill_fp64(T):
    """The whole layer, both forms, and a prefill split in two continued through its states."""
    layer = KimiDeltaAttention(CFG, 0).double()
    gen = torch.Generator().manual_seed(T)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
        x = torch.randn(2, T, CFG.hidden_size, generator=gen, dtype=torch.float64)
        y_chk, conv_chk, s_chk = layer.step(x, recurrent=False)
        y_rec, conv_rec, s_rec = layer.step(x, recurrent=True)
        cut = T // 2
        y_a, conv_a, s_a = layer.step(x[:, :cut], recurrent=False)
        y_b, conv_b, s_b = layer.step(x[:, cut:], conv_state=conv_a, recurrent_state=s_a)
    assert (y_chk - y_rec).abs().max() < 1e-10 and (s_chk - s_rec).abs().max() < 1e-10
    assert torch.equal(conv_chk, conv_rec)
    assert (torch.cat((y_a, y_b), dim=1) - y_chk).abs().max() < 1e-10
    assert (s_b - s_chk).abs().max() < 1e-10 and (conv_b - conv_chk).abs().max() < 1e-12


def test_safe_gate_lower_bound():
    layer = KimiDeltaAttention(MoEConfig(linear_lower_bound=-5.0), 0)
    with torch.no_grad():
        layer.forget_gate.dt_bias.normal_(0, 10)  # large pre-activations: softplus would pass -5
        g = layer.forget_gate(torch.randn(2, 9, 64) * 10)
    assert (g >= -5.0).all() and (g < 0).all() and g.min() < -4.0  # sigmoid may round to 1: g = lb
    with pytest.raises(ValueError, match="linear_lower_bound"):
        MoEConfig(linear_lower_bound=1.0)


def test_strong_forgetting_keeps_the_chunk_cost():
    """A trained forget gate can forget more than e^-80 per channel inside a float32 chunk. The
    chunked form then halves its blocks instead of computing exp over a [.., C, C, K] tensor: the
    largest tensor it exponentiates is at most 8x the weak-decay case's [.., C, K] (it was C = 64x,
    and a training step took ~10x longer)."""
    from jointrl.kernels import kda as kda_mod  # its module, not the function: the test patches Tensor.exp

    sizes = []
    real = torch.Tensor.exp
    for decay in (0.7, 20.0, 200.0):
        q, k, v, g, beta, s0 = _inputs(1, 128, 2, 8, seed=3, dtype=torch.float32)
        g = g * (decay / 0.7)
        biggest = [0]
        def exp(x, _real=real, _b=biggest):
            _b[0] = max(_b[0], x.numel())
            return _real(x)
        torch.Tensor.exp = exp
        try:
            o, s = kda_mod.kda_chunk_torch(q, k, v, g, beta, s0, chunk=64)
        finally:
            torch.Tensor.exp = real
        o_rec, s_rec = kda_recurrent(q, k, v, g, beta, s0)
        assert (o - o_rec).abs().max() < 1e-4 * max(1.0, o_rec.abs().max().item())
        sizes.append(biggest[0])
    assert max(sizes[1:]) <= 8 * sizes[0], sizes
