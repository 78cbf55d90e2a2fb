"""The bubblewrap sandbox, with real bwrap and real uids: what it blocks and what it cleans up."""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox import SandboxConfig, make_sandbox
from jointrl.envs.sandbox.bwrap import TIMEOUT_EXIT_CODE, BwrapSandbox
from jointrl.envs.sandbox.disk import unmount
from jointrl.envs.sandbox.uids import acquire_uid, kill_uid, leftover_pids, pids_of_uid, switching_to

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)


def lone_uid() -> int:
    """A uid outside the default pool, for single-uid pools (random: test runs may overlap)."""
    return random.randrange(21000, 22000)


@pytest.fixture
def sb():
    with BwrapSandbox(SandboxConfig(timeout_s=10)) as sandbox:
        yield sandbox


def test_runs_in_work_with_sane_env(sb):
    r = sb.exec('pwd; echo "$HOME|$PATH"; id -u')
    assert r.ok, r
    assert r.stdout.split("\n")[:3] == ["/work", "/work|/usr/local/bin:/usr/bin:/bin", str(sb.uid)]


def test_network_is_unreachable(sb):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        r = sb.exec(
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"; "
            f"echo python=$?; (echo hi > /dev/tcp/127.0.0.1/{port}) 2>/dev/null; echo devtcp=$?"
        )
    finally:
        server.close()
    assert "python=0" not in r.stdout and "devtcp=0" not in r.stdout, r


def test_cannot_write_outside_workdir(sb, tmp_path):
    marker = f"jointrl-marker-{os.getpid()}"
    r = sb.exec(
        f"for p in /usr/{marker} /etc/{marker} /{marker} /bin/{marker} /proc/{marker}; do "
        f"touch $p 2>/dev/null && echo WROTE $p; done; "
        f"touch /tmp/{marker} && echo tmp-ok; ls {tmp_path} 2>/dev/null && echo SEES-HOST; "
        f"ls /tmp/jointrl-sandboxes 2>/dev/null && echo SEES-POOL; true"
    )
    assert "WROTE" not in r.stdout and "SEES" not in r.stdout, r
    assert "tmp-ok" in r.stdout  # /tmp is writable, but private
    assert not Path(f"/tmp/{marker}").exists()


def test_timeout_kills_the_command_and_its_children(sb):
    t0 = time.monotonic()
    r = sb.exec("sleep 313 & setsid sleep 317 & nohup sleep 319 >/dev/null & echo started; sleep 311", timeout=5)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code == TIMEOUT_EXIT_CODE and not r.ok
    assert "started" in r.stdout
    assert elapsed < 120  # cut at the timeout, not after the 311 s sleep (a wide margin: the host may be loaded)
    assert leftover_pids(sb.uid, sb.shell_pids) == set()  # checked by uid on the host, while the sandbox is still open
    assert sb.exec("echo alive").stdout == "alive\n"  # and the sandbox is usable afterwards


def test_background_processes_do_not_outlive_exec(sb):
    r = sb.exec("sleep 307 & echo $!")
    assert r.ok
    assert leftover_pids(sb.uid, sb.shell_pids) == set()


