"""Where the rollout worker puts the own engine (``rl/rollout/worker.engine_device``): on the rank's GPU
when ``model.kernels`` runs there, else on the host -- and it says which when it starts."""

from __future__ import annotations

import pytest
import torch

from jointrl.rl.config import load_config
from jointrl.rl.device import HOST
from jointrl.rl.rollout.worker import RolloutWorker, engine_device

GPU = torch.device("cuda", 0)  # named, not touched: the choice needs no CUDA runtime


@pytest.mark.parametrize(("kernels", "backend"), [("auto", "triton"), ("triton", "triton"), ("torch", "torch")])
def test_the_engine_goes_to_the_gpu_when_its_kernels_run_there(kernels, backend):
    device, why = engine_device(kernels, device=GPU)
    assert device == GPU
    assert repr(backend) in why and "cuda:0" in why


def test_the_cpu_kernels_and_batch_invariance_keep_the_engine_on_the_host():
    device, why = engine_device("cpu", device=GPU)
    assert device == HOST and "model.kernels=cpu" in why
    device, why = engine_device("auto", batch_invariant=True, device=GPU)
    assert device == HOST and "batch_invariant" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without a GPU")
def test_without_a_gpu_the_worker_builds_its_engine_on_the_host_and_says_so(capsys):
    assert engine_device("auto")[0] == HOST
    for backend in ("engine", "simple"):
        worker = RolloutWorker(load_config(["seed=5", f"rollout.backend={backend}"]))
        assert worker.device == HOST
        assert next(worker.engine.model.parameters()).device == HOST
        assert f"{backend} engine on cpu (no GPU visible" in capsys.readouterr().out
