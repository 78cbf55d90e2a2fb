"""``Kernels``: the op table of one concrete backend, chosen once at construction and handed down.

``kernels_for(name, device)`` resolves ``name`` (``auto | torch | cpu | triton``: ``dispatch.resolve``)
and returns the table of that backend; ``MoETransformer.set_kernels`` gives it to every layer that
calls a kernel op, and ``rl/rollout/model_runner.ModelRunner`` reads it from the model. A forward then
calls ``self.kernels.<op>(...)``: the function was picked when the table was built, so nothing in a
forward compares backend names, and there is one torch reference per op (the ``*_torch`` functions
named below), which the C++ and the Triton kernels are tested against.

| op                | torch (reference)                       | cpu (C++)                         | triton                               |
|-------------------|-----------------------------------------|-----------------------------------|--------------------------------------|
| rms_norm          | norm_rope_cpu.rms_norm_torch            | norm_rope_cpu.rms_norm            | reference                            |
| kda_recurrent     | kda.kda_recurrent_torch                 | reference                         | kda.kda_recurrent_triton             |
| kda_chunk         | kda.kda_chunk_torch                     | reference                         | kda.kda_chunk_triton                 |
| paged_decode      | paged_attention_cpu.paged_decode_torch  | paged_attention_cpu.paged_decode  | paged_decode_triton                  |
| paged_prefill     | paged_attention_cpu.paged_prefill_torch | paged_attention_cpu.paged_prefill | paged_attention.paged_prefill_triton |
| moe_experts       | moe_experts.moe_experts_torch           | moe_experts.moe_experts_cpu       | moe_experts.moe_experts_triton       |
| moe_experts_mxfp4 | moe_matmul.moe_experts_mxfp4_torch      | reference                         | moe_matmul.moe_experts_mxfp4_triton  |
| dsa_scores        | dsa.indexer_scores_torch                | reference                         | dsa.indexer_scores_triton            |
| dsa_select        | topk.select_keys_torch                  | reference                         | topk.select_keys_triton              |
| dsa_attend        | dsa.sparse_attention_torch              | reference                         | dsa.sparse_attention_triton          |

(``rms_norm`` on cpu is an autograd op; ``kda_chunk`` and ``dsa_attend`` on triton have backward kernels.)

``kda_chunk`` on ``triton`` is an ``autograd.Function`` whose backward is the chunked backward kernel, so a
learner step on that table trains KDA through Triton (float64: the reference).

``moe_experts`` (``model.moe.Experts`` over its dense parameters): the C++ loop (``moe_cpu``) on ``cpu`` and
the grouped Triton matmuls (``moe_matmul``, ``MXFP4=False``) on ``triton`` for inference; wherever a
gradient is needed (the learner) and for float64 on ``triton``, the reference (``RoutedSwiGLU``: the grouped
kernels are forward only). ``moe_experts_mxfp4`` runs when the layer holds its experts MXFP4-resident
(``Experts.load_mxfp4``: uint8 blocks and scales as ``kernels/mxfp4`` packs them, what a push delivers):
the MXFP4 MoE kernel on ``triton``, its reference (dequantize, fp32 per-expert matmuls) elsewhere.

The gated_dsa layer's (``model/dsa.py``) three steps per query chunk of c queries over S keys (sparse
mode; the dense warm-up mode is plain attention):
``dsa_scores(q [B, c, n, Di], w [B, c, n], k [B, S, Di])`` → indexer scores [B, c, S] (fp32 / fp64; the
Triton kernel is forward only, so with gradients, i.e. the indexer loss, the reference);
``dsa_select(scores, visible [B, c, S] bool, k)`` → (idx, valid) [B, c, min(k, S)] (the top-k rule, ties
to the most recent key; the radix-select kernel on ``triton``); ``dsa_attend(q [B, Hq, c, D], k, v [B, S,
Hkv, D], idx, valid, want_probs)`` → (o [B, Hq, c, D], probs [B, Hq, c, k] or None): the sparse attention,
forward and backward kernels on ``triton`` (the probabilities for the indexer loss then by the reference,
without gradient).

``cpp`` says whether the C++ CPU kernels are this table's (backend ``cpu``): the engine's per-row C++
ops (``decode_cpu``, ``linear_cpu``, ``moe_cpu``: norms fused with the KV write, the packed projections,
the routed experts) run only then, their torch references otherwise.

Shapes as in the op modules: paged_decode q [B, Hq, D], kv [P, 2, Hkv, D] (the engine's cache: slot p's
key and value), slots [B, S] int64, ctx [B] int64 → [B, Hq, D].

``paged_decode`` and ``paged_prefill`` take optional ``sinks_H`` [Hq] (attention sinks) and ``window`` (a
sliding window), gpt-oss's attention (``paged_attention_cpu``'s docstring): the references and the Triton
kernels implement both; the C++ kernels do not, so on ``cpu`` a call with either runs the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from jointrl.kernels import (dispatch, dsa, kda, moe_experts, moe_matmul, norm_rope_cpu, paged_attention,
                             paged_attention_cpu, topk)

__all__ = ["Kernels", "kernels_for", "paged_decode_triton"]


@dataclass(frozen=True, slots=True)
class Kernels:
    """One backend's ops (module docstring); build with ``kernels_for``."""

    backend: str                   # the concrete backend: torch | cpu | triton
    cpp: bool                      # the C++ CPU kernels are this table's (backend cpu)
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    kda_recurrent: Callable[..., tuple[Tensor, Tensor]]
    kda_chunk: Callable[..., tuple[Tensor, Tensor]]
    paged_decode: Callable[..., Tensor]
    paged_prefill: Callable[..., Tensor]
    moe_experts: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    moe_experts_mxfp4: Callable[..., Tensor]
    dsa_scores: Callable[[Tensor, Tensor, Tensor], Tensor]
    dsa_select: Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]
    dsa_attend: Callable[..., tuple[Tensor, Tensor | None]]


