"""The office tools' schemas, and the host-side check of an ``edit_document`` operation's arguments.

``list_files``, ``read_document`` and ``edit_document`` run ``tool/office_tool.py`` in the
episode's sandbox; ``answer`` ends the episode with the answer text (for an edit task, a
short note). ``edit_document`` takes one operation per call, named by ``op``, with that
operation's arguments beside it (``EDIT_OPS``); what ``op`` needs is checked here, so a
malformed call costs no sandbox run.
"""

from __future__ import annotations

from typing import Any

from jointrl.envs.base import ToolCall, ToolSpec, validate_call

# op -> (document kinds it applies to, required arguments, optional arguments)
EDIT_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "set_cell": ((".xlsx",), ("sheet", "cell", "value"), ()),
    "insert_row": ((".xlsx",), ("sheet", "row"), ("values",)),
    "replace_text": ((".docx", ".pptx"), ("find", "replace"), ()),
    "add_paragraph": ((".docx",), ("text",), ("after", "style")),
    "set_table_cell": ((".docx", ".pptx"), ("table", "row", "col", "text"), ("slide",)),
    "add_slide": ((".pptx",), ("title",), ("bullets",)),
}

LIST_FILES = ToolSpec("list_files", "List the documents (.xlsx, .docx, .pptx) in the working folder.",
                      {"type": "object", "properties": {}})
READ_DOCUMENT = ToolSpec(
    "read_document",
    "Read a document. part (optional) narrows it: for a .xlsx a sheet name or a range such as "
    "'Budget!A1:D9' (cell values, with formulas in brackets); for a .docx 'paragraphs', 'tables' or "
    "'table:N'; for a .pptx 'slide:N'. Indices start at 0.",
    {"type": "object", "properties": {"path": {"type": "string"}, "part": {"type": "string"}}, "required": ["path"]},
)
EDIT_DOCUMENT = ToolSpec(
    "edit_document",
    "Apply one edit operation `op` to a document: .xlsx: set_cell(sheet, cell, value) (a value "
    "starting with '=' is a formula), insert_row(sheet, row, values?) (references below move down, "
    "as in a spreadsheet); .docx: replace_text(find, replace), add_paragraph(text, after?, style?) "
    "(after: a paragraph index; default: at the end), set_table_cell(table, row, col, text); .pptx: "
    "add_slide(title, bullets?), replace_text(find, replace), set_table_cell(slide, table, row, col, text).",
    {
        "type": "object",
        "properties": {
            "path": {"type": "string"}, "op": {"type": "string", "enum": sorted(EDIT_OPS)},
            "sheet": {"type": "string"}, "cell": {"type": "string"}, "value": {"type": ["string", "number"]},
            "row": {"type": "integer"}, "col": {"type": "integer"}, "values": {"type": "array"},
            "find": {"type": "string"}, "replace": {"type": "string"}, "text": {"type": "string"},
            "after": {"type": "integer"}, "style": {"type": "string"}, "table": {"type": "integer"},
            "slide": {"type": "integer"}, "title": {"type": "string"}, "bullets": {"type": "array"},
        },
        "required": ["path", "op"],
    },
)
ANSWER = ToolSpec("answer", "Give your final answer (for an edit task, a short note) and end the episode.",
                  {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
TOOLS = [LIST_FILES, READ_DOCUMENT, EDIT_DOCUMENT, ANSWER]
MAX_ARGUMENT_CHARS = 32_000  # a call's JSON arguments travel on the sandbox command line


def check_call(call: ToolCall) -> str | None:
    """The problem with ``call``, or ``None`` if it is well formed (schemas, then the edit op's needs)."""
    problem = validate_call(call, TOOLS)
    if problem is not None:
        return problem
    args: dict[str, Any] = call.arguments
    if any("\x00" in v for v in args.values() if isinstance(v, str)):
        return f"{call.name}: arguments must not contain NUL bytes"
    if call.name != "edit_document":
        return None
    op = args["op"]
    if op not in EDIT_OPS:
        return f"edit_document: unknown op {op!r}; allowed: {sorted(EDIT_OPS)}"
    kinds, required, optional = EDIT_OPS[op]
    if not args["path"].endswith(kinds):
        return f"edit_document: op {op!r} applies to {list(kinds)} documents, not {args['path']!r}"
    missing = [k for k in required if k not in args]
    extra = sorted(set(args) - {"path", "op", *required, *optional})
    if missing:
        return f"edit_document: op {op!r} needs {missing}"
    if extra:
        return f"edit_document: op {op!r} does not take {extra}; it takes {[*required, *optional]}"
    if op == "set_table_cell" and args["path"].endswith(".pptx") and "slide" not in args:
        return "edit_document: set_table_cell on a .pptx needs 'slide'"
    return None
