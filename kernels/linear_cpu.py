"""``y = x Wᵀ`` for the few rows of a decode step on CPU, against a weight packed once in panels.

    y[n, o] = Σ_k x[n, k] · W[o, k]      (k ascending, one fused multiply-add per term)

Why: a bench_moe decode step runs 19 ``F.linear`` calls over 16-256 rows (q|k|v, o_proj and the
router of each layer, the head), where MKL's sgemm is far from its peak on a weight streamed from memory
(every weight is, once per step). Here the weight is packed once (``pack``: panels of 16 output columns,
``[ceil(O/16), K, 16]``, zero-padded, each panel contiguous so the hardware prefetcher streams it) and
every panel is read once per call while all rows pass over it, 6 (float) / 3 (double) rows x 16 columns of
vector accumulators at a time. Measurements against MKL: tests/bench/results.md, "C++ CPU kernels".

Every output is one sum in k order, whatever the number of rows or a row's place among them: a
row's result does not depend on what shares its call (batch-invariant, as ``rollout.batch_invariant``
wants, though the runner keeps its tiled path there). Against ``F.linear`` it differs only by
summation order: float64 to ~1e-15 relative, float32 to a few ulp (tests/kernels/test_linear_cpu.py).

The C++ is ``csrc/linear.cpp`` (``torch.ops.jointrl.linear_packed``, built by ``kernels/build``);
``load_kernel()`` is None where it cannot be built, and the caller (``rl/rollout/model_runner``) then keeps
``F.linear``. Single-threaded by design (decode rows are few; one torch thread is the rollout actor's
setting). The runner calls it at every row count.

Shapes: N rows, K input features, O outputs, Q = ceil(O / 16) panels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from jointrl.kernels.cpu_extension import load_ops

__all__ = ["PANEL", "load_kernel", "pack", "linear"]

PANEL = 16  # output columns per packed panel


@functools.cache
def load_kernel():
    """The ops (``kernels/cpu_extension.load_ops``), or None where they cannot be built here."""
    return load_ops(["linear_packed"])


def pack(w_OK: Tensor, out: Tensor | None = None) -> Tensor:
    """W [O, K] → panels [ceil(O/16), K, 16]: panel q holds columns 16q .. 16q + 15 of Wᵀ (zeros past O).
    ``out``: an earlier ``pack`` of a weight of this shape, overwritten in place (one strided copy, no new
    memory: a runner repacking after a weight update); its padding columns stay zero."""
    O, K = w_OK.shape
    if out is None:
        return F.pad(w_OK.detach(), (0, 0, 0, -O % PANEL)).view(-1, PANEL, K).transpose(1, 2).contiguous()
    pack_into(out.unsqueeze(0), w_OK.detach().unsqueeze(0))
    return out


def pack_into(out_EQKP: Tensor, w_EOK: Tensor) -> Tensor:
    """Write ``pack(w_EOK[e])`` into ``out_EQKP[e]`` for every e (``out``: panels of this shape whose columns
    past O are zero, as ``pack`` leaves them) → ``out_EQKP``. Raises ``ValueError`` when ``out`` is not
    panels of ``w``'s shape and dtype (a copy into larger panels would leave old weights in the rest)."""
    E, O, K = w_EOK.shape
    full = O // PANEL
    want = (E, full + bool(O % PANEL), K, PANEL)
    if tuple(out_EQKP.shape) != want or out_EQKP.dtype != w_EOK.dtype:
        raise ValueError(f"out {tuple(out_EQKP.shape)} {out_EQKP.dtype} is not the panels of a {w_EOK.dtype} weight "
                         f"[E, O, K] = {(E, O, K)}: expected {want}")
    out_EQKP[:, :full].copy_(w_EOK[:, :full * PANEL].view(E, full, PANEL, K).transpose(2, 3))
    if O % PANEL:
        out_EQKP[:, full, :, :O % PANEL].copy_(w_EOK[:, full * PANEL:].transpose(1, 2))
    return out_EQKP


def linear(x_NK: Tensor, packed_QKP: Tensor, out_features: int) -> Tensor:
    """x [N, K] (float32/64, CPU) and ``pack(W)`` → x Wᵀ [N, O]. No autograd; needs ``load_kernel()``."""
    return load_kernel().linear_packed(x_NK.contiguous(), packed_QKP, out_features)
