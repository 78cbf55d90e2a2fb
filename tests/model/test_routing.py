"""The router: sigmoid + group-limited routing equals transformers' DeepSeek-V3 MoE block; the
auxiliary-loss-free bias update balances a skewed load; the balance loss for both scoring rules."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.moe import SparseMoeBlock
from jointrl.model.routing import TopKRouter, expert_load, load_balancing_loss, update_router_bias

# 8 experts in 4 groups of 2; a token may use only its best 2 groups, then its top-3 experts in them.
SIGMOID = MoEConfig.preset(
    "tiny_moe", hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
    scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2)


def _deepseek_pair(seed: int = 0) -> tuple[DeepseekV3MoE, SparseMoeBlock]:
    """HF's DeepSeek-V3 MoE block and ours, float64, sharing random weights and a random bias."""
    hf_config = DeepseekV3Config(
        hidden_size=SIGMOID.hidden_size, moe_intermediate_size=SIGMOID.moe_intermediate_size,
        n_routed_experts=SIGMOID.num_experts, num_experts_per_tok=SIGMOID.num_experts_per_tok,
        n_group=SIGMOID.n_group, topk_group=SIGMOID.topk_group, n_shared_experts=SIGMOID.n_shared_experts,
        routed_scaling_factor=SIGMOID.routed_scaling_factor, norm_topk_prob=True, hidden_act="silu")
    hf = DeepseekV3MoE(hf_config).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(SIGMOID.num_experts, generator=gen) * 0.2)
    ours = SparseMoeBlock(SIGMOID).double()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected  # same parameter names: experts, gate (+ bias), shared_experts
    return hf, ours


