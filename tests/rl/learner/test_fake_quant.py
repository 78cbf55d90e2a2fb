"""``fake_quantize_mxfp4``: the MXFP4 round trip forward, the identity backward."""

import torch

from jointrl.kernels.mxfp4 import mxfp4_roundtrip
from jointrl.rl.learner.fake_quant import fake_quantize_mxfp4


def test_forward_is_the_roundtrip_and_backward_is_straight_through():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 64, generator=g, requires_grad=True)
    y = fake_quantize_mxfp4(x)
    assert torch.equal(y, mxfp4_roundtrip(x.detach()))
    assert not torch.equal(y, x.detach())  # quantization really changes the values
    up = torch.randn(3, 2, 64, generator=g)
    (y * up).sum().backward()
    assert torch.equal(x.grad, up)
