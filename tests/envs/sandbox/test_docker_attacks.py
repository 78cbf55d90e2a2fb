"""The attack suite against the docker backend: each attack from inside one episode's container
while a victim episode works in another (real daemon, the terminal image, uid 1000 inside).

Every case checks what ``test_attacks.py`` checks for bwrap: the **host** is unharmed (a canary
file, the host's disk), the **victim** finished its command with the right output, the
attacker's **observation** is bounded and holds none of the victim's secret, nothing of the
attack is left running in its container after the command, and its next command runs normally.
Skipped with the reason where no daemon is reachable. Default tier: fork bomb, network and host
files, background processes, disk; the other cases (~6 s each) are ``-m slow``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from jointrl.envs.base import ToolCall
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.docker import unavailable_reason
from jointrl.envs.terminal import TerminalEnv, load_tasks

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"docker: {unavailable_reason()}")

CFG = SandboxConfig(timeout_s=3, max_output_bytes=4096, max_memory_bytes=256 << 20, max_disk_bytes=64 << 20,
                    max_file_bytes=32 << 20, max_processes=64)
SECRET = "victim-secret-4f1d2c"
VICTIM_CMD = "for i in $(seq 20); do echo $i >> count.txt; sleep 0.05; done; wc -l < count.txt; cat secret.txt"
TASK = next(t for t in load_tasks() if t.id == "write-file")
LEFT = "ps -eo pid=,comm= | awk '$1 != 1 && $2 !~ /^(sh|ps|awk|wc)$/' | wc -l"  # processes but pid 1 and this count


def play(attack: list[str], canary: Path, during=None):
    async def go():
        victim, attacker = TerminalEnv(SandboxConfig(timeout_s=30), backend="docker"), TerminalEnv(CFG, backend="docker")
        try:
            await asyncio.gather(victim.reset(TASK), attacker.reset(TASK))
            victim.sandbox.write_file("secret.txt", SECRET)

            async def attack_all():
                return [await attacker.step(ToolCall("bash", {"command": c})) for c in attack]

            victim_obs, attack_obs = await asyncio.gather(victim.step(ToolCall("bash", {"command": VICTIM_CMD})),
                                                          attack_all())
            left = attacker.sandbox._exec(["sh", "-c", LEFT], 10.0, {}, user="0").stdout.strip()
            extra = during(attacker.sandbox) if during else None
            after = await attacker.step(ToolCall("bash", {"command": "echo after"}))
            return dict(victim=victim_obs.text, attack=[o.text for o in attack_obs], after=after.text, left=left,
                        extra=extra)
        finally:
            await asyncio.gather(victim.close(), attacker.close())

    r = asyncio.run(go())
    assert r["victim"] == f"20\n{SECRET}\n[exit code: 0]", r["victim"]
    assert canary.read_text() == "host canary\n"
    assert r["left"] == "0", "processes outlived the command"
    for text in r["attack"]:
        assert SECRET not in text and len(text) < 2 * CFG.max_output_bytes + 600, text[:500]
    assert r["after"] == "after\n[exit code: 0]", r["after"]
    return r


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.txt"
    path.write_text("host canary\n")
    os.chmod(tmp_path, 0o755)
    return path


def test_fork_bomb(canary):
    r = play([":(){ :|:& };:"], canary)
    assert "[timed out" in r["attack"][0] or "exit code" in r["attack"][0]


@pytest.mark.slow
def test_memory_bomb(canary):
    r = play(["python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'; echo rc=$?"], canary)
    assert "rc=137" in r["attack"][0] or "MemoryError" in r["attack"][0], r["attack"][0]


@pytest.mark.slow
def test_100_mb_of_output(canary):
    r = play(["head -c 100000000 /dev/zero | tr '\\0' x; head -c 100000000 /dev/zero >&2"], canary)
    assert "bytes dropped" in r["attack"][0]


def test_network_egress_and_host_files(canary):
    cmd = (f"python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\" 2>/dev/null && echo EGRESS; "
           "(echo > /dev/tcp/172.17.0.1/2375) 2>/dev/null && echo HOST; "
           f"cat {canary} 2>/dev/null && echo CANARY; echo pwned > {canary} 2>/dev/null; "
           "for p in /etc/x /usr/x /x; do echo pwned > $p 2>/dev/null && echo WROTE $p; done; true")
    r = play([cmd], canary)
    for bad in ("EGRESS", "HOST", "CANARY", "WROTE"):
        assert bad not in r["attack"][0], r["attack"][0]


@pytest.mark.slow
def test_reading_another_episodes_files_and_killing_everything(canary):
    cmd = "cat /proc/*/root/work/secret.txt 2>&1; find / -name secret.txt -not -path '/proc/*' 2>/dev/null; kill -9 -1; true"
    play([cmd, "sleep 100 & bash -c 'kill -9 -1'; echo unreachable"], canary)  # play checks the secret and the after


def test_background_processes(canary):
    cmd = "sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 & disown -a; (sleep 1003 &); echo started"
    r = play([cmd, "sleep 0.2; ps -eo comm= | grep -c '^sleep$' || true"], canary)
    assert r["attack"][1].startswith("0\n")


@pytest.mark.slow
def test_symlink_escape_through_the_file_tools(canary):
    def file_tools(sb):
        refused = 0
        for path in ("root/etc/passwd", "pw", "d/up/etc/passwd", "/work/root/etc/passwd", "/etc/passwd"):
            for op in (lambda p: sb.read_file(p), lambda p: sb.write_file(p, "pwned")):
                try:
                    op(path)
                except ValueError:
                    refused += 1
        return refused

    r = play(["ln -s / root; ln -s /etc/passwd pw; mkdir d && ln -s ../.. d/up; true"], canary, during=file_tools)
    assert r["extra"] == 10


def test_filling_the_disk(canary):
    free_before = shutil.disk_usage("/").free
    cmd = ("for i in $(seq 200); do head -c 8M /dev/zero > f$i 2>/dev/null || break; done; "
           "for i in $(seq 200); do head -c 8M /dev/zero > /tmp/f$i 2>/dev/null || break; done; du -sm /work /tmp")
    r = play([cmd], canary)
    work, tmp = (int(line.split()[0]) for line in r["attack"][0].splitlines()[:2])
    assert work <= 64 and tmp <= 64, r["attack"][0]  # the tmpfs bounds
    assert free_before - shutil.disk_usage("/").free < 512 << 20
