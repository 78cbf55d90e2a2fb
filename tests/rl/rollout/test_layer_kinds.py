"""A layer kind brings its own state and kernel: a toy token mixer (a running mean of projected inputs,
its state a fixed-size (sum, count) pair, its kernel a torch cumsum) registered beside ``full`` runs in
the engine -- chunked prefill and batched decode -- without any change to ``ModelRunner`` or
``PagedState``, and gives the tokens and log-probs of a full recompute (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model import config as model_config
from jointrl.model.attention import AttentionBatch
from jointrl.model.moe_transformer import MIXERS
from jointrl.model.state import StateSpec
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.types import SamplingParams

IM_END = 258


def running_mean(v_BTH: torch.Tensor, sum_BH: torch.Tensor, n_B1: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The toy kind's kernel: y_t = (sum + Σ_{s≤t} v_s) / (n + t + 1) → (y [B, T, H], new sum, new count)."""
    T = v_BTH.shape[1]
    sums_BTH = sum_BH[:, None] + v_BTH.cumsum(1)
    counts_BT1 = n_B1[:, None] + torch.arange(1, T + 1, dtype=v_BTH.dtype)[None, :, None]
    return sums_BTH / counts_BT1, sums_BTH[:, -1], n_B1 + T


class RunningMean(nn.Module):
    """y = o_proj(mean over the sequence so far of v_proj(x)); a fixed-size state per sequence."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        H = config.hidden_size
        self.v_proj = nn.Linear(H, H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)
        self.state_spec = StateSpec(fixed=True)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        v_BTH = self.v_proj(x_BTH)
        B, _, H = v_BTH.shape
        stored = None if batch.cache is None else batch.cache.recurrent(self.layer_idx)
        sum_BH, n_B1 = stored if stored is not None else (v_BTH.new_zeros(B, H), v_BTH.new_zeros(B, 1))
        y_BTH, sum_BH, n_B1 = running_mean(v_BTH, sum_BH, n_B1)
        if batch.cache is not None:
            batch.cache.set_recurrent(self.layer_idx, sum_BH, n_B1)
        return self.o_proj(y_BTH)


@pytest.fixture
def toy_model(monkeypatch):
    monkeypatch.setattr(model_config, "LAYER_TYPES", (*model_config.LAYER_TYPES, "running_mean"))
    monkeypatch.setitem(MIXERS, "running_mean", RunningMean)
    cfg = MoEConfig(num_hidden_layers=3, layer_types=("running_mean", "full", "running_mean"), initializer_range=0.1)
    return MoETransformer.from_config(cfg, dtype=torch.float64, seed=2)


def test_a_new_layer_kind_runs_in_the_engine_unchanged(toy_model, greedy_reference):
    engine = LLMEngine(toy_model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16))
    assert not engine.runner.prefix_cacheable  # a fixed-size state is not shared by blocks
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 9)]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = engine.generate_batch(prompts, [params] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        want_ids, want_lps = greedy_reference(toy_model, prompt, params.max_tokens, IM_END)
        assert out.token_ids == want_ids
        assert out.logprobs == pytest.approx(want_lps, abs=1e-10)
    assert engine.stats.steps > len(prompts) + 1  # chunked prefill and batched decode steps both ran


class PlainAttention(nn.Module):
    """A toy kind with a ragged form: softmax attention without q/k-norm or RoPE, its keys/values per token in
    the engine's pools. ``forward`` for the model (a ``KVCache`` or none), ``paged`` for the engine's flat batch:
    its keys/values written at the step's slots, attention through the step's paged kernels."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.Hq, self.Hkv, self.D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.Hq * self.D, bias=False)
        self.kv_proj = nn.Linear(H, 2 * self.Hkv * self.D, bias=False)
        self.o_proj = nn.Linear(self.Hq * self.D, H, bias=False)
        self.state_spec = StateSpec(keys_values=True, ragged=True)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        q_BHTD = self.q_proj(x_BTH).view(B, T, self.Hq, self.D).transpose(1, 2)
        k_BHTD, v_BHTD = self.kv_proj(x_BTH).view(B, T, 2, self.Hkv, self.D).permute(2, 0, 3, 1, 4)
        if batch.cache is not None:
            k_BHTD, v_BHTD = batch.cache.update(self.layer_idx, k_BHTD, v_BHTD)
        out_BHTD = torch.nn.functional.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=batch.mask(),
                                                                    enable_gqa=True)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, -1))

    def paged(self, h_NH: torch.Tensor, step) -> torch.Tensor:
        N = h_NH.shape[0]
        kv_PCHD = step.kv(self.layer_idx)
        kv_PCHD.index_copy_(0, step.slot_N, self.kv_proj(h_NH).view(N, 2, self.Hkv, self.D).to(kv_PCHD.dtype))
        return self.o_proj(step.attend(self.q_proj(h_NH).view(N, self.Hq, self.D), kv_PCHD).reshape(N, -1))


def test_a_new_ragged_layer_kind_runs_on_the_engines_flat_batch(monkeypatch, greedy_reference):
    """A kind that declares a ragged form (``StateSpec.ragged``, its ``paged``) runs with plain full attention on
    the engine's flat batch -- all of a step's rows in one call, keys/values in the pools, prefix caching on --
    without a change to ``ModelRunner``; tokens and log-probs of a full recompute (float64)."""
    monkeypatch.setattr(model_config, "LAYER_TYPES", (*model_config.LAYER_TYPES, "plain"))
    monkeypatch.setitem(MIXERS, "plain", PlainAttention)
    cfg = MoEConfig(num_hidden_layers=3, layer_types=("plain", "full", "plain"), initializer_range=0.1)
    model = MoETransformer.from_config(cfg, dtype=torch.float64, seed=2)
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16))
    assert engine.runner.prefix_cacheable and not engine.runner.hybrid  # one ragged loop, no per-sequence mixers
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 9)]
    params = SamplingParams(max_tokens=6, temperature=0)
    for prompt, out in zip(prompts, engine.generate_batch(prompts, [params] * len(prompts)), strict=True):
        want_ids, want_lps = greedy_reference(model, prompt, params.max_tokens, IM_END)
        assert out.token_ids == want_ids
        assert out.logprobs == pytest.approx(want_lps, abs=1e-10)
