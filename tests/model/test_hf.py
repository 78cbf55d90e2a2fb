"""load_hf for Mixtral and OLMoE directories written by transformers: equal logits (fp32), and a
ValueError naming any config field we do not implement."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.hf import load_hf, save_hf

SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=32, num_experts_per_tok=2)


def _mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=4)).eval()


def _olmoe(norm_topk_prob: bool) -> OlmoeForCausalLM:
    torch.manual_seed(1)
    hf = OlmoeForCausalLM(OlmoeConfig(**SHAPE, num_experts=4, norm_topk_prob=norm_topk_prob,
                                      pad_token_id=0, eos_token_id=1)).eval()
    with torch.no_grad():  # HF initialises q/k-norm to 1 and the router to 0: make both matter
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return hf


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[2, 6:] = False  # right padding
    return ids, mask


@pytest.mark.parametrize("make", [_mixtral, lambda: _olmoe(False), lambda: _olmoe(True)],
                         ids=["mixtral", "olmoe", "olmoe-norm_topk"])
def test_transformers_checkpoint_loads_with_equal_logits(tmp_path, make):
    hf = make()
    hf.save_pretrained(tmp_path)  # transformers 5.x writes the hub's per-expert layout
    ours = load_hf(tmp_path)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ids, mask = _batch()
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos, output_router_logits=True)
        out = ours(ids, attention_mask=mask)
    assert (out.logits - ref.logits)[mask].abs().max() <= 1e-4
    for ours_NE, ref_NE in zip(out.router_logits, ref.router_logits, strict=True):
        assert (ours_NE - ref_NE)[mask.reshape(-1)].abs().max() <= 1e-5
    with torch.no_grad():  # unpadded, HF's default positions
        assert (ours(ids).logits - hf(input_ids=ids).logits).abs().max() <= 1e-4


def test_mixtral_loads_fused_5x_layout_too(tmp_path):
    """Directories holding transformers 5.x's in-memory names (fused experts, `mlp.`) load alike."""
    from safetensors.torch import save_file

    hf = _mixtral()
    hf.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    ours = load_hf(tmp_path)
    for key, value in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


@pytest.mark.parametrize(("make", "field", "value"), [
    (_mixtral, "sliding_window", 4096), (_mixtral, "router_jitter_noise", 0.01),
    (_mixtral, "hidden_act", "gelu"), (_mixtral, "model_type", "mixtral_v9"),
    (lambda: _olmoe(False), "clip_qkv", 8.0), (lambda: _olmoe(False), "attention_bias", True),
    (lambda: _olmoe(False), "head_dim", 8), (lambda: _olmoe(False), "some_new_feature", 1),
    (lambda: _olmoe(False), "rope_parameters", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unsupported_config_fields_are_named(tmp_path, make, field, value):
    make().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field if field != "model_type" else "mixtral_v9"):
        load_hf(tmp_path)


def _kimi_linear():
    """All-KDA kimi_linear (with MLA layers: tests/model/test_mla.py): a dense
    first layer, then sigmoid routing over 2 groups of 4 experts with a shared expert."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(3)
    config = KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_local_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
        layer_types=["linear_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"],
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises router bias to 0: make selection differ from weighting
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


def test_kimi_linear_checkpoint_loads_with_equal_logits(tmp_path):
    hf = _kimi_linear()
    hf.save_pretrained(tmp_path)  # hub layout: block_sparse_moe, w1/w2/w3, q/k/v_conv1d, f_a_proj, A_log
    ours = load_hf(tmp_path)
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert ours.config.kinds == ("kda",) * 3 and ours.config.first_k_dense_replace == 1
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        out = ours(ids)
    assert (out.logits - ref).abs().max() <= 1e-4
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types"):
        load_hf(tmp_path)


def test_dense_first_layers_round_trip_through_qwen3_moe(tmp_path):
    """first_k_dense_replace=k is Qwen3-MoE's mlp_only_layers=[0..k-1]: plain transformers loads our
    export and its dense Qwen3MoeMLP gives the same logits as our dense SwiGLU layer."""
    from transformers import AutoModelForCausalLM

    config = MoEConfig.preset("tiny_moe", num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96)
    ours = MoETransformer.from_config(config, seed=4)
    save_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.mlp_only_layers == [0] and type(hf.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = ours(ids)
        assert (out.logits - hf(input_ids=ids).logits).abs().max() <= 1e-4
        back = load_hf(tmp_path)
        assert back.config == config and torch.equal(back(ids).logits, out.logits)


def test_save_hf_names_fields_qwen3_moe_cannot_hold(tmp_path):
    model = MoETransformer.from_config(MoEConfig.preset("tiny_moe", n_shared_experts=1))
    with pytest.raises(ValueError, match="n_shared_experts"):
        save_hf(model, tmp_path)
    config = MoEConfig.preset("tiny_moe").to_hf_dict()
    config["scoring_func"] = "sigmoid"  # not a Qwen3-MoE field: refused rather than read
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scoring_func"):
        load_hf(tmp_path)
