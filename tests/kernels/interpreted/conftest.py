"""Kernel tests that run the Triton kernels on CPU in Triton's interpreter.

They need ``TRITON_INTERPRET=1`` before triton is imported, which would turn every Triton kernel
in the process into an interpreted one (and break the sm_90 compilations in the same session),
so the default suite runs this folder in a child process (``tests/kernels/test_interpreted.py``).
Run directly with ``TRITON_INTERPRET=1 pytest tests/kernels/interpreted``; without the variable
the folder is skipped.

Poisoned outputs, as fla's conftest does: in this process ``torch.empty``/``torch.empty_like``
return NaN-filled float tensors (integer ones filled with 0x5A), so an output element a kernel
forgets to write fails the comparison instead of passing by luck.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if not INTERPRETING:
    collect_ignore_glob = ["test_*.py"]

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(0x5A)
    return t


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_empty_like(*a, **k)))


@pytest.fixture(autouse=True)
def triton_backend():
    from jointrl.kernels import dispatch

    with dispatch.backend("triton"):
        yield


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere -> NaN, which fails any bound)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


@pytest.fixture
def rel():
    return rel_err
