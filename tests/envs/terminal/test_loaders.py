"""Task folders in both formats: Harbor (shipped) and Terminal-Bench 1, and the docker-only case."""

from __future__ import annotations

import asyncio
import os
import shutil
import textwrap

import pytest

from jointrl.envs.sandbox.docker import unavailable_reason
from jointrl.envs.terminal import TerminalEnv, load_policy, load_task, load_tasks, policy_names, replay
from jointrl.envs.terminal.env import TaskNeedsImage
from jointrl.envs.terminal.policies import render_solution
from jointrl.envs.terminal.tasks import solution_script
from jointrl.rewards import Episode
from jointrl.rewards.tests_pass import tests_pass as reward_fn

needs_bwrap = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap")


def write(folder, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def score(task, policy: str) -> float:
    played = asyncio.run(replay(task, load_policy(task, policy)))
    try:
        return reward_fn(task, Episode(messages=played.messages, verify_sandbox=played.final_files, finished=True)).score
    finally:
        played.final_files.discard()


def test_every_shipped_task_is_full_harbor_layout_with_consistent_solve_sh():
    tasks = load_tasks()
    assert len(tasks) >= 30
    for t in tasks:
        assert t.metadata["format"] == "harbor"
        for rel in ("task.toml", "instruction.md", "tests/test.sh", "solution/solve.sh", "policies.json"):
            assert (t.root / rel).is_file(), (t.id, rel)
        assert solution_script(t).read_text() == render_solution(load_policy(t, "oracle")), t.id
        assert {"oracle", "wrong", "noop", "solution"} <= set(policy_names(t))
    categories = {t.metadata.get("category") for t in tasks}
    assert {"files", "text", "git", "build", "python", "config", "data"} <= categories, categories


@needs_bwrap
def test_harbor_task_with_reward_json_and_a_solution_only(tmp_path):
    folder = tmp_path / "json-reward"
    write(folder, {
        "task.toml": "version = \"1.0\"\n[metadata]\ndifficulty = \"easy\"\n[verifier]\ntimeout_sec = 30\n[agent]\ntimeout_sec = 60\n",
        "instruction.md": "Create /work/done.txt containing `ok`.\n",
        "solution/solve.sh": "#!/bin/bash\necho ok > /work/done.txt\nexit 0\n",
        "tests/test.sh": """\
            if [ "$(cat /work/done.txt 2>/dev/null)" = ok ]; then echo '{"reward": 1.0}' > /logs/verifier/reward.json
            else echo '{"reward": 0.0}' > /logs/verifier/reward.json; fi
        """,
    })
    task = load_task(folder)
    assert task.id == "json-reward" and task.metadata["verifier_timeout_s"] == 30.0
    assert load_policy(task, "oracle") == load_policy(task, "solution")  # no policies.json: the script is the oracle
    assert score(task, "oracle") == 1.0 and score(task, "noop") == 0.0


@needs_bwrap
def test_terminal_bench_1_task(tmp_path):
    folder = tmp_path / "tb1-hello"
    write(folder, {
        "task.yaml": """\
            instruction: |-
              Write a file /work/hello.txt containing "Hello, world!".
            author_email: someone@example.com
            difficulty: easy
            category: file-operations
            tags: [files]
            max_agent_timeout_sec: 180
            max_test_timeout_sec: 30
            run_tests_in_same_shell: false
        """,
        "solution.sh": "#!/bin/bash\necho 'Hello, world!' > /work/hello.txt\n",
        "run-tests.sh": "#!/bin/bash\ncd /work\npython3 -m pytest -q $TEST_DIR/test_outputs.py\n",
        "tests/test_outputs.py": """\
            from pathlib import Path

            def test_hello():
                assert Path("/work/hello.txt").read_text().strip() == "Hello, world!"
        """,
    })
    task = load_task(folder)
    assert task.metadata["format"] == "terminal-bench-1" and task.metadata["difficulty"] == "easy"
    assert task.prompt == 'Write a file /work/hello.txt containing "Hello, world!".'
    assert task.metadata["verifier_timeout_s"] == 30.0
    assert score(task, "oracle") == 1.0 and score(task, "noop") == 0.0


def test_a_task_with_its_own_image_is_refused_on_bwrap_with_the_reason(tmp_path):
    for folder, files in ((tmp_path / "harbor-img", {"task.toml": "", "instruction.md": "x", "tests/test.sh": "exit 0",
                                                    "environment/Dockerfile": "FROM debian:bookworm-slim\n"}),
                          (tmp_path / "tb1-img", {"task.yaml": "instruction: x\n", "run-tests.sh": "exit 0", "tests/t.py": "",
                                                  "Dockerfile": "FROM debian:bookworm-slim\n"})):
        write(folder, files)
        task = load_task(folder)
        assert task.metadata["docker_image"].endswith("Dockerfile")
        with pytest.raises(TaskNeedsImage, match="needs its own Docker image.*docker backend"):
            asyncio.run(TerminalEnv().reset(task))
    assert len(load_tasks(tmp_path)) == len(load_tasks(tmp_path, backend="docker")) == 2
    with pytest.raises(ValueError, match="all 2 terminal tasks .*harbor-img, tb1-img.*envs.sandbox.backend=docker"):
        load_tasks(tmp_path, backend="bwrap")  # a folder left empty on bwrap says why and what to set


def test_loader_errors_name_the_file(tmp_path):
    write(tmp_path / "bad", {"task.yaml": "- not a mapping\n", "run-tests.sh": "", "tests/x": ""})
    with pytest.raises(ValueError, match="needs an 'instruction'"):
        load_task(tmp_path / "bad")
    write(tmp_path / "bad2", {"task.yaml": "instruction: x\n"})
    with pytest.raises(ValueError, match="lacks 'run-tests.sh'"):
        load_task(tmp_path / "bad2")


_DOCKER_WHY = unavailable_reason()


@pytest.mark.skipif(_DOCKER_WHY is not None, reason=f"docker backend: {_DOCKER_WHY}")
def test_a_task_with_its_own_image_runs_on_the_docker_backend(tmp_path):
    folder = tmp_path / "own-image"
    write(folder, {"task.toml": "", "instruction.md": "Write /work/ok.txt containing `ok`.",
                   "environment/Dockerfile": "FROM debian:bookworm-slim\nRUN useradd --uid 1000 agent\nWORKDIR /work\n",
                   "solution/solve.sh": "echo ok > /work/ok.txt\n",
                   "tests/test.sh": '[ "$(cat /work/ok.txt)" = ok ] && echo 1 > /logs/verifier/reward.txt\n'})
    task = load_task(folder)

    async def go(policy):
        env = TerminalEnv(backend="docker")
        try:
            await env.reset(task)
            for turn in load_policy(task, policy):
                for call in turn:
                    await env.step(call)
            final = await env.final_files()
        finally:
            await env.close()
        return reward_fn(task, Episode(messages=[], verify_sandbox=final)).score

    assert asyncio.run(go("solution")) == 1.0 and asyncio.run(go("noop")) == 0.0


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="allowed: \\['bwrap', 'docker'\\]"):
        TerminalEnv(backend="podman")
