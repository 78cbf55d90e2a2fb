"""TerminalEnv over real bwrap: tools, argument errors, infrastructure errors, verification sandboxes."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from jointrl.envs.base import Env, EnvError, Task, ToolCall, Verifiable
from jointrl.envs.sandbox import SandboxConfig
from jointrl.envs.sandbox.disk import unmount
from jointrl.envs.sandbox.uids import kill_uid
from jointrl.envs.terminal import TerminalEnv, load_policy, load_task, load_tasks, policy_names

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap"
)


def bash(command) -> ToolCall:
    return ToolCall(name="bash", arguments={"command": command})


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def task() -> Task:
    return next(t for t in load_tasks() if t.id == "count-lines")


def test_shipped_tasks_load():
    tasks = load_tasks()
    assert len(tasks) >= 12
    assert len({t.id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.domain == "terminal" and t.prompt and t.reward == {"tests_pass": 1.0}
        assert {"oracle", "wrong", "noop"} <= set(policy_names(t))
        assert load_policy(t, "oracle")[-1] == [ToolCall(name="submit", arguments={})]


def test_env_protocols():
    env = TerminalEnv()
    assert isinstance(env, Env) and isinstance(env, Verifiable)
    assert [s.name for s in env.tools] == ["bash", "submit"]
    assert env.tools[0].to_openai()["function"]["parameters"]["required"] == ["command"]


def test_reset_and_bash(task):
    async def episode():
        env = TerminalEnv()
        try:
            messages = await env.reset(task)
            assert [m.role for m in messages] == ["system", "user"] and messages[1].content == task.prompt
            ok = await env.step(bash("wc -l < access.log; echo oops >&2; (exit 3)"))
            return ok
        finally:
            await env.close()

    obs = run(episode())
    assert not obs.is_error and not obs.done
    assert obs.text == "137\n[stderr]\noops\n[exit code: 3]"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (ToolCall(name="python", arguments={"code": "1"}), "unknown tool 'python'"),
        (ToolCall(name="bash", arguments={}), "missing required argument(s) ['command']"),
        (ToolCall(name="bash", arguments={"command": 42}), "argument 'command' must be string, got int"),
        (ToolCall(name="bash", arguments={"command": ["ls"]}), "must be string, got list"),
        (ToolCall(name="bash", arguments={"command": "ls", "cwd": "/"}), "unknown argument 'cwd'"),
        (ToolCall(name="bash", arguments={"command": "ls\x00"}), "NUL byte"),
        (ToolCall(name="bash", arguments="ls"), "must be a JSON object"),
        (ToolCall(name="submit", arguments={"answer": "x"}), "unknown argument 'answer'"),
    ],
)
def test_malformed_calls_are_error_observations_and_the_episode_goes_on(task, call, message):
    async def episode():
        env = TerminalEnv()
        try:
            await env.reset(task)
            bad = await env.step(call)
            good = await env.step(bash("echo still here"))
            return bad, good, env.num_tool_errors
        finally:
            await env.close()

    bad, good, errors = run(episode())
    assert bad.is_error and not bad.done and message in bad.text
    assert good.text == "still here\n[exit code: 0]" and errors == 1


def test_submit_ends_the_episode(task):
    async def episode():
        env = TerminalEnv()
        try:
            await env.reset(task)
            return await env.step(ToolCall(name="submit", arguments={})), await env.step(bash("ls"))
        finally:
            await env.close()

    submitted, after = run(episode())
    assert submitted.done and not submitted.is_error
    assert after.done and after.is_error


def test_command_timeout_is_reported(task):
    async def episode():
        env = TerminalEnv(SandboxConfig(timeout_s=0.5))
        try:
            await env.reset(task)
            return await env.step(bash("echo before; sleep 30"))
        finally:
            await env.close()

    obs = run(episode())
    assert not obs.is_error and obs.text.startswith("before\n")  # bash may add a "Killed" line on stderr
    assert obs.text.endswith("[timed out after 0.5 s; the command and its children were killed]")


def test_step_before_reset_is_a_programming_error():
    with pytest.raises(RuntimeError, match="before reset"):
        run(TerminalEnv().step(bash("ls")))


def test_sandbox_failure_raises_env_error(task):
    async def episode():
        env = TerminalEnv()
        try:
            await env.reset(task)
            unmount(env.sandbox.workdir)  # the host dir that bwrap binds at /work vanished ...
            shutil.rmtree(env.sandbox.workdir)
            kill_uid(env.sandbox.uid)  # ... and the shell died: it cannot restart
            await env.step(bash("ls"))
        finally:
            await env.close()

    with pytest.raises(EnvError):
        run(episode())


def test_verify_sandbox_is_fresh_and_isolated(task):
    async def episode():
        env = TerminalEnv()
        try:
            await env.reset(task)
            await env.step(bash("echo mine > answer.txt; echo 'export PATH=/work/bin:$PATH' > .bashrc"))
            verify = env.verify_sandbox()
            final = await env.final_files()
            return env.sandbox.uid, verify, final
        finally:
            await env.close()

    agent_uid, verify, final = run(episode())
    with verify:
        assert verify.uid != agent_uid
        assert verify.read_file("answer.txt") == b"mine\n"
        r = verify.exec("ls /tests; ls -A /logs/verifier; echo $HOME; touch /tests/x 2>/dev/null || echo ro")
        assert r.stdout == "test.sh\n/tmp\nro\n"  # tests present, logs empty, agent's dotfiles not home
    with final() as again:  # the snapshot outlives env.close()
        assert again.read_file("answer.txt") == b"mine\n"
    final.discard()
    assert not final.snapshot.exists()


def test_loader_names_bad_files(tmp_path):
    folder = tmp_path / "t1"
    (folder / "tests").mkdir(parents=True)
    (folder / "instruction.md").write_text("do it")
    with pytest.raises(ValueError, match="lacks 'task.toml'"):
        load_task(folder)
    (folder / "task.toml").write_text('id = "t1"\n')
    with pytest.raises(ValueError, match="lacks 'test.sh'"):
        load_task(folder)
    (folder / "tests" / "test.sh").write_text("exit 0\n")
    assert load_task(folder).id == "t1"
    (folder / "task.toml").write_text('id = "other"\n')
    with pytest.raises(ValueError, match="must equal the folder name 't1'"):
        load_task(folder)
    (folder / "task.toml").write_text('id = "t1"\ntimeout = 3\n')
    with pytest.raises(ValueError, match="unknown keys \\['timeout'\\]"):
        load_task(folder)
    (folder / "task.toml").write_text('id = "t1"\ntier = "huge"\n')
    with pytest.raises(ValueError, match="tier"):
        load_task(folder)
    (folder / "task.toml").write_text('id = "t1"\n')
    with pytest.raises(ValueError, match="no policy 'oracle'; available: \\['noop'\\]"):
        load_policy(load_task(folder), "oracle")


def test_compact_prompt_keeps_the_tools_and_shrinks_the_system_turn(task):
    """``envs.prompt=compact`` (through the registry, as the env workers build envs): the same tool
    names and required arguments, a system turn under half the tokens, and calls still run."""
    from jointrl.envs.registry import make_env
    from jointrl.model.chat_template import ChatTemplate
    from jointrl.rl.config import EnvsConfig

    async def system_turn(env):
        try:
            messages = await env.reset(task)
            obs = await env.step(bash("wc -l < access.log"))
            return ChatTemplate().render(messages[:1], env.tools), obs
        finally:
            await env.close()

    full, compact = make_env("terminal", EnvsConfig()), make_env("terminal", EnvsConfig(prompt="compact"))
    assert [s.name for s in compact.tools] == [s.name for s in full.tools]
    assert [s.parameters.get("required") for s in compact.tools] == [s.parameters.get("required") for s in full.tools]
    (full_ids, _), (compact_ids, obs) = run(system_turn(full)), run(system_turn(compact))
    assert len(compact_ids) < len(full_ids) / 2 and obs.text == "137\n[exit code: 0]"
    with pytest.raises(ValueError, match=r"envs.prompt.*'full', 'compact'"):
        EnvsConfig(prompt="short")
