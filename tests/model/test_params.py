"""num_parameters: equal to the instantiated model's count, and to hand-derived full-size totals."""

from __future__ import annotations

import pytest

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.params import num_parameters


@pytest.mark.parametrize("config", [
    MoEConfig.preset("tiny_moe"), MoEConfig.preset("tiny_moe", tie_word_embeddings=True, qk_norm="none"),
    MoEConfig.preset("tiny_moe", num_hidden_layers=3, first_k_dense_replace=1, n_shared_experts=2,
                     shared_expert_gate=True, scoring_func="sigmoid", qk_norm="full"),
    MoEConfig.preset("bench_moe"),
], ids=["tiny_moe", "tied-no_qk_norm", "all_options", "bench_moe"])
def test_counts_equal_the_instantiated_model(config):
    model = MoETransformer.from_config(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())  # tied counted once
    # Active: all but the (E − k) routed experts a token skips, in each MoE layer.
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    skipped = config.num_moe_layers * (config.num_experts - config.num_experts_per_tok) * expert
    assert num_parameters(config, active=True) == num_parameters(config) - skipped


def test_bench_moe_is_about_ten_million():
    """bench_moe: V=264, H=256, L=6, 4 heads × 64 (2 KV heads), 16 experts of I=128, top-2, untied.
    embed + lm_head 2·264·256 = 135,168; final norm 256;
    per layer: attention 2·256·256 + 2·256·128 = 196,608, q/k-norm 2·64 = 128, norms 512,
    router 16·256 = 4,096, experts 16·3·256·128 = 1,572,864 → 1,774,208; × 6 = 10,645,248.
    Total 10,780,672; active: experts 2·3·256·128 = 196,608 per layer instead → 2,523,136."""
    config = MoEConfig.preset("bench_moe")
    assert num_parameters(config) == 10_780_672
    assert num_parameters(config, active=True) == 2_523_136


def test_kimi_k2_scale_reference_counts():
    """kimi_k2_gqa (not instantiated): V=163,840, H=7,168, L=61 (layer 0 dense, 60 MoE), 64 query
    heads and 8 KV heads of D=128, no q/k-norm, dense I=18,432, 384 routed experts of I=2,048, top-8,
    1 shared expert, untied embeddings.

    embed + lm_head: 2 · 163,840 · 7,168                       = 2,348,810,240
    final norm                                                  =         7,168
    attention per layer: 2·7,168·8,192 + 2·7,168·1,024          =   132,120,576
      + 2 RMSNorms of 7,168                                     =        14,336  → 132,134,912 × 61 = 8,060,229,632
    dense MLP (layer 0): 3 · 7,168 · 18,432                     =   396,361,728
    one expert: 3 · 7,168 · 2,048                               =    44,040,192
    MoE layer: 384 experts 16,911,433,728 + shared 44,040,192 + router 384·7,168 = 2,752,512
                                                                = 16,958,226,432 × 60 = 1,017,493,585,920
    total = 2,348,810,240 + 7,168 + 8,060,229,632 + 396,361,728 + 1,017,493,585,920 = 1,028,298,994,688
    active MoE layer: 8 experts 352,321,536 + 44,040,192 + 2,752,512 = 399,114,240 × 60 = 23,946,854,400
    active = 2,348,810,240 + 7,168 + 8,060,229,632 + 396,361,728 + 23,946,854,400 = 34,752,263,168
    (Kimi-K2 itself, with MLA attention, is 1.04 T total / 32 B active.)"""
    config = MoEConfig.preset("kimi_k2_gqa")
    assert num_parameters(config) == 1_028_298_994_688
    assert num_parameters(config, active=True) == 34_752_263_168


def test_qwen3_30b_a3b_matches_its_published_size():
    """Qwen3-30B-A3B's model card: 30.5 B total, 3.3 B activated (we count 3.35 B: the card truncates)."""
    config = MoEConfig.preset("qwen3_30b_a3b")
    assert round(num_parameters(config) / 1e9, 1) == 30.5
    assert 3.3e9 <= num_parameters(config, active=True) < 3.4e9
