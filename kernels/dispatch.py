"""Which implementation a kernel op runs: the Triton kernel or its plain-torch reference.

Every public op in ``kernels/`` asks :func:`use_triton` once per call, with the device of its
inputs. The backend is one process-wide setting:

* ``"auto"`` (default): Triton on CUDA tensors, the torch reference elsewhere;
* ``"torch"``: always the torch reference;
* ``"triton"``: always the Triton kernel. CPU tensors then need Triton's interpreter
  (``TRITON_INTERPRET=1`` in the environment before triton is imported): that is how the CPU
  test suite runs every kernel (``tests/kernels/interpreted/``). Slow: for tests only.

Set it with :func:`set_backend`, for a block with ``with backend("triton"): ...``, or at start
with the environment variable ``JOINTRL_KERNEL_BACKEND``.

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

__all__ = ["BACKENDS", "backend", "get_backend", "interpreting", "launcher", "set_backend", "use_triton"]

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "JOINTRL_KERNEL_BACKEND"

_backend: str | None = None  # None: read ENV_VAR on first use


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {list(BACKENDS)}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Select ``"auto"``, ``"torch"`` or ``"triton"`` for every kernel op (module docstring)."""
    global _backend
    _backend = _check(name, "kernel backend")


def get_backend() -> str:
    """The current backend; on first use taken from ``$JOINTRL_KERNEL_BACKEND`` (default auto)."""
    global _backend
    if _backend is None:
        _backend = _check(os.environ.get(ENV_VAR, "auto"), f"${ENV_VAR}")
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
