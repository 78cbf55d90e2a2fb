"""Runs ``tests/model/interpreted/`` (the model's layers on the ``triton`` kernel table, its kernels in
Triton's interpreter on CPU) in a child pytest with ``TRITON_INTERPRET=1``: the variable must be set
before triton is imported and would turn every kernel of this process into an interpreted one."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def test_model_on_the_triton_backend_interpreted(interpreted):
    out = interpreted(HERE / "interpreted")
    assert " passed" in out and "skipped" not in out, out[-2000:]
