"""The sandbox's system from a directory (``envs.sandbox.rootfs``), built by ``.ci/setup.d/rootfs.sh``.

The rootfs is a Debian bookworm minbase tree from ``mmdebstrap`` with the tools the terminal
and code_repo tasks and verifiers run. The default tier checks that the sandbox really runs
it (its ``/etc``, its ``/usr`` inodes) and plays one oracle per domain on it, verifier
included; ``pytest -m slow`` plays every shipped terminal and code_repo oracle on it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from jointrl.envs.code_repo import CodeRepoEnv
from jointrl.envs.code_repo import load_policy as repo_policy
from jointrl.envs.code_repo import load_tasks as repo_tasks
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.envs.terminal import load_policy, load_tasks, replay
from jointrl.model.chat_template import ChatTemplate
from jointrl.rewards import Episode, combine
from jointrl.rl.agent_loop import AgentConfig, run_episode
from jointrl.rl.rollout.scripted import ScriptedEngine
from jointrl.rl.types import FinishReason, SamplingParams

ROOTFS = os.environ.get("JOINTRL_ROOTFS", "/opt/jointrl/rootfs/bookworm-tools")
pytestmark = [
    pytest.mark.skipif(not Path(ROOTFS, "usr", "bin", "bash").exists(),
                       reason=f"no rootfs at {ROOTFS}: run `bash .ci/setup.d/rootfs.sh`"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]
CFG = SandboxConfig(timeout_s=30, rootfs=ROOTFS)
TERMINAL = load_tasks()
REPOS = repo_tasks()


def test_the_sandbox_runs_the_rootfs_system_not_the_hosts():
    with BwrapSandbox(CFG) as sb:
        r = sb.exec("cat /etc/debian_version; stat -L -c %i /usr/bin/python3 /usr/bin/gcc; ls -l /bin | cut -c1")
    version, python, gcc, kind = r.stdout.split()
    assert version == Path(ROOTFS, "etc", "debian_version").read_text().strip()
    assert int(python) == os.stat(Path(ROOTFS, "usr", "bin", "python3")).st_ino != os.stat("/usr/bin/python3").st_ino
    assert int(gcc) == os.stat(Path(ROOTFS, "usr", "bin", "gcc")).st_ino
    assert kind == "l"  # the rootfs's /bin -> usr/bin link, not a bind of the host's /bin


def test_a_directory_without_a_system_is_refused(tmp_path):
    with pytest.raises(ValueError, match="envs.sandbox.rootfs"):
        BwrapSandbox(SandboxConfig(rootfs=str(tmp_path)))


def terminal_oracle(task) -> float:
    async def go():
        played = await replay(task, load_policy(task, "oracle"), CFG)
        episode = Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)
        try:
            return (await asyncio.to_thread(combine, task.reward, task, episode)).score
        finally:
            played.final_files.discard()

    return asyncio.run(go())


def repo_oracle(task) -> tuple[float, FinishReason]:
    async def go():
        env = CodeRepoEnv(CFG)
        try:
            tpl = ChatTemplate()
            return await run_episode(env, ScriptedEngine(repo_policy(task, "oracle"), tpl), task, tpl,
                                     SamplingParams(max_tokens=8192), AgentConfig(max_context=32768), group_id="g")
        finally:
            await env.close()

    traj = asyncio.run(go())
    return traj.reward, traj.finish_reason


def test_a_terminal_oracle_builds_with_the_rootfs_gcc_and_make():
    task = next(t for t in TERMINAL if t.id == "c-build")
    assert terminal_oracle(task) == 1.0


def test_a_code_repo_oracle_passes_the_rootfs_pytest():
    assert repo_oracle(REPOS[0]) == (1.0, FinishReason.STOP)


@pytest.mark.slow
@pytest.mark.parametrize("task", TERMINAL, ids=[t.id for t in TERMINAL])
def test_every_terminal_oracle_on_the_rootfs(task):
    assert terminal_oracle(task) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("task", REPOS, ids=[t.id for t in REPOS])
def test_every_code_repo_oracle_on_the_rootfs(task):
    assert repo_oracle(task) == (1.0, FinishReason.STOP)
