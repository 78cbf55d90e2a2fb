"""The office tools, run inside the episode's sandbox: ``office_tool.py COMMAND JSON_ARGS``.

It runs on the read-only tool venv's Python (openpyxl, python-docx, python-pptx; made by
``.ci/setup.d/office.sh``) with ``-I``, and prints one JSON object: ``{"ok": true, "text": ...}``
or ``{"ok": false, "error": ...}`` (a problem with the call or the document: the host returns it
to the model as an error observation). Commands:

- ``list``: the documents under /work;
- ``read {path, part, limit}``: a document as text (``part``: see ``_read``); a workbook with
  a formula that has no cached value is first recalculated;
- ``edit {path, op, ...}``: one edit operation; workbooks are saved by openpyxl, which drops
  every cached formula value, so the next ``read`` recalculates them;
- ``facts {out, recalculated}``: recalculate every workbook (unless the host already did, in its
  warm LibreOffice: ``recalculated``), then write every document's content as JSON to ``out`` (the
  checker's input, in the verification sandbox); ``workbooks``: the .xlsx paths, as JSON;
- ``render {dir, files}``: write documents from their descriptions (building the shipped tasks);
  ``dump {paths}``: their content as JSON (the build's reproducibility test).

Recalculation is headless LibreOffice with its own profile in a fresh temporary directory per
process (``-env:UserInstallation``: concurrent instances sharing one profile collide) whose
settings say "always recalculate on load" (LibreOffice's default for .xlsx keeps the cached
values, stale ones included).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

WORK = "/work"
KINDS = (".xlsx", ".docx", ".pptx")
RECALC_TIMEOUT_S = 240
# LibreOffice settings for the fresh profile: recalculate OOXML and ODF files on load, always.
_PROFILE_XCU = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" xmlns:xs="http://www.w3.org/2001/XMLSchema" \
xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Calc/Formula/Load"><prop oor:name="OOXMLRecalcMode" oor:op="fuse">\
<value>0</value></prop></item>
<item oor:path="/org.openoffice.Office.Calc/Formula/Load"><prop oor:name="ODFRecalcMode" oor:op="fuse">\
<value>0</value></prop></item>
</oor:items>
"""
_CELL = re.compile(r"^\$?([A-Z]{1,3})\$?([1-9][0-9]*)$")
_REF = re.compile(r"^(?:(?P<sheet>'(?:[^']|'')+'|[^'!:]+)!)?(?P<a>\$?[A-Z]{1,3}\$?\d+)(?::(?P<b>\$?[A-Z]{1,3}\$?\d+))?$")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


class CallError(ValueError):
    """The call or the document is at fault; the message goes back to the model."""


class InfraError(RuntimeError):
    """LibreOffice failed or hung: the host raises ``EnvError`` (retried, never scored)."""


# -- paths and recalculation ------------------------------------------------------------------

def _resolve(path: str) -> str:
    """An existing document under /work (relative paths are relative to /work)."""
    full = os.path.realpath(os.path.join(WORK, path))
    if not (full == WORK or full.startswith(WORK + "/")):
        raise CallError(f"{path}: outside /work")
    if not os.path.isfile(full):
        raise CallError(f"{path}: no such file (list_files shows the documents)")
    if not full.endswith(KINDS):
        raise CallError(f"{path}: not an office document; supported: {list(KINDS)}")
    return full


def documents() -> list[str]:
    out = []
    for root, dirs, files in os.walk(WORK):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.relpath(os.path.join(root, f), WORK) for f in sorted(files) if f.endswith(KINDS)]
    return out


def _uncomputed(path: str) -> bool:
    """Whether a formula of the workbook has no cached value (as after any openpyxl save)."""
    import openpyxl

    wb_f, wb_v = openpyxl.load_workbook(path), openpyxl.load_workbook(path, data_only=True)
    return any(isinstance(c.value, str) and c.value.startswith("=") and wb_v[ws.title][c.coordinate].value is None
               for ws in wb_f.worksheets for row in ws.iter_rows() for c in row)


