"""``swe_tests``: SWE-bench's resolved check, in a fresh sandbox over the episode's final files.

The verification sandbox (``Episode.verify_sandbox()``, ``envs/code_repo/verifier.py``) holds a
copy of the final ``/work`` and, read-only, the instance's test infrastructure from its base
commit with ``test_patch`` applied. The command restores that infrastructure over the agent's
files (its test edits, planted ``conftest.py`` / ``pytest.ini`` / ``setup.cfg`` / ``tox.ini`` /
``pyproject.toml`` are discarded), then runs ``/usr/bin/python3 -P -m pytest -c /dev/null``
on the instance's test files, recording each test's outcome in a logs dir the agent never had.

Score 1.0 iff pytest exits 0 within the timeout **and** every FAIL_TO_PASS and PASS_TO_PASS
test passed; else 0.0. ``info`` names the tests that did not pass (``failed``) and keeps the
tail of pytest's output. A verifier that times out scores 0 (the agent's code hung: a policy
result); a sandbox that cannot start or dies raises ``EnvError`` (infrastructure, retried,
never scored 0). The timeout is ``task.metadata["verifier_timeout_s"]`` (default 120 s).
"""

from __future__ import annotations

from jointrl.envs.base import EnvError, Task
from jointrl.envs.code_repo.records import SweRecord
from jointrl.envs.code_repo.verifier import RESTORE_FAILED_EXIT, RESULTS_FILE, command, outcomes
from jointrl.rewards.base import Episode, RewardResult, register

DEFAULT_TIMEOUT_S = 120.0
_OUTPUT_TAIL = 2000  # characters of pytest's output kept in ``info``


@register("swe_tests")
def swe_tests(task: Task, episode: Episode) -> RewardResult:
    if episode.verify_sandbox is None:
        raise ValueError(f"swe_tests needs episode.verify_sandbox (task {task.id!r})")
    record = SweRecord.from_task(task)
    timeout = float(task.metadata.get("verifier_timeout_s", DEFAULT_TIMEOUT_S))
    try:
        sandbox = episode.verify_sandbox()
    except OSError as e:
        raise EnvError(f"cannot open the verification sandbox of task {task.id!r}: {e}") from e
    try:
        result = sandbox.exec(command(record.test_files(), record.workdir), timeout=timeout)
        try:
            results = sandbox.read_file(RESULTS_FILE).decode("utf-8", errors="replace")
        except (FileNotFoundError, ValueError):  # absent, or not a regular file inside /logs/verifier
            results = ""
    except OSError as e:
        raise EnvError(f"verification sandbox of task {task.id!r} failed: {e}") from e
    finally:
        sandbox.close()
    passed = outcomes(results)
    failed = [t for t in (*record.fail_to_pass, *record.pass_to_pass) if not passed.get(t, False)]
    ok = result.ok and not failed
    info = {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "restore_failed": result.exit_code == RESTORE_FAILED_EXIT,  # on the agent's tree: scored, not retried
        "failed": failed,
        "fail_to_pass_passed": sum(passed.get(t, False) for t in record.fail_to_pass),
        "pass_to_pass_passed": sum(passed.get(t, False) for t in record.pass_to_pass),
        "output": (result.stdout + result.stderr)[-_OUTPUT_TAIL:],
    }
    return RewardResult(score=1.0 if ok else 0.0, info=info)
