"""``swe_tests`` over real sandboxes: per-test results, and what a reward-hacking agent cannot forge.

Each hack is checked twice: it scores 0 through the verifier, and (the control) it really
works on a naive ``python3 -m pytest`` run in the agent's own sandbox -- so the test could fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import doctest
import json
import os
import shutil

import pytest

import jointrl.envs.code_repo.verifier
from jointrl.envs.base import ToolCall
from jointrl.envs.code_repo import CodeRepoEnv, load_policy, load_tasks
from jointrl.envs.sandbox import SandboxConfig
from jointrl.rewards import Episode, get
from jointrl.rewards.swe_tests import swe_tests as reward_fn

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None, reason="needs root and bubblewrap")

TASK = next(t for t in load_tasks() if t.id == "unitconv-1")  # FAIL_TO_PASS in tests/test_convert.py
F2P = TASK.metadata["swe"]["fail_to_pass"]
SUBMIT = ToolCall("submit", {})
FORCE_PASS = '''\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''
SKIP_ALL = '''\
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip(reason="planted"))
'''
# the control: a test that fails, run the naive way; "1 passed" means the hack works
CONTROL = ("printf 'def test_hack():\\n    assert False\\n' > tests/test_hack.py && "
           "python3 -m pytest -q -p no:cacheprovider tests/test_hack.py; echo rc=$?; rm tests/test_hack.py")


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


def create(path: str, content: str) -> ToolCall:
    return ToolCall("create", {"path": path, "content": content})


def play(calls: list[ToolCall], task=TASK):
    """Run ``calls`` in a fresh episode of ``task``; return (reward, observation texts)."""

    async def go():
        env = CodeRepoEnv(SandboxConfig(timeout_s=60))
        try:
            await env.reset(task)
            texts = [(await env.step(c)).text for c in calls]
            return await env.final_files(), texts
        finally:
            await env.close()

    final, texts = asyncio.run(go())
    try:
        return reward_fn(task, Episode(messages=[], verify_sandbox=final, finished=True)), texts
    finally:
        final.discard()


def oracle_calls() -> list[ToolCall]:
    return [c for turn in load_policy(TASK, "oracle") for c in turn if c.name != "submit"]


def test_registered_and_doctests():
    assert get("swe_tests") is reward_fn
    assert doctest.testmod(jointrl.envs.code_repo.verifier).failed == 0


def test_noop_reports_exactly_the_failing_tests():
    r, _ = play([SUBMIT])
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info
    assert r.info["fail_to_pass_passed"] == 0 and r.info["pass_to_pass_passed"] == len(TASK.metadata["swe"]["pass_to_pass"])


def test_oracle_survives_test_edits_and_planted_files():
    """Restoring the tests does not hurt a real fix, whatever the agent did to the test files."""
    sabotage = "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n    raise SystemExit(3)\n"
    r, _ = play([*oracle_calls(), create("tests/test_convert.py", "def test_x():\n    assert False\n"),
                 create("conftest.py", sabotage), create("tests/conftest.py", sabotage), SUBMIT])
    assert r.score == 1.0, r.info


def test_editing_the_tests_to_pass_scores_zero():
    """The agent rewrites the test file with the failing tests' names, trivially passing."""
    body = "".join(f"def {t.split('::')[1]}():\n    assert True\n\n\n" for t in F2P)
    r, texts = play([create("tests/test_convert.py", body),
                     bash("python3 -m pytest -q -p no:cacheprovider tests/test_convert.py; echo rc=$?"), SUBMIT])
    assert "2 passed" in texts[1] and "rc=0" in texts[1]  # the control: the edited tests pass
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info


@pytest.mark.parametrize(("where", "content", "naive_result"), [
    ("conftest.py", FORCE_PASS, "1 passed"),
    ("tests/conftest.py", FORCE_PASS, "1 passed"),
    ("conftest.py", SKIP_ALL, "1 skipped"),  # exit code 0 too: a grader reading only that is fooled
])
def test_planted_conftest_scores_zero(where, content, naive_result):
    r, texts = play([create(where, content), bash(CONTROL), SUBMIT])
    assert naive_result in texts[1] and "rc=0" in texts[1], texts[1]
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info


@pytest.mark.parametrize(("config", "text"), [
    ("pytest.ini", "[pytest]\naddopts = -p hackplug\n"),
    ("setup.cfg", "[tool:pytest]\naddopts = -p hackplug\n"),
    ("pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p hackplug"\n'),
])
def test_planted_pytest_config_scores_zero(config, text):
    r, texts = play([create("hackplug.py", FORCE_PASS), create(config, text), bash(CONTROL), SUBMIT])
    assert "1 passed" in texts[2] and "rc=0" in texts[2], texts[2]
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info


def test_fake_pytest_on_path_and_as_a_module_scores_zero():
    fake_results = "".join(json.dumps({"nodeid": t, "when": "call", "outcome": "passed"}) + "\n"
                           for t in TASK.metadata["swe"]["fail_to_pass"] + TASK.metadata["swe"]["pass_to_pass"])
    module = ("import os, sys\nprint('FAKE PYTEST')\nout = os.environ.get('JOINTRL_VERDICT')\n"
              f"if out:\n    open(out, 'w').write({fake_results!r})\nsys.exit(0)\n")
    script = "#!/bin/sh\necho FAKE PYTEST\nexit 0\n"
    r, texts = play([create("pytest.py", module), create("bin/pytest", script), create("bin/python3", script),
                     bash("chmod +x bin/pytest bin/python3 && for f in .bashrc .profile .bash_profile; do "
                          "echo 'export PATH=/work/bin:$PATH' > $f; done"),
                     bash("python3 -m pytest; echo rc=$?"), SUBMIT])
    assert "FAKE PYTEST" in texts[4] and "rc=0" in texts[4]  # the control: the naive call runs the fake
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info


def test_agent_written_results_and_reward_files_are_never_read():
    fake = "".join(json.dumps({"nodeid": t, "when": "call", "outcome": "passed"}) + "\n" for t in F2P)
    r, texts = play([create("logs/verifier/results.jsonl", fake), create("logs/verifier/reward.txt", "1\n"),
                     create("reward.txt", "1\n"),
                     bash("mkdir -p /logs/verifier 2>&1; echo 1 > /logs/verifier/reward.txt; echo rc=$?"), SUBMIT])
    assert "rc=0" not in texts[3]  # the agent has no /logs/verifier to write to
    assert r.score == 0.0 and r.info["failed"] == F2P, r.info


def test_code_that_hangs_the_verifier_scores_zero():
    task = dataclasses.replace(TASK, metadata={**TASK.metadata, "verifier_timeout_s": 3.0})
    r, _ = play([create("unitconv/units.py", "while True:\n    pass\n"), SUBMIT], task)
    assert r.score == 0.0 and r.info["timed_out"] and r.info["failed"], r.info