def recalc(path: str) -> None:
    """Recalculate every formula of the workbook at ``path`` in place, with headless LibreOffice."""
    with tempfile.TemporaryDirectory(prefix="lo-") as tmp:
        os.makedirs(f"{tmp}/profile/user")
        with open(f"{tmp}/profile/user/registrymodifications.xcu", "w") as f:
            f.write(_PROFILE_XCU)
        cmd = ["soffice", "--headless", "--norestore", "--nologo", "--nolockcheck",
               f"-env:UserInstallation=file://{tmp}/profile", "--convert-to", "xlsx", "--outdir", f"{tmp}/out", path]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=RECALC_TIMEOUT_S,
                               env={**os.environ, "HOME": tmp})
        except subprocess.TimeoutExpired as e:
            raise InfraError(f"LibreOffice did not finish recalculating {path} within {RECALC_TIMEOUT_S} s") from e
        out = os.path.join(tmp, "out", os.path.basename(path))
        if not os.path.isfile(out):
            raise InfraError(f"LibreOffice did not recalculate {path} (exit {r.returncode}): {r.stderr[-500:]}")
        shutil.copyfile(out, path)


# -- reading: every document as plain data ----------------------------------------------------

def _plain(v):
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def dump(path: str) -> dict:
    """The document's content: cells (value and formula), paragraphs and tables, or slides."""
    if path.endswith(".xlsx"):
        import openpyxl

        wb_f, wb_v = openpyxl.load_workbook(path), openpyxl.load_workbook(path, data_only=True)
        sheets = {}
        for ws in wb_f.worksheets:
            wv, cells = wb_v[ws.title], {}
            for row in ws.iter_rows():
                for c in row:
                    if c.value is None:
                        continue
                    formula = c.value if isinstance(c.value, str) and c.value.startswith("=") else None
                    cells[c.coordinate] = {"value": _plain(wv[c.coordinate].value), "formula": formula}
            sheets[ws.title] = cells
        return {"kind": "xlsx", "sheets": sheets}
    if path.endswith(".docx"):
        import docx

        d = docx.Document(path)
        paragraphs = [{"text": p.text, "style": p.style.name if p.style is not None else ""} for p in d.paragraphs]
        tables = [[[c.text for c in r.cells] for r in t.rows] for t in d.tables]
        return {"kind": "docx", "paragraphs": paragraphs, "tables": tables}
    import pptx

    slides = []
    for s in pptx.Presentation(path).slides:
        title = s.shapes.title.text_frame.text if s.shapes.title is not None else ""
        texts, tables = [], []
        for shape in s.shapes:
            if shape.has_text_frame and shape != s.shapes.title:
                texts += [p.text for p in shape.text_frame.paragraphs if p.text]
            if shape.has_table:
                tables.append([[c.text for c in r.cells] for r in shape.table.rows])
        slides.append({"title": title, "texts": texts, "tables": tables})
    return {"kind": "pptx", "slides": slides}


def _grid(rows: list[list[str]]) -> list[str]:
    return [f"  row {i}: " + " | ".join(r) for i, r in enumerate(rows)]


def _index(part: str, prefix: str, n: int) -> int:
    try:
        i = int(part[len(prefix):])
    except ValueError:
        raise CallError(f"part {part!r}: expected {prefix}N") from None
    if not 0 <= i < n:
        raise CallError(f"part {part!r}: index out of range (0..{n - 1})")
    return i