def paged_decode_triton(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float,
                        sinks_H: Tensor | None = None, window: int | None = None) -> Tensor:
    """``paged_attention_cpu.paged_decode``'s contract on ``paged_attention``'s Triton decode kernel: the
    [P, 2, Hkv, D] pool read as key and value caches of P one-slot blocks (strided views, no copy: a bfloat16
    pool under float32 queries too, widened tile by tile in the kernel), each sequence's slots its block table; ``sinks_H`` / ``window`` as the reference's. Float64 queries take the
    reference (the kernels work in fp32)."""
    if q_BHD.dtype == torch.float64:
        return paged_attention_cpu.paged_decode_torch(q_BHD, kv_PCHD, slots_BS, ctx_B, scale, sinks_H, window)
    P, _, Hkv, D = kv_PCHD.shape
    k_cache, v_cache = (kv_PCHD[:, i].view(P, 1, Hkv, D) for i in (0, 1))
    if kv_PCHD.dtype != q_BHD.dtype and q_BHD.dtype != torch.float32:  # fp32 queries: the kernel widens each tile
        k_cache, v_cache = k_cache.to(q_BHD.dtype), v_cache.to(q_BHD.dtype)
    return paged_attention._paged_attention_triton(q_BHD.contiguous(), k_cache, v_cache, slots_BS, ctx_B, scale,
                                                   sinks_H=sinks_H, window=window)


@functools.cache
def _table(backend: str) -> Kernels:
    if backend == "cpu":
        return Kernels("cpu", True, norm_rope_cpu.rms_norm, kda.kda_recurrent_torch, kda.kda_chunk_torch,
                       paged_attention_cpu.paged_decode, paged_attention_cpu.paged_prefill,
                       moe_experts.moe_experts_cpu, moe_matmul.moe_experts_mxfp4_torch,
                       dsa.indexer_scores_torch, topk.select_keys_torch, dsa.sparse_attention_torch)
    if backend == "triton":
        return Kernels("triton", False, norm_rope_cpu.rms_norm_torch, kda.kda_recurrent_triton, kda.kda_chunk_triton,
                       paged_decode_triton, paged_attention.paged_prefill_triton,
                       moe_experts.moe_experts_triton, moe_matmul.moe_experts_mxfp4_triton,
                       dsa.indexer_scores_triton, topk.select_keys_triton, dsa.sparse_attention_triton)
    assert backend == "torch", backend
    return Kernels("torch", False, norm_rope_cpu.rms_norm_torch, kda.kda_recurrent_torch, kda.kda_chunk_torch,
                   paged_attention_cpu.paged_decode_torch, paged_attention_cpu.paged_prefill_torch,
                   moe_experts.moe_experts_torch, moe_matmul.moe_experts_mxfp4_torch,
                   dsa.indexer_scores_torch, topk.select_keys_torch, dsa.sparse_attention_torch)


def kernels_for(name: str, device: torch.device | str = "cpu") -> Kernels:
    """The op table ``name`` (``auto | torch | cpu | triton``) means for tensors on ``device``
    (``dispatch.resolve``: a ``ValueError`` names a backend that cannot run there)."""
    return _table(dispatch.resolve(name, device))
