"""The model's layers on the ``triton`` kernel table on CUDA equal the ``torch`` table (``pytest -m gpu``;
skipped with the reason without a GPU). The interpreter runs the same comparisons on the host
(tests/model/interpreted/); here the compiled kernels run, bf16 ``tl.dot`` included."""

import pytest
import torch

from jointrl.kernels.mxfp4 import quantize_mxfp4
from jointrl.model import MoEConfig, MoETransformer

pytestmark = pytest.mark.gpu

HYBRID = MoEConfig.preset("tiny_hybrid", num_hidden_layers=2, layer_types=("kda", "gated_dsa"), index_topk=16,
                          dsa_query_chunk=32)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def _pair(cfg: MoEConfig, dtype: torch.dtype) -> tuple[MoETransformer, MoETransformer]:
    return tuple(MoETransformer.from_config(cfg, dtype=dtype, seed=1, device="cuda", kernels=k)
                 for k in ("torch", "triton"))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_hybrid_logits_loss_and_gradients_on_cuda(dtype, tol):
    ref, tri = _pair(HYBRID, dtype)
    ids = torch.randint(0, HYBRID.vocab_size, (2, 80), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        assert _rel(tri(ids).logits, ref(ids).logits) < tol
    grads = []
    for model in (ref, tri):
        out = model(ids, return_indexer_loss=True)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().reshape(-1, HYBRID.vocab_size),
                                                 ids[:, 1:].reshape(-1)) + out.indexer_loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for name, g in grads[0].items():
        assert _rel(grads[1][name], g) < 10 * tol, name


def test_mxfp4_resident_experts_on_cuda():
    ref, tri = _pair(MoEConfig.preset("tiny_moe", num_hidden_layers=2), torch.bfloat16)
    for a, b in zip(ref.model.layers, tri.model.layers):
        ex = a.mlp.experts
        blocks = (*quantize_mxfp4(ex.gate_up_proj.detach()), *quantize_mxfp4(ex.down_proj.detach()))
        a.mlp.experts.load_mxfp4(*blocks)
        b.mlp.experts.load_mxfp4(*blocks)
    ids = torch.randint(0, ref.config.vocab_size, (4, 33), device="cuda")
    with torch.no_grad():
        assert _rel(tri(ids).logits, ref(ids).logits) < 2e-2