def _read(path: str, part: str) -> str:
    """Text of a document or of a part of it.

    xlsx: "" (every sheet), "Sheet" or "Sheet!A1:D9" (values, with formulas in brackets);
    docx: "" (paragraphs and tables, in order of kind), "paragraphs", "tables", "table:N";
    pptx: "" (every slide), "slide:N".
    """
    d = dump(path)
    if d["kind"] == "xlsx":
        return _read_sheets(d["sheets"], part)
    if d["kind"] == "docx":
        out = []
        if part in ("", "paragraphs"):
            out += [f"[p{i}] ({p['style']}) {p['text']}" for i, p in enumerate(d["paragraphs"])]
        if part in ("", "tables"):
            for i, t in enumerate(d["tables"]):
                out += [f"[table {i}] {len(t)} rows", *_grid(t)]
        if part.startswith("table:"):
            t = d["tables"][_index(part, "table:", len(d["tables"]))]
            out += [f"[table {part[6:]}] {len(t)} rows", *_grid(t)]
        if not out and part not in ("", "paragraphs", "tables"):
            raise CallError(f"part {part!r}: for a .docx use '', 'paragraphs', 'tables' or 'table:N'")
        return "\n".join(out)
    slides = d["slides"]
    picked = range(len(slides))
    if part:
        if not part.startswith("slide:"):
            raise CallError(f"part {part!r}: for a .pptx use '' or 'slide:N'")
        picked = [_index(part, "slide:", len(slides))]
    out = [f"{len(slides)} slides"]
    for i in picked:
        s = slides[i]
        out += [f"[slide {i}] title: {s['title']}", *[f"  - {t}" for t in s["texts"]]]
        for j, t in enumerate(s["tables"]):
            out += [f"  [table {j}]", *_grid(t)]
    return "\n".join(out)


def _col(letters: str) -> int:
    n = 0
    for ch in letters:
        n = n * 26 + ord(ch) - 64
    return n


def _read_sheets(sheets: dict, part: str) -> str:
    name, _, rng = part.partition("!")
    if name and name not in sheets:
        raise CallError(f"no sheet {name!r}; sheets: {list(sheets)}")
    box = None
    if rng:
        a, _, b = rng.upper().partition(":")
        ma, mb = _CELL.match(a), _CELL.match(b or a)
        if not (ma and mb):
            raise CallError(f"range {rng!r}: expected like A1:D9")
        box = (_col(ma[1]), int(ma[2]), _col(mb[1]), int(mb[2]))
    out = []
    for title, cells in sheets.items():
        if name and title != name:
            continue
        out.append(f"[sheet {title}]")
        rows: dict[int, list[str]] = {}
        for coord, c in cells.items():
            m = _CELL.match(coord)
            col, row = _col(m[1]), int(m[2])
            if box and not (box[0] <= col <= box[2] and box[1] <= row <= box[3]):
                continue
            shown = f"{coord}={c['value']!r}" + (f" [{c['formula']}]" if c["formula"] else "")
            rows.setdefault(row, []).append(shown)
        out += [f"  row {r}: " + " | ".join(rows[r]) for r in sorted(rows)]
    return "\n".join(out)


# -- editing ----------------------------------------------------------------------------------

def _need(args: dict, *keys: str) -> list:
    missing = [k for k in keys if args.get(k) is None]
    if missing:
        raise CallError(f"operation {args['op']!r} needs {missing}")
    return [args[k] for k in keys]


def _cell_value(v):
    """A JSON value as a cell value: '=...' is a formula, a numeric string a number."""
    if isinstance(v, str) and _NUMBER.match(v.strip()):
        s = v.strip()
        return float(s) if "." in s else int(s)
    return v


def shift_formula(formula: str, own_sheet: str, sheet: str, row: int, n: int = 1) -> str:
    """``formula`` (on ``own_sheet``) with references to rows >= ``row`` of ``sheet`` moved down ``n``.

    As a spreadsheet does when rows are inserted: a range ending at or below ``row`` grows.
    """
    from openpyxl.formula.tokenizer import Token, Tokenizer

    def move(ref: str) -> str:
        m = re.match(r"^(\$?[A-Z]{1,3}\$?)(\d+)$", ref)
        r = int(m[2])
        return f"{m[1]}{r + n if r >= row else r}"

    out = []
    for t in Tokenizer(formula).items:
        m = _REF.match(t.value) if t.type == Token.OPERAND and t.subtype == Token.RANGE else None
        if m is None:
            out.append(t.value)
            continue
        target = (m["sheet"] or own_sheet).strip("'").replace("''", "'")
        if target != sheet:
            out.append(t.value)
            continue
        prefix = f"{m['sheet']}!" if m["sheet"] else ""
        out.append(prefix + move(m["a"]) + (f":{move(m['b'])}" if m["b"] else ""))
    return "=" + "".join(out)


