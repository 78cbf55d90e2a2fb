"""Source specs of the shipped code-repository instances (input of ``build_instances.py``).

Each module describes one tiny Python repository written for this project: ``FILES`` is the
correct version (every test passes), ``BUGS`` the instances. An instance's base commit is
the correct version with ``Bug.breaks`` applied (the bug), its ``test_patch`` appends
``Bug.tests`` (tests that fail on the bug), its gold ``patch`` undoes ``breaks`` and its
``wrong_patch`` applies ``Bug.wrong`` on the base commit: a plausible fix that still fails a
FAIL_TO_PASS test or breaks a PASS_TO_PASS one. ``build_instances.py`` checks all of that by
running the tests.
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


def all_repos() -> list[RepoSpec]:
    from jointrl.envs.code_repo.specs import intervals, ledger, texttable, unitconv

    return [unitconv.REPO, intervals.REPO, texttable.REPO, ledger.REPO]
