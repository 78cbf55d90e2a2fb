"""The shipped office tasks, the generator that made them, the loader and the tool-call checks (no sandbox;
the easy families' oracle and slip are played in real sandboxes)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from jointrl.envs import registry
from jointrl.envs.base import ToolCall
from jointrl.envs.office import FAMILIES, OfficeEnv, generate, load_policy, load_task, load_tasks, policy_names
from jointrl.envs.office.build_tasks import build
from jointrl.envs.office.generate import EASY_FAMILIES
from jointrl.rewards import Episode, combine
from jointrl.envs.office.env import TOOL_DIR, TOOL_VENV
from jointrl.envs.office.tools import check_call

TASKS = load_tasks()


def test_ships_at_least_forty_tasks_over_every_family():
    assert len(TASKS) >= 40 and len({t.id for t in TASKS}) == len(TASKS)
    families = Counter(t.metadata["family"] for t in TASKS)
    assert set(families) == set(FAMILIES) and min(families.values()) >= 3
    assert [t.id for t in registry.load_tasks("office")] == [t.id for t in TASKS]


def test_shipped_tasks_are_what_the_generator_makes():
    for t in TASKS:
        spec = generate(t.metadata["family"], t.metadata["seed"])
        shipped = json.loads((t.root / "task.json").read_text())
        keys = ("prompt", "checks", "policies")
        assert {k: shipped[k] for k in keys} == {k: spec[k] for k in keys}, t.id
        assert sorted(p.name for p in (t.root / "files").iterdir()) == sorted(spec["files"]), t.id


def test_generator_is_seeded():
    for family in FAMILIES:
        assert generate(family, 7) == generate(family, 7)
        assert generate(family, 7)["files"] != generate(family, 8)["files"], family
    with pytest.raises(ValueError, match="unknown office task family 'poems'; available: .*budget-lookup"):
        generate("poems", 0)


def test_every_policy_is_well_formed_and_ends_with_an_answer():
    for t in TASKS:
        assert policy_names(t) == ["noop", "oracle", "wrong"]
        assert t.reward == {"office_checks": 1.0} and t.domain == "office"
        for name in policy_names(t):
            turns = load_policy(t, name)
            assert len(turns) <= t.max_turns and turns[-1][-1].name == "answer", (t.id, name)
            for call in (c for turn in turns for c in turn):
                assert check_call(call) is None, (t.id, name, call)
        assert load_policy(t, "oracle") != load_policy(t, "wrong")
    with pytest.raises(ValueError, match="no policy 'lucky'; available: \\['noop', 'oracle', 'wrong'\\]"):
        load_policy(TASKS[0], "lucky")


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="needs task.json and files/"):
        load_task(tmp_path)
    (tmp_path / "files").mkdir()
    (tmp_path / "task.json").write_text("{not json")
    with pytest.raises(ValueError, match="task.json"):
        load_task(tmp_path)
    (tmp_path / "task.json").write_text(json.dumps({"prompt": "p", "checks": [{"type": "answer", "text": "x"}],
                                                     "colour": "red"}))
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\]"):
        load_task(tmp_path)
    (tmp_path / "task.json").write_text(json.dumps({"prompt": "p", "checks": []}))
    with pytest.raises(ValueError, match="non-empty 'checks'"):
        load_task(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        load_tasks(tmp_path / "nowhere")


@pytest.mark.parametrize(("call", "message"), [
    (ToolCall("edit_document", {"path": "a.xlsx", "op": "set_cell", "sheet": "S", "cell": "A1"}), "needs ['value']"),
    (ToolCall("edit_document", {"path": "a.pptx", "op": "set_table_cell", "table": 0, "row": 0, "col": 0,
                                "text": "x"}), "needs 'slide'"),
    (ToolCall("edit_document", {"path": "a.pptx", "op": "add_slide", "title": "t", "bullets": "x"}),
     "argument 'bullets' must be array"),
    (ToolCall("edit_document", {"path": "a.xlsx", "op": "insert_row", "sheet": "S", "row": True}),
     "argument 'row' must be integer"),
    (ToolCall("answer", {}), "missing required argument(s) ['text']"),
])
def test_check_call(call, message):
    assert message in check_call(call)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("soffice") is None or not Path(TOOL_VENV).is_dir(),
                    reason="needs LibreOffice and the office tool venv")
def test_rebuilding_reproduces_the_shipped_documents(tmp_path):
    """``build_tasks`` again, into a temporary folder: every document has the same content."""
    from jointrl.envs.office.build_tasks import SEEDS, build

    ids = build(tmp_path, SEEDS)
    assert sorted(ids) == [t.id for t in TASKS]

    def content(folder: Path) -> dict:
        paths = [str(p) for p in sorted(folder.glob("*/files/*"))]
        r = subprocess.run([f"{TOOL_VENV}/bin/python", "-I", str(TOOL_DIR / "office_tool.py"), "dump",
                            json.dumps({"paths": paths})], capture_output=True, text=True, check=True)
        return {str(Path(k).relative_to(folder)): v for k, v in json.loads(json.loads(r.stdout)["text"]).items()}

    assert content(tmp_path) == content(TASKS[0].root.parent)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("soffice") is None or not Path(TOOL_VENV).is_dir(),
                    reason="needs root, LibreOffice and the office tool venv")
def test_easy_families_build_and_their_oracle_solves_and_slip_fails(tmp_path):
    """The easy families (not shipped; five-domain recipe): built by build_tasks, seeded, named by
    family; the oracle scores 1 and the slip 0 through the env and office_checks."""
    assert not set(EASY_FAMILIES) & set(FAMILIES)
    ids = build(tmp_path, 1, list(EASY_FAMILIES))
    for family in EASY_FAMILIES:
        assert generate(family, 5) == generate(family, 5) != generate(family, 6)
    for task in (load_task(tmp_path / i) for i in ids):
        scores = {}
        for name in ("oracle", "wrong"):
            async def episode():
                env = OfficeEnv()
                try:
                    await env.reset(task)
                    answer = None
                    for turn in load_policy(task, name):
                        for call in turn:
                            obs = await env.step(call)
                            assert not obs.is_error, obs.text
                            answer = obs.text if call.name == "answer" else answer
                    return await asyncio.to_thread(combine, task.reward, task, Episode(
                        messages=[], final_answer=answer, verify_sandbox=env.verify_sandbox))
                finally:
                    await env.close()

            scores[name] = asyncio.run(episode()).score
        assert scores == {"oracle": 1.0, "wrong": 0.0}, (task.id, scores)
