"""The issue-37 acceptance run (slow tier): ``ray start --head --num-gpus=4 --num-cpus=8``
(logical GPUs on this CPU machine) + ``python -m jointrl.rl.train cluster=slurm`` with 2 learner
ranks and 2 rollout workers, one GPU each. The driver's placement table must show each actor on
the Ray node with one GPU of its own and its bundle's CPUs as threads; the run trains on CPU
tensors (no CUDA here, though Ray sets ``CUDA_VISIBLE_DEVICES``) and checkpoints."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_on_logical_gpus_prints_the_placement_table(tmp_path):
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    # `ray start --block` in its own session: ending it stops this head only (never `ray stop`,
    # which stops every Ray instance of the machine)
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
                             "--num-gpus=4", "--num-cpus=8", "--disable-usage-stats", "--include-dashboard=false",
                             "--block"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        probe = f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR')"
        for _ in range(60):
            if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=60).returncode == 0:
                break
            time.sleep(2)
        run = subprocess.run(
            [sys.executable, "-m", "jointrl.rl.train", "cluster=slurm", f"cluster.ray_address=127.0.0.1:{port}",
             "cluster.learner_bundle.CPU=2", "cluster.rollout_bundle.CPU=1", "cluster.env_worker_cpus=1",
             "learner.num_ranks=2", "rollout.num_workers=2", "envs.num_workers=2", f"output_dir={tmp_path}",
             "algo.total_steps=1", "algo.prompts_per_step=2", "algo.group_size=2", "rollout.max_tokens_per_turn=32",
             "algo.max_refill_attempts=0"],
            env=env, capture_output=True, text=True, timeout=900)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    table = log[log.index("placement:"):].splitlines()[2:8]
    rows = [re.match(r"(\w+ \d+)\s+(\S+ \w{8})\s+(\S+)\s+(\S+)\s+(\d+)$", line) for line in table]
    assert all(rows), table
    by_actor = {m[1]: (m[2], m[3], float(m[4]), int(m[5])) for m in rows}
    assert sorted(by_actor) == ["env 0", "env 1", "learner 0", "learner 1", "rollout 0", "rollout 1"]
    gpus = [by_actor[a][1] for a in ("learner 0", "learner 1", "rollout 0", "rollout 1")]
    assert sorted(gpus) == ["0", "1", "2", "3"], table  # one logical GPU each, none shared
    assert by_actor["env 0"][1] == by_actor["env 1"][1] == "-"
    assert [by_actor[a][2:] for a in ("learner 0", "rollout 0", "env 0")] == [(2, 2), (1, 1), (1, 1)]
    assert len({v[0] for v in by_actor.values()}) == 1  # one Ray node
    for a, (_, gpu, _, _) in by_actor.items():  # each actor's own view: CUDA_VISIBLE_DEVICES is exactly its GPU
        role, i = a.split()
        if gpu != "-":
            assert f"{role} {i}: " in log and re.search(rf"{role} {i}: .*\(CUDA_VISIBLE_DEVICES={gpu}\)", log), a
    assert re.search(r"^step\s+1 ", log, re.M), log[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_1"
