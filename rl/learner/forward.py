"""The learner's forward pass over packed rows: segment-causal attention, optional routing
replay and gradient checkpointing, hidden states for a value head.

It runs the model's own layer loop (``MoETransformer.run_layers``, as ``MoETransformer.forward`` does,
between the embedding and the final norm and head), with two differences the learner needs and the model (a
plain single-device module) should not carry: several sequences may share a row (a
block-diagonal causal mask from ``seg_BT``, positions restarting per sequence), and each
layer can be recomputed in backward (``torch.utils.checkpoint``). On unpacked rows the
logits equal ``MoETransformer.forward``'s (tested).

Shared prefixes (``batch.SharedPrefix``, full attention only): a GRPO group's completions
continue one prompt, so the prompt is forwarded once and every layer's keys/values of it are
reused by the completions' rows (their gradients flow back summed); the prompts' and the rows' tokens run as
one flat stream through the same layer loop (one call per projection, norm and FFN), whose attention the
model's ``Attention`` hands to the stream's layout (``_SharedLayout``, ``AttentionBatch.layout``). The attention, and so the
log-probs and the update, equal the unshared forward's up to float summation order; only the
balance loss and the expert-load metrics count the prompt's tokens once instead of per row (and
leave out what is not computed because no log-prob reads it: the rows' last token, and the
prompts' tokens but their last in the last layer's router).

Shapes: B rows, T tokens per row, H hidden, V vocab, L layers, k experts per token, E experts,
G shared prompts of P tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jointrl.model.attention import Attention
from jointrl.model.dsa import indexer_loss as dsa_indexer_loss
from jointrl.model.norm import compute_dtype, outside_autocast
from jointrl.model.routing import expert_load, load_balancing_loss
from jointrl.rl.learner.batch import SharedPrefix
from jointrl.rl.learner.layers import LearnerForward
from jointrl.rl.learner.prefix_cache import forward_with_prefix_cache


def segment_mask(seg_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool SDPA mask: query t sees key s <= t of the same sequence (seg >= 0);
    every position sees itself, so padding (seg = -1) rows stay finite."""
    T = seg_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=seg_BT.device).tril()
    same_BTT = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] >= 0)
    eye_TT = torch.eye(T, dtype=torch.bool, device=seg_BT.device)
    return ((same_BTT & causal_TT) | eye_TT)[:, None]


def check_packable(config) -> None:
    """Packing needs every token mixer to honour the segment mask: only ``full`` attention does
    (KDA's recurrent state and DSA's indexer would carry across sequences)."""
    if set(config.kinds) != {"full"}:
        raise ValueError(f"learner.pack_sequences needs full-attention layers only, the model has {sorted(set(config.kinds))}")


