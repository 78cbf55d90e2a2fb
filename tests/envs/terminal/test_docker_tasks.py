"""Harbor tasks with their own Dockerfile: left out on bwrap (with a warning), run on docker.

``tb2_tasks/`` holds two tasks in the published Terminal-Bench 2 pattern (root, ``WORKDIR /app``,
a ``RUN apt-get install`` step, ``tests/test.sh`` running pytest installed at build time and
writing ``/logs/verifier/reward.txt``). Through ``jointrl eval ... envs.sandbox.backend=docker``
against a real daemon they score oracle 1, no-op 0, wrong 0. Skipped with the reason where no
daemon is reachable (CI starts one: .ci/run).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jointrl.envs.sandbox.docker import unavailable_reason
from jointrl.envs.terminal import TerminalEnv, load_task, load_tasks
from jointrl.rl.eval import main as eval_main

TB2 = Path(__file__).parent / "tb2_tasks"
needs_docker = pytest.mark.skipif(unavailable_reason() is not None, reason=f"docker: {unavailable_reason()}")


def test_bwrap_leaves_dockerfile_tasks_out_with_one_warning_naming_them(tmp_path, caplog):
    for task in ("csv-total", "json-name"):
        (tmp_path / task).symlink_to(TB2 / task)
    plain = tmp_path / "plain"
    (plain / "tests").mkdir(parents=True)
    (plain / "task.toml").write_text("")
    (plain / "instruction.md").write_text("Do nothing.\n")
    (plain / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    with caplog.at_level(logging.WARNING):
        tasks = load_tasks(tmp_path, backend="bwrap")
    assert [t.id for t in tasks] == ["plain"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 3" in warnings[0] and "csv-total, json-name" in warnings[0], warnings
    assert [t.id for t in load_tasks(tmp_path, backend="docker")] == ["csv-total", "json-name", "plain"]


def test_a_folder_of_only_dockerfile_tasks_fails_on_bwrap_suggesting_docker():
    with pytest.raises(ValueError, match=r"all 2 terminal tasks .* envs.sandbox.backend=docker"):
        load_tasks(TB2, backend="bwrap")


def test_harbor_resources_and_timeouts_are_read():
    m = load_task(TB2 / "csv-total").metadata
    assert (m["cpus"], m["memory_mb"], m["storage_mb"], m["agent_timeout_s"], m["verifier_timeout_s"]) == (
        1.0, 1024.0, 256.0, 300.0, 60.0)
    assert m["docker_image"].endswith("csv-total/environment/Dockerfile")


@needs_docker
@pytest.mark.parametrize(("policy", "expected"), [("oracle", 1.0), ("noop", 0.0), ("wrong", 0.0)])
def test_tb2_pattern_tasks_score_through_jointrl_eval_on_docker(tmp_path, policy, expected):
    result = eval_main(["envs=terminal", f"envs.domains.terminal.task_dir={TB2}", "envs.sandbox.backend=docker",
                        f"policy={policy}", "split=all", "k=1", "tier=low", f"out={tmp_path}", "logger.wandb_mode=disabled"])
    episodes = result["episodes"]
    assert sorted(e["task_id"] for e in episodes) == ["csv-total", "json-name"]
    assert all(e["finish_reason"] != "env_error" for e in episodes), episodes
    assert [r["pass@1"] for r in result["rows"]] == [expected], result["rows"]


@needs_docker
def test_the_agent_is_root_in_the_workdir_and_the_verifier_never_saw_the_agent(tmp_path):
    import asyncio

    from jointrl.envs.base import ToolCall

    async def go():
        env = TerminalEnv(backend="docker")
        try:
            messages = await env.reset(load_task(TB2 / "json-name"))
            obs = await env.step(ToolCall("bash", {"command": "id -un; pwd; ls; touch /app/x /usr/local/y && echo wrote; "
                                                              "ls /tests 2>&1 | head -1"}))
            final = await env.final_files()
        finally:
            await env.close()
        verifier = final()
        try:
            seen = verifier.exec("id -un; pwd; ls /app /tests; ls /usr/local/y 2>&1 | head -1")
        finally:
            verifier.close()
            final.discard()
        return messages, obs.text, seen.stdout

    messages, agent, verifier = asyncio.run(go())
    assert "working directory is /app" in messages[0].content
    assert agent.startswith("root\n/app\nconfig.json\nwrote\n") and "No such file" in agent, agent
    # the verifier: the agent's /app (x kept), the tests copied in, a fresh image elsewhere (no /usr/local/y)
    assert verifier.startswith("root\n/app\n/app:\nconfig.json\nx\n\n/tests:\ntest.sh\ntest_outputs.py\n"), verifier
    assert "No such file" in verifier


def _harbor(folder: Path, dockerfile: str, test_sh: str, toml: str = "") -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text("Nothing to do.\n")
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    (folder / "tests" / "test.sh").write_text(test_sh)
    return folder


def _verify(task, verifier_network=False):
    import asyncio

    from jointrl.rewards import Episode
    from jointrl.rewards.tests_pass import tests_pass

    async def go():
        env = TerminalEnv(backend="docker", verifier_network=verifier_network)
        try:
            await env.reset(task)
            final = await env.final_files()
        finally:
            await env.close()
        return final

    final = asyncio.run(go())
    try:
        return tests_pass(task, Episode(messages=[], verify_sandbox=final))
    finally:
        final.discard()


@needs_docker
def test_a_verifier_that_needs_the_network_is_an_env_error_naming_the_command(tmp_path):
    from jointrl.envs.base import EnvError

    test_sh = "apt-get update -qq 2>&1 | tail -2\napt-get install -y -qq jq >/dev/null 2>&1 || exit 1\necho 1 > /logs/verifier/reward.txt\n"  # as TB2 tasks fetch curl / uv
    task = load_task(_harbor(tmp_path / "fetches-a-tool", "FROM debian:bookworm-slim\nWORKDIR /app\n", test_sh))
    with pytest.raises(EnvError) as e:
        _verify(task, verifier_network=True)  # the host permits it, but the task is not marked allow_internet
    msg = str(e.value)
    assert "needs the network" in msg and "'bash /tests/test.sh'" in msg and "\n" not in msg, msg


@needs_docker
@pytest.mark.slow
def test_a_task_marked_allow_internet_verifies_with_a_network_where_permitted(tmp_path):
    """The daemon's bridge network (the one `docker build` reaches the Debian mirror through)."""
    test_sh = "apt-get update -qq && apt-get install -y -qq jq >/dev/null || exit 1\necho 1 > /logs/verifier/reward.txt\n"
    allowed = load_task(_harbor(tmp_path / "allowed", "FROM debian:bookworm-slim\nWORKDIR /app\n", test_sh,
                                "[environment]\nallow_internet = true\n"))
    assert _verify(allowed, verifier_network=True).score == 1.0