def _edit_xlsx(path: str, args: dict) -> str:
    import openpyxl

    wb = openpyxl.load_workbook(path)
    op = args["op"]
    sheet_name = _need(args, "sheet")[0]
    if sheet_name not in wb.sheetnames:
        raise CallError(f"no sheet {sheet_name!r}; sheets: {wb.sheetnames}")
    ws = wb[sheet_name]
    if op == "set_cell":
        cell, value = _need(args, "cell", "value")
        if not _CELL.match(str(cell).upper()):
            raise CallError(f"cell {cell!r}: expected like B7")
        ws[str(cell).upper()] = _cell_value(value)
        msg = f"{sheet_name}!{str(cell).upper()} set to {value!r}"
    elif op == "insert_row":
        row = _need(args, "row")[0]
        if not isinstance(row, int) or row < 1:
            raise CallError(f"row must be an integer >= 1, got {row!r}")
        values = args.get("values") or []
        if not isinstance(values, list):
            raise CallError("values must be an array (the new row's cells from column A)")
        ws.insert_rows(row)
        for other in wb.worksheets:
            for cells in other.iter_rows():
                for c in cells:
                    if isinstance(c.value, str) and c.value.startswith("="):
                        c.value = shift_formula(c.value, other.title, sheet_name, row)
        for i, v in enumerate(values, start=1):
            ws.cell(row=row, column=i, value=_cell_value(v))
        msg = f"row {row} inserted in {sheet_name} (references below it moved down)"
    else:
        raise CallError(f"operation {op!r} does not apply to a .xlsx; use set_cell or insert_row")
    wb.save(path)
    return msg + "; formulas are recalculated when the workbook is next read."


def _replace_in_paragraph(p, find: str, repl: str) -> int:
    """Replace in a python-docx / python-pptx paragraph; text spanning runs lands in the first run."""
    n = p.text.count(find)
    if n:
        new, runs = p.text.replace(find, repl), list(p.runs)
        runs[0].text = new
        for r in runs[1:]:
            r.text = ""
    return n


def _set_table_cell(tables: list, args: dict) -> str:
    table, row, col, text = _need(args, "table", "row", "col", "text")
    if not (isinstance(table, int) and 0 <= table < len(tables)):
        raise CallError(f"table {table!r} out of range (0..{len(tables) - 1})")
    rows = tables[table].rows
    if not (isinstance(row, int) and 0 <= row < len(rows)):
        raise CallError(f"row {row!r} out of range (0..{len(rows) - 1})")
    cells = rows[row].cells
    if not (isinstance(col, int) and 0 <= col < len(cells)):
        raise CallError(f"col {col!r} out of range (0..{len(cells) - 1})")
    cells[col].text = str(text)
    return f"table {table} cell ({row}, {col}) set to {text!r}"


