"""The warm LibreOffice (envs/office/recalc.py) over a real bwrap sandbox and a real soffice:
it recalculates as a cold start does, starts once for many workbooks, keeps no document past its
request, carries nothing from one workbook into the next, and restarts after max_jobs or a crash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from jointrl.envs.office import env as office_env
from jointrl.envs.office.recalc import RecalcConfig, RecalcServer, available

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("soffice") is None
    or not Path(office_env.TOOL_VENV, "bin", "python").exists() or not available(),
    reason="needs root, bubblewrap, LibreOffice, python3-uno and the office tool venv (.ci/setup.d/office.sh)")

_VENV_PY = f"{office_env.TOOL_VENV}/bin/python"


def workbook(rows: list[list]) -> bytes:
    """An .xlsx written by openpyxl (as edit_document saves one: formulas without cached values)."""
    code = ("import io, sys, json, openpyxl\nwb = openpyxl.Workbook()\nws = wb.active\nws.title = 'S'\n"
            "for r in json.loads(sys.argv[1]):\n    ws.append(r)\nb = io.BytesIO()\nwb.save(b)\n"
            "sys.stdout.buffer.write(b.getvalue())")
    return subprocess.run([_VENV_PY, "-I", "-c", code, json.dumps(rows)], capture_output=True, check=True).stdout


def values(data: bytes, cells: list[str]) -> list:
    code = ("import io, sys, json, openpyxl\nws = openpyxl.load_workbook(io.BytesIO(sys.stdin.buffer.read()), "
            "data_only=True)['S']\nprint(json.dumps([ws[c].value for c in sys.argv[1:]]))")
    out = subprocess.run([_VENV_PY, "-I", "-c", code, *cells], input=data, capture_output=True, check=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def server():
    s = RecalcServer()
    yield s
    s.close()


def test_recalculates_every_formula(server):
    data = workbook([[2, 3, "=A1*B1"], ["=SUM(A1:C1)", '=IF(A2>10,"big","small")', "=AVERAGE(A1:B1)"]])
    assert values(data, ["C1", "A2"]) == [None, None]  # openpyxl left nothing computed
    out = server.recalc(data)
    assert values(out, ["C1", "A2", "B2", "C2"]) == [6, 11, "big", 2.5]


def test_one_start_for_many_workbooks_and_no_document_left_behind(server):
    starts = server.starts
    for i in range(5):
        assert values(server.recalc(workbook([[i, "=A1*10"]])), ["B1"]) == [10 * i]
    assert server.starts == max(starts, 1)
    assert server._server.sandbox is not None and list(server._server.sandbox.workdir.iterdir()) == []  # each job's folder deleted


def test_a_workbook_leaves_nothing_for_the_next(server):
    """A workbook full of what a formula can reach beyond its cells (the environment, the network, a
    file of the server's /work, links) changes nothing in the next one's result, against a fresh server."""
    probe = workbook([[7, "=A1*6", '=INFO("system")', "=ROW()"]])
    fresh = RecalcServer()
    try:
        want = values(fresh.recalc(probe), ["B1", "C1", "D1"])
    finally:
        fresh.close()
    hostile = workbook([[1, '=WEBSERVICE("http://127.0.0.1:1/")', "='file:///work/x/in.xlsx'#$S.A1",
                         '=DDE("soffice";"/work/x/in.xlsx";"S.A1")', '=INFO("directory")']])
    server.recalc(hostile)
    assert values(server.recalc(probe), ["B1", "C1", "D1"]) == want == [42, want[1], 1]


def test_restarts_after_max_jobs_and_after_a_crash():
    s = RecalcServer(RecalcConfig(max_jobs=2))
    try:
        for i in range(3):
            assert values(s.recalc(workbook([[i, "=A1+1"]])), ["B1"]) == [i + 1]
        assert s.starts == 2
        s._server.sandbox.kill_processes()  # soffice and the server die between two requests
        assert values(s.recalc(workbook([[5, "=A1+1"]])), ["B1"]) == [6]
        assert s.starts == 3
    finally:
        s.close()


def test_a_document_libreoffice_cannot_open_is_a_value_error(server):
    with pytest.raises(ValueError, match="cannot recalculate"):
        server.recalc(b"PK\x03\x04 not really a zip")
    assert values(server.recalc(workbook([[1, "=A1*3"]])), ["B1"]) == [3]  # the server carries on
