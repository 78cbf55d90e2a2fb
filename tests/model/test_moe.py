"""The MoE FFN options in the model: shared experts (gated or not), dense first layers, sigmoid
routing; gradients reach every parameter; fp64 decoding exactness and routing replay still hold;
config validation names the field and the allowed values."""

from __future__ import annotations

import pytest
import torch

from jointrl.model import KVCache, MoEConfig, MoETransformer

# Every MoE option at once: a dense first layer, a gated shared expert, sigmoid + group-limited
# routing with scaling, and OLMoE's q/k-norm over all heads.
FULL = MoEConfig.preset(
    "tiny_moe", num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96, num_experts=8,
    n_shared_experts=1, shared_expert_gate=True, scoring_func="sigmoid", n_group=2, topk_group=1,
    routed_scaling_factor=2.0, qk_norm="full")


def test_layer_layout_and_parameter_names():
    model = MoETransformer.from_config(FULL)
    names = set(model.state_dict())
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense SwiGLU, DeepSeek-V3 names
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    for i in (1, 2):
        p = f"model.layers.{i}.mlp."
        assert {p + "gate.weight", p + "gate.e_score_correction_bias", p + "experts.gate_up_proj",
                p + "experts.down_proj", p + "shared_experts.gate_proj.weight",
                p + "shared_experts.up_proj.weight", p + "shared_experts.down_proj.weight",
                p + "shared_expert_gate.weight"} <= names
    assert model.state_dict()["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    assert model.state_dict()["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (32, 64)
    assert model.state_dict()["model.layers.1.self_attn.q_norm.weight"].shape == (4 * 16,)
    assert "model.layers.0.self_attn.q_norm.weight" not in MoETransformer.from_config(
        MoEConfig.preset("tiny_moe", qk_norm="none")).state_dict()


def test_every_parameter_gets_a_gradient():
    model = MoETransformer.from_config(FULL, seed=6)
    ids = torch.randint(0, FULL.vocab_size, (4, 24), generator=torch.Generator().manual_seed(6))
    out = model(ids[:, :-1])
    assert out.topk_ids.shape == (4, 23, 2, 2) and out.expert_load.shape == (2, 8)
    assert set(out.topk_ids.unique().tolist()) == set(range(FULL.num_experts))  # all experts used
    groups = out.topk_ids // 4  # n_group=2 of 4 experts, topk_group=1: both experts in one group
    assert torch.equal(groups[..., 0], groups[..., 1])
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, FULL.vocab_size), ids[:, 1:].reshape(-1))
    (ce + FULL.router_aux_loss_coef * out.aux_loss).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert not bias.requires_grad  # moved only by update_router_bias


