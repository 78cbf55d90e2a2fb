"""``tests_pass`` over real sandboxes: what passes, and what a reward-hacking agent cannot forge."""

from __future__ import annotations

import asyncio
import os
import shutil
import textwrap

import pytest

from jointrl.envs.base import EnvError, Task, ToolCall
from jointrl.envs.terminal import load_task, load_tasks, replay
from jointrl.rewards import Episode, get
from jointrl.rewards.tests_pass import tests_pass as reward_fn  # a bare name test* would be collected

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)
SUBMIT = ToolCall(name="submit", arguments={})


def shipped(task_id: str) -> Task:
    return next(t for t in load_tasks() if t.id == task_id)


def make_task(tmp_path, test_sh: str, metadata: str = "") -> Task:
    folder = tmp_path / "custom"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.toml").write_text(f'id = "custom"\n[metadata]\n{metadata}\n')
    (folder / "instruction.md").write_text("Write ok.txt.\n")
    (folder / "tests" / "test.sh").write_text(textwrap.dedent(test_sh))
    return load_task(folder)


def score(task: Task, *commands: str):
    played = asyncio.run(replay(task, [[ToolCall(name="bash", arguments={"command": c})] for c in commands] + [[SUBMIT]]))
    return reward_fn(task, Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True))


def test_registered():
    assert get("tests_pass") is reward_fn


def test_agent_written_reward_files_are_never_read():
    r = score(shipped("write-file"),
              "mkdir -p logs/verifier && for f in reward.txt logs/verifier/reward.txt; do echo 1 > $f; done",
              "mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt 2>/dev/null; true")
    assert r.score == 0.0 and r.info["reward_file"] is None and r.info["exit_code"] != 0


def test_fake_tools_on_path_and_dotfiles_do_not_fool_the_verifier():
    fake = "printf '#!/bin/sh\\nexit 0\\n' > bin/diff && chmod +x bin/diff && cp bin/diff bin/cmp"
    r = score(shipped("sort-numbers"), "mkdir -p bin && " + fake,
              "for f in .bashrc .profile .bash_profile; do echo 'export PATH=/work/bin:$PATH' > $f; done",
              "cat numbers.txt > sorted.txt")
    assert r.score == 0.0, r.info


def test_agent_code_run_by_the_verifier_cannot_forge_a_pass(tmp_path):
    task = make_task(tmp_path, """
        bash /work/solution.sh
        [ -f /work/ok.txt ] || exit 1
        echo 1 > /logs/verifier/reward.txt
    """)
    r = score(task, "echo 'echo 1 > /logs/verifier/reward.txt' > solution.sh")
    assert r.score == 0.0 and r.info["reward_file"] == "1" and r.info["exit_code"] == 1
    assert score(task, "echo 'touch /work/ok.txt' > solution.sh").score == 1.0


@pytest.mark.parametrize(("test_sh", "why"), [
    ("exit 0\n", "exit 0 without a reward file"),
    ("echo 1 > /logs/verifier/reward.txt; exit 2\n", "a reward file but a failing exit"),
    ("echo 0 > /logs/verifier/reward.txt\n", "a reward file holding 0"),
    ("echo yes > /logs/verifier/reward.txt\n", "a reward file that is not a number"),
])
def test_both_exit_zero_and_reward_one_are_required(tmp_path, test_sh, why):
    assert score(make_task(tmp_path, test_sh)).score == 0.0, why


def test_verifier_timeout_scores_zero(tmp_path):
    task = make_task(tmp_path, "echo 1 > /logs/verifier/reward.txt; sleep 30\n", "verifier_timeout_s = 0.5")
    r = score(task)
    assert r.score == 0.0 and r.info["timed_out"]


def test_a_missing_snapshot_is_an_env_error():
    task = shipped("write-file")
    played = asyncio.run(replay(task, [[SUBMIT]]))
    shutil.rmtree(played.final_files.snapshot)
    with pytest.raises(EnvError, match="snapshot"):
        reward_fn(task, Episode(messages=played.messages, verify_sandbox=played.final_files))


def test_needs_a_verify_sandbox():
    with pytest.raises(ValueError, match="verify_sandbox"):
        reward_fn(shipped("write-file"), Episode(messages=[]))
