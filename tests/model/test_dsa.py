"""Gated DSA: the indexer selects as transformers' deepseek_v32 does, top-k ≥ length ≡ dense,
query chunking is exact, memory is linear in length, and the indexer loss trains the indexer only."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

from jointrl.model import MoEConfig
from jointrl.model.attention import Attention, AttentionBatch
from jointrl.kernels.dsa import indexer_scores_torch
from jointrl.kernels.topk import topk_mask
from jointrl.model.dsa import GatedDSAAttention, LightningIndexer, indexer_kl
from jointrl.model.rope import RotaryEmbedding

CFG = MoEConfig(layer_types=("gated_dsa",), num_hidden_layers=1, index_topk=8)


def _batch(cfg: MoEConfig, B: int, T: int, dtype=torch.float64, mask: torch.Tensor | None = None,
           losses: bool = False) -> AttentionBatch:
    pos = torch.arange(T).expand(B, T) if mask is None else (mask.long().cumsum(-1) - 1).clamp_min(0)
    return AttentionBatch(
        rope=RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(pos, dtype),
        index_rope=RotaryEmbedding(cfg.index_head_dim, cfg.rope_theta)(pos, dtype),
        mask_B1TS=None, token_mask_BT=mask, key_mask_BS=mask, cache=None,
        indexer_losses=[] if losses else None)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)


def test_indexer_selects_the_same_keys_as_deepseek_v32():
    T, B = 48, 2
    hf_cfg = DeepseekV32Config(hidden_size=CFG.hidden_size, q_lora_rank=CFG.hidden_size, index_n_heads=4,
                               index_head_dim=16, qk_rope_head_dim=16, index_topk=CFG.index_topk)
    hf = DeepseekV32Indexer(hf_cfg, 0).eval()
    ours = LightningIndexer(CFG)
    _randomize(hf, seed=0)
    ours.load_state_dict({"wq.weight": hf.wq_b.weight, "wk.weight": hf.wk.weight, "k_norm.weight": hf.k_norm.weight,
                          "k_norm.bias": hf.k_norm.bias, "weights_proj.weight": hf.weights_proj.weight})
    x = torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = RotaryEmbedding(16, CFG.rope_theta)(torch.arange(T).expand(B, T), torch.float32)
    causal_BTS = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    with torch.no_grad():
        ref_ids = hf(x, q_resid=x, position_embeddings=(cos, sin), attention_mask=causal_BTS, position_ids=None)
        q, w = ours.queries(x, (cos, sin))
        scores = indexer_scores_torch(q, w, ours.keys(x, (cos, sin)))  # the layer's indexer reference
    ref_sel = torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, ref_ids.long(), True) & causal_BTS
    ours_sel = topk_mask(scores, causal_BTS, CFG.index_topk)
    assert (ours_sel.sum(-1) == torch.arange(1, T + 1).clamp_max(CFG.index_topk)).all()
    differ = ours_sel ^ ref_sel
    # Where the sets differ the scores must tie with the k-th best (an arbitrary pick among equals).
    kth = scores.masked_fill(~causal_BTS, float("-inf")).topk(CFG.index_topk, dim=-1).values[..., -1:]
    assert torch.allclose(scores[differ], kth.expand_as(scores)[differ], atol=1e-6)
    assert differ.sum() <= 0.01 * ours_sel.sum()
    assert (scores[:, CFG.index_topk:] > 0).any()  # not a degenerate all-tie case


def test_topk_at_least_length_equals_dense_gated_attention_fp64():
    T, B = 40, 2
    dsa = GatedDSAAttention(MoEConfig(**{**_fields(CFG), "index_topk": T}), 0).double()
    _randomize(dsa, seed=2)
    dense = Attention(CFG, 0, output_gate=True).double()
    dense.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    x = torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        ref = dense(x, _batch(CFG, B, T, mask=mask))
        out = dsa(x, _batch(CFG, B, T, mask=mask))
        out_loss_path = dsa(x, _batch(CFG, B, T, mask=mask, losses=True))
    assert (out - ref)[mask].abs().max() < 1e-12
    assert (out_loss_path - ref)[mask].abs().max() < 1e-12
    sparse = GatedDSAAttention(CFG, 0).double()
    sparse.load_state_dict(dsa.state_dict())
    with torch.no_grad():
        out_sparse = sparse(x, _batch(CFG, B, T, mask=mask))
    assert (out_sparse - ref)[:, :CFG.index_topk].abs().max() < 1e-12      # ≤ k visible keys: all chosen
    assert (out_sparse - ref)[:, -5:].abs().max() > 1e-3                     # beyond: sparsity bites


def test_query_chunking_is_exact_fp64():
    T, B = 50, 2
    whole = GatedDSAAttention(CFG, 0).double()
    _randomize(whole, seed=4)
    chunked = GatedDSAAttention(MoEConfig(**{**_fields(CFG), "dsa_query_chunk": 7}), 0).double()
    chunked.load_state_dict(whole.state_dict())
    x = torch.randn(B, T, CFG.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert (whole(x, _batch(CFG, B, T)) - chunked(x, _batch(CFG, B, T))).abs().max() < 1e-12
    b1, b2 = _batch(CFG, B, T, losses=True), _batch(CFG, B, T, losses=True)
    whole(x, b1), chunked(x, b2)
    assert abs(b1.indexer_losses[0][0].item() - b2.indexer_losses[0][0].item()) < 1e-10


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_prefill_memory_is_linear_in_length():
    """The largest tensor a prefill creates grows like S (query chunks), not S²."""
    cfg = MoEConfig(**{**_fields(CFG), "dsa_query_chunk": 64, "index_topk": 32})
    layer = GatedDSAAttention(cfg, 0)
    sizes = {}
    for T in (512, 1024):
        x = torch.randn(1, T, cfg.hidden_size)
        with torch.no_grad(), _LargestTensor() as probe:
            layer(x, _batch(cfg, 1, T, dtype=torch.float32))
        sizes[T] = probe.numel
    assert sizes[1024] <= 2.2 * sizes[512]
    assert sizes[1024] < 1024 * 1024 / 2


def test_indexer_loss_trains_only_the_indexer():
    T, B = 40, 2
    layer = GatedDSAAttention(CFG, 0).double()
    _randomize(layer, seed=6, std=0.1)
    x = torch.randn(B, T, CFG.hidden_size, dtype=torch.float64, requires_grad=True)
    batch = _batch(CFG, B, T, losses=True)
    y = layer(x, batch)
    kl_sum, n = batch.indexer_losses[0]
    assert kl_sum.item() > 0 and n.item() == B * T
    kl_sum.backward(retain_graph=True)
    for name, p in layer.named_parameters():
        got = p.grad is not None and p.grad.abs().sum() > 0
        assert got == name.startswith("indexer."), name  # and k_norm.bias too: every indexer tensor
    assert x.grad is None or x.grad.abs().sum() == 0  # the indexer's input is detached
    layer.zero_grad()
    y.pow(2).sum().backward()  # the language-model side never reaches the indexer
    for name, p in layer.named_parameters():
        if name.startswith("indexer."):
            assert p.grad is None or p.grad.abs().sum() == 0, name


def test_dense_mode_loss_is_zero_when_indexer_matches_attention():
    """KL(p ‖ softmax(I)) ≥ 0, and the dense warm-up covers every visible key (sparse: only top-k)."""
    T, B = 40, 1
    dense = GatedDSAAttention(MoEConfig(**{**_fields(CFG), "dsa_mode": "dense"}), 0).double()
    _randomize(dense, seed=7)
    x = torch.randn(B, T, CFG.hidden_size, dtype=torch.float64)
    b_dense = _batch(CFG, B, T, losses=True)
    with torch.no_grad():
        dense(x, b_dense)
        sparse = GatedDSAAttention(CFG, 0).double()
        sparse.load_state_dict(dense.state_dict())
        b_sparse = _batch(CFG, B, T, losses=True)
        sparse(x, b_sparse)
    assert b_dense.indexer_losses[0][0] > b_sparse.indexer_losses[0][0] > 0


def _fields(cfg: MoEConfig) -> dict:
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_topk_mask_equals_a_stable_sort_with_ties_to_the_most_recent_key():
    """``topk_mask`` picks by the k-th value, not by sorting: the same keys as a stable descending
    sort of the reversed row, on random rows and on ReLU-like rows full of exact ties."""

    def by_sort(scores, visible, k):
        S = scores.shape[-1]
        order = torch.sort(scores.masked_fill(~visible, float("-inf")).flip(-1), dim=-1, descending=True,
                           stable=True).indices
        return torch.zeros_like(visible).scatter_(-1, S - 1 - order[..., :min(k, S)], True) & visible

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        c, S = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 80, (1,), generator=g))
        scores = (torch.randint(-3, 4, (2, c, S), generator=g).double().clamp_min(0) if trial % 2
                  else torch.randn(2, c, S, generator=g, dtype=torch.float64))
        visible = torch.rand(2, c, S, generator=g) < 0.7
        for k in (1, 4, 32):
            assert torch.equal(topk_mask(scores, visible, k), by_sort(scores, visible, k)), (trial, k)


def test_sparse_gather_equals_masked_dense_attention_fp64():
    """Sparse mode attends over the k gathered keys of each query. Output, gradients and indexer
    loss equal attention over all S keys under the top-k mask (what it replaced; ~75x the work at
    S = 2,400, k = 32), with left padding and several query chunks."""
    T, B = 60, 2
    cfg = MoEConfig(**{**_fields(CFG), "index_topk": 8, "dsa_query_chunk": 16})
    layer = GatedDSAAttention(cfg, 0).double()
    _randomize(layer, seed=11)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :7] = False
    x0 = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(12), dtype=torch.float64)

    def masked_dense(x, batch):  # the formulation before the gather: probabilities over all S keys
        q, k, v = layer.qkv(x, batch)
        ik = layer.indexer.keys(x.detach(), batch.index_rope)
        iq, iw = layer.indexer.queries(x.detach(), batch.index_rope)
        outs, kl = [], x.new_zeros(())
        for a in range(0, T, cfg.dsa_query_chunk):
            b = min(a + cfg.dsa_query_chunk, T)
            visible = batch.mask((a, b))[:, 0].expand(B, b - a, -1)
            scores = layer.kernels.dsa_scores(iq[:, a:b], iw[:, a:b], ik)
            allowed = topk_mask(scores.detach(), visible, cfg.index_topk)
            probs = layer._probs(q[:, :, a:b], k, allowed)
            outs.append(layer._weighted_values(probs, v))
            kl = kl + indexer_kl(probs.detach().mean(1), scores, allowed, batch.token_mask_BT[:, a:b])
        return layer.output(x, torch.cat(outs, dim=2)), kl

    results = []
    for form in ("gather", "dense"):
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        batch = _batch(cfg, B, T, mask=mask, losses=True)
        if form == "gather":
            y = layer(x, batch)
            kl = batch.indexer_losses[0][0]
        else:
            y, kl = masked_dense(x, batch)
        ((y * mask[..., None]).square().sum() + kl).backward()
        results.append([y.detach()[mask], kl.detach(), x.grad[mask]] + [p.grad.clone() for p in layer.parameters()])
    for got, ref in zip(*results, strict=True):
        assert (got - ref).abs().max() < 1e-10 * max(1.0, ref.abs().max().item())
