"""Where a process computes: one device per rank, chosen once, everything else derived from it.

``rank_device()`` is the GPU this process sees (Ray gives an actor with ``num_gpus`` its own
``CUDA_VISIBLE_DEVICES``; the current CUDA device otherwise), else the host. From it follow the
process group's backend (NCCL on CUDA, gloo on the host: ``dist_backend``) and DeepSpeed's
accelerator (``choose_accelerator``). No module of ``rl/`` or ``model/`` names the host device
for compute (``tests/rl/test_device.py`` scans for it): models are built on the meta device and
allocated once on the target device (``materialise``), so the CPU path and the CUDA path are the
same code.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

HOST = torch.device("cpu")  # the only place rl/ names the host device (tests/rl/test_device.py)


def rank_device() -> torch.device:
    """This process's device: its current CUDA device when CUDA is available, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def as_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``; None: ``rank_device()``. A bare ``cuda`` gets the current index."""
    if device is None:
        return rank_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def dist_backend(device: torch.device) -> str:
    """The collective backend for tensors on ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def accelerator_name(device: torch.device) -> str:
    """DeepSpeed's accelerator for ``device`` (its ``DS_ACCELERATOR`` names)."""
    return "cuda" if device.type == "cuda" else "cpu"


def choose_accelerator(device: torch.device) -> str:
    """Make DeepSpeed use the accelerator of ``device``, before it picks one itself: set
    ``DS_ACCELERATOR`` when unset. → its name.

    Raises:
        ValueError: ``DS_ACCELERATOR`` is set, or DeepSpeed already chose an accelerator in this
            process, and it is not ``device``'s (a CPU accelerator would hand NCCL host tensors,
            a CUDA one would move a host model to the GPU behind our back).
    """
    want = accelerator_name(device)
    have = os.environ.get("DS_ACCELERATOR")
    if have is not None and have != want:
        raise ValueError(f"DS_ACCELERATOR={have!r} but this rank computes on {device} (needs {want!r}); "
                         f"unset it or run on a matching device")
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(real, "ds_accelerator", None)
    if chosen is not None and chosen.device_name() != want:
        raise ValueError(f"DeepSpeed already chose accelerator {chosen.device_name()!r} in this process, "
                         f"but this rank computes on {device} (needs {want!r})")
    os.environ["DS_ACCELERATOR"] = want
    return want


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """Allocate a model built on the meta device once, on ``device`` in ``dtype``, and initialise it
    with ``reset_parameters(seed)``: every parameter drawn in float32 from one host generator and
    rounded into ``dtype``, so it equals ``cls(config, seed).to(device, dtype)`` bit for bit
    (tested) without a host copy of the weights. ``model.to(dtype)`` runs on meta first, so a module
    that keeps a buffer in float32 (``TopKRouter._apply``) keeps it; buffers (the router's selection
    bias) start at zero, as in the eager constructor; a parameter two modules share (tied embeddings)
    gets one tensor."""
    assert all(p.device.type == "meta" for p in model.parameters()), "materialise: build the model under torch.device('meta')"
    model.to(dtype=dtype)
    made: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its allocation (shared parameters stay shared)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros_like(b, device=device)
    model.reset_parameters(seed)
    return model
