"""``jointrl <command>`` checks config and task folders before Ray starts: one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jointrl.rl.preflight import guard


def test_a_missing_task_dir_fails_fast_with_one_line_and_status_2():
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jointrl.rl.cli", "train", "envs.domains.terminal.task_dir=/nonexistent"],
                       capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p
    assert p.stderr == "jointrl: error: envs.domains.terminal: task root '/nonexistent' is not a directory\n", p.stderr
    assert elapsed < 20, elapsed  # ~3 s idle (mostly importing torch); 5-8 s on a loaded 2-core host


def _fails(capsys, command, args, match):
    with pytest.raises(SystemExit) as e:
        guard(command, args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("jointrl: error: ") and err.count("\n") == 1, err
    assert match in err, err


def test_a_malformed_task_toml_and_a_missing_checkpoint_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "t" / "tests").mkdir(parents=True)
    (tmp_path / "t" / "task.toml").write_text("[verifier\n")
    (tmp_path / "t" / "instruction.md").write_text("x\n")
    (tmp_path / "t" / "tests" / "test.sh").write_text("exit 0\n")
    _fails(capsys, "eval", [f"envs.domains.terminal.task_dir={tmp_path}", "split=all"], "task.toml': Expected ']'")
    _fails(capsys, "train", ["checkpoint=/nonexistent"], "checkpoint=/nonexistent does not exist")
    _fails(capsys, "sft", ["envs.sandbox.backend=podman"], "envs.sandbox.backend")
    tb2 = Path(__file__).parents[1] / "envs" / "terminal" / "tb2_tasks"  # tasks that all bring a Dockerfile
    _fails(capsys, "train", [f"envs.domains.terminal.task_dir={tb2}", "envs.domains.terminal.split=all"],
           "need their own Docker image (csv-total, json-name); the bwrap backend cannot build one: "
           "set envs.sandbox.backend=docker")


def test_debug_shows_the_exception_and_good_arguments_pass_through(monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        guard("train", ["checkpoint=/nonexistent", "--debug"])
    assert guard("eval", ["k=1", "policy=oracle", "--debug"]) == ["k=1", "policy=oracle"]
    assert guard("eval", ["k=2", "unseen=false", "tier=low"]) == ["k=2", "unseen=false", "tier=low"]  # eval's own keys
    assert guard("train", ["--cfg", "job"]) == ["--cfg", "job"]  # Hydra's own flags: left to Hydra


def test_an_unknown_heldout_family_is_one_line_before_ray(capsys):
    _fails(capsys, "recipe", ["envs=office", "envs.domains.office.heldout_families=[fix-formula,no-such]"],
           "envs.domains.office: heldout_families names ['no-such'], not a family of domain 'office'")
    assert guard("eval", ["envs=office", "envs.domains.office.heldout_families=[fix-formula]", "split=unseen"])
