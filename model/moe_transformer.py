"""`MoETransformer`: the decoder-only MoE language model, single-device and plain PyTorch.

Each layer's token mixer is chosen by `config.layer_types`: `full` (model/attention.py), `kda`
(model/kda.py), `gated_dsa` (model/dsa.py) or `mla` (model/mla.py, Kimi-Linear's latent attention). With every layer `full` (the default) and Qwen3-MoE's
FFN options the model is state-dict-identical to transformers' `Qwen3MoeForCausalLM` (5.x layout).

Shapes: B batch, T new tokens, S = past + T key positions, H hidden, V vocab, E experts,
k experts per token, L layers, N = B·T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from jointrl.kernels.dispatch import default_backend
from jointrl.kernels.ops import Kernels, kernels_for
from jointrl.model import paged
from jointrl.model.attention import Attention, AttentionBatch
from jointrl.model.config import MoEConfig
from jointrl.model.dsa import GatedDSAAttention, indexer_loss
from jointrl.model.gpt_oss import ClampedSwiGLUExperts, SinkAttention
from jointrl.model.image import ImageProjector
from jointrl.model.kda import KimiDeltaAttention
from jointrl.model.mla import MultiHeadLatentAttention
from jointrl.model.state import AttentionState
from jointrl.model.moe import MLP, SparseMoeBlock
from jointrl.model.routing import expert_load, load_balancing_loss
from jointrl.model.norm import RMSNorm
from jointrl.model.rope import RotaryEmbedding, Yarn


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor               # [B, T, V] in the model dtype
    router_logits: list[torch.Tensor]  # per MoE layer [B·T, E] (pre-softmax/sigmoid; model/routing.py)
    aux_loss: torch.Tensor             # scalar load-balancing loss (unweighted; coef in config)
    topk_ids: torch.Tensor             # [B, T, L_moe, k] int64: experts each token was sent to
    expert_load: torch.Tensor          # [L_moe, E] float32: real-token assignments per expert (no grad)
    # gated_dsa indexer loss (mean KL per real query, averaged over gated_dsa layers), only when the
    # forward was asked for it; gradients reach the indexers only (model/dsa.py).
    indexer_loss: torch.Tensor | None = None


MIXERS = {"full": Attention, "kda": KimiDeltaAttention, "gated_dsa": GatedDSAAttention, "sliding": SinkAttention,
          "mla": MultiHeadLatentAttention}


def mixer(config: MoEConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s token mixer: its kind's class; gpt-oss options (biases, sinks) make a "full"
    layer a `SinkAttention` too."""
    kind = config.kinds[layer_idx]
    if kind == "full" and (config.attention_sinks or config.attention_bias):
        return SinkAttention(config, layer_idx)
    return MIXERS[kind](config, layer_idx)


