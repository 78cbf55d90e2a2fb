"""``texttable``: render rows of values as a plain-text table."""

from jointrl.envs.code_repo.specs.base import Bug, RepoSpec

FILES = {
    "README.md": '''\
# texttable

`render(rows, header=None, align=None, max_width=None)` lays rows of values out as a
plain-text table: cells are converted by `to_text`, padded by `pad`, cut by `truncate`.
Run the tests with `python3 -m pytest`.
''',
    "texttable/__init__.py": '''\
"""texttable: render rows of values as a plain-text table."""

from texttable.align import pad, truncate
from texttable.cells import to_text
from texttable.render import column_widths, render

__all__ = ["column_widths", "pad", "render", "to_text", "truncate"]
''',
    "texttable/cells.py": '''\
"""Turning cell values into text."""


def to_text(value, precision: int = 2) -> str:
    """None -> "", booleans -> "yes"/"no", floats rounded to ``precision``, tabs -> spaces."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{precision}f}"
    return str(value).replace("\\t", "    ")
''',
    "texttable/align.py": '''\
"""Fitting text into a column: padding and truncation."""

ALIGNMENTS = ("left", "right", "center")


def pad(text: str, width: int, align: str = "left") -> str:
    """``text`` padded with spaces to ``width``; center puts an odd extra space on the right."""
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    gap = width - len(text)
    if gap <= 0:
        return text
    if align == "left":
        return text + " " * gap
    if align == "right":
        return " " * gap + text
    left = gap // 2
    return " " * left + text + " " * (gap - left)


def truncate(text: str, width: int, marker: str = "~") -> str:
    """``text`` cut to at most ``width`` characters, ending in ``marker`` when cut."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if len(text) <= width:
        return text
    if width <= len(marker):
        return marker[:width]
    return text[: width - len(marker)] + marker
''',
    "texttable/render.py": '''\
"""Laying rows out as a table: header, separator, rows; columns joined by " | "."""

from texttable.align import pad, truncate
from texttable.cells import to_text


def column_widths(cells: list[list[str]], header: list[str] | None = None) -> list[int]:
    """The width of each column: its longest cell, the header included."""
    ncols = len(header) if header is not None else (len(cells[0]) if cells else 0)
    widths = [0] * ncols
    for row in ([header] if header is not None else []) + cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    return widths


def render(rows: list[list], header: list[str] | None = None, align: list[str] | None = None,
           max_width: int | None = None) -> str:
    """The table as text, one line per row, without trailing spaces."""
    cells = [[to_text(v) for v in row] for row in rows]
    ncols = len(header) if header is not None else (len(cells[0]) if cells else 0)
    for i, row in enumerate(cells):
        if len(row) != ncols:
            raise ValueError(f"row {i} has {len(row)} cells, expected {ncols}")
    if max_width is not None:
        cells = [[truncate(c, max_width) for c in row] for row in cells]
    widths = column_widths(cells, header)
    align = align or ["left"] * ncols

    def line(row):
        return " | ".join(pad(c, w, a) for c, w, a in zip(row, widths, align)).rstrip()

    out = []
    if header is not None:
        out += [line(header), "-+-".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\\n".join(out)
''',
    "tests/test_cells.py": '''\
from texttable import to_text


def test_float_is_rounded():
    assert to_text(3.14159) == "3.14"


def test_float_precision():
    assert to_text(2.0, precision=0) == "2"


def test_bool_is_yes_no():
    assert to_text(True) == "yes" and to_text(False) == "no"


def test_int_and_str():
    assert to_text(42) == "42" and to_text("x") == "x"
''',
    "tests/test_align.py": '''\
import pytest

from texttable import pad, truncate


def test_pad_left():
    assert pad("ab", 5) == "ab   "


def test_pad_right():
    assert pad("ab", 5, "right") == "   ab"


def test_pad_center_even_gap():
    assert pad("ab", 6, "center") == "  ab  "


def test_pad_unknown_alignment_raises():
    with pytest.raises(ValueError):
        pad("ab", 5, "middle")


def test_truncate_short_text_unchanged():
    assert truncate("abc", 5) == "abc"


def test_truncate_long_text():
    assert truncate("abcdefgh", 5) == "abcd~"
''',
    "tests/test_render.py": '''\
from texttable import render


def test_render_with_header():
    assert render([["apple", 3], ["fig", 12]], header=["fruit", "n"]) == (
        "fruit | n\\n"
        "------+---\\n"
        "apple | 3\\n"
        "fig   | 12"
    )


def test_render_without_header():
    assert render([[1, 2], [3, 4]]) == "1 | 2\\n3 | 4"


def test_render_right_aligned():
    assert render([["a", 1], ["b", 100]], align=["left", "right"]) == "a |   1\\nb | 100"


def test_render_max_width():
    assert render([["abcdefgh", 1]], max_width=4) == "abc~ | 1"
''',
}

