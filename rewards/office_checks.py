"""``office_checks``: an office task's checker list, over the final answer and the final documents.

The checks are ``task.metadata["checks"]`` (as OfficeBench): every one must pass for 1.0,
else 0.0; with ``task.metadata["partial_credit"]`` the score is the share that passed.

- ``answer``: ``number`` (with ``unit``, ``rel_tol``, default 1e-3) or ``text`` (with
  ``aliases``) against ``Episode.final_answer``, compared as ``answer_match`` does (units of one
  dimension convert; a unit of another dimension fails; normalized text), and as OfficeQA does:
  the finance shorthands "5.4k", "$1.2M", "3bn" count as scale words, and an answer that states
  more than one number (a hedge such as "1200 or 1300") fails;
- ``cell_value`` (``path, sheet, cell, equals``, ``rel_tol`` for numbers, default 1e-6): the
  cell's value *after recalculation*; ``cell_formula`` (``path, sheet, cell``): the cell holds
  a formula that refers to at least one cell, not a typed-in value (``=5400`` is one);
- ``paragraph_contains`` (``path, text``, optional ``style`` prefix), ``text_absent`` (``path,
  text``: nowhere in the document), ``paragraph_in_section`` (``path, section, text``: a
  paragraph between that heading and the next one), ``table_cell`` (``path, table, row, col,
  text``, plus ``slide`` in a deck);
- ``slide_count`` (``path, count``), ``slide_titles`` (``path, titles``: all, in order),
  ``slide_contains`` (``path, slide, text``: in the slide's title, text or tables).

Text comparisons are on ``answer_match.normalize``. The documents are read in a fresh
verification sandbox over a copy of the episode's final files (``Episode.verify_sandbox``,
``envs/office/env.py``): every workbook there is first recalculated by LibreOffice -- this process's
warm one (``envs/office/recalc.py``: its own sandbox, which never runs policy code and keeps no
document past its request) or, without it, one started in that sandbox -- and the tool script, from
a read-only mount, writes every document's content to ``/logs/verifier``, which the policy never had. The
policy can only change documents through the edit operations, so a typed-in number where a
formula belongs is caught by ``cell_formula``. A checker that cannot run raises ``EnvError``.
Tasks with answer checks only never open a sandbox.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from typing import Any

from jointrl.envs.base import EnvError, Task
from jointrl.envs.office.env import VERIFY_TOOL_MOUNT, run_tool
from jointrl.envs.office.recalc import shared_server
from jointrl.rewards.answer_match import normalize as normalize_text
from jointrl.rewards.answer_match import number_matches
from jointrl.rewards.base import Episode, RewardResult, register

FACTS_FILE = "/logs/verifier/facts.json"
Facts = dict[str, dict[str, Any]]  # document path (relative to /work) -> its content (office_tool.py ``dump``)
_SHORTHAND = re.compile(r"(\d)\s*(k|m|mn|mio|bn)\b", re.IGNORECASE)
_SCALE_WORDS = {"k": "thousand", "m": "million", "mn": "million", "mio": "million", "bn": "billion"}
_NUMBERS = re.compile(r"\d[\d,.]*")
_STRING = re.compile(r'"[^"]*"')
_CELL_REF = re.compile(r"(?<![A-Za-z_.\d])\$?[A-Za-z]{1,3}\$?\d+(?![\d(])")


def refers_to_cells(formula: str | None) -> bool:
    """Whether a formula reads at least one cell (a constant behind ``=`` does not).

    >>> [refers_to_cells(f) for f in ("=SUM(B2:B7)", "=Costs!$B$8*2", "=5400", "=LOG10(100)", '="B2"', None)]
    [True, True, False, False, False, False]
    """
    return bool(formula) and _CELL_REF.search(_STRING.sub("", formula)) is not None


def answer_number_ok(answer: str | None, expected: float, unit: str = "", rel_tol: float = 1e-3) -> bool:
    """Whether ``answer`` states exactly one number, equal to ``expected`` (in ``unit``) within ``rel_tol``.

    >>> [answer_number_ok(a, 1_250_000, "USD") for a in ("1,250,000", "$1.25M", "1.25 million", "1250", "1.2M or 1.25M")]
    [True, True, True, False, False]
    >>> [answer_number_ok(a, 5400) for a in ("5.4k", "5401", "5410", None)]
    [True, True, False, False]
    """
    text = _SHORTHAND.sub(lambda m: f"{m[1]} {_SCALE_WORDS[m[2].lower()]}", answer or "")
    return len(_NUMBERS.findall(text)) == 1 and number_matches(text, expected, unit, rel_tol)


def answer_text_ok(answer: str | None, expected: str, aliases: tuple[str, ...] = ()) -> bool:
    """
    >>> answer_text_ok("the North.", "North"), answer_text_ok("North region", "North"), answer_text_ok("", "")
    (True, False, False)
    """
    got = normalize_text(answer or "")
    return bool(got) and any(got == normalize_text(e) for e in (expected, *aliases))


def _values_equal(got: Any, want: Any, rel_tol: float) -> bool:
    """
    >>> _values_equal(12.0, 12, 1e-6), _values_equal("12", 12, 1e-6), _values_equal(" Travel ", "travel", 0)
    (True, False, True)
    """
    if isinstance(want, int | float) and not isinstance(want, bool):
        return isinstance(got, int | float) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=rel_tol,
                                                                                            abs_tol=1e-9)
    return isinstance(got, str) and normalize_text(got) == normalize_text(str(want))


def _all_text(doc: dict[str, Any]) -> str:
    if doc["kind"] == "docx":
        parts = [p["text"] for p in doc["paragraphs"]] + [c for t in doc["tables"] for r in t for c in r]
    elif doc["kind"] == "pptx":
        parts = [_slide_text(s) for s in doc["slides"]]
    else:
        parts = [str(c["value"]) for cells in doc.get("sheets", {}).values() for c in cells.values()]
    return normalize_text(" ".join(parts))


def _slide_text(slide: dict[str, Any]) -> str:
    return " ".join([slide["title"], *slide["texts"], *[c for t in slide["tables"] for r in t for c in r]])


def _section(paragraphs: list[dict[str, str]], heading: str) -> list[dict[str, str]]:
    """The paragraphs after the heading ``heading`` and before the next heading."""
    def is_heading(p: dict[str, str]) -> bool:
        return p["style"].startswith(("Heading", "Title"))

    start = next((i for i, p in enumerate(paragraphs)
                  if is_heading(p) and normalize_text(p["text"]) == normalize_text(heading)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(paragraphs)) if is_heading(paragraphs[i])), len(paragraphs))
    return paragraphs[start + 1:end]


def _cell(doc: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    return doc.get("sheets", {}).get(spec["sheet"], {}).get(spec["cell"])


def _table_cell(doc: dict[str, Any], spec: dict[str, Any]) -> str | None:
    tables = doc["slides"][spec["slide"]]["tables"] if doc["kind"] == "pptx" else doc["tables"]
    try:
        return tables[spec["table"]][spec["row"]][spec["col"]]
    except IndexError:
        return None


def check(spec: dict[str, Any], facts: Facts, answer: str | None) -> bool:
    """Whether one check passes. Raises ``ValueError`` for a check type that does not exist.

    >>> facts = {"b.xlsx": {"kind": "xlsx", "sheets": {"S": {"B7": {"value": 30, "formula": "=SUM(B2:B6)"}}}}}
    >>> [check(c, facts, None) for c in ({"type": "cell_value", "path": "b.xlsx", "sheet": "S", "cell": "B7", "equals": 30},
    ...                                  {"type": "cell_formula", "path": "./b.xlsx", "sheet": "S", "cell": "B7"},
    ...                                  {"type": "cell_value", "path": "b.xlsx", "sheet": "S", "cell": "B8", "equals": 30})]
    [True, True, False]
    """
    kind = spec["type"]
    if kind == "answer":
        if "number" in spec:
            return answer_number_ok(answer, spec["number"], spec.get("unit", ""), spec.get("rel_tol", 1e-3))
        return answer_text_ok(answer, spec["text"], tuple(spec.get("aliases", ())))
    if kind not in _DOCUMENT_CHECKS:
        raise ValueError(f"unknown office check type {kind!r}; allowed: {sorted(['answer', *_DOCUMENT_CHECKS])}")
    doc = facts.get(posixpath.normpath(spec["path"]))
    if doc is None or doc["kind"] == "unreadable":
        return False
    try:
        return _DOCUMENT_CHECKS[kind](doc, spec)
    except (KeyError, IndexError, TypeError):  # a sheet, slide or table the document does not have
        return False


def _contains(haystack: str, needle: str) -> bool:
    return normalize_text(needle) in normalize_text(haystack)


_DOCUMENT_CHECKS = {
    "cell_value": lambda d, s: (c := _cell(d, s)) is not None and _values_equal(c["value"], s["equals"],
                                                                                   s.get("rel_tol", 1e-6)),
    "cell_formula": lambda d, s: (c := _cell(d, s)) is not None and refers_to_cells(c["formula"]),
    "paragraph_contains": lambda d, s: any(_contains(p["text"], s["text"]) and p["style"].startswith(s.get("style", ""))
                                           for p in d["paragraphs"]),
    "text_absent": lambda d, s: normalize_text(s["text"]) not in _all_text(d),
    "paragraph_in_section": lambda d, s: any(_contains(p["text"], s["text"]) for p in _section(d["paragraphs"], s["section"])),
    "table_cell": lambda d, s: (t := _table_cell(d, s)) is not None and normalize_text(t) == normalize_text(s["text"]),
    "slide_count": lambda d, s: len(d["slides"]) == s["count"],
    "slide_titles": lambda d, s: [normalize_text(x["title"]) for x in d["slides"]] == [normalize_text(t) for t in s["titles"]],
    "slide_contains": lambda d, s: _contains(_slide_text(d["slides"][s["slide"]]), s["text"]),
}


def score(checks: list[dict[str, Any]], facts: Facts, answer: str | None, partial_credit: bool = False) -> RewardResult:
    """All checks pass: 1.0 (else 0.0, or the share passed with ``partial_credit``); ``info["failed"]`` lists the rest.

    >>> score([{"type": "answer", "number": 42}, {"type": "answer", "text": "Oslo"}], {}, "42").info
    {'passed': 1, 'total': 2, 'failed': ['#1 answer']}
    """
    if not checks:
        raise ValueError("an office task needs at least one check")
    failed = [f"#{i} {c['type']}" for i, c in enumerate(checks) if not check(c, facts, answer)]
    passed = len(checks) - len(failed)
    value = passed / len(checks) if partial_credit else float(not failed)
    return RewardResult(value, {"passed": passed, "total": len(checks), "failed": failed})


def final_facts(task: Task, episode: Episode) -> Facts:
    """Every final document's content after recalculation, read in a fresh verification sandbox."""
    if episode.verify_sandbox is None:
        raise ValueError(f"office_checks needs episode.verify_sandbox (task {task.id!r})")
    try:
        sandbox = episode.verify_sandbox()
    except OSError as e:
        raise EnvError(f"cannot open the verification sandbox of task {task.id!r}: {e}") from e
    try:
        server = shared_server()
        if server is not None:  # the final workbooks recalculated in this process's warm LibreOffice
            listed = run_tool(sandbox, "workbooks", {}, script_dir=VERIFY_TOOL_MOUNT)
            if not listed["ok"]:
                raise EnvError(f"the office checker failed on task {task.id!r}: {listed['error']}")
            for path in json.loads(listed["text"]):
                sandbox.write_file(path, server.recalc(sandbox.read_file(path)))
        result = run_tool(sandbox, "facts", {"out": FACTS_FILE, "recalculated": server is not None},
                          script_dir=VERIFY_TOOL_MOUNT)
        if not result["ok"]:
            raise EnvError(f"the office checker failed on task {task.id!r}: {result['error']}")
        return json.loads(sandbox.read_file(FACTS_FILE))
    except (OSError, ValueError) as e:
        raise EnvError(f"verification sandbox of task {task.id!r} failed: {e}") from e
    finally:
        sandbox.close()


@register("office_checks")
def office_checks(task: Task, episode: Episode) -> RewardResult:
    checks = task.metadata.get("checks")
    if not isinstance(checks, list):
        raise ValueError(f"office task {task.id!r} has no checks (metadata['checks'])")
    needs_files = any(c.get("type") != "answer" for c in checks)
    facts = final_facts(task, episode) if needs_files else {}
    return score(checks, facts, episode.final_answer, bool(task.metadata.get("partial_credit", False)))
