"""Runs ``tests/model/interpreted/`` (the model's layers on the ``triton`` kernel table, its kernels in
Triton's interpreter on CPU) in a child pytest with ``TRITON_INTERPRET=1``: the variable must be set
before triton is imported and would turn every kernel of this process into an interpreted one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_model_on_the_triton_backend_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
         "-m", "not slow", str(HERE / "interpreted")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, f"interpreted model tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
