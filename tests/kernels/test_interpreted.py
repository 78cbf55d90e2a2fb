"""Runs ``tests/kernels/interpreted/`` (every Triton kernel on CPU, in Triton's interpreter) in a
child pytest with ``TRITON_INTERPRET=1``: the variable must be set before triton is imported and
would turn every kernel of this process into an interpreted one (see that folder's conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FILES = sorted(p.name for p in (HERE / "interpreted").glob("test_*.py"))
FILES_WITH_SLOW = [name for name in FILES if "pytest.mark.slow" in (HERE / "interpreted" / name).read_text()]


def _run(name: str, marker: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
         "-m", marker, str(HERE / "interpreted" / name)],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, f"interpreted kernel tests failed ({name}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("name", FILES)
def test_interpreted(name):
    _run(name, "not slow")


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES_WITH_SLOW)
def test_interpreted_slow(name):
    """The interpreted files' own slow tests (longer sequences, more shapes)."""
    _run(name, "slow")
