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

from jointrl.envs.code_repo.specs import intervals, ledger, texttable, unitconv
from jointrl.envs.code_repo.specs.base import Bug, Edit, RepoSpec

__all__ = ["Bug", "Edit", "RepoSpec", "all_repos"]


def all_repos() -> list[RepoSpec]:
    return [unitconv.REPO, intervals.REPO, texttable.REPO, ledger.REPO]