def _edit_docx(path: str, args: dict) -> str:
    import docx

    d, op = docx.Document(path), args["op"]
    if op == "replace_text":
        find, repl = _need(args, "find", "replace")
        if not find:
            raise CallError("find must not be empty")
        paragraphs = list(d.paragraphs) + [p for t in d.tables for r in t.rows for c in r.cells for p in c.paragraphs]
        n = sum(_replace_in_paragraph(p, find, repl) for p in paragraphs)
        if not n:
            raise CallError(f"{find!r} does not occur in {os.path.relpath(path, WORK)}")
        msg = f"{n} occurrence(s) replaced"
    elif op == "add_paragraph":
        text = _need(args, "text")[0]
        style, after = args.get("style"), args.get("after")
        try:
            if after is None:
                p = d.add_paragraph(str(text), style)
            else:
                if not (isinstance(after, int) and 0 <= after < len(d.paragraphs)):
                    raise CallError(f"after must be a paragraph index 0..{len(d.paragraphs) - 1}")
                nxt = d.paragraphs[after + 1] if after + 1 < len(d.paragraphs) else None
                p = nxt.insert_paragraph_before(str(text), style) if nxt is not None else d.add_paragraph(str(text), style)
        except KeyError as e:
            raise CallError(f"unknown paragraph style {style!r}") from e
        msg = f"paragraph added ({p.style.name})"
    elif op == "set_table_cell":
        msg = _set_table_cell(d.tables, args)
    else:
        raise CallError(f"operation {op!r} does not apply to a .docx; use replace_text, add_paragraph or set_table_cell")
    d.save(path)
    return msg


def _edit_pptx(path: str, args: dict) -> str:
    import pptx

    prs, op = pptx.Presentation(path), args["op"]
    if op == "add_slide":
        title = _need(args, "title")[0]
        bullets = args.get("bullets") or []
        if not isinstance(bullets, list):
            raise CallError("bullets must be an array of strings")
        slide = prs.slides.add_slide(prs.slide_layouts[1])  # "Title and Content"
        slide.shapes.title.text = str(title)
        body = slide.placeholders[1].text_frame
        for i, b in enumerate(bullets):
            (body.paragraphs[0] if i == 0 else body.add_paragraph()).text = str(b)
        msg = f"slide {len(prs.slides) - 1} added"
    elif op == "replace_text":
        find, repl = _need(args, "find", "replace")
        if not find:
            raise CallError("find must not be empty")
        n = 0
        for s in prs.slides:
            for shape in s.shapes:
                if shape.has_text_frame:
                    n += sum(_replace_in_paragraph(p, find, repl) for p in shape.text_frame.paragraphs)
        if not n:
            raise CallError(f"{find!r} does not occur in {os.path.relpath(path, WORK)}")
        msg = f"{n} occurrence(s) replaced"
    elif op == "set_table_cell":
        slide = _need(args, "slide")[0]
        if not (isinstance(slide, int) and 0 <= slide < len(prs.slides)):
            raise CallError(f"slide {slide!r} out of range (0..{len(prs.slides) - 1})")
        msg = _set_table_cell([s.table for s in prs.slides[slide].shapes if s.has_table], args)
    else:
        raise CallError(f"operation {op!r} does not apply to a .pptx; use add_slide, replace_text or set_table_cell")
    prs.save(path)
    return msg


# -- rendering (building the shipped tasks) ----------------------------------------------------