class _SharedLayout:
    """``model.attention.FlatLayout`` of ``_forward_shared``'s stream: the prompts' G·P tokens, then the rows'
    B·S. The prompts attend over their own keys, the rows over their prompt's keys/values and their own; in
    the last layer only each prompt's last query is computed and only its row and the rows' go on (no later
    layer reads the others')."""

    def __init__(self, prefix: SharedPrefix, seg_BS: torch.Tensor, last_layer: int) -> None:
        G, P = prefix.ids.shape
        B, S = seg_BS.shape
        self.prefix, self.G, self.P, self.B, self.S, self.last = prefix, G, P, B, S, last_layer
        device = seg_BS.device
        self.mask_p = segment_mask(torch.where(prefix.real, 0, -1))
        self.mask_s = torch.cat((prefix.real[prefix.row_group][:, None, None, :].expand(B, 1, S, P),
                                 segment_mask(seg_BS)), dim=-1)
        self.at_G = torch.arange(G, device=device) * P + prefix.real.sum(1) - 1  # each prompt's last token
        self.keep_N = torch.cat((self.at_G, torch.arange(G * P, G * P + B * S, device=device)))

    def attend(self, layer: int, q_NhD: torch.Tensor, k_NhD: torch.Tensor, v_NhD: torch.Tensor, scale: float,
               enable_gqa: bool) -> torch.Tensor:
        G, P, B, S, prefix = self.G, self.P, self.B, self.S, self.prefix
        (q_p, q_s), (k_p, k_s), (v_p, v_s) = (_split_parts(t, G, P, B, S) for t in (q_NhD, k_NhD, v_NhD))
        sdpa = dict(scale=scale, enable_gqa=enable_gqa)
        if layer == self.last:  # the prompts' last queries only, over their prompt's keys
            out_PF = _sdpa(q_NhD.index_select(0, self.at_G)[:, :, None], k_p, v_p,
                           attn_mask=prefix.real[:, None, None, :], **sdpa).reshape(G, -1)
        else:
            out_PF = _sdpa(q_p, k_p, v_p, attn_mask=self.mask_p, **sdpa).transpose(1, 2).reshape(G * P, -1)
        # index_select: its backward is index_add_, not indexing's sorting index_put_(accumulate=True)
        out_BHSD = _sdpa(q_s, torch.cat((k_p.index_select(0, prefix.row_group), k_s), dim=2),
                         torch.cat((v_p.index_select(0, prefix.row_group), v_s), dim=2), attn_mask=self.mask_s, **sdpa)
        return torch.cat((out_PF, out_BHSD.transpose(1, 2).reshape(B * S, out_PF.shape[1])))  # S = 0: one-token completions

    def rows(self, layer: int, x_NF: torch.Tensor) -> torch.Tensor:
        return x_NF.index_select(0, self.keep_N) if layer == self.last else x_NF


