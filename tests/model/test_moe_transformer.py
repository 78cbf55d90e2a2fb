"""MoETransformer: parity with transformers' Qwen3-MoE, KV-cache exactness, routing replay, gradients."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from jointrl.model import KVCache, MoEConfig, MoETransformer
from jointrl.model.hf import load_hf, save_hf

CFG = MoEConfig.preset("tiny_moe")


def _padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 9 tokens: unpadded, left-padded by 3, right-padded by 3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, 6:] = False
    return ids, mask


def _hf_model(config: MoEConfig, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config.to_hf_dict())).eval()


def _hf_logits(hf: Qwen3MoeForCausalLM, ids: torch.Tensor, mask: torch.Tensor):
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos, output_router_logits=True)


# ---- (a) parity with transformers -------------------------------------------------------------

def test_state_dict_keys_and_shapes_equal_hf():
    ours = MoETransformer.from_config(CFG)
    hf = _hf_model(CFG)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == \
        [(k, v.shape) for k, v in hf.state_dict().items()]
    assert ours.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert ours.state_dict()["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)


def test_hf_checkpoint_loads_with_equal_logits(tmp_path):
    hf = _hf_model(CFG)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids, mask = _padded_batch()
    ref = _hf_logits(hf, ids, mask)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
    assert out.logits.dtype == torch.float32
    assert (out.logits - ref.logits)[mask].abs().max() < 1e-4
    for ours_NE, ref_NE in zip(out.router_logits, ref.router_logits, strict=True):
        assert (ours_NE - ref_NE)[mask.reshape(-1)].abs().max() < 1e-5
    assert torch.allclose(out.aux_loss, ref.aux_loss, atol=1e-6)
    # Unpadded, HF's default positions and no mask:
    with torch.no_grad():
        ref_plain = hf(input_ids=ids, output_router_logits=True)
        out_plain = ours(ids)
    assert (out_plain.logits - ref_plain.logits).abs().max() < 1e-4
    assert torch.allclose(out_plain.aux_loss, ref_plain.aux_loss, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_saved_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, tie):
    ours = MoETransformer.from_config(MoEConfig.preset("tiny_moe", tie_word_embeddings=tie), seed=3)
    save_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids, mask = _padded_batch(seed=1)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
    assert (out.logits - _hf_logits(hf, ids, mask).logits)[mask].abs().max() < 1e-4
    back = load_hf(tmp_path)  # and our own loader round-trips it
    assert back.config == ours.config
    with torch.no_grad():
        assert torch.equal(back(ids, attention_mask=mask).logits, out.logits)


def test_bfloat16_close_to_hf(tmp_path):
    hf = _hf_model(CFG).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids, mask = _padded_batch()
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
    ref = _hf_logits(hf, ids, mask)
    assert out.logits.dtype == torch.bfloat16
    assert (out.logits.float() - ref.logits.float())[mask].abs().max() < 2e-2


def test_load_hf_fuses_per_expert_checkpoints(tmp_path):
    ours = MoETransformer.from_config(CFG, seed=5)
    state = {k: v.clone() for k, v in ours.state_dict().items() if ".mlp.experts." not in k}
    inter = CFG.moe_intermediate_size
    for i, layer in enumerate(ours.model.layers):
        for e in range(CFG.num_experts):
            gate_up = layer.mlp.experts.gate_up_proj[e].detach()
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            state[f"{prefix}.gate_proj.weight"] = gate_up[:inter].clone()
            state[f"{prefix}.up_proj.weight"] = gate_up[inter:].clone()
            state[f"{prefix}.down_proj.weight"] = layer.mlp.experts.down_proj[e].detach().clone()
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    loaded = load_hf(tmp_path)
    for key, value in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize(("field", "value"), [
    ("model_type", "llama"), ("use_sliding_window", True), ("hidden_act", "gelu"),
    ("mlp_only_layers", [1]), ("attention_bias", True), ("shared_expert_intermediate_size", 64),
])
def test_load_hf_names_unsupported_config(tmp_path, field, value):
    save_hf(MoETransformer.from_config(CFG), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_hf(tmp_path)


# ---- (b) incremental decoding ≡ full forward (float64) --------------------------------------

def test_incremental_decoding_equals_full_forward_fp64():
    model = MoETransformer.from_config(CFG, dtype=torch.float64, seed=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.empty(CFG, batch=2, dtype=torch.float64)
        chunks = [model(ids[:, :6], cache=cache)]
        assert cache.length == 6
        for t in range(6, 12):
            chunks.append(model(ids[:, t:t + 1], cache=cache))
    assert cache.length == 12
    assert (torch.cat([c.logits for c in chunks], dim=1) - full.logits).abs().max() < 1e-10
    assert torch.equal(torch.cat([c.topk_ids for c in chunks], dim=1), full.topk_ids)


def test_chunked_prefill_equals_full_forward_fp64():
    model = MoETransformer.from_config(CFG, dtype=torch.float64, seed=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache.empty(CFG, batch=2, dtype=torch.float64)
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 3), (3, 8), (8, 9), (9, 12))]
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-10


def test_left_padded_batch_decoding_equals_unpadded_rows_fp64():
    """Prompts of lengths 7, 4 and 2, left-padded to 7, then 5 decode steps with the KV cache:
    every real position's logits equal those of that row's own unpadded full forward."""
    model = MoETransformer.from_config(CFG, dtype=torch.float64, seed=4)
    gen = torch.Generator().manual_seed(4)
    lengths, width, steps = [7, 4, 2], 7, 5
    rows = [torch.randint(0, CFG.vocab_size, (n + steps,), generator=gen) for n in lengths]
    prompt = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        prompt[b, width - n:] = rows[b][:n]
        mask[b, width - n:] = True
    with torch.no_grad():
        cache = KVCache.empty(CFG, batch=3, dtype=torch.float64)
        outs = [model(prompt, attention_mask=mask, cache=cache).logits]
        for s in range(steps):
            mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.bool)), dim=1)
            step_ids = torch.stack([rows[b][n + s] for b, n in enumerate(lengths)])[:, None]
            outs.append(model(step_ids, attention_mask=mask, cache=cache).logits)
        logits = torch.cat(outs, dim=1)
        assert torch.isfinite(logits).all()  # fully masked padding queries attend to themselves
        for b, n in enumerate(lengths):
            ref = model(rows[b][None]).logits[0]
            assert (logits[b, width - n:] - ref).abs().max() < 1e-10


def test_cache_and_mask_shapes_are_checked():
    model = MoETransformer.from_config(CFG)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="batch"):
        model(ids, cache=KVCache.empty(CFG, batch=1))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="routed_experts"):
        model(ids, routed_experts=torch.zeros(2, 3, 2, dtype=torch.long))


# ---- (c) routing replay -----------------------------------------------------------------------

def test_routing_replay():
    model = MoETransformer.from_config(CFG, seed=2)
    ids, mask = _padded_batch(seed=2)
    own = model(ids, attention_mask=mask)
    replayed = model(ids, attention_mask=mask, routed_experts=own.topk_ids)
    assert torch.equal(replayed.logits, own.logits)
    assert torch.equal(replayed.topk_ids, own.topk_ids)

    # Other experts: the output changes, the replayed ids are used, the router still learns.
    other = (own.topk_ids + 1) % CFG.num_experts
    model.zero_grad()
    out = model(ids, attention_mask=mask, routed_experts=other)
    assert torch.equal(out.topk_ids, other)
    assert (out.logits - own.logits).abs().max() > 1e-4
    out.logits[mask].logsumexp(-1).mean().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


# ---- (d) gradients ----------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_gets_a_gradient(tie):
    config = MoEConfig.preset("tiny_moe", tie_word_embeddings=tie)
    model = MoETransformer.from_config(config, seed=6)
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(6))
    out = model(ids[:, :-1])
    assert set(out.topk_ids.unique().tolist()) == set(range(config.num_experts))  # all experts used
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
    (ce + config.router_aux_loss_coef * out.aux_loss).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_aux_loss_matches_hf_formula():
    model = MoETransformer.from_config(CFG, seed=7)
    ids, mask = _padded_batch(seed=7)
    out = model(ids, attention_mask=mask)
    ref = load_balancing_loss_func(tuple(out.router_logits), CFG.num_experts, CFG.num_experts_per_tok,
                                   mask.long())
    assert torch.allclose(out.aux_loss, ref, atol=1e-6)
    assert out.aux_loss.requires_grad


# ---- dtypes and init --------------------------------------------------------------------------

def test_deterministic_init_across_dtypes():
    a = MoETransformer.from_config(CFG, seed=0)
    b = MoETransformer.from_config(CFG, seed=0, dtype=torch.float64)
    c = MoETransformer.from_config(CFG, seed=1)
    for key, value in a.state_dict().items():
        assert torch.equal(value.double(), b.state_dict()[key]), key
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(CFG.hidden_size))
    assert abs(a.lm_head.weight.std().item() - CFG.initializer_range) < 2e-3
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad():
        assert (a(ids).logits.double() - b(ids).logits).abs().max() < 1e-5
        bf = MoETransformer.from_config(CFG, seed=0, dtype=torch.bfloat16)(ids)
    assert bf.logits.dtype == torch.bfloat16 and torch.isfinite(bf.logits).all()


# ---- (e) config ------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "field"), [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"norm_topk_prob": 1}, "norm_topk_prob"),
    ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoEConfig(**overrides)


def test_config_hf_round_trip_and_presets():
    hf_config = Qwen3MoeConfig(**CFG.to_hf_dict())
    assert hf_config.num_experts == CFG.num_experts and hf_config.head_dim == CFG.head_dim
    assert MoEConfig.from_hf_dict(CFG.to_hf_dict()) == CFG
    assert MoEConfig.from_hf_dict(hf_config.to_dict()) == CFG
    big = MoEConfig.preset("qwen3_30b_a3b")
    assert MoEConfig.from_hf_dict(big.to_hf_dict()) == big
    for config in (CFG, big):  # routed experts quantize to MXFP4 along the last dim: blocks of 32
        assert config.hidden_size % 32 == 0 and config.moe_intermediate_size % 32 == 0
    assert MoEConfig.preset("tiny_moe", num_hidden_layers=3).num_hidden_layers == 3
    with pytest.raises(ValueError, match="preset"):
        MoEConfig.preset("huge")
