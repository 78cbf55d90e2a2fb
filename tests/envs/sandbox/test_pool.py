"""The warm pool and the bwrap-only options: cgroup placement, read-only tool mounts, the persistent shell's edges."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.sandbox.pool import SandboxPool

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)


def test_pool_hands_out_warm_sandboxes_once_each_with_the_task_files(tmp_path):
    (tmp_path / "a.txt").write_text("A")
    pool = SandboxPool(SandboxConfig(timeout_s=10), size=2)
    try:
        assert pool.warm(timeout=30) == 2
        warm_ids = {id(sb) for sb in pool._ready}
        first = pool.acquire(tmp_path)
        second = pool.acquire()
        with first, second:
            assert first.uid != second.uid
            assert first.run("cat a.txt; pwd").stdout == "A/work\n"
            assert second.run("ls -A").stdout == ""
            assert {id(first), id(second)} == warm_ids  # the started ones: no bwrap start on this path
        assert pool.warm(timeout=30) == 2  # the filler replaced them
    finally:
        pool.close()
    assert pool.warm(timeout=1) == 0


def test_processes_start_inside_the_sandbox_cgroup():
    with BwrapSandbox(SandboxConfig(max_memory_bytes=300 << 20)) as sb:
        if sb.cgroup is None:
            pytest.skip(f"no cgroup on this host: {sb.limits['memory']}")
        r = sb.run("cat /proc/self/cgroup")
        assert r.ok
        inside = set(sb.cgroup.pids())
        assert sb.shell_pids <= inside
        limit = (sb.cgroup.dirs[0] / ("memory.limit_in_bytes" if sb.cgroup.version == "v1" else "memory.max")).read_text()
        assert int(limit) == 300 << 20
    assert not sb.cgroup.dirs[0].exists()  # removed on close


def test_tool_mount_is_read_only_and_not_copied():
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # pytest's own tmp root is private (0700)
        check_tool_mount(Path(d))


def check_tool_mount(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "tool").write_text("#!/bin/sh\necho tool-ran\n")
    os.chmod(venv / "bin" / "tool", 0o755)
    os.chmod(tmp_path, 0o755)
    with BwrapSandbox(SandboxConfig(tool_mounts={str(venv): "/opt/tools"})) as sb:
        r = sb.run("/opt/tools/bin/tool; touch /opt/tools/x 2>/dev/null || echo read-only")
        assert r.stdout == "tool-ran\nread-only\n"
        assert not any(p.name.startswith("ro-") for p in sb.private_dir.iterdir())  # bound, not staged
    os.chmod(tmp_path, 0o700)
    with pytest.raises(ValueError, match="not world-readable"):
        BwrapSandbox(SandboxConfig(tool_mounts={str(venv): "/opt/tools"}))


def test_a_command_that_ends_the_shell_reports_its_code_and_the_next_gets_a_new_shell():
    with BwrapSandbox() as sb:
        sb.run("cd /tmp; export A=1; B=2")
        r = sb.run("echo bye; exit 3")
        assert (r.stdout, r.exit_code, r.shell_restarted) == ("bye\n", 3, True)
        after = sb.run('pwd; echo "$A|$B"')
        assert after.stdout == "/tmp\n1|\n" and not after.shell_restarted  # exported vars come back, shell vars not


def test_commands_run_in_one_shell_process():
    """The point of the persistent shell: no sandbox start per command (bench_sandbox.py times it)."""
    with BwrapSandbox() as sb:
        shells = {sb.run("echo $$; cut -d' ' -f22 /proc/$$/stat").stdout for _ in range(5)}
    assert len(shells) == 1, shells  # same pid, same start time
