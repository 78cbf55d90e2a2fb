"""Compact text observations (``envs.prompt=compact``): the page view with what the policy already has removed.

A text-mode observation is the page as markdown (``web/text_browser.py``): ``URL:``, ``Title:``,
then the visible lines. For a byte-level model every byte is a token read by every later turn,
and most of a form-filling episode re-sends the same page with one field changed. Compact mode
rewrites each observation on the host, from the previous one, by three rules:

1. the ``Title:`` line goes when a ``# <title>`` heading says the same;
2. markdown table rule lines (``| --- | --- |``) go;
3. an observation of the *same URL* whose lines differ from the previous one's only by lines
   changed in place (same count, same order; a field's value, a checkbox), fewer than half of
   them, becomes ``Same page; changed:`` and the changed lines only (``Same page; nothing
   changed.`` when none did). Any other page -- a new URL, a line added or removed, most lines
   changed -- is sent whole.

Nothing the policy needs is lost: every element number and value it could act on is either in
this observation or unchanged in the last whole one. Error observations are never rewritten.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^\|(?:\s*:?-{3,}:?\s*\|)+$")


def _trim(view: str) -> list[str]:
    """Rules 1 and 2.

    >>> _trim("URL: u\\nTitle: Cart\\n# Cart\\n| a | b |\\n| --- | --- |\\n| 1 | 2 |")
    ['URL: u', '# Cart', '| a | b |', '| 1 | 2 |']
    """
    lines = view.split("\n")
    title = next((ln[len("Title: "):] for ln in lines[:3] if ln.startswith("Title: ")), None)
    if title is not None and f"# {title}" in lines:
        lines = [ln for ln in lines if ln != f"Title: {title}"]
    return [ln for ln in lines if not _RULE.match(ln.strip())]


def compact_view(previous: str | None, view: str) -> str:
    """``view`` as compact mode sends it, given the previous observation's full ``view`` (None: none yet).

    >>> page = "URL: u\\nTitle: T\\n# T\\n[1: text \\"q\\" = \\"\\"]\\nline a\\nline b\\nline c"
    >>> compact_view(None, page).split("\\n")[:2]
    ['URL: u', '# T']
    >>> compact_view(page, page.replace('= ""', '= "x"'))
    'Same page; changed:\\n[1: text "q" = "x"]'
    >>> compact_view(page, page)
    'Same page; nothing changed.'
    """
    new = _trim(view)
    if previous is None:
        return "\n".join(new)
    old = _trim(previous)
    if not new or not old or new[0] != old[0] or not new[0].startswith("URL: "):
        return "\n".join(new)
    if len(new) != len(old):  # a line added or removed: the whole page
        return "\n".join(new)
    changed = [b for a, b in zip(old, new) if a != b]
    if not changed:
        return "Same page; nothing changed."
    if len(changed) * 2 >= len(new):
        return "\n".join(new)
    return "Same page; changed:\n" + "\n".join(changed)
