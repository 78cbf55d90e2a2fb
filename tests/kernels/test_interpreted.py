"""Runs ``tests/kernels/interpreted/`` (every Triton kernel on CPU, in Triton's interpreter) in a
child pytest with ``TRITON_INTERPRET=1``: the variable must be set before triton is imported and
would turn every kernel of this process into an interpreted one (see that folder's conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
FILES = sorted(p.name for p in (HERE / "interpreted").glob("test_*.py"))
FILES_WITH_SLOW = [name for name in FILES if "pytest.mark.slow" in (HERE / "interpreted" / name).read_text()]


@pytest.mark.parametrize("name", FILES)
def test_interpreted(name, interpreted):
    interpreted(HERE / "interpreted" / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES_WITH_SLOW)
def test_interpreted_slow(name, interpreted):
    """The interpreted files' own slow tests (longer sequences, more shapes)."""
    interpreted(HERE / "interpreted" / name, "slow")
