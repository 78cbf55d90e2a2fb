"""The code-repository tools: their schemas and the file-editing ones over a sandbox.

``bash`` and ``submit`` run in ``env.py``; ``view_file``, ``str_replace``, ``create`` and
``insert`` are host-side reads and writes through the sandbox's ``read_file`` /
``write_file``, which refuse any path that leaves ``/work`` -- by ``..`` or through a
symlink -- and never follow a final symlink (``envs/sandbox/files.py``). A problem with a
call (missing file, ``old_str`` not found or not unique, a line out of range, a path outside
``/work``) raises ``ToolError``, which the env returns as an error observation.
"""

from __future__ import annotations

from typing import Any

from jointrl.envs.base import ToolSpec

_PATH = {"type": "string"}  # relative to /work, or absolute under /work (the system prompt says so)


def _spec(name: str, description: str, properties: dict[str, Any], required: list[str]) -> ToolSpec:
    return ToolSpec(name=name, description=description,
                    parameters={"type": "object", "properties": properties, "required": required})


BASH = _spec("bash", "Run a command with `bash -c` in /work (a fresh shell per call).",
             {"command": {"type": "string"}}, ["command"])
VIEW_FILE = _spec("view_file", "Show a file with line numbers (optionally lines start_line..end_line).",
                  {"path": _PATH, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, ["path"])
STR_REPLACE = _spec("str_replace", "Replace old_str, which must occur exactly once in the file, by new_str.",
                    {"path": _PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
                    ["path", "old_str", "new_str"])
CREATE = _spec("create", "Create or overwrite a file.", {"path": _PATH, "content": {"type": "string"}},
               ["path", "content"])
INSERT = _spec("insert", "Insert text after line `line` (0: at the top).",
               {"path": _PATH, "line": {"type": "integer"}, "text": {"type": "string"}}, ["path", "line", "text"])
SUBMIT = _spec("submit", "End the episode; the tests then run on your files.", {}, [])
TOOLS = [BASH, VIEW_FILE, STR_REPLACE, CREATE, INSERT, SUBMIT]
# ``envs.prompt=compact``: the same tools and schemas with one-line descriptions (env.py).
COMPACT = {"bash": "Run a command.", "view_file": "Show a file.", "str_replace": "Replace old_str by new_str.",
           "create": "Write a file.", "insert": "Insert text after a line.", "submit": "Finish."}
TOOLS_COMPACT = [ToolSpec(t.name, COMPACT[t.name], t.parameters) for t in TOOLS]


class ToolError(ValueError):
    """The call cannot be carried out; the message is returned to the model."""


def _read_text(sandbox: Any, path: str) -> str:
    try:
        data = sandbox.read_file(path)
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file") from None
    except (ValueError, OSError) as e:  # outside /work, a directory, a symlink loop, ...
        raise ToolError(f"{path}: {e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path}: not a UTF-8 text file") from None


def _write_text(sandbox: Any, path: str, text: str) -> None:
    try:
        sandbox.write_file(path, text.encode("utf-8"))
    except (ValueError, OSError) as e:
        raise ToolError(f"{path}: {e}") from None


def find_all(text: str, needle: str) -> list[int]:
    """Start offsets of every occurrence of ``needle``, overlapping ones included.

    >>> find_all("aaa", "aa")
    [0, 1]
    """
    out, i = [], text.find(needle)
    while i != -1:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


def view_file(sandbox: Any, path: str, start_line: int | None = None, end_line: int | None = None,
              max_chars: int = 16_384) -> str:
    lines = _read_text(sandbox, path).splitlines()
    start = 1 if start_line is None else start_line
    end = len(lines) if end_line is None else min(end_line, len(lines))
    if start < 1 or (lines and start > len(lines)) or end < start - 1:
        raise ToolError(f"{path}: line range {start}..{end_line} is outside 1..{len(lines)}")
    out = "".join(f"{n:6d}\t{lines[n - 1]}\n" for n in range(start, end + 1))
    if len(out) > max_chars:
        out = out[:max_chars] + f"\n[... cut at {max_chars} characters; view a smaller line range ...]\n"
    return out or f"{path}: empty file\n"


def str_replace(sandbox: Any, path: str, old_str: str, new_str: str) -> str:
    if not old_str:
        raise ToolError("old_str must not be empty")
    text = _read_text(sandbox, path)
    hits = find_all(text, old_str)
    if len(hits) != 1:
        where = "" if not hits else " (lines " + ", ".join(str(text.count("\n", 0, i) + 1) for i in hits[:10]) + ")"
        raise ToolError(f"{path}: old_str occurs {len(hits)} times{where}; it must occur exactly once")
    _write_text(sandbox, path, text[: hits[0]] + new_str + text[hits[0] + len(old_str):])
    line = text.count("\n", 0, hits[0]) + 1
    return f"Replaced 1 occurrence in {path} (line {line})."


def create(sandbox: Any, path: str, content: str) -> str:
    existed = True
    try:
        sandbox.read_file(path)
    except (ValueError, OSError):
        existed = False
    _write_text(sandbox, path, content)
    return f"{'Overwrote' if existed else 'Created'} {path} ({len(content.splitlines())} lines)."


def insert(sandbox: Any, path: str, line: int, text: str) -> str:
    lines = _read_text(sandbox, path).splitlines(keepends=True)
    if not 0 <= line <= len(lines):
        raise ToolError(f"{path}: line must be in 0..{len(lines)}, got {line}")
    if lines and not lines[-1].endswith("\n") and line == len(lines):
        lines[-1] += "\n"
    new = text if text.endswith("\n") else text + "\n"
    _write_text(sandbox, path, "".join(lines[:line]) + new + "".join(lines[line:]))
    return f"Inserted {len(new.splitlines())} lines after line {line} of {path}."
