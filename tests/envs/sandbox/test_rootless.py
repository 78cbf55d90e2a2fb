"""Rootless bwrap as an ordinary user, as on a shared Slurm node (``envs.sandbox.mode=rootless``).

The test process is root; each check drops to uid 65534 (``conftest.Unprivileged``) and, where
it says so, first hands that uid a cgroup subtree it created, as Slurm does for a job. The
contract suite (test_contract.py) and the rootless attack suite (test_attacks_rootless.py) run
as that uid in a pytest of their own; the start-up probe is checked with user namespaces
really disabled (``user.max_user_namespaces=0`` in a user namespace of the test's own); and
the default terminal job trains as that uid. Default tier: the attack suite in a delegated
cgroup, the training run, the probe; slow: the contract suite with and without a cgroup and
the attack suite on rlimits alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jointrl.envs.sandbox.rootless import resolve_mode, userns_nproc
from jointrl.envs.sandbox.userns import SYSCTLS, probe, sysctl_values

WORKTREE = Path(__file__).resolve().parents[3]  # the repository root that `import jointrl` resolves to
WHY = ("needs root to drop to another uid" if os.geteuid() != 0 else
       next((f"needs {t}" for t in ("bwrap", "setpriv", "unshare", "nsenter") if shutil.which(t) is None), None))
needs_rootless = pytest.mark.skipif(WHY is not None, reason=f"rootless tests: {WHY}")


def _pytest_as_user(u, path: str, delegate: bool, timeout: int = 900, select: str = "not docker") -> str:
    """Run one test file (its tests matching ``select``) as the uid; assert every collected test passed
    (none skipped) and return the output."""
    argv = u.argv([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", select,
                   str(WORKTREE / path)], delegate=delegate)
    r = subprocess.run(argv, env=u.env(JOINTRL_TEST_DELEGATED="1" if delegate else "0"), cwd=u.home,
                       capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", out) and not re.search(r"\d+ (skipped|failed|error)", out), out[-3000:]
    return out


@needs_rootless
@pytest.mark.slow
@pytest.mark.parametrize("delegate", [False, True], ids=["rlimits", "cgroup"])
def test_the_contract_suite_passes_as_an_ordinary_user(unprivileged, delegate):
    _pytest_as_user(unprivileged, "tests/envs/sandbox/test_contract.py", delegate)


@needs_rootless
@pytest.mark.parametrize("delegate", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["cgroup", "rlimits"])
def test_the_attack_suite_is_contained_as_an_ordinary_user(unprivileged, delegate):
    _pytest_as_user(unprivileged, "tests/envs/sandbox/test_attacks_rootless.py", delegate)


def test_auto_mode_is_rootless_exactly_when_not_root():
    assert resolve_mode("auto") == (os.geteuid() != 0)
    assert resolve_mode("rootless") and not resolve_mode("root")
    with pytest.raises(ValueError, match="envs.sandbox.mode"):
        resolve_mode("sudo")


def test_rlimit_nproc_is_per_user_namespace_from_linux_5_14():
    assert userns_nproc("5.14.0-1") and userns_nproc("6.18.44-fc") and not userns_nproc("5.10.0-21-amd64")


def test_the_probe_passes_where_bwrap_can_start():
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap")
    assert probe() is None
    assert probe("no-such-bwrap") == "sandbox: 'no-such-bwrap' is not installed (apt-get install bubblewrap), " \
                                     "so no episode can start"


def test_sysctl_values_reads_each_knob_and_says_absent(tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "max_user_namespaces").write_text("0\n")
    assert sysctl_values(tmp_path) == ("kernel.unprivileged_userns_clone=absent, user.max_user_namespaces=0, "
                                       "kernel.apparmor_restrict_unprivileged_userns=absent")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("unshare") is None,
                    reason="needs root (to write user.max_user_namespaces in a namespace of its own), bwrap, unshare")
def test_without_user_namespaces_the_run_stops_before_ray_with_one_line(tmp_path):
    """``user.max_user_namespaces=0`` in a user namespace of the test's own: bwrap cannot nest one."""
    out_dir = tmp_path / "run"
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    argv = ["unshare", "--user", "--map-root-user", "--", "/bin/sh", "-c", script, "sh",
            sys.executable, "-m", "jointrl.rl.train", f"output_dir={out_dir}", "envs.sandbox.mode=rootless"]
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode != 0, lines[-20:]
    assert lines[-1].startswith("sandbox: bwrap cannot create an unprivileged user namespace here"), lines[-20:]
    for name, _ in SYSCTLS:
        assert name in lines[-1]
    assert "user.max_user_namespaces=0" in lines[-1]  # the value it read, in that namespace
    # stopped before Ray and before train() wrote anything (Hydra itself makes the dir)
    assert not (out_dir / "config.yaml").exists() and not any("ray" in x.lower() for x in lines[:-1]), lines
    assert time.monotonic() - t0 < 120


