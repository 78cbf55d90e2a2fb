"""The model's layers on the engine's flat, ragged batch over paged pools: what a layer kind brings to
``rl/rollout/model_runner.ModelRunner`` so the runner's loop over layers does not reach into the modules.

A step of the engine flattens every sequence's new tokens -- one per decoding sequence, a chunk per
prefilling one -- into N rows, and ``layer_forward`` is ``DecoderLayer.forward`` on those rows. A token mixer
with a ragged form (``StateSpec.ragged`` and a ``paged(h_NH, step)`` method; ``Attention``) runs all N rows
in one call per op, with the keys/values written to and read from the runner's pools
(``PagedStep.kv`` / ``PagedStep.attend``: paged decode / prefill through the model's kernel table) and, on
the ``cpu`` backend, the per-row C++ ops (``kernels/decode_cpu``: norms, q/k-norm + RoPE + KV write in one
call, the softmax router) and the dense projections against packed weights (``kernels/linear_cpu``; the
runner owns the packed copies and their cache: ``PagedStep.linear`` / ``packed_weight`` / ``packed_experts``).
A token mixer of any other kind runs its own ``forward`` per sequence group (``PagedStep.per_sequence``: the
model's ``AttentionState`` hook over the same pools) while its layer's norms and FFN run over all N rows.

A pure decode step of a plain Qwen3-MoE-shaped model runs each layer as one C++ call (``decode_cpu``'s
``decode_layer``) from a ``LayerPlan``: ``layer_plan`` says which weights it takes (prepared by the runner's
packer), ``plan_refs`` which parameters it reads (to see them change), ``plain_decode_shape`` when it applies;
``decode_layers`` runs the plan's layers. Bit for bit ``layer_forward``'s results (tests/rl/rollout). A capturable
step (``ModelRunner.decode_step`` for CUDA graphs) runs the same ``layer_forward``: its MoE calls the layer's
experts through the kernel table (``kernels.moe_experts`` / ``moe_experts_mxfp4``), whose Triton form has no
host sync (``kernels/moe_matmul._routed``).

Shapes: N new tokens, H hidden, Hq/Hkv heads, D head_dim, E experts, k experts per token, P cache slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from jointrl.kernels import decode_cpu, linear_cpu, moe_cpu
from jointrl.kernels.norm_rope_cpu import rms_norm_torch
from jointrl.model.norm import RMSNorm
from jointrl.model.rope import rotate_half


@dataclass(slots=True)
class LayerPlan:
    """One decoder layer of a planned decode step: its cache pool and the prepared weights the C++ call takes."""

    kv_PCHD: torch.Tensor        # the layer's cache pool
    w_in: torch.Tensor           # input RMSNorm weight [H]
    eps_in: float
    qkv_p: torch.Tensor          # q|k|v projection, packed (linear_cpu.pack)
    qkv_out: int                 # its output width (Hq + 2·Hkv)·D
    qk_norm_w: torch.Tensor      # [Hq + Hkv, D] per-head q/k-norm weights, or empty: no q/k-norm
    qk_eps: float
    o_p: torch.Tensor            # o projection, packed
    hidden: int                  # H
    w_post: torch.Tensor         # post-attention RMSNorm weight [H]
    eps_post: float
    gate_p: torch.Tensor         # router projection, packed
    num_experts: int             # E
    top_k: int
    norm_topk: bool
    route_scale: float
    experts: tuple[torch.Tensor, torch.Tensor, int]  # (gate_up, down panels, I): moe_cpu.moe_experts_packed


@dataclass(slots=True)
class DecodePlan:
    """A pure decode step of a plain Qwen3-MoE-shaped model: its layers, then the final norm and the head."""

    layers: list[LayerPlan]
    w_norm: torch.Tensor
    eps_norm: float
    head_p: torch.Tensor         # lm_head, packed
    vocab: int                   # V


class PagedStep(Protocol):
    """What the runner hands every layer for one step: its choices, the step's rows, its pools and packer."""

    fast: bool                   # the per-row C++ ops (kernels/decode_cpu) run
    packed_linear: bool          # dense projections through kernels/linear_cpu's packed weights
    kv_dtype: torch.dtype        # the cache's dtype
    cos_ND: torch.Tensor         # RoPE of the step's rows
    sin_ND: torch.Tensor
    slot_N: torch.Tensor         # each row's cache slot

    def kv(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key/value pool [P, 2, Hkv, D]."""

    def attend(self, q_NHD: torch.Tensor, kv_PCHD: torch.Tensor, sinks_H: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
        """Every row's attention over its sequence's keys in ``kv_PCHD`` (written already) → [N, Hq, D]; with
        attention sinks ``sinks_H`` [Hq] and a sliding ``window`` as the kernel table's paged ops take them."""

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x_NH: torch.Tensor) -> torch.Tensor:
        """``fn`` (row-wise) over the rows of x (batch-invariant mode: per fixed-size tile)."""

    def tiles(self, x_NH: torch.Tensor) -> list[torch.Tensor]:
        """The row tiles ``rows`` calls ``fn`` on: [x] outside batch-invariant mode, else fixed-size tiles, the
        last zero-padded."""

    def linear(self, x_NK: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        """x @ cat(ws).T against the packed copy of ``ws`` (bias-free)."""

    def packed_weight(self, *ws: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the packed copy of cat(ws), its output count)."""

    def packed_experts(self, experts) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(gate_up, down panels, I) of ``experts``' packed copy (``moe_cpu.moe_experts_packed``)."""

    def derived(self, ws: tuple[torch.Tensor, ...], fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``fn(*ws)``, cached until any of ``ws`` changes (in place or replaced)."""

    def per_sequence(self, mixer, h_NH: torch.Tensor) -> torch.Tensor:
        """A token mixer without a ragged form (``StateSpec.ragged`` false) over the step's rows through its own
        ``forward``, per sequence group over the engine's ``AttentionState`` (rl/rollout/paged_state.py) → [N, H]."""


def embed(model, ids_N: torch.Tensor, patches: torch.Tensor | None = None) -> torch.Tensor:
    """The step's rows' embeddings [N, H], ``patches`` (one row per ``<image>`` id, in row order) merged in."""
    x_NH = model.model.embed_tokens(ids_N)
    if patches is not None:
        x_NH = model.model.image_projector.merge(x_NH[None], ids_N[None], patches)[0]
    return x_NH


def rope_table(model, size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_PD, sin_PD) of the model's RoPE at positions 0..size-1 (the runner indexes it by position)."""
    cos_1PD, sin_1PD = model.model.rotary_emb(torch.arange(size, device=device)[None], dtype)
    return cos_1PD[0], sin_1PD[0]


def norm(step: PagedStep, module, x_NH: torch.Tensor) -> torch.Tensor:
    """``module(x_NH)`` (the model's kernel table); on the fast path one ``decode_cpu`` call."""
    if step.fast and x_NH.dim() == 2:
        return decode_cpu.rms_norm(x_NH, module.weight, module.eps)
    return module(x_NH)


def layer_forward(layer, x_NH: torch.Tensor, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``DecoderLayer.forward`` over the step's rows → (x_NH, expert ids_Nk, None for a dense layer)."""
    mixer, h_NH = layer.self_attn, norm(step, layer.input_layernorm, x_NH)
    x_NH = x_NH + (mixer.paged(h_NH, step) if mixer.state_spec.ragged else step.per_sequence(mixer, h_NH))
    h_NH = norm(step, layer.post_attention_layernorm, x_NH)
    if not getattr(layer, "is_moe", True):  # a dense first layer
        return x_NH + step.rows(layer.mlp, h_NH), None
    y_NH, ids_Nk = moe_forward(layer.mlp, h_NH, step)
    return x_NH + y_NH, ids_Nk


def attention_forward(attn, h_NH: torch.Tensor, step: PagedStep, sinks_H: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """``Attention.forward`` over the step's rows: q|k|v in one projection (plus their biases, if any), q/k-norm
    + RoPE, the keys/values written at ``step.slot_N``, attention through the pool (``step.attend``, with the
    layer's attention sinks ``sinks_H`` [Hq] and sliding ``window``, gpt-oss's), the output gate and o_proj."""
    N, Hq, Hkv, D = h_NH.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    ws = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    if step.packed_linear:
        qkv_NF = step.linear(h_NH, *ws)
    else:
        qkv_weight = step.derived(ws, lambda *w: torch.cat(w))  # one matmul instead of three
        qkv_NF = step.rows(lambda t: F.linear(t, qkv_weight), h_NH)
    if attn.q_proj.bias is not None:  # biased projections (gpt-oss)
        qkv_NF = qkv_NF + step.derived((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias), lambda *b: torch.cat(b))
    kv_PCHD = step.kv(attn.layer_idx)
    qk_norm_HD = qk_norm_weight(attn, step)
    if step.fast and (qk_norm_HD is not None or no_qk_norm(attn)):  # norm, RoPE, KV write: one call
        q_NHD = decode_cpu.qk_norm_rope_store(qkv_NF, qk_norm_HD, getattr(attn.q_norm, "eps", 0.0), step.cos_ND,
                                              step.sin_ND, kv_PCHD, step.slot_N, Hq, Hkv)
    else:
        q_NHD = _qk_rope_store(attn, qkv_NF, qk_norm_HD, step, kv_PCHD)
    out_NF = step.attend(q_NHD, kv_PCHD, sinks_H, window).reshape(N, Hq * D)
    if getattr(attn, "gate_proj", None) is not None:  # sigmoid output gate
        out_NF = out_NF * torch.sigmoid(step.rows(attn.gate_proj, h_NH))
    if step.packed_linear and attn.o_proj.bias is None:
        return step.linear(out_NF, attn.o_proj.weight)
    return step.rows(attn.o_proj, out_NF)


def qk_norm_weight(attn, step: PagedStep) -> torch.Tensor | None:
    """Per-head q- and k-norm weights as one [Hq + Hkv, D] table (None unless both are per-head ``RMSNorm``s
    with one eps), cached by the step's runner."""
    qn, kn = attn.q_norm, attn.k_norm
    if type(qn) is not RMSNorm or type(kn) is not RMSNorm or qn.eps != kn.eps:
        return None
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    return step.derived((qn.weight, kn.weight), lambda q, k: torch.cat((q.expand(Hq, D), k.expand(Hkv, D))))


def _qk_rope_store(attn, qkv_NF, qk_norm_HD, step: PagedStep, kv_PCHD) -> torch.Tensor:
    """q/k-norm and RoPE of the fused projection's q and k in torch, k and v written at ``slot_N`` → q_NHD."""
    N, Hq, Hkv, D = qkv_NF.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    cos_N1D, sin_N1D = step.cos_ND[:, None], step.sin_ND[:, None]
    q_NF, k_NF, v_NF = qkv_NF.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    v_NHD = v_NF.reshape(N, Hkv, D)
    if qk_norm_HD is not None:  # q and k side by side: one norm and one RoPE over both
        qk_NHD = qkv_NF[:, :(Hq + Hkv) * D].view(N, Hq + Hkv, D)
        qk_NHD = rms_norm_torch(qk_NHD, qk_norm_HD, attn.q_norm.eps)
        qk_NHD = qk_NHD * cos_N1D + rotate_half(qk_NHD) * sin_N1D
        q_NHD, k_NHD = qk_NHD.split((Hq, Hkv), dim=1)
    else:
        q_NHD = attn.q_norm(q_NF.reshape(N, Hq, D))
        k_NHD = attn.k_norm(k_NF.reshape(N, Hkv, D))
        q_NHD = q_NHD * cos_N1D + rotate_half(q_NHD) * sin_N1D
        k_NHD = k_NHD * cos_N1D + rotate_half(k_NHD) * sin_N1D
    kv_PCHD.index_copy_(0, step.slot_N, torch.stack((k_NHD, v_NHD), dim=1).to(step.kv_dtype))
    return q_NHD


def moe_forward(mlp, h_NH: torch.Tensor, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block over the rows of ``h_NH`` → (y_NH, expert ids_Nk); batch-invariant: per tile. On the fast
    path the softmax router is one C++ call (its projection packed with ``packed_linear``) and dense experts go
    through their packed copy whenever the C++ kernels build here, at any row count (``cpp_moe``: the router
    and experts those calls compute); MXFP4-resident experts (``Experts.load_mxfp4``) and every other path call
    the layer's experts, through the kernel table."""
    if step.fast and cpp_moe(mlp):
        gate = mlp.gate
        logits_NE = step.linear(h_NH, gate.weight) if step.packed_linear else F.linear(h_NH, gate.weight)
        ids_Nk, w_Nk = decode_cpu.route_softmax_topk(logits_NE, gate.top_k, gate.norm_topk_prob,
                                                     gate.routed_scaling_factor)
        ex = mlp.experts
        dense = getattr(ex, "mxfp4_gate_up_blocks", None) is None  # else its MXFP4 buffers, not these parameters
        if dense and step.packed_linear and moe_cpu.load_kernel() is not None:  # any row count (prefill chunks too)
            return moe_cpu.moe_experts_packed(h_NH, ids_Nk, w_Nk, *step.packed_experts(ex)), ids_Nk
        if dense and moe_cpu.use_kernel(h_NH, ids_Nk, ex.gate_up_proj.shape[0], False):
            return moe_cpu.moe_experts(h_NH, ids_Nk, w_Nk, ex.gate_up_proj, ex.down_proj), ids_Nk
        return ex(h_NH, ids_Nk, w_Nk), ids_Nk
    N = h_NH.shape[0]
    parts = [mlp(t[None]) for t in step.tiles(h_NH)]  # the block per tile (one tile outside invariant mode)
    if len(parts) == 1:
        return parts[0][0][0][:N], parts[0][3][:N]
    return torch.cat([p[0][0] for p in parts])[:N], torch.cat([p[3] for p in parts])[:N]


def head(model, x_RH: torch.Tensor, step: PagedStep) -> torch.Tensor:
    """The final norm and the head over the rows that need logits → [R, V]."""
    h_RH = norm(step, model.model.norm, x_RH)
    if step.packed_linear and model.lm_head.bias is None:
        return step.linear(h_RH, model.lm_head.weight)
    return step.rows(model.lm_head, h_RH)


def cpp_moe(mlp) -> bool:
    """Whether the C++ MoE calls compute this block: a softmax router without a logit bias
    (``decode_cpu.route_softmax_topk``), experts that declare ``plain_swiglu`` (``model.moe.Experts``: what
    ``moe_cpu`` computes), no shared experts. gpt-oss's biased router and clamped experts, sigmoid routers
    and shared experts run the module."""
    gate = mlp.gate
    return (mlp.shared_experts is None and not gate.sigmoid and gate.bias is None
            and getattr(getattr(mlp, "experts", None), "plain_swiglu", False))


def plain_decode_shape(model) -> bool:
    """Whether every layer is what a ``DecodePlan`` covers: a token mixer the op covers (its ``fused_decode``:
    plain full attention with RMSNorm q/k-norm or none, no output gate, bias-free projections), a softmax-routed
    MoE without shared experts, RMSNorm norms."""
    m = model.model
    if type(m.norm) is not RMSNorm or model.lm_head.bias is not None:
        return False
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused = getattr(attn, "fused_decode", None)  # the mixer says whether the op covers it (Attention.fused_decode)
        if not (fused is not None and fused() and getattr(layer, "is_moe", True)
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                and cpp_moe(mlp)):
            return False
    return True


def no_qk_norm(attn) -> bool:
    return isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity)


def plan_refs(model) -> list[tuple[dict, str]]:
    """The parameters a ``DecodePlan`` of ``model`` reads, as (its module's parameter table, name): a lookup
    there sees a parameter replaced by assignment and is cheap, unlike ``Module.__getattr__``. [] when
    ``plain_decode_shape`` does not hold."""
    if not plain_decode_shape(model):
        return []
    m = model.model
    mods = [(m.norm, "weight"), (model.lm_head, "weight")]
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods += [(layer.input_layernorm, "weight"), (layer.post_attention_layernorm, "weight"),
                 (attn.q_proj, "weight"), (attn.k_proj, "weight"), (attn.v_proj, "weight"),
                 (attn.o_proj, "weight"), (mlp.gate, "weight"), (mlp.experts, "gate_up_proj"),
                 (mlp.experts, "down_proj")]
        if not no_qk_norm(attn):
            mods += [(attn.q_norm, "weight"), (attn.k_norm, "weight")]
    return [(mod._parameters, name) for mod, name in mods]


def layer_plan(layer, step: PagedStep) -> LayerPlan:
    """A plain layer's ``LayerPlan``: its weights prepared by the step's packer, its pool."""
    attn, mlp, (in_norm, post_norm) = layer.self_attn, layer.mlp, (layer.input_layernorm, layer.post_attention_layernorm)
    qk_norm_HD = qk_norm_weight(attn, step)
    gate = mlp.gate
    qkv_p, qkv_out = step.packed_weight(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    o_p, hidden = step.packed_weight(attn.o_proj.weight)
    gate_p, num_experts = step.packed_weight(gate.weight)
    return LayerPlan(
        kv_PCHD=step.kv(attn.layer_idx), w_in=in_norm.weight.detach(), eps_in=in_norm.eps, qkv_p=qkv_p,
        qkv_out=qkv_out, qk_norm_w=qk_norm_HD.detach() if qk_norm_HD is not None else in_norm.weight.new_empty(0),
        qk_eps=getattr(attn.q_norm, "eps", 0.0), o_p=o_p, hidden=hidden, w_post=post_norm.weight.detach(),
        eps_post=post_norm.eps, gate_p=gate_p, num_experts=num_experts, top_k=gate.top_k,
        norm_topk=gate.norm_topk_prob, route_scale=gate.routed_scaling_factor,
        experts=step.packed_experts(mlp.experts))


def decode_plan(model, step: PagedStep) -> DecodePlan:
    """``model``'s ``DecodePlan`` (``plain_decode_shape`` must hold): every layer's, the final norm and head."""
    head_p, vocab = step.packed_weight(model.lm_head.weight)
    layers = [layer_plan(layer, step) for layer in model.model.layers]
    return DecodePlan(layers, model.model.norm.weight.detach(), model.model.norm.eps, head_p, vocab)


def decode_layers(plan: DecodePlan, x_NH: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor,
                  slot_N: torch.Tensor, slots_BS: torch.Tensor, ctx_B: torch.Tensor, scale: float, Hq: int, Hkv: int,
                  want_routed: bool) -> list[torch.Tensor]:
    """The plan's layers over a pure decode step's rows, ``x_NH`` updated in place (the residual adds inside
    the op): one ``decode_cpu`` ``decode_layer`` call per layer (the general path's nine calls, in order)
    → each MoE layer's expert ids [N, k] when ``want_routed``."""
    layer_op = decode_cpu.load_kernel().decode_layer
    routed = []
    for p in plan.layers:
        ids_Nk = layer_op(x_NH, p.w_in, p.eps_in, p.qkv_p, p.qkv_out, p.qk_norm_w, p.qk_eps, cos_ND, sin_ND,
                          p.kv_PCHD, slot_N, slots_BS, ctx_B, scale, Hq, Hkv, p.o_p, p.hidden, p.w_post,
                          p.eps_post, p.gate_p, p.num_experts, p.top_k, p.norm_topk, p.route_scale, *p.experts)
        if want_routed:
            routed.append(ids_Nk)
    return routed


def decode_head(plan: DecodePlan, x_RH: torch.Tensor) -> torch.Tensor:
    """The plan's final norm and head → logits [R, V]."""
    return linear_cpu.load_kernel().linear_packed(decode_cpu.load_kernel().rms_norm(x_RH, plan.w_norm, plan.eps_norm),
                                                  plan.head_p, plan.vocab)
