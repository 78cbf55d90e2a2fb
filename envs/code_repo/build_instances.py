"""Build the shipped code-repository instances from ``specs/``: git bundles and records.

    python -m jointrl.envs.code_repo.build_instances [--out DIR]

For each repository spec: a git repository whose ``main`` is the correct version (one commit),
then, per bug, a branch named after the instance holding one commit, the bug (the instance's
``base_commit``). Records take ``test_patch``, ``patch`` (gold) and ``wrong_patch`` as
``git diff`` output against the base commit. Identity and dates are fixed, so every commit id
-- and hence every record -- is the same on every machine; the bundle's bytes may differ
between git versions, not its commits.

Every instance is checked by running its tests with the host's ``/usr/bin/python3 -m pytest``
(the verifier's own command line and plugin): at the base commit with the test patch, every
FAIL_TO_PASS test fails; with the gold patch every test passes; with the wrong patch some
FAIL_TO_PASS or PASS_TO_PASS test fails. PASS_TO_PASS is every other test that passes both
before and after the gold patch. Writes ``DIR/instances.jsonl`` and ``DIR/repos/<name>.bundle``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from jointrl.envs.code_repo.records import DATA_DIR, INSTANCES_FILE
from jointrl.envs.code_repo.snapshot import git
from jointrl.envs.code_repo.specs import Bug, Edit, RepoSpec, all_repos
from jointrl.envs.code_repo.verifier import TOOLS_DIR, outcomes, pytest_argv, pytest_env

_DATE = "2024-01-01T{:02d}:{:02d}:00+00:00"  # commit n of a repository at 00:00 + n minutes


def apply_edits(root: Path, edits: list[Edit], where: str) -> None:
    for path, old, new in edits:
        text = (root / path).read_text()
        if text.count(old) != 1:
            raise ValueError(f"{where}: {old!r:.60} occurs {text.count(old)} times in {path}, not once")
        (root / path).write_text(text.replace(old, new))


def append_tests(root: Path, tests: dict[str, str]) -> None:
    for path, text in tests.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text((p.read_text() if p.exists() else "") + text)


def run_tests(root: Path, test_files: list[str]) -> dict[str, bool]:
    """Per node id: passed? The verifier's pytest command, run on the host in ``root``."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, **pytest_env(str(results), str(TOOLS_DIR))}
        subprocess.run(pytest_argv(test_files, rootdir=str(root)), cwd=root, env=env, capture_output=True, timeout=120)
        return outcomes(results.read_text() if results.exists() else "")


def _diff(repo: Path) -> str:
    git("add", "-A", cwd=repo)
    out = git("diff", "--cached", "--no-color", "--no-ext-diff", cwd=repo).decode()
    git("reset", "-q", "--hard", cwd=repo)
    git("clean", "-qfdx", cwd=repo)
    return out


def build_bug(repo: Path, spec: RepoSpec, bug: Bug, n: int) -> dict:
    git("checkout", "-q", "-b", bug.id, "main", cwd=repo)
    apply_edits(repo, bug.breaks, f"{bug.id} breaks")
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", f"{bug.id}: base commit", cwd=repo, date=_DATE.format(n // 60, n % 60))
    base = git("rev-parse", "HEAD", cwd=repo).decode().strip()
    append_tests(repo, bug.tests)
    test_patch = _diff(repo)
    apply_edits(repo, [(p, new, old) for p, old, new in bug.breaks], f"{bug.id} gold")
    patch = _diff(repo)
    apply_edits(repo, bug.wrong, f"{bug.id} wrong")
    wrong_patch = _diff(repo)

    append_tests(repo, bug.tests)
    files = sorted(str(p.relative_to(repo)) for p in repo.glob("tests/test_*.py"))
    before = run_tests(repo, files)
    apply_edits(repo, [(p, new, old) for p, old, new in bug.breaks], f"{bug.id} gold")
    after = run_tests(repo, files)
    git("reset", "-q", "--hard", cwd=repo)
    git("clean", "-qfdx", cwd=repo)
    append_tests(repo, bug.tests)
    apply_edits(repo, bug.wrong, f"{bug.id} wrong")
    wrong = run_tests(repo, files)
    git("reset", "-q", "--hard", cwd=repo)
    git("clean", "-qfdx", cwd=repo)
    git("checkout", "-q", "main", cwd=repo)

    problems = [f"{t} does not fail at the base commit" for t in bug.fail_to_pass if before.get(t, False)]
    problems += [f"{t} fails with the gold patch" for t, ok in after.items() if not ok]
    problems += [f"{t} was not run" for t in bug.fail_to_pass if t not in after]
    p2p = sorted(t for t, ok in after.items() if ok and before.get(t) and t not in bug.fail_to_pass)
    if all(wrong.get(t, False) for t in (*bug.fail_to_pass, *p2p)):
        problems.append("the wrong patch passes every test")
    if len(p2p) < 5:
        problems.append(f"only {len(p2p)} PASS_TO_PASS tests")
    if problems:
        raise ValueError(f"instance {bug.id}: " + "; ".join(problems))
    return {"repo": f"jointrl/{spec.name}", "instance_id": bug.id, "base_commit": base, "patch": patch,
            "test_patch": test_patch, "problem_statement": bug.problem,
            "FAIL_TO_PASS": json.dumps(bug.fail_to_pass), "PASS_TO_PASS": json.dumps(p2p),
            "wrong_patch": wrong_patch}


def build_repo(spec: RepoSpec, work: Path, bundle: Path) -> list[dict]:
    repo = work / spec.name
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    for path, text in spec.files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", f"{spec.name}: initial version", cwd=repo, date=_DATE.format(0, 0))
    records = [build_bug(repo, spec, bug, n + 1) for n, bug in enumerate(spec.bugs)]
    git("-c", "pack.threads=1", "bundle", "create", str(bundle), "--all", cwd=repo)
    return records


def build(out: Path, repos: list[RepoSpec] | None = None) -> list[dict]:
    """Build every repository into ``out`` (``repos/`` and ``instances.jsonl``); return the records."""
    (out / "repos").mkdir(parents=True, exist_ok=True)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in all_repos() if repos is None else repos:
            records += build_repo(spec, Path(tmp), out / "repos" / f"{spec.name}.bundle")
    with open(out / INSTANCES_FILE, "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help=f"output folder (default {DATA_DIR})")
    args = parser.parse_args(argv)
    if not os.access("/usr/bin/python3", os.X_OK) or shutil.which("git") is None:
        raise SystemExit("needs git and /usr/bin/python3 with pytest (python3-pytest)")
    records = build(args.out)
    print(f"{len(records)} instances from {len({r['repo'] for r in records})} repositories -> {args.out}")


if __name__ == "__main__":
    main()
