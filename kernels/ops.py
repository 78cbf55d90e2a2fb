"""``Kernels``: the op table of one concrete backend, chosen once at construction and handed down.

``kernels_for(name, device)`` resolves ``name`` (``auto | torch | cpu | triton``: ``dispatch.resolve``)
and returns the table of that backend; ``MoETransformer.set_kernels`` gives it to every layer that
calls a kernel op, and ``rl/rollout/model_runner.ModelRunner`` reads it from the model. A forward then
calls ``self.kernels.<op>(...)``: the function was picked when the table was built, so nothing in a
forward compares backend names, and there is one torch reference per op (the ``*_torch`` functions
named below), which the C++ and the Triton kernels are tested against.

| op              | torch (reference)                            | cpu (C++, ``csrc/``)                  | triton                       |
|-----------------|----------------------------------------------|---------------------------------------|------------------------------|
| rms_norm        | ``norm_rope_cpu.rms_norm_torch``             | ``norm_rope_cpu.rms_norm`` (autograd) | reference                    |
| kda_recurrent   | ``kda.kda_recurrent_torch``                  | reference                             | ``kda.kda_recurrent_triton`` |
| kda_chunk       | ``kda.kda_chunk_torch``                      | reference                             | ``kda.kda_chunk_triton``     |
| paged_decode    | ``paged_attention_cpu.paged_decode_torch``   | ``paged_attention_cpu.paged_decode``  | ``paged_decode_triton``      |
| paged_prefill   | ``paged_attention_cpu.paged_prefill_torch``  | ``paged_attention_cpu.paged_prefill`` | ``paged_attention.paged_prefill_triton`` |

``cpp`` says whether the C++ CPU kernels are this table's (backend ``cpu``): the engine's per-row C++
ops (``decode_cpu``, ``linear_cpu``, ``moe_cpu``: norms fused with the KV write, the packed projections,
the routed experts) run only then, their torch references otherwise. Ops whose inputs a layer does not
have in the kernel's form stay out of the table: ``moe_matmul`` takes MXFP4 expert blocks (the model
keeps dense experts; the engine dequantizes a pushed MXFP4 bundle), and DSA's Triton ops score and
attend over a whole cache where the model's gated_dsa layer works per query chunk with its indexer loss.

Shapes as in the op modules: paged_decode q [B, Hq, D], kv [P, 2, Hkv, D] (the engine's cache: slot p's
key and value), slots [B, S] int64, ctx [B] int64 → [B, Hq, D].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from jointrl.kernels import dispatch, kda, norm_rope_cpu, paged_attention, paged_attention_cpu

__all__ = ["Kernels", "kernels_for", "paged_decode_triton"]


@dataclass(frozen=True, slots=True)
class Kernels:
    """One backend's ops (module docstring); build with ``kernels_for``."""

    backend: str                   # the concrete backend: torch | cpu | triton
    cpp: bool                      # the C++ CPU kernels are this table's (backend cpu)
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    kda_recurrent: Callable[..., tuple[Tensor, Tensor]]
    kda_chunk: Callable[..., tuple[Tensor, Tensor]]
    paged_decode: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]
    paged_prefill: Callable[..., Tensor]


def paged_decode_triton(q_BHD: Tensor, kv_PCHD: Tensor, slots_BS: Tensor, ctx_B: Tensor, scale: float) -> Tensor:
    """``paged_attention_cpu.paged_decode``'s contract on ``paged_attention``'s Triton decode kernel: the
    [P, 2, Hkv, D] pool read as key and value caches of P one-slot blocks (strided views, no copy), each
    sequence's slots its block table. Float64 queries take the reference (the kernels work in fp32)."""
    if q_BHD.dtype == torch.float64:
        return paged_attention_cpu.paged_decode_torch(q_BHD, kv_PCHD, slots_BS, ctx_B, scale)
    P, _, Hkv, D = kv_PCHD.shape
    k_cache, v_cache = (kv_PCHD[:, i].view(P, 1, Hkv, D) for i in (0, 1))
    if kv_PCHD.dtype != q_BHD.dtype:
        k_cache, v_cache = k_cache.to(q_BHD.dtype), v_cache.to(q_BHD.dtype)
    return paged_attention._paged_attention_triton(q_BHD.contiguous(), k_cache, v_cache, slots_BS, ctx_B, scale)


@functools.cache
def _table(backend: str) -> Kernels:
    if backend == "cpu":
        return Kernels("cpu", True, norm_rope_cpu.rms_norm, kda.kda_recurrent_torch, kda.kda_chunk_torch,
                       paged_attention_cpu.paged_decode, paged_attention_cpu.paged_prefill)
    if backend == "triton":
        return Kernels("triton", False, norm_rope_cpu.rms_norm_torch, kda.kda_recurrent_triton, kda.kda_chunk_triton,
                       paged_decode_triton, paged_attention.paged_prefill_triton)
    assert backend == "torch", backend
    return Kernels("torch", False, norm_rope_cpu.rms_norm_torch, kda.kda_recurrent_torch, kda.kda_chunk_torch,
                   paged_attention_cpu.paged_decode_torch, paged_attention_cpu.paged_prefill_torch)


def kernels_for(name: str, device: torch.device | str = "cpu") -> Kernels:
    """The op table ``name`` (``auto | torch | cpu | triton``) means for tensors on ``device``
    (``dispatch.resolve``: a ``ValueError`` names a backend that cannot run there)."""
    return _table(dispatch.resolve(name, device))
