"""The default run end to end, killed after a checkpoint and resumed (real Ray, DeepSpeed, bwrap)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _train(out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jointrl.rl.train", f"output_dir={out}", "algo.total_steps=3",
           "algo.prompts_per_step=2", "algo.group_size=2", "checkpoint_every=1", "envs.num_workers=1",
           "rollout.max_tokens_per_turn=48", "algo.max_refill_attempts=1", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for(proc: subprocess.Popen, needle: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
    proc.wait()
    pytest.fail(f"run ended (rc {proc.returncode}) before printing {needle!r}:\n" + "".join(lines[-40:]))


def test_run_killed_after_checkpoint_resumes_at_next_step(tmp_path):
    first = _train(tmp_path)
    _wait_for(first, "checkpoint step 1")
    latest, deadline = tmp_path / "checkpoints" / "latest", time.monotonic() + 300
    while not (latest.is_file() and latest.read_text() == "step_1"):  # written in the background, then committed
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)  # no clean shutdown: as if the node died
    first.wait()
    assert not (tmp_path / "trajectories" / "step_000003.jsonl").exists()

    second = _train(tmp_path, "resume=true")
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-4000:]
    assert "resuming after step 1" in out
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    assert steps == [2, 3], out[-4000:]
    # each step line carries reward, tool-call error rate, tokens/s and the time of every stage
    line = next(line for line in out.splitlines() if line.startswith("step    3"))
    for field in ("reward", "tool_err", "tok/s", "rollout", "learner", "push"):
        assert field in line

    rows = [json.loads(x) for x in (tmp_path / "trajectories" / "step_000003.jsonl").read_text().splitlines()]
    # 2 prompts x group of 2, plus refill groups (one round: algo.max_refill_attempts=1) sampled only while
    # fewer than 2 groups had rewards that differ
    gids = {r["group_id"] for r in rows}
    assert len(rows) == 2 * len(gids)
    refills = {g for g in gids if re.match(r"s3-r1-g", g)}
    assert len(gids - refills) == 2
    informative = {g for g in gids if len({r["reward"] for r in rows if r["group_id"] == g}) > 1}
    assert not refills or len(informative - refills) < 2
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"]) == len(r["policy_version"])
        assert r["domain"] == "terminal" and r["finish_reason"] in ("stop", "length", "tool_limit", "context_overflow")
        # the rollout ran the weights pushed after step 2
        assert {v for v, m in zip(r["policy_version"], r["loss_mask"]) if m} == {2}
    # the same step as parquet, read by Hugging Face datasets: the JSONL's tokens, masks and rewards
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "trajectories" / "step_000003.parquet"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(rows)
    for got, r in zip(ds, rows):
        assert (got["token_ids"], got["loss_mask"], got["reward"]) == (r["token_ids"], r["loss_mask"], r["reward"])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(list(r.glob("*.wandb")) for r in runs)


@pytest.mark.slow
def test_colocated_own_engine_sleeps_through_each_step_and_samples_as_if_it_never_slept(tmp_path):
    """cluster.colocate=true with the own engine: after each step's rollouts the driver puts it to sleep
    (its KV pool freed: the worker measures 0 bytes of it still alive; weights to the host), the learner
    steps, the push lands in the sleeping weights, and the engine wakes with a fresh pool. Decoding is
    batch invariant, so the colocated run's trajectories -- step 2's sampled on step 1's push after a
    sleep and a wake -- equal, token and log-prob bits, those of the same run whose engine never slept
    (rl/rollout/test_worker.py checks a woken worker against a fresh engine given only the push)."""
    common = ("algo.total_steps=2", "algo.group_size=4", "algo.max_refill_attempts=2", "checkpoint_every=0",
              "rollout.batch_invariant=true", "logger.wandb_mode=disabled")
    logs = {}
    for colocate in (True, False):
        proc = _train(tmp_path / str(colocate), *common, f"cluster.colocate={str(colocate).lower()}",
                      *(["rollout.colocate_offload_weights=true"] if colocate else []))
        out, _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, out[-5000:]
        logs[colocate] = out
    asleep = re.findall(r"rollout worker 0: engine asleep during the learner step \(KV pool of (\d+) bytes freed, "
                        r"(\d+) still held; weights on cpu\)", logs[True])
    assert len(asleep) == 1 and int(asleep[0][0]) > 0 and asleep[0][1] == "0", logs[True][-3000:]
    assert "asleep" not in logs[False]
    assert re.search(r"step 1: mismatch KL", logs[True]), "no learner step at step 1: the push changed nothing"

    def batch(out: Path, step: int):
        rows = [json.loads(x) for x in (out / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        return sorted((r["group_id"], r["token_ids"], r["logprobs"], r["policy_version"]) for r in rows)

    for step in (1, 2):
        colocated = batch(tmp_path / "True", step)
        assert {v for r in colocated for v in r[3]} == {-1, step - 1}  # -1: tokens the policy did not sample
        assert colocated == batch(tmp_path / "False", step)
