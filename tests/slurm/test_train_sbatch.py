"""slurm/train.sbatch end to end on this machine as a two-"node" allocation, with one requeue.

Shims stand in for Slurm's commands only: `scontrol` (hostnames, requeue), `srun` (runs the
step's command here), `sbatch` (runs the batch script with the job's environment, the GPUs per
node its ``#SBATCH --gpus-per-node`` line asks for as ``SLURM_GPUS_ON_NODE``, and runs it again
when it was requeued). Ray (with those GPUs as logical GPUs), the driver, DeepSpeed and the
sandboxes are real.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "requeue "*) echo "$2" >> "$SHIM_DIR/requeued" ;;
  *) echo "scontrol shim: unsupported: $*" >&2; exit 1 ;;
esac
"""
SRUN = """#!/usr/bin/env bash
while [ $# -gt 0 ]; do   # drop srun's own options, run the step's command on this machine
  case "$1" in -w|--nodelist) shift 2 ;; -*) shift ;; *) break ;; esac
done
exec "$@"
"""
SBATCH = """#!/usr/bin/env bash
script=$1; shift
export SLURM_JOB_ID=4242 SLURM_JOB_NODELIST='node[1-2]' SLURM_RESTART_COUNT=0 SLURM_CPUS_ON_NODE=2
export SLURM_GPUS_ON_NODE=$(sed -n 's/^#SBATCH --gpus-per-node=//p' "$script")
while true; do
  rm -f "$SHIM_DIR/requeued"
  bash "$script" "$@" &
  echo $! > "$SHIM_DIR/batch.pid"
  wait $!; rc=$?
  [ -f "$SHIM_DIR/requeued" ] || exit $rc
  SLURM_RESTART_COUNT=$((SLURM_RESTART_COUNT + 1))
done
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sbatch_runs_two_nodes_and_resumes_after_a_requeue(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN), ("sbatch", SBATCH)):
        (shims / name).write_text(body)
        (shims / name).chmod(0o755)
    out = tmp_path / "run"
    env = {**os.environ, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SHIM_DIR": str(tmp_path),
           "JOINTRL_RAY_PORT": str(_free_port()), "JOINTRL_HEAD_ADDR": "127.0.0.1", "JOINTRL_NODE_START_DELAY": "2",
           "PYTHONUNBUFFERED": "1"}
    overrides = [f"output_dir={out}", "algo.total_steps=3", "algo.prompts_per_step=2", "algo.group_size=2",
                 "checkpoint_every=10", "envs.num_workers=2", "rollout.max_tokens_per_turn=48",
                 # two "nodes" of 2 CPUs on this machine: bundles smaller than slurm.yaml's 8 CPUs
                 "cluster.learner_bundle.CPU=0.5", "cluster.rollout_bundle.CPU=0.5", "cluster.env_worker_cpus=0.25"]
    proc = subprocess.Popen(["sbatch", str(ROOT / "slurm" / "train.sbatch"), *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, signalled = [], False
    deadline = time.monotonic() + 900
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step    1") and not signalled:  # Slurm's warning before the time limit
            os.kill(int((tmp_path / "batch.pid").read_text()), signal.SIGUSR1)
            signalled = True
        assert time.monotonic() < deadline, "".join(lines[-50:])
    rc = proc.wait()
    log = "".join(lines)
    assert rc == 0, log[-5000:]
    assert "on 2 nodes (8 GPUs, 2 CPUs each)" in log and "restart 1" in log  # the script's GPU request
    # both runs (before and after the requeue) placed the learner rank and the rollout worker on a GPU each
    tables = [log[i:].splitlines()[2:6] for i in range(len(log)) if log.startswith("placement:", i)]
    assert len(tables) == 2, log[-5000:]
    for table in tables:
        gpus = {f"{w[0]}{w[1]}": (w[3], w[4]) for w in map(str.split, table)}  # actor -> (Ray node, GPU ids)
        assert "-" not in (gpus["learner0"][1], gpus["rollout0"][1]), table
        assert gpus["learner0"] != gpus["rollout0"], table  # not the same GPU of the same node
        assert gpus["env0"][1] == gpus["env1"][1] == "-", table
    assert "SIGUSR1: stopping after step 1 for requeue" in log or "SIGUSR1: stopping after step 2" in log
    assert "requeueing job 4242" in log
    steps = [int(x.split()[1]) for x in log.splitlines() if x.startswith("step ")]
    assert steps[-1] == 3 and sorted(set(steps)) == [1, 2, 3] and len(steps) == 3, log[-5000:]  # nothing redone
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_3"
