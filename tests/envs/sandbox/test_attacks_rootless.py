"""The attack suite in rootless mode, as an ordinary user (test_rootless.py runs this file as uid 65534).

As in test_attacks.py, each attack is played through ``TerminalEnv.step`` while a victim
episode works beside it, and every case checks the host (a canary file; no process left in
any sandbox namespace after the command or the episode; bounded disk), the victim (its
output right), and the attacker's observation (bounded, no secret, the next command runs).
What differs without root: the attacker, the victim and this test process are **one uid**,
so "nothing left" is checked by namespace, not by uid, and a sentinel process of the same
uid outside the sandboxes (the job's other processes: its Ray workers) must survive every
attack. ``JOINTRL_TEST_DELEGATED=1`` says a cgroup subtree was delegated to the uid: then the
episode's memory and process bounds must come from it, else from rlimits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from jointrl.envs.base import ToolCall
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import SANDBOX_ROOT
from jointrl.envs.sandbox.uids import pids_of_uid
from jointrl.envs.terminal import TerminalEnv, load_tasks

pytestmark = pytest.mark.skipif(os.geteuid() == 0 or shutil.which("bwrap") is None,
                                reason="rootless attacks run as an ordinary user: test_rootless.py runs this file as 65534")

CFG = SandboxConfig(timeout_s=3, max_output_bytes=4096, max_memory_bytes=256 << 20, max_disk_bytes=64 << 20,
                    max_file_bytes=32 << 20, max_processes=64, mode="rootless")
VICTIM_CFG = SandboxConfig(timeout_s=30, mode="rootless")
SECRET = "victim-secret-4f1d2c"
VICTIM_CMD = "for i in $(seq 20); do echo $i >> count.txt; sleep 0.05; done; wc -l < count.txt; cat secret.txt"
TASK = next(t for t in load_tasks() if t.id == "write-file")
DELEGATED = os.environ.get("JOINTRL_TEST_DELEGATED") == "1"
UID = os.getuid()


def _ns(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def in_ns(kind: str, ns: str | None) -> set[int]:
    """Live processes of our uid in namespace ``ns`` of ``kind`` (zombies left out)."""
    return {p for p in pids_of_uid(UID) if _ns(p, kind) == ns}


def sandboxed(settle_s: float = 10.0) -> set[int]:
    """Processes of our uid in another user namespace than ours (sandboxes, keepers), once the dying are gone."""
    mine, deadline = _ns(os.getpid(), "user"), time.monotonic() + settle_s
    while True:
        found = {p for p in pids_of_uid(UID) if _ns(p, "user") not in (mine, None)}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


class Watch(threading.Thread):
    """Samples how many processes the attacker's shell pid namespace holds while the attack runs."""

    def __init__(self, ns: str | None) -> None:
        super().__init__(daemon=True)
        self.ns, self.peak, self.stop = ns, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, len(in_ns("pid", self.ns)))
            time.sleep(0.01)


def play(attack: list[str], canary: Path, during=None, cfg: SandboxConfig = CFG):
    """Run ``attack`` in one episode (``cfg``) while the victim works in another; returns what the checks need."""
    sentinel = subprocess.Popen(["sleep", "600"])  # one of "the job's other processes", same uid

    async def go():
        victim, attacker = TerminalEnv(VICTIM_CFG), TerminalEnv(cfg)
        try:
            await asyncio.gather(victim.reset(TASK), attacker.reset(TASK))
            victim.sandbox.write_file("secret.txt", SECRET)
            sb = attacker.sandbox
            assert sb.rootless and (sb.cgroup is not None) == DELEGATED, sb.limits
            sb.run("true")
            shell_ns = next(n for n in (_ns(p, "pid") for p in sb.shell_pids) if n != _ns(os.getpid(), "pid"))
            watch = Watch(shell_ns)
            watch.start()

            async def attack_all():
                out = []
                for cmd in attack:
                    cmd = cmd.replace("@VICTIM_WORK@", str(victim.sandbox.workdir))
                    out.append(await attacker.step(ToolCall("bash", {"command": cmd})))
                return out

            victim_obs, attack_obs = await asyncio.gather(victim.step(ToolCall("bash", {"command": VICTIM_CMD})),
                                                          attack_all())
            watch.stop.set()
            watch.join()
            deadline = time.monotonic() + 10
            while (leftovers := in_ns("pid", shell_ns) - sb.shell_pids) and time.monotonic() < deadline:
                time.sleep(0.01)
            extra = during(sb) if during else None
            after = await attacker.step(ToolCall("bash", {"command": "echo after"}))
            return dict(victim=victim_obs.text, attack=[o.text for o in attack_obs], after=after.text,
                        leftovers=leftovers, peak=watch.peak, extra=extra)
        finally:
            await asyncio.gather(victim.close(), attacker.close())

    try:
        result = asyncio.run(go())
        assert sentinel.poll() is None, "a process of the job outside the sandboxes was killed"
    finally:
        sentinel.kill()
        sentinel.wait()
    assert result["victim"] == f"20\n{SECRET}\n[exit code: 0]", result["victim"]
    assert canary.read_text() == "host canary\n"
    assert result["leftovers"] == set(), "processes outlived the command"
    assert sandboxed() == set(), "processes (or a keeper) outlived the episode"
    for text in result["attack"]:
        assert SECRET not in text and len(text) < 2 * CFG.max_output_bytes + 600, text[:500]
    assert result["after"] == "after\n[exit code: 0]", result["after"]
    return result


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.txt"
    path.write_text("host canary\n")
    return path


