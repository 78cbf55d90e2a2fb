"""``learner.keep_freed_memory`` (rl/learner/setup.keep_freed_memory): a process that frees and allocates the
same large tensors every step stops page-faulting them back in."""

import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys, torch
if sys.argv[1] == "keep":
    from jointrl.rl.learner.setup import keep_freed_memory
    assert keep_freed_memory()
for _ in range(3):  # warm up: the first allocation faults its pages in either way
    torch.ones(4 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # a "step": 16 MiB allocated, written, freed
    torch.ones(4 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    """Ten 16 MiB tensors allocated and freed in turn: glibc's default unmaps each on free, so each comes back as
    fresh pages (up to 4096 faults each; 24.6-28.7 K for the ten in two runs here, some pages huge); with keep_freed_memory
    the same memory is reused (a few faults)."""
    default, kept = _faults("default"), _faults("keep")
    assert default >= 10_000, default
    assert kept < 500, (kept, default)