BUGS = [
    Bug(
        id="texttable-1",
        problem=(
            "Centering puts the odd extra space on the wrong side: `pad(\"ab\", 5, \"center\")` "
            "returns `\"  ab \"`, but the docstring (and the layout of centered columns) "
            "expects `\" ab  \"`."
        ),
        breaks=[("texttable/align.py", "    left = gap // 2\n", "    left = gap - gap // 2\n")],
        tests={"tests/test_align.py": '''

def test_pad_center_odd_gap():
    assert pad("ab", 5, "center") == " ab  "


def test_render_centered_column():
    from texttable import render

    assert render([["x", "abcd"], ["y", "d"]], align=["left", "center"]) == "x | abcd\\ny |  d"
'''},
        fail_to_pass=["tests/test_align.py::test_pad_center_odd_gap", "tests/test_align.py::test_render_centered_column"],
        wrong=[("texttable/align.py", '    return " " * left + text + " " * (gap - left)\n',
                '    left = gap // 2\n    return " " * left + text + " " * left\n')],
    ),
    Bug(
        id="texttable-2",
        problem=(
            "`truncate` overflows the width with markers longer than one character: "
            "`truncate(\"abcdefgh\", 6, \"...\")` returns `\"abcde...\"` (8 characters), and "
            "`truncate(\"abcdef\", 2, \"...\")` returns 6 characters; the result must never be "
            "longer than `width` (just `\"..\"` in the second case)."
        ),
        breaks=[("texttable/align.py",
                 "    if width <= len(marker):\n        return marker[:width]\n"
                 "    return text[: width - len(marker)] + marker\n",
                 "    return text[: width - 1] + marker\n")],
        tests={"tests/test_align.py": '''

def test_truncate_long_marker():
    assert truncate("abcdefgh", 6, "...") == "abc..."


def test_truncate_narrower_than_marker():
    assert truncate("abcdef", 2, "...") == ".."
'''},
        fail_to_pass=["tests/test_align.py::test_truncate_long_marker", "tests/test_align.py::test_truncate_narrower_than_marker"],
        wrong=[("texttable/align.py", "    return text[: width - 1] + marker\n",
                "    return text[: width - len(marker)] + marker\n")],
    ),
    Bug(
        id="texttable-3",
        problem=(
            "Missing values show up as the word None: `to_text(None)` returns `\"None\"` and "
            "`render([[\"a\", None]])` prints `a | None`. Empty cells should be empty."
        ),
        breaks=[("texttable/cells.py", '    if value is None:\n        return ""\n    if isinstance(value, bool)',
                 "    if isinstance(value, bool)")],
        tests={"tests/test_cells.py": '''

def test_none_is_empty():
    assert to_text(None) == ""


def test_render_none_cell():
    from texttable import render

    assert render([["a", None], ["b", 1]]) == "a |\\nb | 1"
'''},
        fail_to_pass=["tests/test_cells.py::test_none_is_empty", "tests/test_cells.py::test_render_none_cell"],
        wrong=[("texttable/render.py", "    cells = [[to_text(v) for v in row] for row in rows]\n",
                '    cells = [["" if v is None else to_text(v) for v in row] for row in rows]\n')],
    ),
    Bug(
        id="texttable-4",
        problem=(
            "Rows with the wrong number of cells are silently cut or dropped: "
            "`render([[1, 2], [3]])` and `render([[1, 2]], header=[\"a\"])` print garbled "
            "tables or fail with an IndexError. `render` should raise `ValueError` naming the row."
        ),
        breaks=[("texttable/render.py",
                 "    for i, row in enumerate(cells):\n        if len(row) != ncols:\n"
                 "            raise ValueError(f\"row {i} has {len(row)} cells, expected {ncols}\")\n"
                 "    if max_width", "    if max_width")],
        tests={"tests/test_ragged.py": '''\
import pytest

from texttable import render


def test_short_row_raises():
    with pytest.raises(ValueError, match="row 1"):
        render([[1, 2], [3]])


def test_long_row_raises():
    with pytest.raises(ValueError, match="row 0"):
        render([[1, 2]], header=["a"])


def test_even_rows_render():
    assert render([[1, 2], [3, 4]], header=["a", "b"]).splitlines()[0] == "a | b"
'''},
        fail_to_pass=["tests/test_ragged.py::test_short_row_raises", "tests/test_ragged.py::test_long_row_raises"],
        wrong=[("texttable/render.py", "    if max_width is not None:\n",
                "    for i, row in enumerate(cells):\n        if len(row) < ncols:\n"
                "            raise ValueError(f\"row {i} has {len(row)} cells, expected {ncols}\")\n"
                "    if max_width is not None:\n")],
    ),
    Bug(
        id="texttable-5",
        problem=(
            "Headers wider than their column's cells are not accounted for: "
            "`column_widths([[\"1\"]], header=[\"count\"])` returns `[1]` instead of `[5]`, so "
            "`render` misaligns the header and its separator line is too short; a table with a "
            "header and no rows renders an empty separator."
        ),
        breaks=[("texttable/render.py", "    for row in ([header] if header is not None else []) + cells:\n",
                 "    for row in cells:\n")],
        tests={"tests/test_render.py": '''

def test_column_widths_include_header():
    from texttable import column_widths

    assert column_widths([["1"]], header=["count"]) == [5]


def test_render_header_only():
    assert render([], header=["name", "qty"]) == "name | qty\\n-----+----"
'''},
        fail_to_pass=["tests/test_render.py::test_column_widths_include_header", "tests/test_render.py::test_render_header_only"],
        wrong=[("texttable/render.py", "    for row in cells:\n", "    for row in cells or [header or []]:\n")],
    ),
]

REPO = RepoSpec(name="texttable", files=FILES, bugs=BUGS)