class DecoderLayer(nn.Module):
    """x += attn(norm(x)); x += moe(norm(x))."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        # Registration order = HF's, so state_dict() lists keys in the same order. The token mixer
        # (`self_attn` whatever its kind) is the layer's `layer_types` entry.
        self.self_attn = mixer(config, layer_idx)
        # The first `first_k_dense_replace` layers have a dense SwiGLU MLP (DeepSeek-V3), no router.
        self.is_moe = layer_idx >= config.first_k_dense_replace
        self.mlp = SparseMoeBlock(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        if self.is_moe and config.swiglu_limit is not None:  # gpt-oss's experts (model/gpt_oss.py)
            self.mlp.experts = ClampedSwiGLUExperts(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def paged(self, x_NH: torch.Tensor, step: paged.PagedStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` over the engine's flat, ragged batch [N, H] (its token mixer's ``paged``: a kind with
        ``StateSpec.ragged``) → (x_NH, expert ids_Nk or None for a dense layer); ``model/paged.py``."""
        return paged.layer_forward(self, x_NH, step)

    def forward(self, x_BTH: torch.Tensor, batch: AttentionBatch, replay_ids_Nk: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """→ (x_BTH, (router logits_NE, probs_NE, ids_Nk) or None for a dense layer)."""
        a_BTH = self.self_attn(self.input_layernorm(x_BTH), batch)
        if batch.layout is not None:  # a flat stream: its layout may keep fewer rows after the attention
            x_BTH = batch.layout.rows(self.self_attn.layer_idx, x_BTH)
        x_BTH = x_BTH + a_BTH
        h_BTH = self.post_attention_layernorm(x_BTH)
        if not self.is_moe:
            return x_BTH + self.mlp(h_BTH), None
        y_BTH, logits_NE, probs_NE, ids_Nk = self.mlp(h_BTH, replay_ids_Nk)
        return x_BTH + y_BTH, (logits_NE, probs_NE, ids_Nk)


class MoEBackbone(nn.Module):
    """Embedding, decoder layers and final norm: HF's `Qwen3MoeModel` (the `model.` prefix)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        yarn = None if config.rope_type == "default" else Yarn(
            config.rope_factor, config.rope_original_max_position_embeddings, config.rope_beta_fast,
            config.rope_beta_slow, config.rope_truncate)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, yarn)
        self.index_rotary_emb = RotaryEmbedding(config.index_head_dim, config.rope_theta)  # no parameters
        if config.image_patch_dim:
            self.image_projector = ImageProjector(config.image_patch_dim, config.hidden_size, config.image_token_id)


class MoETransformer(nn.Module):
    """Qwen3-MoE-shaped causal LM. `state_dict()` keys equal `Qwen3MoeForCausalLM`'s."""

    def __init__(self, config: MoEConfig, seed: int = 0, kernels: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = MoEBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.device.type != "meta":  # meta: shapes only, weights loaded later
            self.reset_parameters(seed)
        self.set_kernels(default_backend() if kernels is None else kernels)

    @classmethod
    def from_config(cls, config: MoEConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                    device: torch.device | str | None = None, kernels: str | None = None) -> MoETransformer:
        """Deterministic init: the same seed gives the same weights (rounded) in any dtype. ``kernels``:
        ``set_kernels``' choice (default ``$JOINTRL_KERNEL_BACKEND``, else auto), resolved on ``device``."""
        model = cls(config, seed=seed, kernels="torch").to(device=device, dtype=dtype)
        model.set_kernels(default_backend() if kernels is None else kernels)
        return model

    def set_kernels(self, name: str) -> Kernels:
        """Choose the kernel backend (``auto | torch | cpu | triton``, ``kernels/dispatch``) for the device the
        weights are on (meta: CPU), and hand its op table (``kernels/ops.Kernels``) to every module that calls
        a kernel op (those with a ``kernels`` attribute: norms, KDA, experts). Call it again after moving the
        model to another device. → the table, also ``self.kernels`` (the engine's runner reads it)."""
        device = self.lm_head.weight.device
        table = kernels_for(name, "cpu" if device.type == "meta" else device)
        self.kernels_choice = name  # what was asked (auto may resolve otherwise on another device)
        for module in self.modules():
            if hasattr(module, "kernels") and module is not self:
                module.kernels = table
        self.kernels = table
        return table

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Norm weights 1, norm biases 0; KDA's decay parameters as fla (A_log = log U(1, 16), or 0 with
        a safe lower bound; dt_bias = softplus⁻¹(dt), log dt ~ U(log 1e-3, log 0.1)) and its conv
        N(0, 1/W); every other weight N(0, initializer_range). All drawn in float32 from one
        generator in `named_parameters()` order."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("norm.bias", "proj_bias")):
                p.zero_()
            elif name.endswith("A_log"):
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                p.copy_(torch.zeros_like(u) if self.config.linear_lower_bound is not None else (1 + 15 * u).log())
            elif name.endswith("dt_bias"):
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                dt = torch.exp(math.log(1e-3) + u * (math.log(0.1) - math.log(1e-3)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def attention_batch(self, position_ids: torch.Tensor, dtype: torch.dtype, **fields) -> AttentionBatch:
        """The ``AttentionBatch`` of a forward at RoPE positions ``position_ids`` [B, T]: its rotary tables (the
        indexer's too where a gated_dsa layer reads them) and ``fields`` (mask, cache, ... as named there)."""
        index_rope = self.model.index_rotary_emb(position_ids, dtype) if "gated_dsa" in self.config.kinds else None
        return AttentionBatch(rope=self.model.rotary_emb(position_ids, dtype), index_rope=index_rope, **fields)

    def run_layers(self, x_BTH: torch.Tensor, batch: AttentionBatch, routed_experts: torch.Tensor | None = None,
                   grad_checkpoint: bool = False) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Every decoder layer over ``x_BTH`` [B, T, H] → (x_BTH, per MoE layer (router logits_NE, probs_NE,
        ids_Nk)): the layer loop of ``forward``, which the learner's forwards share (its shared prompts too: a
        flat stream x [N, H] under ``batch.layout``, full-attention layers only, where the layout may keep fewer
        rows after a layer's attention, ``model.attention.FlatLayout``). ``routed_experts`` [B, T, L_moe, k]:
        routing replay; ``grad_checkpoint``: recompute each layer in backward."""
        if batch.layout is not None and (routed_experts is not None or grad_checkpoint):
            raise ValueError("a flat stream (AttentionBatch.layout) runs without routing replay and checkpointing")
        B, T = x_BTH.shape[:2]
        routing = []
        for layer in self.model.layers:
            replay_Nk = None if routed_experts is None or not layer.is_moe else routed_experts[:, :, len(routing)].reshape(B * T, -1)
            if grad_checkpoint and torch.is_grad_enabled():
                x_BTH, routed = checkpoint(layer, x_BTH, batch, replay_Nk, use_reentrant=False)
            else:
                x_BTH, routed = layer(x_BTH, batch, replay_Nk)
            if routed is not None:
                routing.append(routed)
        return x_BTH, routing

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: AttentionState | None = None,
                routed_experts: torch.Tensor | None = None, return_indexer_loss: bool = False,
                image_patches: torch.Tensor | None = None) -> ModelOutput:
        """Logits for `input_ids` [B, T], continuing `cache` (a `KVCache` or another `AttentionState`,
        updated in place) when given.

        position_ids [B, T]: RoPE positions. Default: each token's index among the real tokens
            of `attention_mask` (so left padding is transparent), else past + arange(T).
        attention_mask [B, S] bool, S = cache.length + T: True = real token; masks keys (left or
            right padding). Outputs at padding positions are finite but meaningless.
        routed_experts [B, T, L_moe, k] int64, L_moe = config.num_moe_layers (dense first layers
            have no router): routing replay; these experts replace the router's top-k, weighted by
            the router's (renormalised) scores at those ids. Ids must be valid experts at every
            position, padding included.
        return_indexer_loss: compute `ModelOutput.indexer_loss` (gated_dsa layers; their attention
            is then computed explicitly, chunk by chunk, to get its probabilities).
        image_patches [P, image_patch_dim]: one row per `<image>` token in `input_ids` (row-major),
            projected into those positions (model/image.py); needs `config.image_patch_dim`.
        """
        cfg = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past = 0 if cache is None else cache.length
        if cache is not None and cache.batch != B:
            raise ValueError(f"cache holds batch {cache.batch}, input_ids has batch {B}")
        device = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                real_BS = attention_mask.to(device=device, dtype=torch.long)
                position_ids = (real_BS.cumsum(-1) - 1).clamp_min(0)[:, past:]
            else:
                position_ids = torch.arange(past, past + T, device=device).expand(B, T)
        elif position_ids.shape != (B, T):
            raise ValueError(f"position_ids must be [B, T] = {(B, T)}, got {tuple(position_ids.shape)}")
        L, k = cfg.num_moe_layers, cfg.num_experts_per_tok
        if routed_experts is not None and routed_experts.shape != (B, T, L, k):
            raise ValueError(f"routed_experts must be [B, T, num_moe_layers, k] = {(B, T, L, k)}, "
                             f"got {tuple(routed_experts.shape)}")

        x_BTH = self.model.embed_tokens(input_ids)
        if image_patches is not None:
            if not cfg.image_patch_dim:
                raise ValueError("image_patches given but MoEConfig.image_patch_dim is 0 (a text-only model)")
            x_BTH = self.model.image_projector.merge(x_BTH, input_ids, image_patches)
        key_mask_BS = None if attention_mask is None else attention_mask.to(device, torch.bool)
        batch = self.attention_batch(
            position_ids, x_BTH.dtype, mask_B1TS=None, token_mask_BT=None if key_mask_BS is None else key_mask_BS[:, past:],
            cache=cache, indexer_losses=[] if return_indexer_loss else None, past=past, key_mask_BS=key_mask_BS)
        if attention_mask is not None and attention_mask.shape[1] != past + T:
            raise ValueError(f"attention_mask must cover past + new tokens = {past + T} positions, "
                             f"got shape {tuple(attention_mask.shape)}")
        x_BTH, routing = self.run_layers(x_BTH, batch, routed_experts)
        router_logits, probs, ids = ([r[i] for r in routing] for i in range(3))
        logits_BTV = self.lm_head(self.model.norm(x_BTH))
        if cache is not None:
            cache.advance(T)

        token_mask_N = None if attention_mask is None else attention_mask[:, past:].reshape(-1)
        aux_loss = load_balancing_loss(probs, ids, cfg.num_experts, token_mask_N)
        topk_ids_BTLk = torch.stack(ids, dim=1).view(B, T, L, k)
        with torch.no_grad():
            load_LE = torch.stack([expert_load(ids_Nk, cfg.num_experts, token_mask_N) for ids_Nk in ids])
        return ModelOutput(logits=logits_BTV, router_logits=router_logits, aux_loss=aux_loss,
                           topk_ids=topk_ids_BTLk, expert_load=load_LE,
                           indexer_loss=indexer_loss(batch.indexer_losses) if return_indexer_loss else None)
