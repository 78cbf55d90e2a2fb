"""Shared prompts for models with ``kda`` / ``gated_dsa`` / ``mla`` layers: the prompt through the model once,
its attention state (keys/values, indexer keys, MLA latents, KDA conv window and delta state) handed to every row
that continues it, as the rollout engine's cache would be.

``forward.learner_forward(prefix=...)`` calls ``forward_with_prefix_cache`` for such models (its flat
stream in ``forward._forward_shared`` is exact for full attention only: a KDA state cannot be
concatenated); both run the model's own layer loop, ``MoETransformer.run_layers``. The same ``MicroBatch``
layout (``batch.collate_shared``):

    prompts [G, P] (right-padded), row b continues prompt row_group[b]; its column 0 is that
    prompt's last token, columns 1.. its own tokens.

1. Each prompt *without its last token* is left-padded into [G, P0] and run through every layer
   with a differentiable ``KVCache`` (``torch.cat``). Left padding is exact for every mixer: KDA
   zeroes padded inputs, so a prompt reaches its first real token with a zero state and ends with
   its last real inputs in the conv window; attention masks the padded keys.
2. The cache is indexed by ``row_group`` (B rows, gradients flow back into the prompts' tensors)
   and the rows [B, T] run on from it: past = P0, their padded prompt slots masked as keys.

Per row this is the unshared sequence's computation, so log-probs and gradients equal the
unshared forward's (float64 tests). What it saves: the prompt's tokens once per group instead of
once per row, in every layer.

Counts that read prompt tokens stay per row: the expert load (the router-bias update), the balance
loss and gated_dsa's indexer loss weight each prompt token by the number of rows that continue it
(``AttentionBatch.query_weight_BT``), so they too equal the unshared forward's.
"""

from __future__ import annotations

import torch

from jointrl.model.attention import AttentionBatch
from jointrl.model.dsa import indexer_loss as dsa_indexer_loss
from jointrl.model.kv_cache import KVCache
from jointrl.model.routing import expert_load, load_balancing_loss
from jointrl.rl.learner.layers import LearnerForward


def _left_padded_prompts(prefix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each prompt without its last token, left-padded: (ids [G, P0], real [G, P0], positions);
    padding holds token 0 (never seen: masked as a key, zeroed as a KDA input)."""
    lens_G = prefix.real.sum(1) - 1
    G, P0 = prefix.ids.shape[0], int(lens_G.max())
    ids = torch.zeros((G, P0), dtype=prefix.ids.dtype)
    real = torch.zeros((G, P0), dtype=torch.bool)
    for g, n in enumerate(lens_G.tolist()):
        if n:
            ids[g, P0 - n:] = prefix.ids[g, :n]
            real[g, P0 - n:] = True
    return ids, real, (real.long().cumsum(1) - 1).clamp(min=0)


def _batch(model, x_BTH, pos_BT, token_mask_BT, cache, losses, key_mask_BS, query_weight_BT=None) -> AttentionBatch:
    return model.attention_batch(pos_BT, x_BTH.dtype, mask_B1TS=None, token_mask_BT=token_mask_BT, cache=cache,
                                 indexer_losses=losses, past=cache.length, key_mask_BS=key_mask_BS,
                                 query_weight_BT=query_weight_BT)


def forward_with_prefix_cache(model: torch.nn.Module, ids_BT: torch.Tensor, pos_BT: torch.Tensor,
                              seg_BT: torch.Tensor, prefix, indexer_loss: bool = False):
    """``learner_forward`` of rows that continue shared prompts, through a cache of the prompts."""
    cfg, backbone = model.config, model.model
    B, T = ids_BT.shape
    L, k = cfg.num_moe_layers, cfg.num_experts_per_tok
    dtype = backbone.embed_tokens.weight.dtype
    losses: list | None = [] if indexer_loss else None
    pre_ids, pre_real, pre_pos = _left_padded_prompts(prefix)
    G, P0 = pre_ids.shape
    cache = KVCache.empty(cfg, G, dtype=dtype)
    rg = prefix.row_group
    # a prompt token stands for every row that continues it
    uses_G = torch.bincount(rg, minlength=G).to(torch.float32)
    probs_p, ids_p = [], []
    if P0:
        x_GPH = backbone.embed_tokens(pre_ids)
        _, routing = model.run_layers(x_GPH, _batch(model, x_GPH, pre_pos, pre_real, cache, losses, pre_real,
                                                    pre_real * uses_G[:, None]))
        probs_p, ids_p = [r[1] for r in routing], [r[2] for r in routing]
        cache.advance(P0)
    def rows(ts: list) -> list:
        return [None if t is None else t[rg] for t in ts]
    row_cache = KVCache(keys=rows(cache.keys), values=rows(cache.values), index_keys=rows(cache.index_keys),
                        conv_states=rows(cache.conv_states), recurrent_states=rows(cache.recurrent_states),
                        batch=B, length=P0, latents=rows(cache.latents))
    real_BT = seg_BT >= 0
    x_BTH = backbone.embed_tokens(ids_BT)
    batch = _batch(model, x_BTH, pos_BT, real_BT, row_cache, losses, torch.cat((pre_real[rg], real_BT), dim=1))
    x_BTH, routing = model.run_layers(x_BTH, batch)
    probs_r, ids_r = [r[1] for r in routing], [r[2] for r in routing]
    hidden_BTH = backbone.norm(x_BTH)
    logits_BTV = model.lm_head(hidden_BTH)
    weight_N = torch.cat(((pre_real * uses_G[:, None]).reshape(-1), real_BT.reshape(-1).to(torch.float32)))
    probs = [torch.cat(pr) for pr in zip(probs_p, probs_r)] if P0 else probs_r
    ids = [torch.cat(pr) for pr in zip(ids_p, ids_r)] if P0 else ids_r
    aux = load_balancing_loss(probs, ids, cfg.num_experts, weight_N)
    with torch.no_grad():
        load_LE = torch.stack([expert_load(ids_Nk, cfg.num_experts, weight_N) for ids_Nk in ids])
    idx_loss = None
    if indexer_loss:  # one (KL sum, weighted queries) per gated_dsa layer: the prompts' pass and the rows' added
        n = len(losses) // 2 if P0 else len(losses)
        per_layer = ([(a[0] + b[0], a[1] + b[1]) for a, b in zip(losses[:n], losses[n:], strict=True)]
                     if P0 else losses)
        idx_loss = dsa_indexer_loss(per_layer)
    return LearnerForward(logits_BTV, hidden_BTH, torch.stack(ids_r, dim=1).view(B, T, L, k), aux, load_LE, idx_loss)
