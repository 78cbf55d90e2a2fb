"""``office_checks`` on hand-made answers and document facts (no sandbox)."""

from __future__ import annotations

import doctest

import pytest

import jointrl.rewards.office_checks
from jointrl.envs.base import Task
from jointrl.rewards import Episode, combine, registered
from jointrl.rewards.office_checks import answer_number_ok, answer_text_ok, check, score

XLSX = {"kind": "xlsx", "sheets": {
    "Costs": {"A7": {"value": "Travel", "formula": None}, "B7": {"value": 1200, "formula": None},
              "B8": {"value": 5400.0, "formula": "=SUM(B2:B7)"}, "B9": {"value": 5400, "formula": None},
              "B10": {"value": 5400, "formula": "=5400"}},
    "Summary": {"B2": {"value": 0.123456789, "formula": "=Costs!B8/Costs!B1"}}}}
DOCX = {"kind": "docx",
        "paragraphs": [{"text": "Report", "style": "Title"}, {"text": "Summary", "style": "Heading 1"},
                       {"text": "Project Osprey leads.", "style": "Normal"}, {"text": "Offices", "style": "Heading 1"},
                       {"text": "By office:", "style": "Normal"}, {"text": "Outlook", "style": "Heading 1"},
                       {"text": "Stable demand.", "style": "Normal"}],
        "tables": [[["Office", "Headcount"], ["Berlin", "41"], ["Oslo", "17"]]]}
PPTX = {"kind": "pptx", "slides": [
    {"title": "Review", "texts": ["Quarterly update"], "tables": []},
    {"title": "Results", "texts": [], "tables": [[["Quarter", "Profit"], ["Q1", "310"]]]},
    {"title": "Next steps", "texts": ["Launch the pilot", "Hire two analysts"], "tables": []}]}
FACTS = {"b.xlsx": XLSX, "r.docx": DOCX, "d.pptx": PPTX, "bad.xlsx": {"kind": "unreadable", "error": "zip"}}


def test_doctests():
    assert doctest.testmod(jointrl.rewards.office_checks).failed == 0


def test_registered():
    assert "office_checks" in registered()


@pytest.mark.parametrize(("answer", "expected", "unit", "ok"), [
    ("5,400", 5400, "", True), ("5400.0", 5400, "", True), ("The total is $5,400.", 5400, "USD", True),
    ("5.4k", 5400, "", True), ("5.4 thousand", 5400, "", True), ("5401", 5400, "", True),  # within 0.1 %
    ("5410", 5400, "", False), ("5.4", 5400, "", False),  # kUSD read as USD: off by 1000
    ("5400 or 5500", 5400, "", False), ("", 5400, "", False), (None, 5400, "", False),
    ("12.5%", 12.5, "%", True), ("12.5", 12.5, "%", True), ("-3", -3, "", True), ("3", -3, "", False),
    ("$1.2bn", 1.2e9, "USD", True), ("1,200 kg", 1200, "USD", False),  # a unit of another dimension
])
def test_numeric_answers(answer, expected, unit, ok):
    assert answer_number_ok(answer, expected, unit) is ok


@pytest.mark.parametrize(("answer", "ok"), [("Berlin", True), ("  berlin. ", True), ("The Berlin", True),
                                            ("Berlin office", False), ("", False), ("Oslo", False)])
def test_text_answers(answer, ok):
    assert answer_text_ok(answer, "Berlin") is ok


