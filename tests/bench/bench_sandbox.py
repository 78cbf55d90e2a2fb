"""Sandbox benchmark: cold start (with where it goes) and persistent-shell commands against a
plain subprocess, and 64 concurrent episodes. Not collected by pytest; run as
``python tests/bench/bench_sandbox.py`` (root + bubblewrap; docker rows where a daemon answers). Prints one table; ratios are
against ``subprocess.run(["true"])`` measured in the same run, and the start measurements are
interleaved round by round with it, so a loaded host moves both sides alike.

Targets (issue #7): cold sandbox start <= 3x the plain subprocess, a persistent-shell command
<= 1x, 64 concurrent episodes on 2 cores with no failure. They are reported, not asserted.
The "where a cold start goes" rows time each step alone (setup outside the timing): they
explain the cold start, they do not add up to it exactly (steps overlap: the cgroup move
runs while bwrap sets up its namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Callable

from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox, sandbox_root
from jointrl.envs.sandbox.bwrap_argv import bwrap_argv
from jointrl.envs.sandbox.cgroups import Cgroup
from jointrl.envs.sandbox.disk import mount_tmpfs, unmount
from jointrl.envs.sandbox.pool import SandboxPool
from jointrl.envs.sandbox.uids import acquire_uid
from jointrl.envs.terminal import load_policy, load_tasks, replay
from jointrl.rewards import Episode, combine

Timed = Callable[[], float]  # runs once, returns the seconds of its timed part


def timed(fn: Callable[[], object]) -> Timed:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def interleaved(cases: dict[str, Timed], rounds: int) -> dict[str, float]:
    """Median ms of each case, the cases taking turns round by round (load spikes hit all alike)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            times[name].append(case())
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def cold_start(config: SandboxConfig | None = None) -> float:
    t0 = time.perf_counter()
    sb = BwrapSandbox(config)
    took = time.perf_counter() - t0
    sb.close()
    return took


def close_only() -> float:
    sb = BwrapSandbox()
    t0 = time.perf_counter()
    sb.close()
    return time.perf_counter() - t0


class Parts:
    """The steps of a cold start, each timed alone, on one leased uid held for the whole run."""

    def __init__(self) -> None:
        self.cfg = SandboxConfig()
        self.root = sandbox_root()
        # A leased uid and a work dir for the bare bwrap; no cgroup of its own (the parts make one).
        self.box = BwrapSandbox(SandboxConfig(use_cgroup=False), shell=False)
        self.mnt = self.box.private_dir / "bench-mnt"
        os.mkdir(self.mnt)

    def lease(self) -> float:
        t0 = time.perf_counter()
        lease = acquire_uid(self.cfg.uid_range, self.root / ".locks")
        took = time.perf_counter() - t0
        lease.release(clean=True)  # nothing ran under it
        return took

    def tmpfs(self) -> float:
        t0 = time.perf_counter()
        why = mount_tmpfs(self.mnt, self.cfg.max_disk_bytes, self.box.uid)
        took = time.perf_counter() - t0
        assert why is None, why
        unmount(self.mnt)
        return took

    def cgroup(self) -> float:
        t0 = time.perf_counter()
        cg = Cgroup.create(self.box.uid, self.cfg.max_memory_bytes, self.cfg.max_processes)
        took = time.perf_counter() - t0
        if cg is not None:
            cg.remove()
        return took

    def cgroup_move(self) -> float:
        """Moving one process into a fresh v1 cgroup (the kernel may wait an RCU grace period)."""
        cg = Cgroup.create(self.box.uid, self.cfg.max_memory_bytes, self.cfg.max_processes)
        if cg is None:
            return 0.0
        proc = subprocess.Popen(["sleep", "60"])
        try:
            t0 = time.perf_counter()
            cg.add(proc.pid)
            return time.perf_counter() - t0
        finally:
            proc.kill()
            proc.wait()
            cg.remove()

    def bare_bwrap(self) -> float:
        """bwrap with the sandbox's namespaces and mounts running ``true`` as the uid: no cgroup,
        no block-fd round trip, no shell."""
        argv = bwrap_argv(self.cfg, self.box.workdir, [], self.box.env, ["/bin/true"], status_fd=None, block_fd=None)
        u = self.box.uid
        return timed(lambda: subprocess.run(argv, user=u, group=u, extra_groups=[], env={"PATH": "/usr/bin:/bin"},
                                            check=True))()

    def close(self) -> None:
        self.box.close()


