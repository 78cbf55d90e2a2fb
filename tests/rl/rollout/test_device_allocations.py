"""Allocation audit of the engine's hot loop: every tensor a step of the own engine creates in
``rl/rollout/``, ``model/`` or ``kernels/`` code is created on the engine's device (an explicit ``device=``, a
``like`` tensor, or a ``new_*`` / ``*_like`` call), so the same code runs with the weights, KV pool and
states on CUDA. It runs on the host, where a forgotten ``device=`` costs nothing and shows nothing: so
a ``TorchFunctionMode`` records every factory call (``torch.tensor``, ``arange``, ``zeros``, ...) made
from those files without a device, over chunked prefill, batched decode and sampling (seeded, top-k,
routing replay) of a full-attention and a hybrid model on the ``torch`` and ``cpu`` kernel backends
(and bfloat16, whose expert matmuls pad their rows),
and the test fails listing them -- except ``HOST_BY_DESIGN``, each with the reason it stays a host tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import jointrl
from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
from jointrl.rl.rollout.sampler import SimpleSampler
from jointrl.rl.types import SamplingParams

ROOT = Path(jointrl.__file__).resolve().parent
AUDITED = ("rl/rollout/", "model/", "kernels/")
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace, torch.randperm, torch.empty_strided}

# (file, enclosing function, factory) -> why that tensor is meant to be a host tensor
HOST_BY_DESIGN: dict[tuple[str, str, str], str] = {
    ("kernels/cpu_extension.py", "zeros_huge_pages", "empty"):
        "the host KV pool / expert panels in huge pages: ModelRunner calls it only when its device is the host",
    ("kernels/cpu_extension.py", "zeros_huge_pages", "zeros"):
        "the same, where the OS gives no huge pages",
}


class FactoryAudit(TorchFunctionMode):
    """Records (file relative to the package, enclosing function, factory) for every factory call
    made directly from an audited file with neither ``device=`` nor a tensor to take it from."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, str, str], int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not (
                func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename).resolve()
            if path.is_relative_to(ROOT):
                rel = path.relative_to(ROOT).as_posix()
                if rel.startswith(AUDITED):
                    key = (rel, frame.f_code.co_name, func.__name__)
                    self.found[key] = frame.f_lineno
        return func(*args, **kwargs)


MODELS = {"full": MoEConfig(initializer_range=0.1),
          "hybrid": MoEConfig.preset("tiny_hybrid", initializer_range=0.1, kda_chunk_size=8)}


@pytest.mark.parametrize(("backend", "dtype"), [("torch", torch.float32), ("cpu", torch.float32),
                                               ("torch", torch.bfloat16)])  # bfloat16: the MoE's padded rows
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_an_engine_step_allocates_on_the_engine_device(kind, backend, dtype):
    model = MoETransformer.from_config(MODELS[kind], dtype=dtype, seed=3, kernels=backend)
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                  return_routed_experts=True))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19, 3)]
    params = [SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=4, seed=5, top_k=20),
              SamplingParams(max_tokens=4, seed=7, temperature=0.7, top_p=0.9)]
    audit = FactoryAudit()
    with audit:
        outs = engine.generate_batch(prompts, params)
    assert all(len(o.token_ids) == 4 for o in outs)
    assert all(o.routed_experts.device.type == "cpu" for o in outs)  # outputs cross processes: host tensors
    device = next(engine.model.parameters()).device
    assert engine.runner.kv_LPCHD.device == device
    assert engine.make_sequence([1, 2], SamplingParams(seed=1)).gen.device == device  # sampled where the logits are
    unexplained = {k: line for k, line in audit.found.items() if k not in HOST_BY_DESIGN}
    assert not unexplained, "tensors created without device= (file, function, factory: line):\n" + "\n".join(
        f"  {f}:{line} {fn}() torch.{fac}" for (f, fn, fac), line in sorted(unexplained.items()))


def test_the_simple_sampler_allocates_on_the_model_device():
    model = MoETransformer.from_config(MODELS["full"], dtype=torch.float32, seed=3, kernels="torch")
    sampler = SimpleSampler(model, ByteTokenizer(), record_routes=True)
    audit = FactoryAudit()
    with audit:
        outs = sampler.generate_batch([[5, 6, 7], [8]], [SamplingParams(max_tokens=3, seed=2),
                                                         SamplingParams(max_tokens=3, temperature=0)])
    assert all(len(o.token_ids) == 3 and o.routed_experts.device.type == "cpu" for o in outs)
    assert not audit.found, f"tensors created without device=: {audit.found}"