def _forward_shared(model: torch.nn.Module, ids_BT: torch.Tensor, pos_BT: torch.Tensor, seg_BT: torch.Tensor,
                    prefix: SharedPrefix) -> LearnerForward:
    """``learner_forward`` of rows that continue shared prompts, through the model's own layer loop
    (``MoETransformer.run_layers``) over one flat stream of N = G·P + B·S tokens, the prompts' tokens and the
    rows' tokens 1..: every per-token step of a layer (norms, q/k/v, q/k-norm + RoPE, o_proj, FFN / MoE:
    ``DecoderLayer.forward``'s, so each expert runs once per layer) runs once over the stream; only the
    attention runs per part (``_SharedLayout``): the prompts over their own keys, then the rows over their
    prompt's keys/values and their own. Column 0's outputs are its prompt's last token's. Nothing whose output
    no log-prob reads is computed: the rows' last column (no query reads its keys and values, no log-prob its
    logits: column t predicts token t + 1; its logits and hidden state come back 0, its experts -1) and, in the
    last layer, the prompts' tokens but their last after the keys and values (no later layer reads their
    outputs). Like the prompts' repeats, those tokens (the last layer's for its router) are not in the balance
    loss or the expert load. Every layer must be plain full attention (``Attention``)."""
    cfg, backbone = model.config, model.model
    if not flat_shareable(model):
        raise ValueError(f"shared prefixes need full-attention layers only, the model has {sorted(set(cfg.kinds))}")
    B, T = ids_BT.shape
    G, P = prefix.ids.shape
    S, H = T - 2, cfg.hidden_size  # the rows' columns 1..T-2
    GP = G * P
    k = cfg.num_experts_per_tok
    seg_BS = seg_BT[:, 1:-1]
    # the stream stays 2-D [N, ·] and q/k/v [N, heads, D] (each part a strided view of it): a leading
    # [1, ...] dim and its select cost every layer's backward a zero-filled copy of q, k, v and h, and
    # the [N, heads, D] views' backward a reshape copy each
    x_NH = backbone.embed_tokens(torch.cat((prefix.ids.reshape(-1), ids_BT[:, 1:-1].reshape(-1))))
    pos_1N = torch.cat((torch.arange(P, device=ids_BT.device).repeat(G), pos_BT[:, 1:-1].reshape(-1)))[None]
    last = cfg.num_hidden_layers - 1
    layout = _SharedLayout(prefix, seg_BS, last)
    batch_n = model.attention_batch(pos_1N, x_NH.dtype, mask_B1TS=None, token_mask_BT=None, cache=None, layout=layout)
    x_NH, routing = model.run_layers(x_NH, batch_n)
    probs, ids = [r[1] for r in routing], [r[2] for r in routing]
    real_N = torch.cat((prefix.real.reshape(-1), (seg_BS >= 0).reshape(-1)))
    trimmed = torch.cat((torch.ones(G, dtype=torch.bool, device=ids_BT.device), real_N[GP:]))
    # per MoE layer: its router's tokens' mask and where column 0's token is among them (the last layer: trimmed)
    moe_last = [i == last for i, layer in enumerate(backbone.layers) if layer.is_moe]
    masks = [trimmed if t else real_N for t in moe_last]
    col0 = [(torch.arange(G, device=ids_BT.device), G) if t else (layout.at_G, GP) for t in moe_last]
    x_GH, x_BSH = x_NH.split((G, B * S))
    hidden_BSH = backbone.norm(torch.cat((x_GH.index_select(0, prefix.row_group)[:, None], x_BSH.view(B, S, H)), dim=1))
    # the last column back as zeros (a pad: its gradient is a slice of the logits' gradient)
    logits_BTV = F.pad(_head(model, hidden_BSH), (0, 0, 0, 1))
    # pooled over (layer, token) as load_balancing_loss pools L layers of one token set
    aux = load_balancing_loss([torch.cat(probs)], [torch.cat(ids)], cfg.num_experts, torch.cat(masks))
    with torch.no_grad():
        load_LE = torch.stack([expert_load(ids_Nk, cfg.num_experts, m) for ids_Nk, m in zip(ids, masks)])
    topk_BSLk = torch.stack([torch.cat((ids_Nk[at[prefix.row_group]][:, None], ids_Nk[start:].view(B, S, k)), dim=1)
                             for ids_Nk, (at, start) in zip(ids, col0)], dim=2)
    topk_BTLk = F.pad(topk_BSLk, (0, 0, 0, 0, 0, 1), value=-1)
    return LearnerForward(logits_BTV, F.pad(hidden_BSH, (0, 0, 0, 1)), topk_BTLk, aux, load_LE)


def flat_shareable(model: torch.nn.Module) -> bool:
    """Whether every layer's token mixer is plain full attention, which attends through ``_SharedLayout``
    (other kinds, sinks and windows included, share prompts through ``prefix_cache``)."""
    return all(type(layer.self_attn) is Attention for layer in model.model.layers)


