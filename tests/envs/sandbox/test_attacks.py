"""Attacks from inside an episode, with a second episode running beside it (real bwrap, real uids).

Each attack is played through ``TerminalEnv.step`` (the bash tool, persistent shell) while a
victim episode runs a steady workload. Every case checks the same three things: the **host**
is unharmed (a canary file outside the sandboxes, no process of the attacker's uid left after
the command or the episode, bounded disk), the **victim** finished its command with the right
output, and the attacker's **observation** is clean (bounded, none of the victim's secret, and
the next command runs normally). Cases add what their bound is (pids, memory, disk, output).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from jointrl.envs.base import ToolCall
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import SANDBOX_ROOT
from jointrl.envs.sandbox.uids import leftover_pids, pids_of_uid
from jointrl.envs.terminal import TerminalEnv, load_tasks

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)

CFG = SandboxConfig(timeout_s=3, max_output_bytes=4096, max_memory_bytes=256 << 20, max_disk_bytes=64 << 20,
                    max_file_bytes=32 << 20, max_processes=64)
VICTIM_CFG = SandboxConfig(timeout_s=30)
SECRET = "victim-secret-4f1d2c"
VICTIM_CMD = "for i in $(seq 20); do echo $i >> count.txt; sleep 0.05; done; wc -l < count.txt; cat secret.txt"
TASK = next(t for t in load_tasks() if t.id == "write-file")


class Watch(threading.Thread):
    """Samples the attacker uid's process count on the host while the attack runs."""

    def __init__(self, uid: int) -> None:
        super().__init__(daemon=True)
        self.uid, self.peak, self.stop = uid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, len(pids_of_uid(self.uid)))
            time.sleep(0.01)


def play(attack: list[str], canary: Path, during=None):
    """Run ``attack`` in one episode while the victim works in another; returns what the checks need."""

    async def go():
        victim, attacker = TerminalEnv(VICTIM_CFG), TerminalEnv(CFG)
        try:
            await asyncio.gather(victim.reset(TASK), attacker.reset(TASK))
            victim.sandbox.write_file("secret.txt", SECRET)
            uid, sb = attacker.sandbox.uid, attacker.sandbox
            watch = Watch(uid)
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
            leftovers = leftover_pids(uid, sb.shell_pids)
            extra = during(sb) if during else None
            after = await attacker.step(ToolCall("bash", {"command": "echo after"}))
            return dict(victim=victim_obs.text, attack=[o.text for o in attack_obs], after=after.text, uid=uid,
                        leftovers=leftovers, peak=watch.peak, extra=extra)
        finally:
            await asyncio.gather(victim.close(), attacker.close())

    result = asyncio.run(go())
    assert result["victim"] == f"20\n{SECRET}\n[exit code: 0]", result["victim"]
    assert canary.read_text() == "host canary\n"
    assert result["leftovers"] == set(), "processes outlived the command"
    assert leftover_pids(result["uid"]) == set(), "processes outlived the episode"
    for text in result["attack"]:
        assert SECRET not in text and len(text) < 2 * CFG.max_output_bytes + 600, text[:500]
    assert result["after"] == "after\n[exit code: 0]", result["after"]
    return result


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.txt"
    path.write_text("host canary\n")
    os.chmod(tmp_path, 0o755)
    return path


def test_fork_bomb(canary):
    r = play([":(){ :|:& };:"], canary)
    assert r["peak"] <= CFG.max_processes + 3, r["peak"]  # the pids cgroup (+ bwrap, its init, the shell)
    assert "[timed out" in r["attack"][0] or "exit code" in r["attack"][0]


def test_memory_bomb(canary):
    bomb = "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'; echo rc=$?"
    r = play([bomb], canary, during=lambda sb: sb.cgroup.oom_kills() if sb.cgroup else None)
    assert "rc=137" in r["attack"][0] or "MemoryError" in r["attack"][0], r["attack"][0]
    assert r["extra"] is None or r["extra"] >= 1  # the kernel OOM-killed inside the episode's cgroup


def test_infinite_loop_in_the_shell_itself(canary):
    r = play(["while :; do :; done"], canary)
    assert "[timed out after 3 s" in r["attack"][0] and "the shell ended" in r["attack"][0]


def test_100_mb_of_output(canary):
    r = play(["head -c 100000000 /dev/zero | tr '\\0' x; head -c 100000000 /dev/zero >&2"], canary)
    assert "bytes dropped" in r["attack"][0]


def test_network_egress(canary):
    cmd = ("curl -sS -m 2 http://pypi.org >/dev/null 2>&1 && echo EGRESS; "
           "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\" 2>/dev/null && echo EGRESS; "
           "(echo > /dev/tcp/127.0.0.1/22) 2>/dev/null && echo LOOPBACK; ip -o link 2>/dev/null | grep -v ' lo:' ; true")
    r = play([cmd], canary)
    assert "EGRESS" not in r["attack"][0] and "LOOPBACK" not in r["attack"][0], r["attack"][0]


def test_writes_outside_the_work_dir(canary):
    cmd = (f"for p in {canary} {canary.parent}/new /etc/x /usr/x /x /proc/x ../x {SANDBOX_ROOT}/x; do "
           "echo pwned > $p 2>/dev/null && echo WROTE $p; done; true")
    r = play([cmd], canary)
    assert "WROTE" not in r["attack"][0].replace("WROTE ../x", "")  # ../x from /work is /x: read-only too
    assert not (canary.parent / "new").exists() and not (SANDBOX_ROOT / "x").exists()


def test_reading_another_episodes_files(canary):
    cmd = ("cat @VICTIM_WORK@/secret.txt 2>&1; "
           f"ls {SANDBOX_ROOT} 2>&1; cat /proc/*/root/work/secret.txt 2>&1; "
           "find / -name secret.txt -not -path '/proc/*' 2>/dev/null; true")
    play([cmd], canary)  # play checks that the secret appears in no observation


def test_kill_everything(canary):
    r = play(["kill -9 -1; echo survived", "sleep 100 & bash -c 'kill -9 -1'; echo unreachable"], canary)
    assert "survived" in r["attack"][0]  # from the shell itself: nothing else of its pid namespace to kill
    assert "unreachable" not in r["attack"][1] and "the shell ended" in r["attack"][1]  # from a child: the shell dies


def test_background_processes(canary):
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
    assert b"pwned" not in Path("/etc/passwd").read_bytes()


def test_filling_the_disk(canary):
    free_before = shutil.disk_usage("/").free
    cmd = ("for i in $(seq 200); do head -c 8M /dev/zero > f$i 2>/dev/null || break; done; "
           "for i in $(seq 200); do head -c 8M /dev/zero > /tmp/f$i 2>/dev/null || break; done; du -sm /work /tmp")
    r = play([cmd], canary, during=lambda sb: sum(f.stat().st_size for f in sb.workdir.iterdir()))
    assert r["extra"] <= CFG.max_disk_bytes  # the tmpfs bound on /work
    assert free_before - shutil.disk_usage("/").free < 512 << 20  # the host disk did not fill (other work runs too)
