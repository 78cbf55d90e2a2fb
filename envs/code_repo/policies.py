"""Scripted policies of a code-repository instance, as tool calls.

- ``oracle``: view the files the gold ``patch`` touches, apply it as ``str_replace`` calls
  (``create`` for new files, ``bash rm`` for deleted ones), submit -- reward 1;
- ``wrong``: the same for the record's ``wrong_patch`` (a plausible fix that fails a test) -- 0;
- ``noop``: submit at once -- 0;
- ``oracle_shell`` / ``wrong_shell``: the same edits made by one ``bash`` call (a Python
  ``str.replace`` on each file, found by a glob over its top folder: ``*/count_above.py``), then
  submit -- what an agent that edits from the shell without opening the files writes. For small
  models the path's package name (drawn per repository) is the hard part to copy; the glob leaves
  only the edit, which GRPO can then choose between (docs/recipe.md);
- ``oracle_sed`` / ``wrong_sed``: for generated instances (``generate.py``), the family's own
  edit as one ``sed -i 's/old/new/' */<module>.py`` (46-123 bytes instead of the ~230 of the
  Python script, whose inexact copies left GRPO nothing to choose between), then submit.

``patch_calls`` turns any patch into such calls: each changed block of lines becomes one
``str_replace`` whose ``old_str`` is widened by context lines (one line after it, or one before,
else both) until it occurs exactly once in the file as it is at that point, so applying the calls in order reproduces the patched file.
"""

from __future__ import annotations

import difflib
import random
import shlex
import subprocess
import tempfile
from pathlib import Path

from jointrl.envs.base import Task, ToolCall
from jointrl.envs.code_repo.generate import FAMILIES
from jointrl.envs.code_repo.records import SweRecord
from jointrl.envs.code_repo.snapshot import RepoStore, default_store
from jointrl.envs.code_repo.tools import find_all

Policy = list[list[ToolCall]]
POLICIES = ("noop", "oracle", "wrong", "oracle_shell", "wrong_shell", "oracle_sed", "wrong_sed")
SUBMIT = ToolCall(name="submit", arguments={})


