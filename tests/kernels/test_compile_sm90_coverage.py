"""Every Triton kernel the CUDA engine and learner launch has an sm_90 compile test
(``test_compile_sm90.py``): a new kernel without one fails here, so "compiles for Hopper" stays
true of all of them in the default suite, without a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
COMPILE_TESTS = Path(__file__).with_name("test_compile_sm90.py")


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def launched_kernels() -> set[tuple[str, str]]:
    """(module, name) of each ``@triton.jit`` function no other jit function calls (helpers such as
    a tile decoder are compiled inside the kernels that call them)."""
    out = set()
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit = [n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)]
        called = {c.func.id for fn in jit for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        out |= {(path.stem, fn.name) for fn in jit if fn.name not in called}
    return out


def compiled_in_tests() -> set[tuple[str, str]]:
    """(module, name) of each ``module.name`` the sm_90 compile tests reference."""
    tree = ast.parse(COMPILE_TESTS.read_text())
    return {(n.value.id, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def test_every_launched_kernel_has_an_sm90_compile_test():
    kernels = launched_kernels()
    assert len(kernels) >= 10 and ("mxfp4", "_e2m1_tile") not in kernels  # the scan finds kernels, not helpers
    missing = sorted(kernels - compiled_in_tests())
    assert not missing, f"Triton kernels without an sm_90 compile test in {COMPILE_TESTS.name}: {missing}"
