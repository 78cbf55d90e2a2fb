"""Repository snapshots on the host: trees of a shipped repository at an instance's commit.

A repository ships as a git bundle (or any directory ``git clone`` accepts), or inside a
Docker image at the record's working dir (``record.image``: that git repository is copied out
of the image once, ``images.export_repo``). ``RepoStore`` clones each source once (bare) and derives, per instance, cached for the process:

- ``workdir(record)``: the tree at ``base_commit`` as a fresh one-commit git repository,
  copied into each episode's ``/work``. A fresh history, so later commits of the source
  (which may hold the fix) never reach the agent;
- ``canon(record)``: the test infrastructure the verifier restores -- every test directory,
  test file and pytest config file (``restore_tests.py``'s kinds) of the base commit with the
  instance's ``test_patch`` applied;
- ``patched(record, patch)``: the files a patch touches, before and after (scripted policies).

Everything here runs on trusted data (the shipped sources and records), never on files an
agent wrote. Thread-safe: one lock serializes the git work of a store.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

TEST_DIRS = frozenset({"tests", "test", "testing"})
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
_IDENTITY = {"GIT_AUTHOR_NAME": "jointrl", "GIT_AUTHOR_EMAIL": "jointrl@example.invalid",
             "GIT_COMMITTER_NAME": "jointrl", "GIT_COMMITTER_EMAIL": "jointrl@example.invalid",
             "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00"}
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def is_test_path(rel: str) -> bool:
    """Whether the verifier restores ``rel`` from the task (test dirs, test files, pytest config)."""
    parts = Path(rel).parts
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts[:-1]) or name in CONFIG_FILES or name.endswith("_test.py")
            or (name.startswith("test_") and name.endswith(".py")))


def git(*args: str, cwd: Path | None = None, input: bytes | None = None, date: str | None = None) -> bytes:
    """Run git with a fixed identity and date and no user or system config; raise on failure."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "LC_ALL": "C", **_IDENTITY}
    if date:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = date
    if cwd is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
    r = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:3])} failed ({r.returncode}): {r.stderr.decode(errors='replace')[-1000:]}")
    return r.stdout


def patch_paths(patch: str) -> list[str]:
    """The paths a unified git diff touches, in order (the post-image name of a rename)."""
    return [m.group(2) for m in _DIFF_PATH.finditer(patch)]


def read_tree(root: Path, paths: list[str]) -> dict[str, str | None]:
    """Text of each path under ``root``; None for a missing file."""
    return {p: (root / p).read_text() if (root / p).is_file() else None for p in paths}


class RepoStore:
    """Per-process cache of instance trees derived from repository sources (see module doc)."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.root = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="jointrl-code-repo-"))
        self._lock = threading.Lock()
        self._done: dict[tuple, Path] = {}
        if cache_dir is None:
            weakref.finalize(self, shutil.rmtree, self.root, True)

    def _bare(self, record: Any) -> Path:
        key = ("bare", _source_key(record))
        if key not in self._done:
            dest = self.root / f"src-{len(self._done)}.git"
            if record.source is None:
                from jointrl.envs.code_repo.images import export_repo  # lazy: the docker SDK only for image records

                exported = dest.with_suffix(".export")
                export_repo(record.image, record.workdir, exported)
                git("clone", "--bare", "-q", str(exported), str(dest))
                shutil.rmtree(exported, ignore_errors=True)
            else:
                if not record.source.exists():
                    raise ValueError(f"repository source {str(record.source)!r} does not exist")
                git("clone", "--bare", "-q", str(record.source), str(dest))
            self._done[key] = dest
        return self._done[key]

    def _tree(self, record: Any, commit: str, dest: Path) -> None:
        data = git("--git-dir", str(self._bare(record)), "archive", "--format=tar", commit)
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter="data")

    def _cached(self, key: tuple, build: Any) -> Path:
        with self._lock:
            if key not in self._done:
                dest = self.root / f"tree-{len(self._done)}"
                build(dest)
                self._done[key] = dest
            return self._done[key]

    def workdir(self, record: Any) -> Path:
        """The base commit's tree as a one-commit git repository (do not modify it)."""

        def build(dest: Path) -> None:
            self._tree(record, record.base_commit, dest)
            git("init", "-q", "-b", "main", cwd=dest)
            git("add", "-A", cwd=dest)
            git("commit", "-q", "-m", f"{record.repo} at {record.base_commit[:12]}", cwd=dest)

        return self._cached(("work", _source_key(record), record.base_commit), build)

    def canon(self, record: Any) -> Path:
        """The test infrastructure at the base commit with ``test_patch`` applied (do not modify it)."""

        def build(dest: Path) -> None:
            full = dest.with_name(dest.name + "-full")
            self._tree(record, record.base_commit, full)
            if record.test_patch.strip():
                git("apply", "--whitespace=nowarn", "-", cwd=full, input=record.test_patch.encode())
            dest.mkdir()
            for path in sorted(full.rglob("*")):
                rel = path.relative_to(full)
                if path.is_file() and not path.is_symlink() and is_test_path(str(rel)):
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, dest / rel)
            shutil.rmtree(full)

        return self._cached(("canon", _source_key(record), record.instance_id, record.base_commit), build)

    def patched(self, record: Any, patch: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
        """(before, after): the text of each file ``patch`` touches at the base commit and after it."""
        paths = patch_paths(patch)
        with self._lock:
            tmp = Path(tempfile.mkdtemp(dir=self.root))
            try:
                self._tree(record, record.base_commit, tmp / "t")
                before = read_tree(tmp / "t", paths)
                git("apply", "--whitespace=nowarn", "-", cwd=tmp / "t", input=patch.encode())
                return before, read_tree(tmp / "t", paths)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def _source_key(record: Any) -> str:
    return f"image:{record.image}:{record.workdir}" if record.source is None else str(record.source)


_default: RepoStore | None = None
_default_lock = threading.Lock()


def default_store() -> RepoStore:
    """The process-wide store (created on first use, removed at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = RepoStore()
        return _default
