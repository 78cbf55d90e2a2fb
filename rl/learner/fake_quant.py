"""Quantization-aware training for the learner: MXFP4 fake quantization with a straight-through
gradient, so the learner's forward sees the routed-expert weights the rollout engine runs."""

from __future__ import annotations

from torch import Tensor

from jointrl.kernels.mxfp4 import mxfp4_roundtrip


def fake_quantize_mxfp4(x: Tensor, scale_rule: str = "floor") -> Tensor:
    """``mxfp4_roundtrip(x)`` in the forward pass, identity in the backward (straight-through).

    ``mxfp4_roundtrip(x).detach() + (x - x.detach())``: the value is exactly the round trip (the
    weights the rollout engine runs, as ``rl/weight_sync.py`` pushes them), the gradient w.r.t.
    ``x`` is the incoming gradient unchanged (the straight-through estimator, Bengio et al.
    2013). ``x [..., K]``, ``K % 32 == 0``, quantized along the last dim.
    """
    return mxfp4_roundtrip(x.detach(), scale_rule) + (x - x.detach())
