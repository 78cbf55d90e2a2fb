"""The model's layers on the ``triton`` kernel table equal the ``torch`` table (float32, Triton's interpreter).

Same weights, same tokens; ``kernels=triton`` sends the routed experts through the grouped Triton matmuls
(dense) or the MXFP4 MoE kernel (MXFP4-resident experts), KDA through its chunked Triton kernels and their
backward (``kernels/kda._KDAChunk``). Bounds are relative Frobenius errors: both sides compute in fp32 and
differ only in summation order.
"""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from jointrl.model import MoEConfig, MoETransformer

TOL = 1e-4


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _pair(config: MoEConfig) -> tuple[MoETransformer, MoETransformer]:
    torch_model = MoETransformer.from_config(config, seed=1, kernels="torch")
    triton_model = MoETransformer.from_config(config, seed=1, kernels="triton")
    assert triton_model.kernels.backend == "triton" and torch_model.kernels.backend == "torch"
    return torch_model, triton_model


def _ids(config: MoEConfig, B: int, T: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes ``t`` was computed through."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_moe_logits_equal_with_dense_experts():
    from jointrl.kernels import moe_experts

    cfg = MoEConfig.preset("tiny_moe", num_hidden_layers=2)
    ref, tri = _pair(cfg)
    assert tri.model.layers[0].mlp.experts.kernels.moe_experts is moe_experts.moe_experts_triton
    ids = _ids(cfg, 2, 7)
    with torch.no_grad():
        want, got = ref(ids).logits, tri(ids).logits
    assert rel(got, want) < TOL


def test_moe_logits_equal_with_mxfp4_resident_experts():
    """MXFP4-resident experts (``Experts.load_mxfp4``) on ``triton`` run the MXFP4 MoE kernel; the ``torch``
    table runs its reference over the same blocks, and both equal a dense model holding the dequantized
    experts."""
    cfg = MoEConfig.preset("tiny_moe", num_hidden_layers=2)
    ref, tri = _pair(cfg)
    dense = MoETransformer.from_config(cfg, seed=1, kernels="torch")
    for model_layers, dense_layer in zip(zip(ref.model.layers, tri.model.layers), dense.model.layers):
        ex = model_layers[0].mlp.experts
        gu, dn = quantize_mxfp4(ex.gate_up_proj.detach()), quantize_mxfp4(ex.down_proj.detach())
        for layer in model_layers:
            layer.mlp.experts.load_mxfp4(*gu, *dn)
        with torch.no_grad():
            dense_layer.mlp.experts.gate_up_proj.copy_(dequantize_mxfp4(*gu, dtype=torch.float32))
            dense_layer.mlp.experts.down_proj.copy_(dequantize_mxfp4(*dn, dtype=torch.float32))
    ids = _ids(cfg, 2, 7)
    with torch.no_grad():
        want, got, dense_logits = ref(ids).logits, tri(ids).logits, dense(ids).logits
    assert rel(got, want) < TOL and rel(want, dense_logits) < TOL
    tri.model.layers[0].mlp.experts.drop_mxfp4()
    with torch.no_grad():
        assert rel(tri(ids).logits, want) > 1e-3  # layer 0 reads its dense (unquantized) experts again


def test_load_mxfp4_names_a_mismatched_tensor():
    model = MoETransformer.from_config(MoEConfig.preset("tiny_moe", num_hidden_layers=1), kernels="torch")
    ex = model.model.layers[0].mlp.experts
    gu, dn = quantize_mxfp4(ex.gate_up_proj.detach()), quantize_mxfp4(ex.down_proj.detach())
    with pytest.raises(ValueError, match="down_scales"):
        ex.load_mxfp4(*gu, dn[0], dn[1][:, :1])


def test_hybrid_logits_equal():
    """tiny_hybrid's inference forward: KDA chunks, the indexer scores, the top-k selection and the sparse
    attention on their Triton kernels (top-8 of up to 20 keys, two query chunks, so the selection bites)."""
    cfg = MoEConfig.preset("tiny_hybrid", num_hidden_layers=2, layer_types=("kda", "gated_dsa"), index_topk=8,
                           dsa_query_chunk=16)
    ref, tri = _pair(cfg)
    ids = _ids(cfg, 1, 20)
    with torch.no_grad():
        assert rel(tri(ids).logits, ref(ids).logits) < TOL


def test_hybrid_loss_and_gradients_equal():
    """tiny_hybrid (KDA, gated DSA, MoE): the language-model loss plus the indexer loss and every parameter's
    gradient with ``kernels=triton`` (KDA's chunked forward and backward kernels, the sparse attention's
    forward and backward kernels; the indexer, whose kernel is forward only, and the experts train through
    their references) equal ``kernels=torch``."""
    cfg = MoEConfig.preset("tiny_hybrid", num_hidden_layers=2, layer_types=("kda", "gated_dsa"), index_topk=8,
                           dsa_query_chunk=16)
    ref, tri = _pair(cfg)
    ids = _ids(cfg, 1, 20)
    losses, grads = [], []
    for model in (ref, tri):
        out = model(ids, return_indexer_loss=True)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        loss = loss + out.indexer_loss + 0.01 * out.aux_loss
        nodes = _graph_nodes(loss)  # KDA and the sparse attention train through their Triton backward kernels
        assert ("_KDAChunkBackward" in nodes) == ("_SparseAttentionBackward" in nodes) == (model is tri)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert rel(losses[1], losses[0]) < 1e-5
    assert grads[0].keys() == grads[1].keys() and any(".self_attn.q_proj" in n for n in grads[0])
    for name, g in grads[0].items():
        assert rel(grads[1][name], g) < TOL, name


@pytest.mark.parametrize("preset", ["tiny_moe", "tiny_hybrid"])
def test_bf16_logits_equal_within_bf16_rounding(preset):
    """A bfloat16 model: every Triton path above with bf16 activations and weights (the interpreter's dots in
    fp32, its fp32 -> bf16 casts truncating), against the torch table's bf16 forward (measured: rel 4e-3)."""
    cfg = MoEConfig.preset(preset, num_hidden_layers=2, **(
        dict(layer_types=("kda", "gated_dsa"), index_topk=8, dsa_query_chunk=16) if preset == "tiny_hybrid" else {}))
    ref = MoETransformer.from_config(cfg, dtype=torch.bfloat16, seed=1, kernels="torch")
    tri = MoETransformer.from_config(cfg, dtype=torch.bfloat16, seed=1, kernels="triton")
    ids = _ids(cfg, 1, 20)
    with torch.no_grad():
        want, got = ref(ids).logits, tri(ids).logits
    assert got.dtype == torch.bfloat16 and rel(got, want) < 2e-2
