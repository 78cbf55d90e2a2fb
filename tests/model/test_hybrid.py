"""tiny_hybrid (3 KDA : 1 gated DSA, shared expert, sigmoid router): gradients, incremental decoding
through the state interface, the state-size formula, config validation, and the remote-code export."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from jointrl.model import KVCache, MoEConfig, MoETransformer
from jointrl.model.hf_hybrid import load_hybrid, save_hybrid
from jointrl.model.state import state_bytes_per_sequence

CFG = MoEConfig.preset("tiny_hybrid")


def test_preset_shape():
    assert CFG.kinds == ("kda", "kda", "kda", "gated_dsa") and CFG.is_hybrid
    assert 32 <= CFG.index_topk <= 64 and CFG.n_shared_experts == 1 and CFG.scoring_func == "sigmoid"


def test_every_parameter_gets_a_gradient():
    model = MoETransformer.from_config(CFG, seed=6)
    T = 2 * CFG.index_topk + 7  # the gated_dsa layer runs sparse; KDA crosses a chunk boundary
    ids = torch.randint(0, CFG.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(6))
    out = model(ids[:, :-1], return_indexer_loss=True)
    assert out.indexer_loss is not None and out.indexer_loss.item() > 0
    ce = F.cross_entropy(out.logits.reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))
    (ce + CFG.router_aux_loss_coef * out.aux_loss + out.indexer_loss).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_incremental_decoding_equals_full_forward_fp64():
    """Chunked prefill (KDA chunked form, DSA query chunks) then token-by-token decode (KDA recurrent
    form, DSA top-k over cached indexer keys), across the top-k and the KDA chunk length."""
    model = MoETransformer.from_config(CFG, dtype=torch.float64, seed=1)
    T = 72  # prefill crosses the KDA chunk (64) and the top-k (32); decode attends 32 of 67..71 keys
    ids = torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.empty(CFG, batch=2, dtype=torch.float64)
        parts = [model(ids[:, a:b], cache=cache) for a, b in ((0, 20), (20, 66), (66, 67))]
        parts += [model(ids[:, t:t + 1], cache=cache) for t in range(67, T)]
    assert cache.length == T
    assert (torch.cat([p.logits for p in parts], dim=1) - full.logits).abs().max() < 1e-10
    assert torch.equal(torch.cat([p.topk_ids for p in parts], dim=1), full.topk_ids)


def test_left_padded_batch_equals_unpadded_rows_fp64():
    model = MoETransformer.from_config(CFG, dtype=torch.float64, seed=4)
    gen = torch.Generator().manual_seed(4)
    lengths, width, steps = [45, 30], 45, 4
    rows = [torch.randint(0, CFG.vocab_size, (n + steps,), generator=gen) for n in lengths]
    prompt = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        prompt[b, width - n:] = rows[b][:n]
        mask[b, width - n:] = True
    with torch.no_grad():
        cache = KVCache.empty(CFG, batch=2, dtype=torch.float64)
        outs = [model(prompt, attention_mask=mask, cache=cache).logits]
        for s in range(steps):
            mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.bool)), dim=1)
            step = torch.stack([rows[b][lengths[b] + s] for b in range(2)])[:, None]
            outs.append(model(step, attention_mask=mask, cache=cache).logits)
        logits = torch.cat(outs, dim=1)
        for b, n in enumerate(lengths):
            ref = model(rows[b][None]).logits[0]
            assert (logits[b, width - n:] - ref).abs().max() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_formula_matches_the_cache(dtype):
    model = MoETransformer.from_config(CFG, dtype=dtype)
    T = 37
    cache = KVCache.empty(CFG, batch=1, dtype=dtype)
    with torch.no_grad():
        model(torch.randint(0, CFG.vocab_size, (1, T)), cache=cache)
    held = sum(t.numel() * t.element_size() for store in (cache.keys, cache.values, cache.index_keys,
                                                          cache.conv_states, cache.recurrent_states)
               for t in store if t is not None)
    assert held == state_bytes_per_sequence(CFG, T, dtype)
    # Hand-derived for tiny_hybrid in bf16: per token 1 DSA layer × (2·2·16 + 16)·2 B; fixed 3 KDA
    # layers × (3·4·16·3·2 B conv + 4·16·16·4 B state).
    assert state_bytes_per_sequence(CFG, 1000, torch.bfloat16) == 1000 * 160 + 3 * (1152 + 4096)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"layer_types": ("kda", "mamba")}, "layer_types"),
    ({"layer_types": ("kda",)}, "layer_types"),
    ({"index_topk": 0}, "index_topk"),
    ({"dsa_mode": "fuzzy"}, "dsa_mode"),
    ({"linear_lower_bound": 0.5}, "linear_lower_bound"),
    ({"index_head_dim": 15}, "index_head_dim"),
])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoEConfig(num_hidden_layers=2, **overrides)


def test_layer_types_lists_compare_equal_and_qwen3_export_refuses_hybrids():
    assert MoEConfig(num_hidden_layers=2, layer_types=["kda", "full"]) == \
        MoEConfig(num_hidden_layers=2, layer_types=("kda", "full"))
    with pytest.raises(ValueError, match="layer_types"):
        CFG.to_hf_dict()


def test_export_loads_in_transformers_with_remote_code_and_equal_logits(tmp_path):
    model = MoETransformer.from_config(CFG, seed=3)
    save_hybrid(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_jointrl.JointrlHybridForCausalLM"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(hf).__name__ == "JointrlHybridForCausalLM"
    ids = torch.randint(0, CFG.vocab_size, (2, 60), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask.bool()).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        back = load_hybrid(tmp_path)(ids, attention_mask=mask.bool()).logits
    assert (ours - theirs)[mask.bool()].abs().max() < 1e-5
    assert torch.equal(back, ours)


def test_hydra_model_group_builds_the_preset():
    from jointrl.rl.build import model_config
    from jointrl.rl.config import load_config

    assert model_config(load_config(["model=tiny_hybrid"])) == CFG
    assert model_config(load_config(["model=tiny_hybrid", "model.dsa_mode=dense"])).dsa_mode == "dense"
    with pytest.raises(ValueError, match="layer_types"):
        load_config(["model=tiny_hybrid", "model.layer_types=[kda,rnn,kda,gated_dsa]"])