def test_runs_under_a_nonzero_host_uid(sb):
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", sb.exec("exec sleep 3.234")))
    worker.start()
    uid_line = None
    deadline = time.monotonic() + 60
    while uid_line is None and time.monotonic() < deadline:
        for pid in pids_of_uid(sb.uid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x003.234\x00":
                    uid_line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    worker.join()
    assert uid_line is not None, "the sandboxed process was not found on the host"
    uids = [int(x) for x in uid_line.split()[1:]]
    assert uids == [sb.uid] * 4 and sb.uid != 0
    assert result["r"].ok


def test_output_is_truncated_with_a_marker_and_bounded_memory():
    with BwrapSandbox(SandboxConfig(max_output_bytes=1000)) as sb:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = sb.exec("head -c 100000000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2")
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.ok and r.truncated
    assert r.stdout == "a" * 1000 + "\n[... output truncated: 99999000 bytes dropped ...]"
    assert r.stderr == "b" * 1000 + "\n[... output truncated: 4000 bytes dropped ...]"
    assert rss_after - rss_before < 50_000  # KiB: 100 MB of output was read and discarded


def test_concurrent_sandboxes_get_distinct_uids_and_private_dirs():
    with BwrapSandbox() as a, BwrapSandbox() as b:
        assert a.uid != b.uid and 0 not in (a.uid, b.uid)
        a.write_file("secret.txt", "top secret")
        for box in (a, b):
            st = os.stat(box.private_dir)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (box.uid, 0o700)
        # inside b, a's host dir does not exist at all ...
        assert "top secret" not in b.exec(f"cat {a.workdir}/secret.txt 2>&1").stdout
        # ... and even on the host, b's uid may not read it
        r = subprocess.run(["cat", str(a.workdir / "secret.txt")], user=b.uid, group=b.uid, extra_groups=[],
                           capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr


def test_uid_pool_is_exclusive_and_freed_on_close():
    uid = lone_uid()
    cfg = SandboxConfig(uid_range=(uid, uid))
    first = BwrapSandbox(cfg)
    with pytest.raises(EnvError, match="no free sandbox uid"):
        BwrapSandbox(cfg)
    first.close()
    with BwrapSandbox(cfg) as again:
        assert again.uid == uid


def test_close_kills_removes_and_is_idempotent():
    sb = BwrapSandbox()
    sb.write_file("f.txt", "x")
    private = sb.private_dir
    sb.close()
    sb.close()
    assert not private.exists()
    assert leftover_pids(sb.uid, sb.shell_pids) == set()
    with pytest.raises(RuntimeError, match="closed"):
        sb.exec("true")


def test_read_and_write_files(sb):
    sb.write_file("d/e/f.txt", "hello")
    assert sb.read_file("d/e/f.txt") == b"hello"
    assert sb.read_file("/work/d/e/f.txt") == b"hello"
    assert sb.exec("echo more >> d/e/f.txt && cat d/e/f.txt").stdout == "hellomore\n"  # owned by the uid
    sb.exec("ln -s /work/d/e/f.txt abs && ln -s d/e/f.txt rel && ln -s d dirlink")
    assert sb.read_file("abs") == sb.read_file("rel") == sb.read_file("dirlink/e/f.txt") == b"hellomore\n"


@pytest.mark.parametrize("path", ["../x", "d/../../x", "/etc/passwd", "/work/../etc/passwd", "/tmp/x",
                                  "out", "up/passwd", "loop", "chain"])
def test_file_access_refuses_escapes(sb, path):
    sb.exec("mkdir d; ln -s /etc/passwd out; ln -s .. up; ln -s loop loop; ln -s up/.. chain")
    with pytest.raises(ValueError):
        sb.read_file(path)
    with pytest.raises(ValueError):
        sb.write_file(path, "pwned")
    assert b"pwned" not in Path("/etc/passwd").read_bytes()


def test_read_file_refuses_a_fifo_without_blocking(sb):
    sb.exec("mkfifo pipe")
    with pytest.raises(ValueError, match="not a regular file"):
        sb.read_file("pipe")


def test_workdir_from_is_copied_and_owned(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(tmp_path / "sub" / "run.sh", 0o4755)
    os.symlink("/etc/passwd", tmp_path / "link")
    with BwrapSandbox(workdir_from=tmp_path) as sb:
        assert sb.exec("./sub/run.sh").stdout == "ran\n"
        st = os.lstat(sb.workdir / "sub" / "run.sh")
        assert st.st_uid == sb.uid and stat.S_IMODE(st.st_mode) == 0o755  # setuid dropped
        assert os.readlink(sb.workdir / "link") == "/etc/passwd"  # copied as a link, not followed


def test_snapshot_and_ro_binds_and_rw_dirs(sb, tmp_path):
    sb.exec("echo final > result.txt")
    snap = tmp_path / "snap"
    sb.copy_workdir_to(snap)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "check.sh").write_text("grep -q final /work/result.txt && echo 1 > /logs/out/r.txt\n")
    with BwrapSandbox(workdir_from=snap, ro_binds={str(tmp_path / "tests"): "/tests"}, rw_dirs=("/logs/out",)) as v:
        assert v.uid != sb.uid
        assert v.exec("bash /tests/check.sh").ok
        assert v.read_file("/logs/out/r.txt") == b"1\n"
        assert not v.exec("touch /tests/x").ok  # read-only


def test_rlimits_are_a_backstop():
    cfg = SandboxConfig(max_processes=16, max_file_bytes=1 << 20)
    with BwrapSandbox(cfg) as sb:
        forks = sb.exec(
            "python3 -c \"import subprocess\nn = 0\nwhile n < 100:\n"
            "    try: subprocess.Popen(['sleep', '5'])\n    except OSError: break\n    n += 1\nprint(n)\""
        )
        assert forks.ok and int(forks.stdout) < 16, forks
        big = sb.exec("head -c 2000000 /dev/zero > big")
        assert not big.ok and os.path.getsize(sb.workdir / "big") <= 1 << 20
        # The same hard limits in the persistent shell, and no command can raise them.
        for run in (sb.exec, sb.run):
            r = run("ulimit -H -u; ulimit -H -f; ulimit -t; ulimit -u 1000 2>/dev/null && echo RAISED; "
                    "ulimit -f unlimited 2>/dev/null && echo RAISED; true")
            assert r.stdout.split() == ["16", "1024", str(cfg.cpu_seconds)], r
        # A command that is not one of the sandbox's bashes (the browser driver) gets them from prlimit.
        proc, status_r, _, _ = sb._spawn(["/bin/cat", "/proc/self/limits"], stdin=subprocess.DEVNULL)
        out, _ = proc.communicate(timeout=60)
        os.close(status_r)
        limits = {line[:26].strip(): line[26:].split()[:2] for line in out.decode().splitlines()[1:]}
        assert limits["Max processes"] == ["16", "16"] and limits["Max file size"] == [str(1 << 20)] * 2, limits


def test_bwrap_failure_is_an_env_error(sb):
    unmount(sb.workdir)  # the host dir that bwrap binds at /work vanished ...
    shutil.rmtree(sb.workdir)
    kill_uid(sb.uid)  # ... and the shell died: it cannot restart
    with pytest.raises(EnvError, match="bwrap"):
        sb.exec("true")


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="allowed: \\['bwrap', 'docker'\\]"):
        make_sandbox("docker-ish")
    with pytest.raises(ValueError, match="overlaps the reserved '/usr'"):
        BwrapSandbox(ro_binds={str(tmp_path): "/usr/local"})
    with pytest.raises(ValueError, match="normalized absolute"):
        BwrapSandbox(rw_dirs=("logs",))
    with pytest.raises(ValueError, match="does not exist"):
        BwrapSandbox(ro_binds={str(tmp_path / "nope"): "/tests"})
    with pytest.raises(ValueError, match="timeout"):
        with make_sandbox("bwrap") as sb:
            sb.exec("true", timeout=0)


def running(uid: int, name: str) -> bool:
    """Whether a process of ``uid`` runs the program ``name``."""
    for pid in pids_of_uid(uid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return True
        except FileNotFoundError:
            pass
    return False


def test_a_crashed_holders_leftovers_are_cleaned_by_the_next_lease():
    uid = lone_uid()
    cfg = SandboxConfig(uid_range=(uid, uid))
    script = ("from jointrl.envs.sandbox.bwrap import BwrapSandbox\n"
              "from jointrl.envs.sandbox import SandboxConfig\n"
              "import os, sys, threading\n"
              f"sb = BwrapSandbox(SandboxConfig(uid_range=({uid}, {uid})))\n"
              "threading.Thread(target=sb.exec, args=('sleep 300',)).start()\n"
              "print(sb.private_dir, flush=True)\n"
              "sys.stdin.readline()\n")
    crashed = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    private = Path(crashed.stdout.readline().strip())
    deadline = time.monotonic() + 60
    while not running(uid, "sleep") and time.monotonic() < deadline:  # every spawn done, the command runs
        time.sleep(0.02)
    assert running(uid, "sleep")
    crashed.kill()  # SIGKILL: neither close() nor any finalizer runs
    crashed.wait()
    assert private.exists()
    for _ in range(100):  # a fork of the crashed process may hold its lock fd until it execs
        try:
            sb = BwrapSandbox(cfg)
            break
        except EnvError:
            time.sleep(0.02)
    with sb:
        assert sb.uid == uid and not private.exists() and leftover_pids(uid, sb.shell_pids) == set()


def test_a_crashed_holders_spawn_in_flight_is_killed_by_the_next_lease(tmp_path):
    """A holder killed while its ``setpriv`` had not yet switched to the uid: that process is
    still root when the next holder sweeps by uid, and would become a leftover of the uid a
    moment later (CI once caught the crash test above in this window). The sweep kills it."""
    uid = lone_uid()
    crashed = acquire_uid((uid, uid), tmp_path)
    crashed.release(clean=False)  # what a crash leaves: the lock file says dirty
    # A root process whose argv reads like an in-flight spawn for this uid (bash's exec -a names it).
    in_flight = subprocess.Popen(["bash", "-c", f'exec -a setpriv {sys.executable} -c "import time; time.sleep(300)" '
                                  f"--reuid={uid} --regid={uid} --clear-groups --"])
    other = subprocess.Popen(["bash", "-c", f'exec -a setpriv {sys.executable} -c "import time; time.sleep(300)" '
                              f"--reuid={uid + 1}"])
    try:
        deadline = time.monotonic() + 30
        while switching_to(uid) != [in_flight.pid] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert switching_to(uid) == [in_flight.pid]
        lease = acquire_uid((uid, uid), tmp_path)
        try:
            assert not lease.inherited_clean
            assert in_flight.wait(timeout=10) == -signal.SIGKILL
            assert other.poll() is None  # a spawn for another uid is left alone
        finally:
            lease.release(clean=True)
        lease = acquire_uid((uid, uid), tmp_path)  # released clean: no sweep this time
        assert lease.inherited_clean
        lease.release(clean=True)
    finally:
        for proc in (in_flight, other):
            proc.kill()
            proc.wait()
