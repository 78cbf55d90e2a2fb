"""The code-repository verifier: a fresh sandbox over the episode's final files, tests restored.

Reward integrity (docs/architecture.md). At the end of the episode the agent's ``/work`` is
snapshotted on the host; :class:`FinalRepo` opens, per call, a new sandbox under a new uid
over a *copy* of it, with

- ``/verifier/canon`` (read-only): the instance's test infrastructure from the base commit
  with ``test_patch`` applied (``RepoStore.canon``);
- ``/verifier/tools`` (read-only): ``restore_tests.py`` and the ``jointrl_verdict`` pytest
  plugin (``verifier_tools/``);
- ``/logs/verifier`` (fresh, empty, writable, never seen by the agent): the per-test results;
- ``HOME=/tmp`` (a fresh tmpfs) and the read-only system ``PATH``.

``command(record)`` then, in that sandbox: deletes every test dir, test file and pytest config
file of ``/work`` (edited or planted: ``conftest.py``, ``pytest.ini``, ``tox.ini``,
``setup.cfg``, ``pyproject.toml``) and copies the canonical ones in; runs
``/usr/bin/python3 -P -m pytest`` (``-P``: ``/work`` is not on ``sys.path`` while pytest
itself is imported, so a planted ``pytest.py`` is never loaded; an absolute interpreter, so a
fake ``pytest`` or ``python3`` on ``PATH`` is never run) with ``-c /dev/null`` (no ini file
is read), ``--rootdir=/work``, ``-p no:cacheprovider``, plugin autoloading off, on the test
files of the instance; the plugin writes one JSON line per test report to
``/logs/verifier/results.jsonl``. ``outcomes`` reads them back: a test passed iff its call
passed and none of its reports failed; a test with no report (not collected) failed.

Not protected: the code under test runs inside the pytest process, so source code that
deliberately tampers with pytest's reporting in-process (monkeypatching ``_pytest``, writing
the results file itself) is not caught -- the same limit as SWE-bench's harness. The
verifier also requires pytest's exit code 0, which such code would have to forge as well.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import weakref
from pathlib import Path
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.code_repo.images import open_sandbox
from jointrl.envs.sandbox.base import Sandbox, SandboxConfig
from jointrl.envs.sandbox.bwrap import sandbox_root

TOOLS_DIR = Path(__file__).parent / "verifier_tools"
CANON_MOUNT = "/verifier/canon"
TOOLS_MOUNT = "/verifier/tools"
VERIFIER_LOGS = "/logs/verifier"
RESULTS_FILE = f"{VERIFIER_LOGS}/results.jsonl"
RESTORE_FAILED_EXIT = 90  # the restore step failed: no test ran


def pytest_argv(test_files: list[str], *, rootdir: str = "/work") -> list[str]:
    """The pytest command line the verifier runs (also used on the host by ``build_instances``).

    The repository's root and its ``src/`` are put on ``sys.path`` once pytest is imported
    (``-o pythonpath``), so both layouts import without installing the package.
    """
    if not test_files:
        raise ValueError("pytest_argv needs at least one test file")
    return ["/usr/bin/python3", "-P", "-m", "pytest", "-c", "/dev/null", f"--rootdir={rootdir}",
            "-o", f"pythonpath={rootdir} {rootdir}/src", "-p", "no:cacheprovider", "-p", "jointrl_verdict",
            "-q", "-rfE", "--tb=short", "--", *test_files]


def pytest_env(results_file: str, tools_dir: str = TOOLS_MOUNT) -> dict[str, str]:
    return {"PYTHONPATH": tools_dir, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "JOINTRL_VERDICT": results_file,
            "PYTHONDONTWRITEBYTECODE": "1"}


def command(test_files: list[str], workdir: str = "/work") -> str:
    """The shell command run in the verification sandbox (see the module docstring); ``workdir``:
    where the repository is (an image record's, e.g. ``/testbed``)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in pytest_env(RESULTS_FILE).items())
    run = " ".join(shlex.quote(a) for a in pytest_argv(test_files, rootdir=workdir))
    w = shlex.quote(workdir)
    return (f"chmod -R u+rwX {w} 2>/dev/null; "
            f"/usr/bin/python3 -I {TOOLS_MOUNT}/restore_tests.py {CANON_MOUNT} {w} || exit {RESTORE_FAILED_EXIT}; "
            f"cd {w} && env {env} {run}")


def outcomes(results: str) -> dict[str, bool]:
    """Per test node id: whether it passed, from the plugin's JSON lines (bad lines are skipped).

    >>> outcomes('{"nodeid": "t.py::a", "when": "call", "outcome": "passed"}\\n'
    ...          '{"nodeid": "t.py::b", "when": "call", "outcome": "passed"}\\n'
    ...          '{"nodeid": "t.py::b", "when": "teardown", "outcome": "failed"}\\n')
    {'t.py::a': True, 't.py::b': False}
    """
    passed: dict[str, bool] = {}
    for line in results.splitlines():
        try:
            rep = json.loads(line)
            nodeid, when, outcome = rep["nodeid"], rep["when"], rep["outcome"]
        except (ValueError, KeyError, TypeError):
            continue
        if outcome == "failed":
            passed[nodeid] = False
        elif when == "call":
            passed.setdefault(nodeid, outcome == "passed")
    return passed


class FinalRepo:
    """A host snapshot of an episode's final ``/work``; calling it opens a verification sandbox.

    The snapshot is deleted by :meth:`discard` or when this object is garbage-collected, so
    rewards may be computed after the episode's own sandbox closed. The caller closes each
    sandbox it opens.
    """

    def __init__(self, snapshot: Path, canon: Path, config: SandboxConfig, record: Any) -> None:
        self.snapshot, self.canon, self.config, self.record = snapshot, canon, config, record
        self._finalizer = weakref.finalize(self, shutil.rmtree, snapshot, True)

    @classmethod
    def take(cls, sandbox: Sandbox, canon: Path, config: SandboxConfig, record: Any) -> FinalRepo:
        """Snapshot ``sandbox``'s working dir now; verification sandboxes are ``record``'s kind
        (bwrap, or a fresh container of its image)."""
        snapshot = sandbox_root() / f"snap-{secrets.token_hex(8)}"
        sandbox.copy_workdir_to(snapshot)
        return cls(snapshot, canon, config, record)

    def __call__(self) -> Sandbox:
        if not self._finalizer.alive:
            raise RuntimeError("the episode's final files were discarded")
        if not self.snapshot.is_dir():  # removed behind our back: infrastructure, not the policy
            raise EnvError(f"the snapshot of the episode's final files is gone: {str(self.snapshot)!r}")
        return open_sandbox(self.record, self.config, self.snapshot,
                            ro_binds={str(self.canon): CANON_MOUNT, str(TOOLS_DIR): TOOLS_MOUNT},
                            rw_dirs=(VERIFIER_LOGS,), env={"HOME": "/tmp"})

    def discard(self) -> None:
        """Delete the snapshot now. Idempotent."""
        self._finalizer()
