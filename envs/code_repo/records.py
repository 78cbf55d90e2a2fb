"""SWE-bench-style instance records and their loader.

A task folder holds ``instances.jsonl`` (one record per line; a ``.json`` list works too)
and ``repos/``, one git bundle ``<name>.bundle`` -- or a directory ``git clone`` accepts,
``<name>/`` -- per repository, ``<name>`` being the last part of the record's ``repo``.
A record has SWE-bench's fields::

    repo, instance_id, base_commit, patch, test_patch, problem_statement,
    FAIL_TO_PASS, PASS_TO_PASS        (JSON strings, as in SWE-bench's dataset, or lists)

and may add ``wrong_patch`` (a jointrl extension: a plausible-but-wrong fix, for the
scripted ``wrong`` policy). Other fields are ignored. The shipped set, built by
``build_instances.py``, lives in ``envs/code_repo/data/``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jointrl.envs.base import Task

DOMAIN = "code_repo"
DATA_DIR = Path(__file__).parent / "data"
INSTANCES_FILE = "instances.jsonl"
DEFAULT_MAX_TURNS = 30
_TEXT_FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement")


@dataclass(frozen=True, slots=True)
class SweRecord:
    repo: str
    instance_id: str
    base_commit: str
    patch: str
    test_patch: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    source: Path | None  # the repository's bundle or directory; None: the image's working dir holds it
    wrong_patch: str = ""
    image: str = ""  # a Docker image holding the repository (and its runtime) at ``workdir``; "": bwrap
    workdir: str = "/work"  # where the agent finds the repository (an image's: its WORKDIR, /testbed)

    def test_files(self) -> list[str]:
        """The test files holding the FAIL_TO_PASS and PASS_TO_PASS tests, sorted."""
        return sorted({t.split("::")[0] for t in (*self.fail_to_pass, *self.pass_to_pass)})

    @classmethod
    def from_dict(cls, raw: dict[str, Any], repos_dir: Path | None, image: str = "",
                  workdir: str = "/work") -> SweRecord:
        """Parse one record; its repository is ``repos_dir``'s bundle, or (``repos_dir`` None) in
        ``image`` at ``workdir``. Raises ``ValueError`` naming the instance and the bad field."""
        if not isinstance(raw, dict):
            raise ValueError(f"an instance record must be a JSON object, got {type(raw).__name__}")
        name = raw.get("instance_id", "<no instance_id>")
        for key in _TEXT_FIELDS:
            if not isinstance(raw.get(key), str):
                raise ValueError(f"instance {name!r}: field {key!r} must be a string, got {raw.get(key)!r:.80}")
        tests = {key: parse_test_list(raw.get(key), f"instance {name!r}: field {key!r}")
                 for key in ("FAIL_TO_PASS", "PASS_TO_PASS")}
        if not tests["FAIL_TO_PASS"]:
            raise ValueError(f"instance {name!r}: FAIL_TO_PASS is empty")
        for t in (*tests["FAIL_TO_PASS"], *tests["PASS_TO_PASS"]):
            if "::" not in t or t.startswith("/") or ".." in t.split("::")[0].split("/"):
                raise ValueError(f"instance {name!r}: test id {t!r} must be a relative 'path::name' node id")
        return cls(repo=raw["repo"], instance_id=raw["instance_id"], base_commit=raw["base_commit"],
                   patch=raw["patch"], test_patch=raw["test_patch"], problem_statement=raw["problem_statement"],
                   fail_to_pass=tests["FAIL_TO_PASS"], pass_to_pass=tests["PASS_TO_PASS"],
                   source=None if repos_dir is None else repo_source(repos_dir, raw["repo"]),
                   wrong_patch=str(raw.get("wrong_patch", "")), image=image, workdir=workdir)

    def to_metadata(self) -> dict[str, Any]:
        """JSON-able fields for ``Task.metadata`` (``from_task`` reads them back)."""
        d = asdict(self)
        d["source"] = "" if self.source is None else str(self.source)
        d["fail_to_pass"], d["pass_to_pass"] = list(self.fail_to_pass), list(self.pass_to_pass)
        return d

    @classmethod
    def from_task(cls, task: Task) -> SweRecord:
        """The record a ``code_repo`` task was made from. Raises ``ValueError`` for other tasks."""
        m = task.metadata.get("swe")
        if task.domain != DOMAIN or not isinstance(m, dict):
            raise ValueError(f"task {task.id!r} (domain {task.domain!r}) is not a code_repo task")
        return cls(**{**m, "source": Path(m["source"]) if m["source"] else None, "fail_to_pass": tuple(m["fail_to_pass"]),
                      "pass_to_pass": tuple(m["pass_to_pass"])})


def parse_test_list(value: Any, where: str) -> tuple[str, ...]:
    """A list of test ids, given as a list or as a JSON string of one (SWE-bench's encoding).

    >>> parse_test_list('["a.py::t1", "a.py::t2"]', "x")
    ('a.py::t1', 'a.py::t2')
    >>> parse_test_list(["a.py::t1"], "x")
    ('a.py::t1',)
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is a string but not a JSON list: {e}") from e
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{where} must be a list of test ids (or a JSON string of one), got {value!r:.80}")
    return tuple(value)


def repo_source(repos_dir: Path, repo: str) -> Path:
    name = repo.rstrip("/").split("/")[-1]
    for candidate in (repos_dir / f"{name}.bundle", repos_dir / name):
        if candidate.exists():
            return candidate.resolve()
    raise ValueError(f"repository {repo!r}: neither {name}.bundle nor {name}/ exists in {str(repos_dir)!r}")


def read_records(root: Path | None = None) -> list[SweRecord]:
    """The records of the task folder ``root`` (default: the shipped set), in file order."""
    root = DATA_DIR if root is None else Path(root)
    path = root / INSTANCES_FILE
    if not path.is_file() and (root / "instances.json").is_file():
        path = root / "instances.json"
    if not path.is_file():
        raise ValueError(f"task folder {str(root)!r} has no {INSTANCES_FILE} (or instances.json)")
    text = path.read_text()
    if path.suffix == ".json":
        raws = json.loads(text)
    else:
        raws = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raws.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{str(path)!r} line {n}: not JSON: {e}") from e
    records = [SweRecord.from_dict(r, root / "repos") for r in raws]
    ids = [r.instance_id for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{str(path)!r}: duplicate instance ids")
    return records


def render_prompt(record: SweRecord) -> str:
    """The task's user turn: where the repository is and what to do, then the issue, last, right
    before the agent's turn (a small model reads what is near its turn: docs/recipe.md, fifth session)."""
    return (f"The repository {record.repo} is checked out in {record.workdir}. Fix the issue below by editing "
            f"the source files (not the tests), then call `submit`.\n\n<issue>\n{record.problem_statement.strip()}\n</issue>")


def to_task(record: SweRecord, max_turns: int = DEFAULT_MAX_TURNS) -> Task:
    root = None if record.source is None else record.source.parent
    return Task(id=record.instance_id, domain=DOMAIN, prompt=render_prompt(record), tier="low",
                max_turns=max_turns, root=root, reward={"swe_tests": 1.0},
                metadata={"swe": record.to_metadata()})


def load_tasks(root: Path | None = None) -> list[Task]:
    """One ``code_repo`` task per record of ``root`` (default: the shipped set), sorted by id."""
    return sorted((to_task(r) for r in read_records(root)), key=lambda t: t.id)
