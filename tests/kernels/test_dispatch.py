"""kernels.dispatch: one backend setting picks Triton or the torch reference for every op; kernels.ops:
the op table of a concrete backend, chosen once and handed to the model's layers."""

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
    with pytest.raises(ValueError, match=r"\['auto', 'torch', 'cpu', 'triton'\].*'cuda'"):
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
    with pytest.raises(ValueError, match=r"JOINTRL_KERNEL_BACKEND must be one of \['auto', 'torch', 'cpu', 'triton'\]"):
        dispatch.get_backend()


def test_compiled_kernel_on_cpu_tensors_says_what_to_do():
    if dispatch.interpreting(_quantize_mxfp4_kernel):
        pytest.skip("this process interprets Triton kernels")
    with dispatch.backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize_mxfp4(torch.zeros(4, 32))
    with dispatch.backend("auto"):  # CPU tensors take the reference
        assert quantize_mxfp4(torch.zeros(4, 32))[1].tolist() == [[0]] * 4


def test_resolve_picks_a_concrete_backend_per_device():
    assert dispatch.resolve("torch", "cuda") == "torch"
    assert dispatch.resolve("triton", "cpu") == "triton"
    assert dispatch.resolve("auto", "cuda") == "triton"
    built = dispatch.load_ops(["rms_norm"]) is not None
    assert dispatch.resolve("auto", "cpu") == ("cpu" if built else "torch")
    with pytest.raises(ValueError, match="runs CPU tensors only"):
        dispatch.resolve("cpu", "cuda")


def test_kernel_tables_bind_each_backends_functions_once():
    from jointrl.kernels import kda, norm_rope_cpu, paged_attention_cpu  # the functions the tables must hold
    from jointrl.kernels.ops import kernels_for

    torch_ops = kernels_for("torch")
    assert (torch_ops.backend, torch_ops.cpp) == ("torch", False)
    assert torch_ops.rms_norm is norm_rope_cpu.rms_norm_torch and torch_ops.kda_chunk is kda.kda_chunk_torch
    assert torch_ops.paged_decode is paged_attention_cpu.paged_decode_torch
    triton_ops = kernels_for("triton")
    assert triton_ops.kda_recurrent is kda.kda_recurrent_triton and triton_ops.kda_chunk is kda.kda_chunk_triton
    assert kernels_for("torch") is torch_ops  # one table per backend
    if dispatch.load_ops(["rms_norm"]) is not None:
        cpu_ops = kernels_for("cpu")
        assert cpu_ops.cpp and cpu_ops.paged_decode is paged_attention_cpu.paged_decode
        assert cpu_ops.kda_recurrent is kda.kda_recurrent_torch  # no C++ KDA: the reference


def test_model_hands_its_table_to_every_layer():
    from jointrl.model import MoEConfig, MoETransformer  # the model is what hands the table down

    model = MoETransformer.from_config(MoEConfig.preset("tiny_hybrid"), kernels="torch")
    users = [m for m in model.modules() if hasattr(m, "kernels")]
    assert len(users) > 3 and all(m.kernels is model.kernels for m in users)
    assert model.set_kernels("triton").backend == "triton"
    assert all(m.kernels.backend == "triton" for m in users)
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        model.set_kernels("fast")
