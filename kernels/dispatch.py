"""Which implementation a kernel op runs: the Triton kernel, the C++ CPU kernel or the plain-torch reference.

Backends (``model.kernels`` in the config, ``rl/config.KernelBackend``; its default is
``$JOINTRL_KERNEL_BACKEND``, else ``auto``):

* ``"auto"``: Triton on CUDA tensors; on CPU the C++ kernels where they build here, else the torch
  references (:func:`resolve`);
* ``"torch"``: always the torch reference (one per op);
* ``"cpu"``: the C++ CPU kernels (``kernels/csrc``, ``torch.ops.jointrl``) for the ops that have one
  (norms, the paged attention of the engine's cache, the routed experts, the packed projections), the
  torch reference for the rest (KDA, DSA: Triton or torch only);
* ``"triton"``: the Triton kernel of every op that has one, the torch reference for the rest. CPU
  tensors then need Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before triton is
  imported): that is how the CPU test suite runs every kernel (``tests/kernels/interpreted/``) and
  the engine on this backend (``tests/rl/rollout/interpreted/``). Slow: for tests only.

A model and an engine choose once, at construction: ``kernels/ops.kernels_for(name, device)`` resolves
the name to a concrete backend and returns its op table (``Kernels``), which ``MoETransformer`` hands to
its layers and ``ModelRunner`` reads; nothing in a forward compares backend names.

The public functions of ``kernels/<op>.py`` (what tests and benchmarks call) instead ask
:func:`use_triton` once per call, with the device of their inputs, under one process-wide setting:
:func:`set_backend`, for a block ``with backend("triton"): ...``, or ``$JOINTRL_KERNEL_BACKEND``
(``"cpu"`` there means: not Triton).

The ops that dispatch here: ``mxfp4.quantize_mxfp4`` / ``dequantize_mxfp4``,
``moe_matmul.moe_swiglu_mxfp4`` / ``moe_down_mxfp4`` / ``moe_experts_mxfp4``,
``paged_attention.paged_attention_decode``, ``kda.kda_recurrent`` / ``kda_chunk`` (forward and
backward), ``dsa.indexer_scores`` / ``sparse_attention`` (forward and backward) and
``topk.select_topk``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from jointrl.kernels.cpu_extension import load_ops

__all__ = ["BACKENDS", "backend", "default_backend", "get_backend", "interpreting", "launcher", "resolve",
           "set_backend", "use_triton"]

BACKENDS = ("auto", "torch", "cpu", "triton")
ENV_VAR = "JOINTRL_KERNEL_BACKEND"

_backend: str | None = None  # None: read ENV_VAR on first use


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {list(BACKENDS)}, got {name!r}")
    return name


def default_backend() -> str:
    """``$JOINTRL_KERNEL_BACKEND`` (checked), else ``"auto"``: the default of ``model.kernels``."""
    return _check(os.environ.get(ENV_VAR, "auto"), f"${ENV_VAR}")


def resolve(name: str, device: torch.device | str = "cpu") -> str:
    """The concrete backend (``"torch"``, ``"cpu"`` or ``"triton"``) that ``name`` means for tensors on
    ``device``: ``auto`` is Triton on CUDA, the C++ kernels on CPU where they build, else torch. ``cpu``
    on another device, or where the C++ kernels cannot be built, is a ``ValueError``."""
    device = torch.device(device)
    name = _check(name, "kernel backend")
    if name in ("torch", "triton"):
        return name
    if device.type != "cpu":
        if name == "cpu":
            raise ValueError(f"kernel backend 'cpu' runs CPU tensors only, the model is on {device}")
        return "triton" if device.type == "cuda" else "torch"
    built = load_ops(["rms_norm"]) is not None
    if name == "cpu" and not built:
        raise ValueError("kernel backend 'cpu' needs the C++ CPU kernels, which did not build here "
                         "(python -m jointrl.kernels.build says why); use auto or torch")
    return "cpu" if built else "torch"


def set_backend(name: str) -> None:
    """Select ``"auto"``, ``"torch"``, ``"cpu"`` or ``"triton"`` for the public op functions (module docstring)."""
    global _backend
    _backend = _check(name, "kernel backend")


def get_backend() -> str:
    """The current backend; on first use taken from ``$JOINTRL_KERNEL_BACKEND`` (default auto)."""
    global _backend
    if _backend is None:
        _backend = default_backend()
    return _backend


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run a block under another backend, restoring the previous one afterwards."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_triton(device: torch.device) -> bool:
    """Whether an op whose inputs live on ``device`` runs its Triton kernel."""
    mode = get_backend()
    if mode == "auto":
        return device.type == "cuda"
    return mode == "triton"


def interpreting(kernel) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1`` was set before
    triton was imported). Kernels then upcast ``tl.dot`` operands to fp32: the interpreter's
    bf16 ``tl.dot`` returns garbage."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def launcher(kernel, device: torch.device):
    """``kernel``, checked to be runnable on ``device``: compiled kernels need CUDA tensors;
    CPU tensors need the interpreter."""
    if device.type != "cuda" and not interpreting(kernel):
        raise RuntimeError(
            f"the Triton kernel {kernel.fn.__name__} got {device.type} tensors: on CPU, Triton "
            "kernels run only under TRITON_INTERPRET=1, set before triton is imported"
        )
    return kernel