# The C++ ops (DeepSpeed's CPU communication op, jointrl's CPU kernels) compiled for the test uid once
# and kept, like root's ~/.cache: seeded from root's cache, so later runs compile nothing.
UID_CACHE = Path("/var/tmp/jointrl-test-uid-cache")


def _uid_cache(uid: int) -> Path:
    """Root's compiled ops copied for ``uid``: whatever ``UID_CACHE`` lacks is copied on each call, so
    kernels rebuilt after a source change (a new hash folder in root's cache) reach the uid too."""
    UID_CACHE.mkdir(mode=0o755, exist_ok=True)
    for name in ("torch_extensions", "jointrl"):
        src = Path(os.path.expanduser(f"~/.cache/{name}"))
        if src.is_dir():
            shutil.copytree(src, UID_CACHE / name, symlinks=True, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.lock", "*.tmp-*"))
    (UID_CACHE / "torch_extensions").mkdir(exist_ok=True)
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(UID_CACHE)], check=True)
    return UID_CACHE


@needs_rootless
@pytest.mark.timeout(1800)
def test_the_default_terminal_job_trains_as_an_ordinary_user(unprivileged):
    """``python -m jointrl.rl.train`` (2 steps) as uid 65534 in a delegated cgroup: every episode scores.

    About 40 s here once the uid's C++ ops are compiled (``UID_CACHE``); the first run on a
    machine compiles them (minutes), as the first root run does for root's cache.
    """
    u = unprivileged
    out = u.home / "run"
    cache = _uid_cache(u.uid)
    cmd = [sys.executable, "-m", "jointrl.rl.train", f"output_dir={out}", "algo.total_steps=2", "algo.prompts_per_step=2",
           "algo.group_size=2", "envs.num_workers=1", "rollout.max_tokens_per_turn=48", "algo.max_refill_attempts=1"]
    env = u.env(DS_ACCELERATOR="cpu", WANDB_SILENT="true", PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(cache),
                TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"), RAY_TMPDIR=str(u.short))
    r = subprocess.run(u.argv(cmd, delegate=True), env=env, cwd=u.home, capture_output=True, text=True, timeout=1700)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    steps = re.findall(r"^step +\d+ \|.*$", text, re.M)
    assert len(steps) == 2, text[-4000:]
    for line in steps:
        print(line)
        assert re.search(r"env_err 0\b", line), line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_run_whose_episodes_cannot_start_stops_at_its_first_step(tmp_path):
    """A rootfs that passes the start-up check but holds no working system: every episode is an env_error."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr" / "bin").mkdir(parents=True)
    (rootfs / "usr" / "bin" / "bash").write_text("not a shell\n")
    (rootfs / "etc").mkdir()
    cmd = [sys.executable, "-m", "jointrl.rl.train", f"output_dir={tmp_path / 'run'}", "algo.total_steps=3",
           "algo.prompts_per_step=2", "algo.group_size=2", "envs.num_workers=1", "rollout.max_tokens_per_turn=48",
           "algo.max_refill_attempts=1", f"envs.sandbox.rootfs={rootfs}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "step 1: all 4 episodes ended in env_error, so no learner step can run" in out, out[-4000:]
    assert not re.search(r"^step +\d+ \|", out, re.M), out[-4000:]  # no step was logged


@needs_rootless
def test_the_cad_reward_builder_holds_as_an_ordinary_user(unprivileged):
    """The warm CAD builder's isolation checks (a forked build leaves nothing, cannot reach the server)
    in a rootless sandbox, as on a Slurm node: cleaning and seccomp must not lean on root's uid per
    sandbox. The whole file as that uid: slow tier (test_builder.py's docstring)."""
    if not os.path.exists("/opt/jointrl/venvs/cad/bin/python"):
        pytest.skip("needs the CAD tool venv (.ci/setup.d/cad.sh)")
    out = _pytest_as_user(unprivileged, "tests/envs/cad/test_builder.py", delegate=True,
                          select="leaves_nothing or cannot_reach or carries_over")
    assert "3 passed" in out, out[-2000:]
