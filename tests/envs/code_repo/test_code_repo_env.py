"""CodeRepoEnv over real bwrap and git: the checkout, every tool, path escapes, argument errors."""

from __future__ import annotations

import asyncio
import os
import shutil
from types import SimpleNamespace

import pytest

from jointrl.envs.base import Env, ToolCall, Verifiable
from jointrl.envs.code_repo import CodeRepoEnv, load_tasks
from jointrl.envs.registry import load_tasks as registry_load_tasks
from jointrl.envs.registry import make_env
from jointrl.envs.sandbox import SandboxConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap")

TASK = next(t for t in load_tasks() if t.id == "ledger-4")


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments)


def episode(*calls: ToolCall) -> tuple[CodeRepoEnv, list]:
    """Observations of ``calls`` in one fresh episode of TASK (the env is closed after)."""

    async def go():
        env = CodeRepoEnv(SandboxConfig(timeout_s=30))
        try:
            await env.reset(TASK)
            return env, [await env.step(c) for c in calls]
        finally:
            await env.close()

    return asyncio.run(go())


def test_registry_and_protocols():
    env = make_env("code_repo", SimpleNamespace(command_timeout_s=5.0))
    assert isinstance(env, CodeRepoEnv) and isinstance(env, Env) and isinstance(env, Verifiable)
    assert env.config.timeout_s == 5.0
    assert [t.id for t in registry_load_tasks("code_repo")] == [t.id for t in load_tasks()]
    assert {t.name for t in env.tools} == {"bash", "view_file", "str_replace", "create", "insert", "submit"}
    compact = make_env("code_repo", SimpleNamespace(command_timeout_s=5.0, prompt="compact"))  # envs.prompt
    assert [(t.name, t.parameters) for t in compact.tools] == [(t.name, t.parameters) for t in env.tools]
    assert sum(len(t.description) for t in compact.tools) < sum(len(t.description) for t in env.tools) / 2


def test_checkout_is_the_base_commit_without_hidden_tests_or_history():
    hidden = [t.split("::")[1] for t in TASK.metadata["swe"]["fail_to_pass"]]
    _, obs = episode(call("bash", command="git log --oneline | wc -l"),
                     call("bash", command="git status --porcelain | wc -l"),
                     call("bash", command=f"grep -rl -e {hidden[0]} -e {hidden[1]} /work /tmp; echo done"),
                     call("bash", command="grep -c 'if qty > have' ledger/inventory.py; ls tests"))
    assert obs[0].text.startswith("1\n")  # one commit: later commits (the fix) never reach the agent
    assert obs[1].text.startswith("0\n")  # a clean tree
    assert obs[2].text.startswith("done\n"), obs[2].text  # the hidden tests are not in the checkout
    assert obs[3].text.startswith("0\n") and "test_inventory.py" in obs[3].text  # the bug is there, the old tests too


def test_file_tools_edit_the_repository():
    _, obs = episode(
        call("view_file", path="ledger/inventory.py", start_line=1, end_line=3),
        call("create", path="notes/todo.txt", content="a\nb\n"),
        call("insert", path="notes/todo.txt", line=0, text="top"),
        call("insert", path="notes/todo.txt", line=3, text="end\n"),
        call("str_replace", path="notes/todo.txt", old_str="b\n", new_str="B\n"),
        call("view_file", path="/work/notes/todo.txt"),
        call("bash", command="cat notes/todo.txt"),
        call("create", path="notes/todo.txt", content="new\n"),
        call("submit"),
    )
    assert obs[0].text == '     1\t"""Stock on hand, per SKU."""\n     2\t\n     3\t\n'
    assert obs[1].text.startswith("Created") and obs[7].text.startswith("Overwrote")
    assert obs[5].text == "     1\ttop\n     2\ta\n     3\tB\n     4\tend\n"
    assert obs[6].text.startswith("top\na\nB\nend\n")
    assert obs[8].done and not any(o.is_error for o in obs)


def test_tool_mistakes_are_error_observations():
    env, obs = episode(
        call("str_replace", path="ledger/inventory.py", old_str="raise ValueError", new_str="x"),  # 2 hits
        call("str_replace", path="ledger/inventory.py", old_str="not in the file", new_str="x"),
        call("str_replace", path="ledger/inventory.py", old_str="", new_str="x"),
        call("view_file", path="ledger/missing.py"),
        call("view_file", path="ledger/inventory.py", start_line=500),
        call("view_file", path="ledger"),
        call("insert", path="ledger/book.py", line=-1, text="x"),
        call("view_file", path="ledger/book.py", start_line="1"),  # wrong type
        call("str_replace", path="ledger/book.py", old="a", new="b"),  # wrong argument names
        call("delete", path="ledger/book.py"),
    )
    assert all(o.is_error and o.text.startswith("Error") for o in obs), [o.text for o in obs]
    assert "occurs 2 times (lines " in obs[0].text and "occurs 0 times" in obs[1].text
    assert "no such file" in obs[3].text and "outside 1.." in obs[4].text and "unknown tool" in obs[9].text
    assert env.num_tool_errors == len(obs)


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "/tmp/x", "link/passwd", "linkfile", "ledger/../../x"])
def test_file_tools_refuse_paths_outside_work(path):
    setup = call("bash", command="ln -s /etc link && ln -s /etc/passwd linkfile")
    _, obs = episode(setup, call("view_file", path=path), call("create", path=path, content="pwned\n"),
                     call("insert", path=path, line=0, text="pwned"),
                     call("str_replace", path=path, old_str="root", new_str="pwned"))
    assert all(o.is_error for o in obs[1:]), [o.text for o in obs]
    assert "pwned" not in open("/etc/passwd").read() and not os.path.exists("/escape.txt")


def test_symlinks_inside_work_are_followed():
    _, obs = episode(call("bash", command="ln -s ledger pkg && ln -s book.py ledger/alias.py"),
                     call("str_replace", path="pkg/alias.py", old_str="class Ledger:", new_str="class Book:"),
                     call("bash", command="grep -c 'class Book:' ledger/book.py; test -L ledger/alias.py && echo link"))
    assert not obs[1].is_error and obs[2].text.startswith("1\nlink\n"), [o.text for o in obs]


def test_calls_after_submit_are_refused():
    _, obs = episode(call("submit"), call("bash", command="true"))
    assert obs[0].done and obs[1].is_error and obs[1].done