def test_incremental_decoding_equals_full_forward_fp64():
    model = MoETransformer.from_config(FULL, dtype=torch.float64, seed=1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    ids = torch.randint(0, FULL.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.empty(FULL, batch=2, dtype=torch.float64)
        parts = [model(ids[:, :6], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(6, 10)]
    assert (torch.cat([p.logits for p in parts], dim=1) - full.logits).abs().max() < 1e-10
    assert torch.equal(torch.cat([p.topk_ids for p in parts], dim=1), full.topk_ids)


def test_routing_replay_with_dense_layers():
    model = MoETransformer.from_config(FULL, seed=2)
    ids = torch.randint(0, FULL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    own = model(ids)
    assert torch.equal(model(ids, routed_experts=own.topk_ids).logits, own.logits)
    other = (own.topk_ids + 1) % FULL.num_experts
    out = model(ids, routed_experts=other)
    assert torch.equal(out.topk_ids, other) and (out.logits - own.logits).abs().max() > 1e-4
    with pytest.raises(ValueError, match="num_moe_layers"):
        model(ids, routed_experts=torch.zeros(2, 9, 3, 2, dtype=torch.long))


def test_shared_expert_gate_scales_the_shared_output():
    """Gate weight 0 → sigmoid 1/2: the block output is routed + shared / 2."""
    config = MoEConfig.preset("tiny_moe", n_shared_experts=2, shared_expert_gate=True)
    block = MoETransformer.from_config(config, dtype=torch.float64, seed=3).model.layers[0].mlp
    x_BTH = torch.randn(2, 5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        block.shared_expert_gate.weight.zero_()
        y_BTH, _, _, ids_Nk = block(x_BTH)
        x_NH = x_BTH.reshape(-1, 64)
        routed_NH = block.experts(x_NH, ids_Nk, block.gate(x_NH)[3])
        expected = routed_NH + 0.5 * block.shared_experts(x_NH)
    assert (y_BTH.reshape(-1, 64) - expected).abs().max() < 1e-14


@pytest.mark.parametrize(("overrides", "message"), [
    ({"scoring_func": "relu"}, r"scoring_func must be one of \['softmax', 'sigmoid'\]"),
    ({"qk_norm": "rms"}, r"qk_norm must be one of \['head', 'full', 'none'\]"),
    ({"n_group": 2}, "n_group=2 .* needs scoring_func='sigmoid'"),
    ({"scoring_func": "sigmoid", "n_group": 3}, "n_group=3 must divide num_experts=4"),
    ({"scoring_func": "sigmoid", "n_group": 2, "topk_group": 3}, r"topk_group must be in 1..n_group=2"),
    ({"scoring_func": "sigmoid", "num_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 1},
     "num_experts_per_tok=3 exceeds"),
    ({"first_k_dense_replace": 2}, r"first_k_dense_replace must be in 0..num_hidden_layers-1=1"),
    ({"n_shared_experts": -1}, "n_shared_experts must be an int >= 0"),
    ({"shared_expert_gate": True}, "shared_expert_gate .* needs n_shared_experts >= 1"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a float > 0"),
    ({"intermediate_size": 0}, "intermediate_size must be an int >= 1"),
])
def test_config_validation_names_the_field_and_allowed_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig.preset("tiny_moe", **overrides)


def test_mxfp4_resident_experts_follow_the_module_and_stay_out_of_the_state_dict():
    """``Experts.load_mxfp4`` on the torch table: the layer's output equals the same layer holding the
    dequantized experts densely; the blocks move with ``.to`` (uint8, never cast), are absent from
    ``state_dict``, and ``drop_mxfp4`` returns to the dense parameters."""
    from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from jointrl.model.moe import Experts

    cfg = MoEConfig.preset("tiny_moe")
    g = torch.Generator().manual_seed(0)
    ex, dense = Experts(cfg), Experts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.2, generator=g)
        ex.down_proj.normal_(0, 0.2, generator=g)
    gu, dn = quantize_mxfp4(ex.gate_up_proj.detach()), quantize_mxfp4(ex.down_proj.detach())
    with torch.no_grad():
        dense.gate_up_proj.copy_(dequantize_mxfp4(*gu, dtype=torch.float32))
        dense.down_proj.copy_(dequantize_mxfp4(*dn, dtype=torch.float32))
    x = torch.randn(9, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    keys = set(ex.state_dict())
    ex.load_mxfp4(*gu, *dn)
    assert set(ex.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(ex(x, ids, w), dense(x, ids, w), rtol=1e-5, atol=1e-6)
        ex.double()
        assert ex.mxfp4_down_scales.dtype == torch.uint8 and torch.equal(ex.mxfp4_down_blocks, dn[0])
        ex.float()
        ex.drop_mxfp4()
        assert ex.mxfp4_gate_up_blocks is None
        assert (ex(x, ids, w) - dense(x, ids, w)).abs().max() > 1e-4  # the unquantized experts again


def test_mxfp4_resident_experts_are_copies_not_views_of_the_payload():
    """``load_mxfp4`` from views into one larger buffer (as a push bucket delivers them): the held blocks have
    storage of their own and of their own size, so the bucket's payload is not kept alive."""
    from jointrl.kernels.mxfp4 import quantize_mxfp4
    from jointrl.model.moe import MXFP4_BUFFERS, Experts

    cfg = MoEConfig.preset("tiny_moe")
    ex = Experts(cfg)
    g = torch.Generator().manual_seed(1)
    gu = quantize_mxfp4(torch.randn(ex.gate_up_proj.shape, generator=g))
    dn = quantize_mxfp4(torch.randn(ex.down_proj.shape, generator=g))
    parts = (*gu, *dn)
    payload = torch.cat([t.reshape(-1) for t in parts])
    views, at = [], 0
    for t in parts:
        views.append(payload[at:at + t.numel()].view(t.shape))
        at += t.numel()
    ex.load_mxfp4(*views)
    for name, t in zip(MXFP4_BUFFERS, parts):
        held = getattr(ex, name)
        assert torch.equal(held, t)
        assert held.untyped_storage().data_ptr() != payload.untyped_storage().data_ptr()
        assert held.untyped_storage().nbytes() == held.numel()
