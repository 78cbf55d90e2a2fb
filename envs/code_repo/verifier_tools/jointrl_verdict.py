"""pytest plugin of the code-repository verifier: one JSON line per test report.

Loaded with ``-p jointrl_verdict`` from a read-only directory; writes to the file named by
``$JOINTRL_VERDICT`` (in the verifier-only ``/logs/verifier``). Each line is
``{"nodeid", "when", "outcome"}`` for the setup / call / teardown of a test, and
``"when": "collect"`` for a file that failed to collect. The host judges a test passed iff its
call passed and none of its reports failed (``envs/code_repo/verifier.py``).
"""

import json
import os

_out = None


def _write(nodeid, when, outcome):
    global _out
    if _out is None:
        _out = open(os.environ["JOINTRL_VERDICT"], "a", encoding="utf-8")
    _out.write(json.dumps({"nodeid": nodeid, "when": when, "outcome": outcome}) + "\n")
    _out.flush()


def pytest_runtest_logreport(report):
    _write(report.nodeid, report.when, report.outcome)


def pytest_collectreport(report):
    if report.failed:
        _write(report.nodeid, "collect", "failed")
