"""Shared by the kernel tests: compiling a Triton kernel for Hopper without a GPU.

Nothing here touches ``TRITON_INTERPRET``: the interpreter tests run in their own process
(``tests/kernels/interpreted/``, launched by ``test_interpreted.py``).
"""

from __future__ import annotations

import pytest
import torch

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
        torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}


def compile_sm90(kernel, args: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """Compile ``kernel`` to a cubin for sm_90 (``GPUTarget("cuda", 90, 32)``).

    ``args``: every runtime argument by name, a torch dtype for a pointer or ``"i32"``/``"fp32"``
    for a scalar; ``constexprs``: the constexpr values. Returns the compiled kernel.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        pytest.skip("kernels are interpreted in this process (TRITON_INTERPRET=1)")
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            spec = args[name]
            signature[name] = _PTR[spec] if isinstance(spec, torch.dtype) else spec
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.fixture
def sm90():
    return compile_sm90