def start_rows(rounds: int) -> tuple[float, list[tuple[str, float]]]:
    """-> (plain ms, [(row, ms)]) for the cold start and its parts, interleaved with the plain subprocess."""
    parts = Parts()
    no_cgroup = SandboxConfig(use_cgroup=False)
    try:
        ms = interleaved({
            "plain": timed(lambda: subprocess.run(["true"])),
            "cold sandbox start (uid, tmpfs, cgroup, shell ready)": cold_start,
            "  same without a cgroup (use_cgroup=False)": lambda: cold_start(no_cgroup),
            "  part: uid lease": parts.lease,
            "  part: tmpfs mount of /work": parts.tmpfs,
            "  part: cgroup create": parts.cgroup,
            "  part: first move into the cgroup": parts.cgroup_move,
            "  part: bare bwrap, same namespaces + mounts, `true`": parts.bare_bwrap,
            "  part: bare bwrap, namespaces only (root, --ro-bind / /)": timed(lambda: subprocess.run(
                ["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "/bin/true"], check=True)),
            "  part: plain bash --noprofile --norc -c true": timed(lambda: subprocess.run(
                ["bash", "--noprofile", "--norc", "-c", "true"])),
            # Floors of any sandbox with per-episode namespaces, bwrap or not:
            "  floor: a new network namespace alone (unshare -n true)": timed(lambda: subprocess.run(
                ["unshare", "-n", "true"], check=True)),
            "  floor: every namespace + fork + bash -c true (unshare)": timed(lambda: subprocess.run(
                ["unshare", "-Urnmpiu", "-C", "-f", "bash", "--noprofile", "--norc", "-c", "true"], check=True)),
            "sandbox close": close_only,
        }, rounds)
    finally:
        parts.close()
    plain = ms.pop("plain")
    return plain, list(ms.items())


def per_call_ms(fn: Callable[[], object], n: int) -> float:
    return interleaved({"x": timed(fn)}, n)["x"]


def pool_acquire_ms(n: int) -> float:
    """A reset from the warm pool: a started sandbox handed out with a task's files copied in."""
    files = next(t.root / "environment" for t in load_tasks() if t.id == "permissions")  # the largest, 32 KB
    pool = SandboxPool(SandboxConfig(), size=4)
    times = []
    try:
        for _ in range(n):
            pool.warm(timeout=60)
            t0 = time.perf_counter()
            sb = pool.acquire(files)
            times.append(time.perf_counter() - t0)
            sb.close()
    finally:
        pool.close()
    return statistics.median(times) * 1e3


def concurrent_episodes(n: int) -> tuple[float, int, int]:
    """``n`` oracle episodes at once (tasks cycled), each scored by its verifier. -> (wall s, failures, wrong scores)."""
    tasks = load_tasks(backend="bwrap")
    config = SandboxConfig(timeout_s=120)
    pool = SandboxPool(config, size=8)

    async def one(task):
        played = await replay(task, load_policy(task, "oracle"), config, pool)
        try:
            episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)
            return (await asyncio.to_thread(combine, task.reward, task, episode)).score
        finally:
            played.final_files.discard()

    async def all_of_them():
        return await asyncio.gather(*(one(tasks[i % len(tasks)]) for i in range(n)), return_exceptions=True)

    t0 = time.perf_counter()
    try:
        results = asyncio.run(all_of_them())
    finally:
        pool.close()
    wall = time.perf_counter() - t0
    failures = sum(isinstance(r, BaseException) for r in results)
    wrong = sum(r != 1.0 for r in results if not isinstance(r, BaseException))
    for r in results:
        if isinstance(r, BaseException):
            print("failure:", repr(r)[:300])
    return wall, failures, wrong


def docker_ms(starts: int, n: int) -> dict[str, float] | None:
    """The docker backend (the terminal image): cold container start + close, a warm-pool reset,
    an emulated-shell command and a one-shot exec, interleaved with the plain subprocess.
    None where no daemon is reachable."""
    from jointrl.envs.sandbox.docker import DockerSandbox, unavailable_reason

    if unavailable_reason() is not None:
        print(f"docker rows skipped: {unavailable_reason()}")
        return None
    DockerSandbox().close()  # builds the image once, outside the timing
    out = interleaved({"plain": timed(lambda: subprocess.run(["true"])),
                       "cold": timed(lambda: DockerSandbox().close())}, starts)
    files = next(t.root / "environment" for t in load_tasks() if t.id == "permissions")  # as the bwrap row
    pool = SandboxPool(SandboxConfig(), size=4, backend="docker")
    try:
        acquired = []
        for _ in range(min(starts, 10)):
            pool.warm(timeout=120)
            t0 = time.perf_counter()
            sb = pool.acquire(files if files.is_dir() else None)
            acquired.append(time.perf_counter() - t0)
            sb.close()
    finally:
        pool.close()
    with DockerSandbox() as sb:
        cmds = interleaved({"plain": timed(lambda: subprocess.run(["true"])), "shell": timed(lambda: sb.run("true")),
                            "exec": timed(lambda: sb.exec("true"))}, n)
    return {"ref": out["plain"], "cold": out["cold"], "acquire": statistics.median(acquired) * 1e3,
            "ref_cmd": cmds["plain"], "shell": cmds["shell"], "exec": cmds["exec"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="timed calls per command measurement")
    ap.add_argument("--starts", type=int, default=30, help="rounds of cold starts (and of each part) to time")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--docker-n", type=int, default=30, help="timed calls per docker measurement (0: no docker rows)")
    args = ap.parse_args()

    print(f"load before: {os.getloadavg()[0]:.2f}")
    ref, starts = start_rows(args.starts)
    with BwrapSandbox() as sb:
        sb.run("true")
        shell = interleaved({"plain": timed(lambda: subprocess.run(["true"])),
                             "shell": timed(lambda: sb.run("true")),
                             "echo": timed(lambda: sb.run("echo hello; cd /tmp; cd /work"))}, args.n)
        one_shot = per_call_ms(lambda: sb.exec("true"), max(20, args.n // 10))
        limits = sb.limits
    acquire = pool_acquire_ms(20)
    wall, failures, wrong = concurrent_episodes(args.episodes)
    docker = docker_ms(args.docker_n, args.docker_n) if args.docker_n else None

    def row(name: str, ms: float, ref_ms: float, target: str = "", limit: float | None = None) -> tuple:
        met = "" if limit is None else ("yes" if ms <= limit * ref_ms else "no")
        return (name, f"{ms:.2f} ms", f"{ms / ref_ms:.2f}x", target, met)

    rows = [("plain subprocess.run(['true'])", f"{ref:.2f} ms", "1.00x", "", "")]
    for name, ms in starts:
        cold = name.startswith("cold")
        rows.append(row(name, ms, ref, "<= 3x" if cold else "", 3.0 if cold else None))
    rows += [
        row("warm-pool acquire + task files (reset)", acquire, ref),
        row("persistent-shell command: true", shell["shell"], shell["plain"], "<= 1x", 1.0),
        row("persistent-shell command: echo; cd; cd", shell["echo"], shell["plain"]),
        row("one-shot exec: true (fresh bwrap)", one_shot, ref),
        (f"{args.episodes} concurrent oracle episodes + verifier", f"{wall:.1f} s", "", "no failure",
         f"{failures} failed, {wrong} scored != 1"),
    ]
    if docker is not None:
        rows += [row("docker: cold container start + close", docker["cold"], docker["ref"]),
                 row("docker: warm-pool acquire + task files (reset)", docker["acquire"], docker["ref"]),
                 row("docker: emulated-shell command: true", docker["shell"], docker["ref_cmd"]),
                 row("docker: one-shot exec: true", docker["exec"], docker["ref_cmd"])]
    header = ("measurement", "median", "vs plain", "target", "met")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"limits that held: {limits}; load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
