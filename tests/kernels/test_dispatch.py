"""kernels.dispatch: one backend setting picks Triton or the torch reference for every op."""

from __future__ import annotations

import pytest
import torch

from jointrl.kernels import dispatch
from jointrl.kernels.mxfp4 import _quantize_mxfp4_kernel, quantize_mxfp4


def test_auto_picks_triton_only_on_cuda():
    with dispatch.backend("auto"):
        assert dispatch.use_triton(torch.device("cuda", 0))
        assert not dispatch.use_triton(torch.device("cpu"))
    with dispatch.backend("torch"):
        assert not dispatch.use_triton(torch.device("cuda", 0))
    with dispatch.backend("triton"):
        assert dispatch.use_triton(torch.device("cpu"))


def test_unknown_backend_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"\['auto', 'torch', 'triton'\].*'cuda'"):
        dispatch.set_backend("cuda")


def test_backend_context_restores_the_previous_setting():
    before = dispatch.get_backend()
    with pytest.raises(RuntimeError, match="boom"):
        with dispatch.backend("torch"):
            assert dispatch.get_backend() == "torch"
            raise RuntimeError("boom")
    assert dispatch.get_backend() == before


def test_environment_variable_sets_the_default_and_is_checked(monkeypatch):
    monkeypatch.setattr(dispatch, "_backend", None)  # as in a fresh process
    monkeypatch.setenv("JOINTRL_KERNEL_BACKEND", "torch")
    assert dispatch.get_backend() == "torch"
    monkeypatch.setattr(dispatch, "_backend", None)
    monkeypatch.setenv("JOINTRL_KERNEL_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"JOINTRL_KERNEL_BACKEND must be one of \['auto', 'torch', 'triton'\]"):
        dispatch.get_backend()


def test_compiled_kernel_on_cpu_tensors_says_what_to_do():
    if dispatch.interpreting(_quantize_mxfp4_kernel):
        pytest.skip("this process interprets Triton kernels")
    with dispatch.backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize_mxfp4(torch.zeros(4, 32))
    with dispatch.backend("auto"):  # CPU tensors take the reference
        assert quantize_mxfp4(torch.zeros(4, 32))[1].tolist() == [[0]] * 4
