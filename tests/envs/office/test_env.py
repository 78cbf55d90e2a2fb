"""OfficeEnv over real bwrap sandboxes, the tool venv and headless LibreOffice.

Includes the two acceptance checks on recalculation: a workbook whose cached values are stale
(or missing, as openpyxl leaves them) is scored on recalculated values, and four episodes
recalculating at once (each LibreOffice with its own profile) do not disturb each other.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from jointrl.envs.base import Env, EnvError, ToolCall, Verifiable
from jointrl.envs.office import OfficeEnv, load_task, load_tasks
from jointrl.envs.office import env as office_env
from jointrl.rewards import Episode, combine

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("soffice") is None
    or not Path(office_env.TOOL_VENV, "bin", "python").exists(),
    reason="needs root, bubblewrap, LibreOffice and the office tool venv (.ci/setup.d/office.sh)")

TASKS = {t.id: t for t in load_tasks()}


def read(path, part=None) -> ToolCall:
    return ToolCall("read_document", {"path": path, **({"part": part} if part else {})})


def edit(path, op, **arguments) -> ToolCall:
    return ToolCall("edit_document", {"path": path, "op": op, **arguments})


async def play(task, calls, env=None):
    """Run ``calls`` in a fresh episode; the observations and the final files (a snapshot)."""
    env = env or OfficeEnv()
    try:
        await env.reset(task)
        observations = [await env.step(c) for c in calls]
        return observations, await env.final_files()
    finally:
        await env.close()


def test_protocols_and_tools():
    env = OfficeEnv()
    assert isinstance(env, Env) and isinstance(env, Verifiable)
    assert [t.name for t in env.tools] == ["list_files", "read_document", "edit_document", "answer"]


def test_read_and_edit_a_report_and_a_deck():
    task = TASKS["report-to-slides-0"]
    calls = [
        ToolCall("list_files", {}),
        read("report.docx", "paragraphs"),
        edit("report.docx", "replace_text", find="Key figure", replace="Headline"),
        edit("report.docx", "add_paragraph", text="Added after the title.", after=0),
        read("report.docx", "paragraphs"),
        edit("summary.pptx", "add_slide", title="First", bullets=["one", "two"]),
        read("summary.pptx", "slide:1"),
    ]
    obs, _ = asyncio.run(play(task, calls))
    assert not any(o.is_error for o in obs), [o.text for o in obs if o.is_error]
    assert re.search(r"report\.docx \(\d+ bytes\)\nsummary\.pptx \(\d+ bytes\)", obs[0].text)
    assert "[p0] (Title)" in obs[1].text and "(Heading 1)" in obs[1].text and "Key figure:" in obs[1].text
    assert re.match(r"\d+ occurrence\(s\) replaced", obs[2].text)
    after = obs[4].text.splitlines()
    assert after[1] == "[p1] (Normal) Added after the title." and "Key figure" not in obs[4].text
    assert obs[6].text == "2 slides\n[slide 1] title: First\n  - one\n  - two"


def test_malformed_and_refused_calls_are_error_observations():
    task = TASKS["report-edit-0"]
    bad = [
        (ToolCall("shell", {"command": "ls"}), "unknown tool 'shell'"),
        (ToolCall("read_document", {}), "missing required argument(s) ['path']"),
        (ToolCall("read_document", {"path": 3}), "argument 'path' must be string, got int"),
        (ToolCall("read_document", "report.docx"), "must be a JSON object"),
        (edit("report.docx", "delete_everything"), "unknown op 'delete_everything'"),
        (edit("report.docx", "set_cell", sheet="S", cell="A1", value=1), "applies to ['.xlsx'] documents"),
        (edit("report.docx", "replace_text", find="x"), "needs ['replace']"),
        (edit("report.docx", "replace_text", find="x", replace="y", sheet="S"), "does not take ['sheet']"),
        (edit("report.docx", "replace_text", find="\x00", replace="y"), "NUL"),
        (edit("report.docx", "replace_text", find="Project Nobody", replace="y"), "does not occur"),
        (edit("report.docx", "set_table_cell", table=4, row=0, col=0, text="x"), "table 4 out of range"),
        (read("missing.docx"), "no such file"),
        (read("../../etc/passwd"), "outside /work"),
        (read("report.docx", "slide:1"), "for a .docx use"),
        (read("report.docx", "table:9"), "index out of range"),
    ]
    good = read("report.docx", "table:0")

    async def episode():
        env = OfficeEnv()
        try:
            await env.reset(task)
            return [await env.step(c) for c, _ in bad], await env.step(good), env.num_tool_errors
        finally:
            await env.close()

    observations, ok, errors = asyncio.run(episode())
    for (call, message), obs in zip(bad, observations):
        assert obs.is_error and not obs.done and message in obs.text, (call, obs.text)
    assert not ok.is_error and ok.text.startswith("[table 0] 6 rows\n  row 0: Office | Headcount | Revenue")
    assert errors == len(bad)


def test_answer_ends_the_episode():
    async def episode():
        env = OfficeEnv()
        try:
            await env.reset(TASKS["budget-lookup-0"])
            return await env.step(ToolCall("answer", {"text": "4,210"})), await env.step(read("budget.xlsx"))
        finally:
            await env.close()

    answered, after = asyncio.run(episode())
    assert answered.done and not answered.is_error and answered.text == "4,210"
    assert after.done and after.is_error


def test_a_missing_tool_venv_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(office_env, "TOOL_VENV", "/nonexistent/venv")
    with pytest.raises(EnvError, match="setup.d/office.sh"):
        OfficeEnv()


def test_a_broken_tool_is_an_env_error_not_a_policy_error(monkeypatch):
    """A tool script that cannot run (here: not where the command looks) is infrastructure."""
    async def episode():
        env = OfficeEnv()
        try:
            await env.reset(TASKS["budget-lookup-0"])
            monkeypatch.setattr(office_env, "TOOL_MOUNT", "/opt/elsewhere")
            await env.step(read("budget.xlsx"))
        finally:
            await env.close()

    with pytest.raises(EnvError, match="office_tool read crashed"):
        asyncio.run(episode())


def _openpyxl_reads(workbook: Path, sheet: str, cell: str):
    """What openpyxl alone (no recalculation) reads as the cell's value: the cached one."""
    code = (f"import openpyxl; print(repr(openpyxl.load_workbook({str(workbook)!r}, data_only=True)"
            f"[{sheet!r}][{cell!r}].value))")
    return subprocess.run([f"{office_env.TOOL_VENV}/bin/python", "-I", "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def _with_stale_cache(src: Path, dest: Path, cell: str, value: int) -> None:
    """Copy a workbook, setting ``cell`` of its first sheet to ``value`` without recomputing anything."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename == "xl/worksheets/sheet1.xml":
                data, n = re.subn(rf'(<c r="{cell}"[^>]*><v>)[^<]*(</v>)'.encode(), rb"\g<1>%d\g<2>" % value, data)
                assert n == 1
            zout.writestr(item, data)


@pytest.mark.parametrize("recalc", ["warm", "cold"])
def test_stale_and_missing_cached_values_are_recalculated_before_checking(tmp_path, monkeypatch, recalc):
    """budget.xlsx with Budget!B2 raised by 1000 behind the spreadsheet's back: E2 = SUM(B2:D2)
    and B8 = SUM(B2:B7) still cache the old totals. openpyxl alone reads those stale values (and
    None once an edit saved the file); the checker recalculates and sees the new ones, with the warm
    LibreOffice and with a start per recalculation."""
    monkeypatch.setenv("JOINTRL_OFFICE_RECALC", recalc)
    shipped = TASKS["budget-lookup-0"]
    folder = tmp_path / "stale"
    shutil.copytree(shipped.root, folder)
    cached_e2 = float(_openpyxl_reads(folder / "files" / "budget.xlsx", "Budget", "E2"))
    b2 = float(_openpyxl_reads(folder / "files" / "budget.xlsx", "Budget", "B2"))
    _with_stale_cache(shipped.root / "files" / "budget.xlsx", folder / "files" / "budget.xlsx", "B2", int(b2) + 1000)
    checks = [{"type": "cell_value", "path": "budget.xlsx", "sheet": "Budget", "cell": "E2", "equals": cached_e2 + 1000},
              {"type": "cell_formula", "path": "budget.xlsx", "sheet": "Budget", "cell": "E2"}]
    spec = json.loads((folder / "task.json").read_text())
    (folder / "task.json").write_text(json.dumps({**spec, "checks": checks}))
    task = load_task(folder)
    assert float(_openpyxl_reads(folder / "files" / "budget.xlsx", "Budget", "E2")) == cached_e2  # stale

    async def episode(calls):
        env = OfficeEnv(recalc=recalc == "warm")
        try:
            await env.reset(task)
            for c in calls:
                assert not (await env.step(c)).is_error
            final = await env.final_files()
            return final, combine(task.reward, task, Episode(messages=[], verify_sandbox=env.verify_sandbox))
        finally:
            await env.close()

    final, untouched = asyncio.run(episode([]))
    assert float(_openpyxl_reads(final.snapshot / "budget.xlsx", "Budget", "E2")) == cached_e2  # still stale
    assert untouched.score == 1.0, untouched.info
    final, edited = asyncio.run(episode([edit("budget.xlsx", "set_cell", sheet="Budget", cell="G1", value="note")]))
    assert _openpyxl_reads(final.snapshot / "budget.xlsx", "Budget", "E2") == "None"  # openpyxl dropped it
    assert edited.score == 1.0, edited.info


def test_four_episodes_recalculate_at_once_without_collisions(tmp_path):
    """Four add-cost-line episodes insert different amounts and read the Summary at the same time:
    each LibreOffice run (its own profile) recalculates its own workbook."""
    task = TASKS["add-cost-line-0"]
    t = next(int(c["cell"][1:]) for c in task.metadata["checks"] if c["type"] == "cell_formula")
    base = next(c["equals"] for c in task.metadata["checks"] if c["cell"] == f"B{t - 1}" and c["sheet"] == "Costs")
    old_total = next(c["equals"] for c in task.metadata["checks"] if c["cell"] == "B2" and c["sheet"] == "Summary") - base

    def calls(amount):
        return [edit("budget.xlsx", "insert_row", sheet="Costs", row=t - 1, values=["Extra", amount]),
                edit("budget.xlsx", "set_cell", sheet="Costs", cell=f"B{t}", value=f"=SUM(B2:B{t - 1})"),
                read("budget.xlsx", "Summary!A2:B2")]

    async def all_four():
        return await asyncio.gather(*[play(task, calls(1000 * (i + 1))) for i in range(4)])

    results = asyncio.run(all_four())
    for i, (obs, _) in enumerate(results):
        assert not any(o.is_error for o in obs), [o.text for o in obs]
        want = old_total + 1000 * (i + 1)
        assert f"B2={want!r} [=Costs!B{t}]" in obs[-1].text, (i, want, obs[-1].text)


@pytest.mark.slow
def test_four_recalculations_in_one_tmp_do_not_collide(tmp_path):
    """The same on the host, where the four LibreOffice processes share /tmp (the build's case):
    each makes its own profile, so none hands its document to another's running instance."""
    procs = []
    for i in range(1, 5):
        (tmp_path / str(i)).mkdir()
        spec = {"kind": "xlsx", "sheets": [{"name": "S", "rows": [[i], ["=A1*10"]]}]}
        args = json.dumps({"dir": str(tmp_path / str(i)), "files": {"w.xlsx": spec}})
        tool = str(office_env.TOOL_DIR / "office_tool.py")
        procs.append(subprocess.Popen([f"{office_env.TOOL_VENV}/bin/python", "-I", tool, "render", args],
                                      stdout=subprocess.PIPE, text=True))
    assert all(json.loads(p.communicate(timeout=600)[0])["ok"] for p in procs)
    for i in range(1, 5):
        assert _openpyxl_reads(tmp_path / str(i) / "w.xlsx", "S", "A2") == str(10 * i)