def test_fork_bomb(canary):
    r = play([":(){ :|:& };:"], canary)
    # the pids cgroup, else RLIMIT_NPROC counted in the episode's own user namespace (+ init, the shell)
    assert r["peak"] <= CFG.max_processes + 3, r["peak"]
    assert "[timed out" in r["attack"][0] or "exit code" in r["attack"][0]


def test_memory_bomb(canary):
    bomb = "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'; echo rc=$?"
    r = play([bomb], canary, during=lambda sb: sb.cgroup.oom_kills() if sb.cgroup else None)
    assert "rc=137" in r["attack"][0] or "MemoryError" in r["attack"][0], r["attack"][0]
    assert r["extra"] is None or r["extra"] >= 1  # the kernel OOM-killed inside the episode's cgroup


def test_memory_bomb_over_many_processes(canary):
    """Under RLIMIT_AS alone each process may take its limit: the cgroup bounds the sum (documented)."""
    bomb = ("for i in 1 2 3 4; do python3 -c 'import time; b = bytearray(200 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
            "time.sleep(2)' & done; wait; echo done")
    # 20 s, not 3: on a loaded machine four Python starts could outlast 3 s, the command be killed before any
    # two processes held their 200 MB at once, and no OOM kill happen (seen once in CI under load)
    r = play([bomb], canary, during=lambda sb: sb.cgroup.oom_kills() if sb.cgroup else None,
             cfg=dataclasses.replace(CFG, timeout_s=20))
    assert "done" in r["attack"][0], r["attack"][0]
    assert not DELEGATED or r["extra"] >= 1  # 4 x 200 MB > the 256 MB cgroup: the kernel OOM-killed


def test_busy_loop_in_the_shell_itself(canary):
    r = play(["while :; do :; done"], canary)
    assert "[timed out after 3 s" in r["attack"][0] and "the shell ended" in r["attack"][0]


def test_200_mb_of_output(canary):
    r = play(["head -c 200000000 /dev/zero | tr '\\0' x; head -c 200000000 /dev/zero >&2"], canary)
    assert "bytes dropped" in r["attack"][0]


def test_network_egress(canary):
    cmd = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\" 2>/dev/null && echo EGRESS; "
           "(echo > /dev/tcp/127.0.0.1/22) 2>/dev/null && echo LOOPBACK; ip -o link 2>/dev/null | grep -v ' lo:' ; true")
    r = play([cmd], canary)
    assert "EGRESS" not in r["attack"][0] and "LOOPBACK" not in r["attack"][0], r["attack"][0]


def test_writes_outside_the_work_dir(canary):
    home = os.environ.get("HOME", "/nonexistent")
    cmd = (f"for p in {canary} {canary.parent}/new /etc/x /usr/x /x /proc/x ../x {SANDBOX_ROOT}/x {home}/x; do "
           "echo pwned > $p 2>/dev/null && echo WROTE $p; done; true")
    r = play([cmd], canary)
    assert "WROTE" not in r["attack"][0].replace("WROTE ../x", "")  # ../x from /work is /x: read-only too
    assert not (canary.parent / "new").exists() and not (SANDBOX_ROOT / "x").exists()
    assert not Path(home, "x").exists()


def test_reading_another_episodes_files(canary):
    cmd = ("cat @VICTIM_WORK@/secret.txt 2>&1; "
           f"ls {SANDBOX_ROOT} 2>&1; cat /proc/*/root/work/secret.txt /proc/*/root/tmp/*/*/work/secret.txt 2>&1; "
           "find / -name secret.txt -not -path '/proc/*' 2>/dev/null; true")
    play([cmd], canary)  # play checks that the secret appears in no observation


def test_kill_everything(canary):
    r = play(["kill -9 -1; echo survived", "sleep 100 & bash -c 'kill -9 -1'; echo unreachable"], canary)
    assert "survived" in r["attack"][0]  # from the shell itself: nothing else of its pid namespace to kill
    assert "unreachable" not in r["attack"][1] and "the shell ended" in r["attack"][1]  # from a child: the shell dies


def test_orphans_and_background_processes(canary):
    cmd = "sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 & disown -a; (sleep 1003 &); echo started"
    r = play([cmd, "sleep 0.2; ps -eo comm= | grep -c '^sleep$' || true"], canary)
    assert r["attack"][1].startswith("0\n")  # not even the next command of the same episode sees them


def test_symlink_escape_through_the_shell_and_the_file_tools(canary):
    cmd = f"ln -s {canary} c; ln -s / root; ln -s /etc/passwd pw; mkdir d && ln -s ../.. d/up; cat c root/etc/hostname 2>&1; true"

    def file_tools(sb):
        refused = 0
        for path in ("c", "root/etc/passwd", "pw", "d/up/etc/passwd", "/work/root/etc/passwd"):
            for op in (lambda p: sb.read_file(p), lambda p: sb.write_file(p, "pwned")):
                try:
                    op(path)
                except ValueError:
                    refused += 1
        return refused

    r = play([cmd], canary, during=file_tools)
    assert r["extra"] == 10  # every read and write through a link out of /work refused
    assert "host canary" not in r["attack"][0]


def test_filling_the_disk(canary):
    free_before = shutil.disk_usage("/").free
    cmd = ("for i in $(seq 200); do head -c 8M /dev/zero > f$i 2>/dev/null || break; done; "
           "for i in $(seq 200); do head -c 8M /dev/zero > /tmp/f$i 2>/dev/null || break; done; du -sm /work /tmp")
    r = play([cmd], canary, during=lambda sb: sum(f.stat().st_size for f in sb.workdir.iterdir()))
    assert r["extra"] <= CFG.max_disk_bytes  # the keeper's tmpfs bound on /work
    assert free_before - shutil.disk_usage("/").free < 512 << 20  # the host disk did not fill (other work runs too)