def render(path: str, spec: dict) -> None:
    """Write a document from its description (``envs/office/generate.py`` makes them)."""
    import datetime

    fixed = datetime.datetime(2024, 1, 1)
    if spec["kind"] == "xlsx":
        import openpyxl
        from openpyxl.styles import Font

        wb = openpyxl.Workbook()
        wb.remove(wb.active)
        for sheet in spec["sheets"]:
            ws = wb.create_sheet(sheet["name"])
            for row in sheet["rows"]:
                ws.append(row)
            for c in ws[1]:
                c.font = Font(bold=True)
            ws.column_dimensions["A"].width = 22
        wb.properties.created = wb.properties.modified = fixed
        wb.save(path)
    elif spec["kind"] == "docx":
        import docx

        d = docx.Document()
        for block in spec["blocks"]:
            if "heading" in block:
                d.add_heading(block["heading"], block.get("level", 1))
            elif "paragraph" in block:
                d.add_paragraph(block["paragraph"])
            elif "bullets" in block:
                for b in block["bullets"]:
                    d.add_paragraph(b, "List Bullet")
            else:
                rows = block["table"]
                t = d.add_table(rows=len(rows), cols=len(rows[0]))
                t.style = "Table Grid"
                for r, row in enumerate(rows):
                    for c, text in enumerate(row):
                        t.cell(r, c).text = str(text)
        d.core_properties.created = d.core_properties.modified = fixed
        d.save(path)
    else:
        import pptx
        from pptx.util import Inches

        prs = pptx.Presentation()
        for s in spec["slides"]:
            if "subtitle" in s:
                slide = prs.slides.add_slide(prs.slide_layouts[0])
                slide.placeholders[1].text = s["subtitle"]
            elif "table" in s:
                slide = prs.slides.add_slide(prs.slide_layouts[5])  # "Title Only"
                rows = s["table"]
                t = slide.shapes.add_table(len(rows), len(rows[0]), Inches(0.5), Inches(1.6), Inches(9),
                                           Inches(0.4) * len(rows)).table
                for r, row in enumerate(rows):
                    for c, text in enumerate(row):
                        t.cell(r, c).text = str(text)
            else:
                slide = prs.slides.add_slide(prs.slide_layouts[1])
                body = slide.placeholders[1].text_frame
                for i, b in enumerate(s.get("bullets", [])):
                    (body.paragraphs[0] if i == 0 else body.add_paragraph()).text = b
            slide.shapes.title.text = s["title"]
        prs.core_properties.created = prs.core_properties.modified = fixed
        prs.save(path)
    if path.endswith(".xlsx"):
        recalc(path)  # the shipped workbook carries LibreOffice's computed values


# -- commands ---------------------------------------------------------------------------------

def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut; read a part]"


def main(command: str, args: dict) -> str:
    limit = int(args.get("limit", 12000))
    if command == "list":
        docs = documents()
        return "\n".join(f"{p} ({os.path.getsize(os.path.join(WORK, p))} bytes)" for p in docs) or "(no documents)"
    if command == "read":
        path = _resolve(args["path"])
        if path.endswith(".xlsx") and _uncomputed(path):
            recalc(path)
        return _truncate(_read(path, str(args.get("part") or "")), limit)
    if command == "edit":
        path = _resolve(args["path"])
        return {".xlsx": _edit_xlsx, ".docx": _edit_docx, ".pptx": _edit_pptx}[path[-5:]](path, args)
    if command == "dump":
        return json.dumps({p: dump(p) for p in args["paths"]})
    if command == "render":
        for name, spec in args["files"].items():
            render(os.path.join(args["dir"], name), spec)
        return f"{len(args['files'])} documents"
    if command == "workbooks":  # the host recalculates these in its warm LibreOffice (envs/office/recalc.py)
        return json.dumps([p for p in documents() if p.endswith(".xlsx")])
    if command == "facts":
        facts = {}
        for rel in documents():
            full = os.path.join(WORK, rel)
            if full.endswith(".xlsx") and not args.get("recalculated"):
                recalc(full)
            try:
                facts[rel] = dump(full)
            except Exception as e:  # noqa: BLE001  (an unreadable document is a fact: checks on it fail)
                facts[rel] = {"kind": "unreadable", "error": f"{type(e).__name__}: {e}"}
        with open(args["out"], "w") as f:
            json.dump(facts, f)
        return f"{len(facts)} documents"
    raise CallError(f"unknown command {command!r}")


if __name__ == "__main__":
    try:
        result = {"ok": True, "text": main(sys.argv[1], json.loads(sys.argv[2]))}
    except CallError as e:
        result = {"ok": False, "error": str(e)}
    except (InfraError, ImportError) as e:  # LibreOffice failed; the tool venv is missing
        result = {"ok": False, "infra": True, "error": f"{type(e).__name__}: {e}"}
    except (KeyError, IndexError, TypeError, ValueError, OSError) as e:
        # A document the libraries cannot open, a bad value for a cell, LibreOffice failing, ...
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
