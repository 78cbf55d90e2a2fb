"""Scale-out end to end (slow tier): 2 learner ranks + 2 rollout workers + 4 env workers in sync
and async mode; SIGKILL of an env worker, a rollout worker or the driver mid-run loses and
duplicates no trajectory; a resumed run reproduces the next step's batch exactly.

Every run is ``python -m jointrl.rl.train`` in its own process group; the driver prints the
pids of its actors (``processes: ...``), which is how a test picks the process to kill."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCALE = ["learner.num_ranks=2", "rollout.num_workers=2", "envs.num_workers=4"]


def _train(out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jointrl.rl.train", f"output_dir={out}", "algo.total_steps=3", "algo.prompts_per_step=2",
           "algo.group_size=2", "checkpoint_every=1", "rollout.max_tokens_per_turn=48", "algo.max_refill_attempts=1",
           *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for(proc: subprocess.Popen, needle: str, lines: list[str]) -> str:
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return line
    proc.wait()
    pytest.fail(f"run ended (rc {proc.returncode}) before printing {needle!r}:\n" + "".join(lines[-60:]))


def _finish(proc: subprocess.Popen, lines: list[str]) -> str:
    out, _ = proc.communicate(timeout=1500)
    log = "".join(lines) + out
    assert proc.returncode == 0, log[-5000:]
    return log


def _pids(line: str) -> dict[str, list[int]]:
    m = re.search(r"learner ranks \[(.*)\] rollout workers \[(.*)\] env workers \[(.*)\]", line)
    return {k: [int(x) for x in g.split(",")] for k, g in zip(("learner", "rollout", "env"), m.groups())}


def _rows(out: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (out / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def _check_complete(out: Path, steps=(1, 2, 3), group_size: int = 2) -> None:
    """Every launched group has exactly group_size trajectories (none lost, none twice) and none
    is an env_error: the failure was absorbed by a retry."""
    for step in steps:
        rows = _rows(out, step)
        counts = Counter(r["group_id"] for r in rows)
        assert set(counts.values()) == {group_size}, (step, counts)
        assert all(r["finish_reason"] != "env_error" for r in rows), step


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_learners_two_rollout_workers_four_env_workers(tmp_path, mode):
    # the default run's batch (4 prompts x 4, 96 tokens a turn) has groups whose rewards differ: the learners train
    proc = _train(tmp_path, *SCALE, f"rollout.mode={mode}", "algo.prompts_per_step=4", "algo.group_size=4",
                  "rollout.max_tokens_per_turn=96")
    lines: list[str] = []
    pids = _pids(_wait_for(proc, "processes:", lines))
    assert [len(pids[k]) for k in ("learner", "rollout", "env")] == [2, 2, 4]
    log = _finish(proc, lines)
    steps = [x for x in log.splitlines() if x.startswith("step ")]
    assert [int(x.split()[1]) for x in steps] == [1, 2, 3]
    assert any("loss +0.0000" not in x for x in steps), "the learner ranks never trained"
    _check_complete(tmp_path, group_size=4)
    versions = {v for r in _rows(tmp_path, 2) for v, m in zip(r["policy_version"], r["loss_mask"]) if m}
    if mode == "sync":
        assert versions == {1}  # step 2 ran only on the weights pushed after step 1
    else:
        assert 0 in versions  # step 2's rollouts ran while the learner trained on step 1


@pytest.mark.parametrize("role,transport", [("env", "ray"), ("rollout", "ray"), ("rollout", "dist")])
def test_sigkill_of_a_worker_mid_step_loses_no_trajectory(tmp_path, role, transport):
    # episodes of several seconds; with dist the push rebuilds its groups over the restarted worker
    proc = _train(tmp_path, *SCALE, "rollout.max_tokens_per_turn=256", f"rollout.weight_transport={transport}")
    lines: list[str] = []
    pids = _pids(_wait_for(proc, "processes:", lines))
    _wait_for(proc, "step    1", lines)  # step 2's rollouts start now
    os.kill(pids[role][0], signal.SIGKILL)
    log = _finish(proc, lines)
    assert [int(x.split()[1]) for x in log.splitlines() if x.startswith("step ")] == [1, 2, 3]
    _check_complete(tmp_path)
    if role == "rollout":  # its episodes were re-run on the other worker
        assert any(r["env_retries"] for s in (2, 3) for r in _rows(tmp_path, s)), "no episode was re-run"


def test_driver_sigkill_resumes_with_the_same_next_batch(tmp_path):
    """Bit-exact replay needs decoding whose float sums do not depend on which requests share a
    batch, so the engine runs with ``rollout.batch_invariant=true`` (continuous batching kept:
    rl/rollout/model_runner.py). Under test: data order, step count, per-request sampling seeds
    and the policy version (weights) of the next step, down to every log-prob's bits (without
    the option, in one such run the tokens happened to agree but 423 of 28,508 log-prob entries
    did not: float sums there follow which requests share a batch)."""
    exact = ("rollout.backend=engine", "rollout.batch_invariant=true", "rollout.num_workers=2", "algo.prompts_per_step=4")
    whole = _train(tmp_path / "whole", *exact)
    _finish(whole, [])
    killed = _train(tmp_path / "killed", *exact)
    lines: list[str] = []
    _wait_for(killed, "checkpoint step 1", lines)
    latest, deadline = tmp_path / "killed" / "checkpoints" / "latest", time.monotonic() + 300
    while not (latest.is_file() and latest.read_text() == "step_1"):  # written in the background, then committed
        assert time.monotonic() < deadline and killed.poll() is None, "".join(lines[-60:])
        time.sleep(0.02)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = _train(tmp_path / "killed", "resume=true", *exact)
    log = _finish(resumed, [])
    assert "resuming after step 1" in log

    def batch(out):
        return sorted((r["group_id"], r["token_ids"], r["logprobs"], r["reward"]) for r in _rows(out, 2))

    assert batch(tmp_path / "killed") == batch(tmp_path / "whole")  # same data order, RNG, policy version


def test_run_resumes_with_another_learner_layout(tmp_path):
    """A run checkpointed by 2 learner ranks with experts sharded (ep_size 2) resumes on 1 rank
    through ``jointrl train resume=true``: each rank's part (rl/checkpoint_format.py)
    restores weights and Adam moments, and the run finishes its steps with nothing lost."""
    first = _train(tmp_path, "learner.num_ranks=2", "learner.ep_size=2", "learner.zero_stage=2",
                   "rollout.num_workers=1", "envs.num_workers=2", "algo.total_steps=1")
    _finish(first, [])
    assert (tmp_path / "checkpoints").exists()
    resumed = _train(tmp_path, "resume=true", "learner.num_ranks=1", "learner.ep_size=1",
                     "rollout.num_workers=1", "envs.num_workers=2", "algo.total_steps=2")
    log = _finish(resumed, [])
    assert "resuming after step 1" in log
    assert [int(x.split()[1]) for x in log.splitlines() if x.startswith("step ")] == [2]
    _check_complete(tmp_path, steps=(1, 2))