@needs_docker
def test_a_failing_image_build_is_that_tasks_clear_error(tmp_path):
    import asyncio

    from jointrl.envs.sandbox.docker import ImageBuildError

    task = load_task(_harbor(tmp_path / "broken-image", "FROM debian:bookworm-slim\nRUN echo no-such-tool && false\n",
                             "exit 0\n"))
    with pytest.raises(ImageBuildError, match=r"docker build of '.*broken-image/environment/Dockerfile' failed"):
        asyncio.run(TerminalEnv(backend="docker").reset(task))


@needs_docker
@pytest.mark.slow
def test_every_shipped_terminal_task_scores_its_oracle_on_docker(tmp_path):
    """The shipped tasks (no Dockerfile of their own) in the terminal image: a pooled container
    per episode, the verifier in a fresh one. Caught: /tmp noexec (make-build runs ./hello
    there), directory modes and the WORKDIR's owner lost on the way to the verifier (git)."""
    result = eval_main(["envs=terminal", "envs.sandbox.backend=docker", "policy=oracle", "split=all", "k=1", "tier=low",
                        f"out={tmp_path}", "logger.wandb_mode=disabled"])
    (row,) = result["rows"]
    assert (row["tasks"], row["pass@1"], row["env_error"]) == (len(load_tasks()), 1.0, 0), \
        [e for e in result["episodes"] if not e["success"]]
