"""The pure reward modules' doctests, and ``combine`` over them."""

from __future__ import annotations

import doctest

import jointrl.rewards.format
import jointrl.rewards.tests_pass
from jointrl.envs.base import Task
from jointrl.rewards import Episode, combine, registered


def test_doctests():
    for module in (jointrl.rewards.format, jointrl.rewards.tests_pass):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_builtins_are_registered():
    assert {"format", "tests_pass"} <= set(registered())


def test_format_in_combine():
    task = Task(id="t", domain="terminal", prompt="p")
    r = combine({"format": 0.5}, task, Episode(messages=[], finished=True))
    assert r.score == 0.5 and r.info["format"] == 1.0 and r.info["format/num_tool_errors"] == 0
