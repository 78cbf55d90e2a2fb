"""Kimi-Linear (KDA + MLA hybrid): a tiny random `KimiLinearForCausalLM` made here with transformers' class loads
through `load_hf` with equal logits on ragged prompts, exports back through `save_kimi_linear`, and MLA's two
forms (expanded, absorbed) and its latent cache agree with the full forward."""

from __future__ import annotations

import json

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.hf import load_hf, save_kimi_linear
from jointrl.model.kv_cache import KVCache
from jointrl.model.mla import MultiHeadLatentAttention, absorbed_pays
from jointrl.model.state import state_layout

KIMI_KINDS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _kimi_linear(q_lora_rank: int | None):
    """3 KDA layers + 1 MLA layer, a dense first MLP, then sigmoid routing over 2 groups of 4 experts with a
    shared expert; router, norms and KDA gates randomised so each matters."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(7)
    config = KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_local_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
        kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        layer_types=KIMI_KINDS, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif "layernorm" in name or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


def _ragged() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (3, 10), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    mask[2, 7:] = False  # right padding
    return ids, mask


@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q_proj", "q_lora"])
def test_kimi_linear_loads_and_exports_with_equal_logits(tmp_path, q_lora_rank):
    hf = _kimi_linear(q_lora_rank)
    hf.save_pretrained(tmp_path / "hf")  # the hub's layout (q/k/v_conv1d, per-expert w1/w2/w3, ...)
    ours = load_hf(tmp_path / "hf")
    assert ours.config.kinds == ("kda", "kda", "kda", "mla") and ours.config.first_k_dense_replace == 1
    assert ours.config.n_shared_experts == 1 and ours.config.q_lora_rank == q_lora_rank
    assert isinstance(ours.model.layers[3].self_attn, MultiHeadLatentAttention)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ids, mask = _ragged()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        out = ours(ids, attention_mask=mask).logits
    assert (out - ref)[mask].abs().max() <= 1e-5

    from transformers import KimiLinearForCausalLM

    save_kimi_linear(ours, tmp_path / "ours")
    back = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert back.config.layer_types == KIMI_KINDS and back.config.mlp_layer_types[0] == "dense"
    for name, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    with torch.no_grad():
        again = back(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
    assert (again - ref)[mask].abs().max() <= 1e-5
    assert load_hf(tmp_path / "ours").config == ours.config


@pytest.mark.parametrize(("field", "value"), [("mla_use_nope", False), ("num_key_value_heads", 2)])
def test_kimi_linear_refuses_what_its_mla_does_not_compute(tmp_path, field, value):
    """mla_use_nope false (the hub's flag: a rotated key part, which Kimi-Linear does not use); fewer key-value
    heads than heads (transformers' KimiLinearAttention would repeat the already expanded heads)."""
    _kimi_linear(None).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_hf(tmp_path)


def _tiny_kimi(**overrides) -> MoEConfig:
    kw = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              layer_types=("kda", "kda", "kda", "mla"), first_k_dense_replace=1, intermediate_size=96,
              n_shared_experts=1, num_experts=8, scoring_func="sigmoid", n_group=2, topk_group=1,
              kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    return MoEConfig(**{**kw, **overrides})


def test_mla_cache_keeps_the_latent_and_decode_equals_full_forward():
    """float64: prefill + token-by-token decode through a KVCache (absorbed form, latent cache of
    kv_lora_rank + qk_rope_head_dim values per token) equals one full forward, on ragged rows."""
    config = _tiny_kimi(q_lora_rank=20)
    model = MoETransformer.from_config(config, dtype=torch.float64, seed=3)
    layer = model.model.layers[3].self_attn
    assert layer.state_spec.latent_dim == 24 + 8 and not layer.state_spec.keys_values
    kda_fixed = 3 * (3 * 4 * 16 * 3 * 8 + 4 * 16 * 16 * 8)
    assert state_layout(config, torch.float64).per_token == (24 + 8) * 8
    assert state_layout(config, torch.float64).fixed == kda_fixed
    ids, mask = _ragged()
    P = 6
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = KVCache.empty(config, batch=3, dtype=torch.float64)
        steps = [model(ids[:, :P], attention_mask=mask[:, :P], cache=cache).logits]
        for t in range(P, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
    assert cache.latents[3].shape == (3, ids.shape[1], 24 + 8)
    assert all(cache.latents[i] is None for i in range(3)) and cache.keys[3] is None
    assert (torch.cat(steps, dim=1) - full)[mask].abs().max() <= 1e-10


def test_mla_absorbed_form_equals_expanded_and_is_chosen_for_decode():
    from jointrl.model.attention import AttentionBatch

    config = _tiny_kimi()
    model = MoETransformer.from_config(config, dtype=torch.float64, seed=5)
    layer = model.model.layers[3].self_attn
    x = torch.randn(2, 7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[0, :2] = False
    batch = model.attention_batch(torch.zeros(2, 7, dtype=torch.long), torch.float64, mask_B1TS=None,
                                  token_mask_BT=key_mask, cache=None, key_mask_BS=key_mask)
    assert isinstance(batch, AttentionBatch)
    with torch.no_grad():
        a, b = layer(x, batch, absorbed=True), layer(x, batch, absorbed=False)
    assert (a - b)[key_mask].abs().max() <= 1e-12
    assert absorbed_pays(1, 4096, 512, 128, 64, 128) and not absorbed_pays(4096, 4096, 512, 128, 64, 128)