@pytest.mark.parametrize(("spec", "ok"), [
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Costs", "cell": "B8", "equals": 5400}, True),
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Costs", "cell": "B8", "equals": 5401}, False),
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Costs", "cell": "A7", "equals": "travel"}, True),
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Costs", "cell": "A7", "equals": 1200}, False),
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Summary", "cell": "B2", "equals": 0.1234567891}, True),
    ({"type": "cell_value", "path": "b.xlsx", "sheet": "Nope", "cell": "B8", "equals": 5400}, False),
    ({"type": "cell_formula", "path": "b.xlsx", "sheet": "Costs", "cell": "B8"}, True),
    ({"type": "cell_formula", "path": "b.xlsx", "sheet": "Costs", "cell": "B9"}, False),  # typed-in total
    ({"type": "cell_formula", "path": "b.xlsx", "sheet": "Costs", "cell": "B10"}, False),  # typed in behind '=' 
    ({"type": "cell_formula", "path": "bad.xlsx", "sheet": "Costs", "cell": "B8"}, False),
    ({"type": "cell_formula", "path": "missing.xlsx", "sheet": "Costs", "cell": "B8"}, False),
    ({"type": "paragraph_contains", "path": "r.docx", "text": "project osprey"}, True),
    ({"type": "paragraph_contains", "path": "r.docx", "text": "Osprey", "style": "Heading"}, False),
    ({"type": "text_absent", "path": "r.docx", "text": "Project Falcon"}, True),
    ({"type": "text_absent", "path": "r.docx", "text": "Oslo"}, False),  # in a table cell
    ({"type": "paragraph_in_section", "path": "r.docx", "section": "Summary", "text": "Osprey leads"}, True),
    ({"type": "paragraph_in_section", "path": "r.docx", "section": "Offices", "text": "Osprey leads"}, False),
    ({"type": "paragraph_in_section", "path": "r.docx", "section": "Missing", "text": "Osprey"}, False),
    ({"type": "table_cell", "path": "r.docx", "table": 0, "row": 1, "col": 1, "text": "41"}, True),
    ({"type": "table_cell", "path": "r.docx", "table": 0, "row": 2, "col": 1, "text": "41"}, False),
    ({"type": "table_cell", "path": "r.docx", "table": 0, "row": 9, "col": 1, "text": "41"}, False),
    ({"type": "table_cell", "path": "d.pptx", "slide": 1, "table": 0, "row": 1, "col": 1, "text": "310"}, True),
    ({"type": "slide_count", "path": "d.pptx", "count": 3}, True),
    ({"type": "slide_count", "path": "d.pptx", "count": 4}, False),
    ({"type": "slide_titles", "path": "d.pptx", "titles": ["Review", "Results", "Next steps"]}, True),
    ({"type": "slide_titles", "path": "d.pptx", "titles": ["Review", "Next steps", "Results"]}, False),
    ({"type": "slide_contains", "path": "d.pptx", "slide": 2, "text": "launch the pilot"}, True),
    ({"type": "slide_contains", "path": "d.pptx", "slide": 1, "text": "310"}, True),
    ({"type": "slide_contains", "path": "d.pptx", "slide": 7, "text": "310"}, False),
])
def test_document_checks(spec, ok):
    assert check(spec, FACTS, None) is ok


def test_unknown_check_type_names_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown office check type 'cell_colour'.*slide_titles"):
        check({"type": "cell_colour", "path": "b.xlsx"}, FACTS, None)


def test_all_checks_must_pass_unless_partial_credit():
    checks = [{"type": "slide_count", "path": "d.pptx", "count": 3}, {"type": "answer", "text": "Oslo"}]
    assert score(checks, FACTS, "Oslo").score == 1.0
    assert score(checks, FACTS, "Berlin").score == 0.0
    assert score(checks, FACTS, "Berlin", partial_credit=True).score == 0.5


def test_answer_only_tasks_need_no_sandbox():
    task = Task(id="t", domain="office", prompt="p", reward={"office_checks": 1.0},
                metadata={"checks": [{"type": "answer", "number": 1_250_000, "unit": "USD"}]})
    assert combine(task.reward, task, Episode(messages=[], final_answer="1.25 million")).score == 1.0
    assert combine(task.reward, task, Episode(messages=[], final_answer="1250")).score == 0.0
    with pytest.raises(ValueError, match="no checks"):
        combine(task.reward, Task(id="u", domain="office", prompt="p"), Episode(messages=[]))
