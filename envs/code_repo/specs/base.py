"""The records a repository spec is written in: ``RepoSpec`` (one tiny repository) and its ``Bug``s.

Each spec module beside this one (``unitconv``, ``intervals``, ``texttable``, ``ledger``) builds one
``RepoSpec`` from these; ``specs/__init__.py`` collects them (``all_repos``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Edit = tuple[str, str, str]  # (path, old, new): ``old`` occurs exactly once in the file


@dataclass(frozen=True)
class Bug:
    id: str  # the instance id, "<repo>-<n>"
    problem: str  # the issue text the agent sees
    breaks: list[Edit]  # applied to the correct version: the base commit
    tests: dict[str, str]  # path -> text appended (the file is created if absent): the test_patch
    fail_to_pass: list[str]  # test node ids the tests add, failing at the base commit
    wrong: list[Edit]  # applied to the base commit: the plausible-but-wrong fix


@dataclass(frozen=True)
class RepoSpec:
    name: str  # "jointrl/<name>" in the records; the bundle is data/repos/<name>.bundle
    files: dict[str, str]
    bugs: list[Bug] = field(default_factory=list)