def _head(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``model.lm_head(hidden)``, outside autocast (``learner.autocast``): the logits the log-probs and the
    policy ratio come from stay in the hidden state's precision."""
    with outside_autocast(hidden):
        return model.lm_head(hidden)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on CPU under autocast (``learner.autocast``) with autocast off, in
    at least float32: torch's bfloat16 CPU attention ran bench_moe's learner step slower than float32 here
    (tests/bench/results.md, "Model and learner")."""
    if q.device.type == "cpu" and torch.is_autocast_enabled(q.device.type):
        dtype = compute_dtype(q.dtype)
        with outside_autocast(q):
            return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _split_parts(t_NhD: torch.Tensor, G: int, P: int, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[G·P + B·S, heads, D] → the prompts' [G, heads, P, D] and the rows' [B, heads, S, D] (views)."""
    p_NhD, s_NhD = t_NhD.split((G * P, B * S))
    return p_NhD.unflatten(0, (G, P)).transpose(1, 2), s_NhD.unflatten(0, (B, S)).transpose(1, 2)


def learner_forward(model: torch.nn.Module, ids_BT: torch.Tensor, pos_BT: torch.Tensor, seg_BT: torch.Tensor,
                    replay_BTLk: torch.Tensor | None = None, grad_checkpoint: bool = False,
                    image_patches: torch.Tensor | None = None, prefix: SharedPrefix | None = None,
                    indexer_loss: bool = False, logits: bool = True) -> LearnerForward:
    """Forward ``ids_BT`` with RoPE positions ``pos_BT`` and sequence ids ``seg_BT`` (-1 = padding).

    ``replay_BTLk`` [B, T, L_moe, k]: routing replay (the rollout's experts; valid ids everywhere).
    ``image_patches`` [P, patch_dim]: one row per ``<image>`` id, row-major (``MicroBatch.images``).
    ``prefix``: the rows continue these shared prompts (``MicroBatch.prefix``; none of the above).
    ``indexer_loss``: also return gated_dsa's indexer loss (``model.dsa.indexer_loss``; None
    without gated_dsa layers).
    ``logits=False``: skip the head (``logits_BTV`` None) for ``learner/logprobs.chunked_logprobs``,
    which reads ``hidden_BTH`` (shared prefixes compute their logits regardless).
    """
    if prefix is not None:
        if replay_BTLk is not None or grad_checkpoint or image_patches is not None:
            raise ValueError("shared prefixes work without routing replay, gradient checkpointing and images only")
        if not flat_shareable(model):  # a KDA state does not concatenate: the prompts' cache instead
            return forward_with_prefix_cache(model, ids_BT, pos_BT, seg_BT, prefix, indexer_loss)
        return _forward_shared(model, ids_BT, pos_BT, seg_BT, prefix)
    B, T = ids_BT.shape
    cfg = model.config
    L, k = cfg.num_moe_layers, cfg.num_experts_per_tok
    if replay_BTLk is not None and replay_BTLk.shape != (B, T, L, k):
        raise ValueError(f"routed experts must be [B, T, L, k] = {(B, T, L, k)}, got {tuple(replay_BTLk.shape)}")
    backbone = model.model
    x_BTH = backbone.embed_tokens(ids_BT)
    if image_patches is not None:
        x_BTH = backbone.image_projector.merge(x_BTH, ids_BT, image_patches)
    real_BT = seg_BT >= 0
    batch = model.attention_batch(pos_BT, x_BTH.dtype, mask_B1TS=segment_mask(seg_BT), token_mask_BT=real_BT,
                                  cache=None, indexer_losses=[] if indexer_loss else None)
    x_BTH, routing = model.run_layers(x_BTH, batch, replay_BTLk, grad_checkpoint)
    probs, ids = [r[1] for r in routing], [r[2] for r in routing]
    indexer_losses = list(batch.indexer_losses or ())  # before a checkpointed backward appends its recomputed ones
    hidden_BTH = backbone.norm(x_BTH)
    logits_BTV = _head(model, hidden_BTH) if logits else None
    real_N = real_BT.reshape(-1)
    aux = load_balancing_loss(probs, ids, cfg.num_experts, real_N)
    with torch.no_grad():
        load_LE = torch.stack([expert_load(ids_Nk, cfg.num_experts, real_N) for ids_Nk in ids])
    return LearnerForward(logits_BTV, hidden_BTH, torch.stack(ids, dim=1).view(B, T, L, k), aux, load_LE,
                          dsa_indexer_loss(indexer_losses) if indexer_loss else None)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H_t of the distribution that predicted token t (softmax(logits_{t-1} / T)); [B, T], 0 at t = 0."""
    if temperature not in (0.0, 1.0):
        logits_BTV = logits_BTV / temperature
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float() if logits_BTV.dtype == torch.bfloat16 else logits_BTV[:, :-1], -1)
    h_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return torch.cat([h_BT.new_zeros(h_BT.shape[0], 1), h_BT], dim=1)
