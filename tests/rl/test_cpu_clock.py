"""rl/cpu_clock.py: the CPU seconds of a command that ran and ended in a sandbox are counted."""

from __future__ import annotations

import os
import shutil

import pytest

from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.rl.cpu_clock import CPUACCT, CpuClock

BURN = "python3 -c 'import time; t = time.process_time(); exec(\"while time.process_time() - t < 0.5: pass\")'"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None or not os.path.isdir("/sys/fs/cgroup/cpuacct"),
                    reason="needs root, bubblewrap and cgroup v1 cpuacct")
def test_a_finished_sandboxed_command_is_counted():
    clock = CpuClock("jointrl-test")
    try:
        assert clock.exact
        sandbox = BwrapSandbox(shell=False)
        try:
            c0 = clock()
            assert sandbox.exec(BURN, timeout=60).exit_code == 0
            used = clock() - c0
        finally:
            sandbox.close()
        assert used >= 0.45, used  # the 0.5 CPU-s the sandboxed python burnt (rusage sees ~0 of it)
    finally:
        clock.close()
    assert clock.group is None and not (CPUACCT / f"jointrl-test-{os.getpid()}").exists()  # the group is gone
