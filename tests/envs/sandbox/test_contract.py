"""The one contract every sandbox backend passes, parametrized over the backends.

bwrap runs here (root + bubblewrap); docker runs where a daemon is reachable and is skipped
with the reason where not (no daemon on the development host: checked, not faked). Run as an
ordinary user, bwrap is in rootless mode (``envs.sandbox.mode=auto``): test_rootless.py runs
this file as uid 65534, with and without a delegated cgroup.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from jointrl.envs.sandbox import BACKENDS, SandboxConfig, make_sandbox
from jointrl.envs.sandbox.docker import unavailable_reason

_DOCKER_WHY = unavailable_reason()
_BWRAP_WHY = None if shutil.which("bwrap") else "needs bubblewrap"  # not root: rootless mode
SKIP = {"bwrap": _BWRAP_WHY, "docker": _DOCKER_WHY}
PARAMS = [pytest.param(b, marks=pytest.mark.skipif(SKIP[b] is not None, reason=f"{b} backend: {SKIP[b]}"))
          for b in BACKENDS]
SMALL = SandboxConfig(timeout_s=10, max_output_bytes=1000, max_memory_bytes=256 << 20, max_disk_bytes=32 << 20,
                      max_file_bytes=64 << 20, max_processes=64)


@pytest.fixture(params=PARAMS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def sb(backend):
    with make_sandbox(backend, SMALL) as sandbox:
        yield sandbox


def test_exec_runs_in_work_with_both_streams_and_the_exit_code(sb):
    r = sb.exec("pwd; echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.ok) == ("/work\nout\n", "err\n", 7, False, False)


def test_exec_is_one_shot(sb):
    sb.exec("cd /tmp; export FOO=1")
    assert sb.exec('pwd; echo "[$FOO]"').stdout == "/work\n[]\n"


def test_run_keeps_cwd_and_environment(sb):
    assert sb.run("mkdir -p sub && cd sub && export FOO=bar && pwd").stdout == "/work/sub\n"
    r = sb.run('pwd; echo "$FOO"; echo e >&2; false')
    assert (r.stdout, r.stderr, r.exit_code) == ("/work/sub\nbar\n", "e\n", 1)


def test_a_timed_out_command_is_killed_and_the_shell_state_stays(sb):
    sb.run("cd /tmp && export KEEP=yes")
    t0 = time.monotonic()
    r = sb.run("echo started; sleep 300", timeout=5)
    # cut at the timeout, not after the 300 s sleep (a wide margin: the host may be loaded)
    assert r.timed_out and r.exit_code == 124 and "started" in r.stdout and time.monotonic() - t0 < 120
    assert sb.run('pwd; echo "$KEEP"').stdout == "/tmp\nyes\n"


def test_background_processes_do_not_outlive_their_command(sb):
    assert sb.run("sleep 300 & echo $!").ok
    r = sb.run("ps -eo comm= | grep -c '^sleep$' || true")
    assert r.stdout.strip() == "0", r


def test_output_is_capped_with_a_marker(sb):
    r = sb.run("head -c 5000000 /dev/zero | tr '\\0' a")
    assert r.ok and r.truncated and r.stdout.startswith("a" * 1000 + "\n[... output truncated: 4999000 bytes")


def test_files_round_trip_and_escapes_are_refused(sb):
    sb.write_file("d/e.txt", "hello")
    assert sb.read_file("d/e.txt") == sb.read_file("/work/d/e.txt") == b"hello"
    assert sb.run("cat d/e.txt").stdout == "hello"
    sb.run("ln -s /etc/passwd out; ln -s .. up")
    for bad in ("out", "up/etc/passwd", "../x", "/etc/passwd"):
        with pytest.raises(ValueError):
            sb.read_file(bad)
        with pytest.raises(ValueError):
            sb.write_file(bad, "pwned")


def test_no_network_and_read_only_system(sb):
    r = sb.run("(echo > /dev/tcp/1.1.1.1/53) 2>/dev/null && echo NET; touch /usr/x /etc/x 2>/dev/null && echo WROTE; "
               "touch /tmp/ok && echo tmp-ok; cp /bin/true /tmp/t && /tmp/t && echo tmp-exec")
    assert "NET" not in r.stdout and "WROTE" not in r.stdout and "tmp-ok" in r.stdout
    assert "tmp-exec" in r.stdout  # tests build and run programs in /tmp


def test_memory_is_bounded_and_the_sandbox_survives(sb):
    r = sb.run("python3 -c 'b = bytearray(1 << 30); print(len(b))'; echo rc=$?", timeout=60)
    assert "rc=0" not in r.stdout and str(1 << 30) not in r.stdout
    assert sb.run("echo alive").stdout == "alive\n"


def test_disk_is_bounded(sb):
    r = sb.run("for i in $(seq 100); do head -c 1048576 /dev/zero > f$i || break; done; du -sm . | cut -f1", timeout=60)
    assert int(r.stdout.split()[-1]) <= 33, r  # the 32 MiB tmpfs (+ rounding)
    assert sb.run("rm -f f*; echo ok > a.txt && cat a.txt").stdout == "ok\n"  # usable once freed


def test_populate_and_snapshot(sb, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("A")
    sb.populate(tmp_path / "src")
    assert sb.run("cat a.txt").stdout == "A"
    sb.run("echo B > b.txt; ln -s /etc/passwd leak; mkdir priv && chmod 700 priv; echo 'echo ran' > run.sh; chmod 755 run.sh")
    sb.copy_workdir_to(tmp_path / "snap")
    assert (tmp_path / "snap" / "b.txt").read_text() == "B\n" and (tmp_path / "snap" / "a.txt").read_text() == "A"
    modes = {n: oct((tmp_path / "snap" / n).stat().st_mode & 0o777) for n in ("priv", "run.sh")}
    assert modes == {"priv": "0o700", "run.sh": "0o755"}, modes  # a verifier sees the agent's modes
    leak = tmp_path / "snap" / "leak"
    assert not leak.exists() or (leak.is_symlink() and os.readlink(leak) == "/etc/passwd")  # a link, never its target


def test_close_is_idempotent_and_final(backend):
    sb = make_sandbox(backend, SMALL)
    sb.close()
    sb.close()
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("true")


def test_bad_arguments_are_value_errors(sb):
    with pytest.raises(ValueError, match="timeout"):
        sb.run("true", timeout=0)
    with pytest.raises(ValueError, match="NUL"):
        sb.exec("echo \0")
