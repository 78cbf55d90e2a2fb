"""gpt-oss (model/gpt_oss.py, model/hf_gpt_oss.py): a random transformers `GptOssForCausalLM` whose experts
our quantizer wrote as MXFP4 blocks + scales (tests/conftest.py) loads with transformers' logits, and
exports back to its layout bit for bit; the config mapping and the sink attention's math."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from jointrl.model.config import MoEConfig
from jointrl.model.gpt_oss import sink_attention, window_mask
from jointrl.model.hf import config_from_hf, load_hf
from jointrl.rl.export import export_hf, export_mxfp4


def _reference(d):
    # transformers runs MXFP4 experts on CPU only dequantized (exact in float32: E2M1 · 2^k)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def _ragged(vocab: int, T: int = 13):
    ids = torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    mask[2, -3:] = False  # right padding
    return ids, mask, (mask.long().cumsum(-1) - 1).clamp_min(0)


def _logits_match(ours, hf, vocab: int) -> float:
    ids, mask, pos = _ragged(vocab)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        got = ours(ids, attention_mask=mask).logits
    return (got - ref)[mask].abs().max().item()


def test_logits_equal_transformers_on_ragged_prompts_past_the_window(gpt_oss_dir):
    ours = load_hf(gpt_oss_dir, dtype=torch.float32).eval()
    cfg = ours.config
    assert cfg.kinds == ("sliding", "full") and cfg.attention_window == 4 and cfg.rope_type == "yarn"
    assert cfg.attention_sinks and cfg.router_bias and cfg.swiglu_limit == 7.0
    hf = _reference(gpt_oss_dir)
    assert _logits_match(ours, hf, cfg.vocab_size) <= 1e-5
    # the dequantized experts are transformers' (their gate/up rows de-interleaved)
    ref = hf.model.layers[1].mlp.experts
    got = ours.model.layers[1].mlp.experts
    assert torch.equal(got.down_proj, ref.down_proj.transpose(1, 2))
    I = cfg.moe_intermediate_size
    assert torch.equal(got.gate_up_proj[:, :I], ref.gate_up_proj[..., ::2].transpose(1, 2))
    assert torch.equal(got.gate_up_proj_bias[:, I:], ref.gate_up_proj_bias[:, 1::2])


def test_export_round_trips_blocks_and_scales_bit_exact_and_reloads(gpt_oss_dir, tmp_path):
    ours = load_hf(gpt_oss_dir, dtype=torch.float32).eval()
    out = export_mxfp4(ours, tmp_path / "out", step=0, tokenizer_dir=gpt_oss_dir, max_shard_bytes=100_000)
    src = load_file(gpt_oss_dir / "model.safetensors")
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 2 and set(weight_map) == set(src)
    got = {}
    for shard in set(weight_map.values()):
        got.update(load_file(out / shard))
    for key, t in src.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key  # blocks/scales uint8, the rest fp32
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert config_from_hf(json.loads((out / "config.json").read_text())) == ours.config
    assert _logits_match(ours, _reference(out), ours.config.vocab_size) <= 1e-5
    plain = export_hf(ours, tmp_path / "plain", tokenizer_dir=gpt_oss_dir)  # transformers' unquantized layout
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert _logits_match(ours, hf, ours.config.vocab_size) <= 1e-5
    assert _logits_match(load_hf(plain), hf, ours.config.vocab_size) <= 1e-5


def test_hub_config_maps_and_unknown_fields_are_refused():
    # openai/gpt-oss-120b's config.json as published (transformers 4.55 spelling)
    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
           "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
    cfg = config_from_hf(hub)
    assert cfg.kinds == ("sliding", "full") * 18 and cfg.num_experts == 128 and cfg.num_experts_per_tok == 4
    assert (cfg.rope_theta, cfg.rope_factor, cfg.rope_truncate, cfg.moe_intermediate_size) == (150000.0, 32.0, False, 2880)
    assert cfg.is_gpt_oss and not cfg.is_hybrid and cfg.qk_norm == "none"
    with pytest.raises(ValueError, match="sliding_window_size"):
        config_from_hf({**hub, "sliding_window_size": 3})
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**hub, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="to_hf_dict"):
        cfg.to_hf_dict()
    with pytest.raises(ValueError, match="attention_window"):
        MoEConfig(layer_types=("sliding", "full"))


def test_sink_attention_is_softmax_with_an_extra_logit():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril() & window_mask(0, 5, 5, 3, q.device)
    assert mask[0, 0, 4].tolist() == [False, False, True, True, True]
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    out = sink_attention(q, k, v, mask, sinks, 0.3)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(2, 3) * 0.3).masked_fill(~mask, float("-inf")).exp()
    p = s / (s.sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1))
    torch.testing.assert_close(out, p @ vv, rtol=0, atol=1e-12)
    plain = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(sink_attention(q, k, v, mask, torch.full((4,), -torch.inf, dtype=torch.float64), 0.3),
                               plain, rtol=0, atol=1e-12)
