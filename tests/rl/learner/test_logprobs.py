"""chunked_logprobs == the full-logits log-probs and entropies (float64), values and gradients."""

from __future__ import annotations

import pytest
import torch

from jointrl.rl.learner.batch import logprobs_from_logits
from jointrl.rl.learner.forward import token_entropy
from jointrl.rl.learner.logprobs import chunked_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_equals_full_logits_in_float64(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 13, 16, 50
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = hidden @ weight.T
    want_lp = logprobs_from_logits(logits, ids, temperature)
    want_h = token_entropy(logits, temperature)
    got_lp, got_h = chunked_logprobs(hidden, weight, ids, temperature, chunk=chunk, entropy=True)
    assert got_lp.dtype == torch.float64
    assert torch.allclose(got_lp, want_lp, rtol=0, atol=1e-12) and torch.allclose(got_h, want_h, rtol=0, atol=1e-12)
    w = torch.randn(B, T, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((want_lp * w).sum() + want_h.sum(), (hidden, weight))
    got = torch.autograd.grad((got_lp * w).sum() + got_h.sum(), (hidden, weight))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_no_entropy_and_one_token_rows():
    hidden, weight = torch.randn(2, 1, 4, requires_grad=True), torch.randn(9, 4)
    lp, h = chunked_logprobs(hidden, weight, torch.zeros(2, 1, dtype=torch.long))
    assert h is None and torch.equal(lp, torch.zeros(2, 1))
    assert lp.grad_fn is not None  # a padding micro-batch's loss still backpropagates (DeepSpeed needs a graph)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_logprobs(hidden, weight, torch.zeros(2, 1, dtype=torch.long), chunk=0)