def test_sigmoid_group_limited_router_equals_deepseek_v3_block():
    """fp64 block parity. HF's gate runs in float32 whatever the module dtype, ours in float64, so the
    whole-block comparison is at fp32 precision; the experts + shared experts + scaled combination are
    then checked exactly by feeding HF's expert modules our routing."""
    hf, ours = _deepseek_pair()
    x_BTH = torch.randn(4, 16, SIGMOID.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_NH = x_BTH.reshape(-1, SIGMOID.hidden_size)
    with torch.no_grad():
        y_ref = hf(x_BTH)
        y_ours, _, probs_NE, ids_Nk = ours(x_BTH)
        _, w_ref_Nk, ids_ref_Nk = hf.gate(x_BTH)
        _, _, _, w_Nk = ours.gate(x_NH)
    assert torch.equal(ids_Nk.sort(-1).values, ids_ref_Nk.sort(-1).values)
    order_ref, order = ids_ref_Nk.argsort(-1), ids_Nk.argsort(-1)
    assert (w_Nk.gather(1, order) - w_ref_Nk.gather(1, order_ref)).abs().max() < 1e-6
    assert (y_ours - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    # Exact composition: HF's experts and shared experts under our routing.
    with torch.no_grad():
        y_exact = hf.experts(x_NH, ids_Nk, w_Nk).view_as(x_BTH) + hf.shared_experts(x_BTH)
    assert (y_ours - y_exact).abs().max() < 1e-12
    # The weights are routed_scaling_factor · renormalised sigmoid scores, bias-free:
    scores_Nk = torch.sigmoid(x_NH @ ours.gate.weight.T).gather(1, ids_Nk)
    assert torch.allclose(w_Nk, 2.5 * scores_Nk / scores_Nk.sum(-1, keepdim=True), atol=1e-14)
    assert torch.allclose(probs_NE.sum(-1), torch.ones(len(x_NH), dtype=torch.float64))
    # The test exercises both the group limit and the bias: each changes some token's choice.
    scores_NE = torch.sigmoid(x_NH @ ours.gate.weight.T)
    plain = (scores_NE + ours.gate.e_score_correction_bias).topk(3).indices.sort(-1).values
    no_bias = scores_NE.topk(3).indices.sort(-1).values
    assert (plain != ids_Nk.sort(-1).values).any(-1).sum() > 0
    assert (no_bias != ids_Nk.sort(-1).values).any(-1).sum() > 0
    groups_Nk = ids_Nk // 2
    assert all(len(set(row.tolist())) <= 2 for row in groups_Nk)


def test_bias_update_balances_a_skewed_load():
    """Tokens share one direction u that the router's rows for experts 0 and 1 align with, so those
    two take most of the load. DeepSeek-V3's update b += γ·sign(mean − load) (γ = 0.02, then 0.004)
    must drive the MaxVio (max load − mean) / mean from > 2 to < 0.3, while the routing weights
    never see b."""
    config = MoEConfig.preset("tiny_moe", hidden_size=32, num_experts=8, num_experts_per_tok=2,
                              scoring_func="sigmoid", norm_topk_prob=True)
    block = SparseMoeBlock(config).double()
    gen = torch.Generator().manual_seed(0)
    u_H = torch.randn(32, generator=gen, dtype=torch.float64)
    u_H /= u_H.norm()
    x_NH = 3 * u_H + 0.5 * torch.randn(256, 32, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        block.gate.weight.copy_(0.3 * torch.randn(8, 32, generator=gen, dtype=torch.float64))
        block.gate.weight[:2] += 1.5 * u_H
    history = []
    with torch.no_grad():
        for step in range(60):
            ids_Nk = block.gate(x_NH)[2]
            load_1E = expert_load(ids_Nk, 8)[None]
            rate = 0.02 if step < 40 else 0.004
            history.append(update_router_bias(block, load_1E, rate=rate)["router/max_violation"])
        final = update_router_bias(block, expert_load(block.gate(x_NH)[2], 8)[None], rate=1e-6)
    assert history[0] > 2.0, history[0]
    assert final["router/max_violation"] < 0.3, history
    bias_E = block.gate.e_score_correction_bias
    assert bias_E[:2].max() < bias_E[2:].min()  # the overloaded experts were pushed down
    # Selection only: at fixed ids, the weights are the same with and without the bias.
    ids_Nk = torch.randint(0, 8, (256, 2), generator=gen).sort(-1).values
    ids_Nk[:, 1] = torch.where(ids_Nk[:, 1] == ids_Nk[:, 0], (ids_Nk[:, 0] + 1) % 8, ids_Nk[:, 1])
    with torch.no_grad():
        w_biased = block.gate(x_NH, ids_Nk)[3]
        bias_E.zero_()
        assert torch.equal(block.gate(x_NH, ids_Nk)[3], w_biased)


def test_bias_update_checks_its_inputs():
    model = MoETransformer.from_config(MoEConfig.preset("tiny_moe"))
    with pytest.raises(ValueError, match="sigmoid"):
        update_router_bias(model, torch.ones(2, 4), rate=1e-3)
    with pytest.raises(ValueError, match="load_LE"):
        update_router_bias(model, torch.ones(3, 4), rate=1e-3)


def test_model_returns_per_layer_load_and_bias_stays_float32():
    config = MoEConfig.preset("tiny_moe", scoring_func="sigmoid", num_hidden_layers=3, first_k_dense_replace=1)
    model = MoETransformer.from_config(config, dtype=torch.bfloat16)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2 and all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False
    out = model(ids, attention_mask=mask)
    assert out.expert_load.shape == (2, 4) and out.topk_ids.shape == (2, 7, 2, 2)
    assert out.expert_load.sum(-1).tolist() == [11 * 2, 11 * 2]  # 11 real tokens, k = 2
    for j in range(2):
        assert torch.equal(out.expert_load[j], expert_load(out.topk_ids[:, :, j][mask], 4))
    update_router_bias(model, out.expert_load, rate=1e-3)
    assert routers[0].e_score_correction_bias.abs().max().item() == pytest.approx(1e-3)  # not rounded away


def test_balance_loss_is_k_at_uniform_routing_for_both_scoring_rules():
    """E · Σ f_e P_e = k when every expert gets the same share and the same mean probability."""
    E, k, N = 4, 2, 8
    ids_Nk = torch.tensor([[0, 1], [2, 3]] * (N // 2))
    probs_NE = torch.full((N, E), 1 / E, dtype=torch.float64)
    assert load_balancing_loss([probs_NE], [ids_Nk], E).item() == pytest.approx(k)
    skewed_NE = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * N, dtype=torch.float64)
    skewed_ids = torch.tensor([[0, 1]] * N)
    assert load_balancing_loss([skewed_NE], [skewed_ids], E).item() > k
    # The sigmoid router's probs are its scores normalised over experts, so the loss is defined alike.
    block = SparseMoeBlock(MoEConfig.preset("tiny_moe", scoring_func="sigmoid")).double()
    torch.nn.init.normal_(block.gate.weight, generator=torch.Generator().manual_seed(0))
    x_NH = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, probs_NE, ids_Nk, _ = block.gate(x_NH)
    assert torch.allclose(probs_NE.sum(-1), torch.ones(16, dtype=torch.float64))
    loss = load_balancing_loss([probs_NE], [ids_Nk], 4)
    assert loss.requires_grad and torch.isfinite(loss)