def replace_calls(path: str, before: str, after: str) -> list[ToolCall]:
    """``str_replace`` calls that turn ``before`` into ``after`` when applied in order.

    >>> calls = replace_calls("f.py", "a\\nb\\na\\nc\\n", "a\\nb\\na\\nC\\n")
    >>> [(c.arguments["old_str"], c.arguments["new_str"]) for c in calls]
    [('c\\n', 'C\\n')]
    """
    cur = before.splitlines(keepends=True)
    new = after.splitlines(keepends=True)
    calls, delta = [], 0
    ops = difflib.SequenceMatcher(None, cur, new, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        a, b = i1 + delta, i2 + delta  # the block's lines in the current text
        repl = new[j1:j2]
        text, lo, hi = "".join(cur), a, b
        unique = lambda lo, hi: (o := "".join(cur[lo:hi])) != "" and len(find_all(text, o)) == 1  # noqa: E731
        while not unique(lo, hi):
            if lo == 0 and hi == len(cur):
                return [ToolCall("create", {"path": path, "content": after})]  # no unique anchor anywhere
            # one more context line, after the block first, then before it, then both
            lo, hi = next(((l2, h2) for l2, h2 in ((lo, min(len(cur), hi + 1)), (max(0, lo - 1), hi))
                           if (l2, h2) != (lo, hi) and unique(l2, h2)), (max(0, lo - 1), min(len(cur), hi + 1)))
        old = "".join(cur[lo:hi])
        calls.append(ToolCall("str_replace", {"path": path, "old_str": old,
                                              "new_str": "".join(cur[lo:a] + repl + cur[b:hi])}))
        cur[a:b] = repl
        delta += len(repl) - (i2 - i1)
    return calls


def patch_calls(record: SweRecord, patch: str, store: RepoStore | None = None) -> Policy:
    """Turns applying ``patch`` at the base commit: view each file, edit, submit."""
    before, after = (store or default_store()).patched(record, patch)
    views = [ToolCall("view_file", {"path": p}) for p, text in before.items() if text is not None]
    edits: list[ToolCall] = []
    for path, old in before.items():
        new = after[path]
        if new is None:
            edits.append(ToolCall("bash", {"command": f"rm -f -- {shlex.quote(path)}"}))
        elif old is None:
            edits.append(ToolCall("create", {"path": path, "content": new}))
        else:
            edits += replace_calls(path, old, new)
    return [turn for turn in (views, edits, [SUBMIT]) if turn]


def _glob(path: str) -> str:
    """``pkg/mod.py`` -> ``*/mod.py``; a top-level file keeps its name."""
    head, _, rest = path.partition("/")
    return f"*/{rest}" if rest else head


def shell_calls(record: SweRecord, patch: str, store: RepoStore | None = None) -> Policy:
    """Turns applying ``patch`` from the shell: one ``bash`` call whose Python script replaces each
    changed block (``replace_calls``'s unique ``old_str``) in the file its glob finds, then submit."""
    before, after = (store or default_store()).patched(record, patch)
    lines = ["python3 - <<'EOF'", "import glob"]
    for path, old in before.items():
        new = after[path]
        if old is None or new is None:
            raise ValueError(f"{record.instance_id}: the shell policy edits files; {path!r} is created or deleted")
        lines.append(f"p, = glob.glob({_glob(path)!r})")
        lines.append("s = open(p).read()")
        for call in replace_calls(path, old, new):
            if call.name != "str_replace":
                raise ValueError(f"{record.instance_id}: {path!r} has no unique block to replace")
            lines.append(f"s = s.replace({call.arguments['old_str']!r}, {call.arguments['new_str']!r}, 1)")
        lines.append("open(p, 'w').write(s)")
    lines.append("EOF")
    return [[ToolCall("bash", {"command": "\n".join(lines)})], [SUBMIT]]


def sed_expression(old: str, new: str) -> str:
    """The ``sed`` substitution of the literal ``old`` (one line) by ``new``: ``s/old/new/``, with
    ``|`` or ``#`` as the delimiter when ``/`` occurs, and only what sed would misread escaped.

    >>> sed_expression("x >= threshold", "x > threshold")
    's/x >= threshold/x > threshold/'
    >>> print(sed_expression("start = number * size", "start = (number - 1) * size"))
    s/start = number \\* size/start = (number - 1) * size/
    """
    if old.endswith("\n") and new.endswith("\n"):
        old, new = old[:-1], new[:-1]
    if not old or "\n" in old:
        raise ValueError(f"a sed edit replaces part of one line; got {old!r}")
    delim = next((d for d in "/|#" if d not in old + new), None)
    if delim is None:
        raise ValueError(f"no sed delimiter fits {old!r} -> {new!r}")
    pattern = "".join("\\" + c if c in "\\*[^$" else c for c in old)  # '.' matches itself too
    repl = "".join("\\" + c if c in "\\&" else c for c in new).replace("\n", "\\n")
    return f"s{delim}{pattern}{delim}{repl}{delim}"


def sed_calls(record: SweRecord, role: str, store: RepoStore | None = None) -> Policy:
    """Turns of a generated instance's ``oracle`` or ``wrong`` edit from the shell: one ``sed -i`` on
    ``*/<module>.py`` with the family's edit (``generate.FAMILIES``), then submit. Checked: the real
    sed on the base file gives exactly the patched file, else ``ValueError``."""
    family, _, seed = record.instance_id.rpartition("-s")
    if family not in FAMILIES or not seed.isdigit():
        raise ValueError(f"{record.instance_id}: sed demonstrations exist for generated instances only "
                         f"(<family>-s<seed>, families {sorted(FAMILIES)})")
    fam = FAMILIES[family]
    _, _, _, breaks, wrong = fam.make(random.Random(f"{family}/{seed}"))
    edits = [(new, old) for old, new in breaks] if role == "oracle" else wrong
    script = "; ".join(sed_expression(a, b) for a, b in edits)
    command = f"sed -i {shlex.quote(script)} */{fam.module}.py"
    before, after = (store or default_store()).patched(record, record.patch if role == "oracle" else record.wrong_patch)
    (path,) = before
    with tempfile.TemporaryDirectory() as tmp:  # the command, run by the real sed, must make the patch
        target = Path(tmp) / path
        target.parent.mkdir(parents=True)
        target.write_text(before[path])
        ran = subprocess.run(["bash", "-c", command], cwd=tmp, capture_output=True, text=True)
        if ran.returncode != 0 or target.read_text() != after[path]:
            raise ValueError(f"{record.instance_id}: {command!r} does not reproduce the {role} patch "
                             f"(exit {ran.returncode}: {ran.stderr.strip()[-300:]!r})")
    return [[ToolCall("bash", {"command": command})], [SUBMIT]]


def load_policy(task: Task, name: str, store: RepoStore | None = None) -> Policy:
    """The named policy of a ``code_repo`` task. Raises ``ValueError`` naming the available ones."""
    record = SweRecord.from_task(task)
    if name == "noop":
        return [[SUBMIT]]
    if name == "oracle":
        return patch_calls(record, record.patch, store)
    if name == "wrong" and record.wrong_patch:
        return patch_calls(record, record.wrong_patch, store)
    if name == "oracle_shell":
        return shell_calls(record, record.patch, store)
    if name == "wrong_shell" and record.wrong_patch:
        return shell_calls(record, record.wrong_patch, store)
    if name == "oracle_sed" or (name == "wrong_sed" and record.wrong_patch):
        return sed_calls(record, name.removesuffix("_sed"), store)
    available = [p for p in POLICIES if not p.startswith("wrong") or record.wrong_patch]
    raise ValueError(f"task {task.id!r} has no policy {name!r}; available: {available}")
