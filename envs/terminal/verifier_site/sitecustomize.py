"""Imported by every Python the verifier runs (it is on the verifier's PYTHONPATH).

``python3 -m pytest`` puts the working directory -- the agent's ``/work`` -- first on
``sys.path``, so a ``pytest.py`` (or ``pytest/``, ``_pytest/``) the agent planted there would
be imported as pytest and could exit 0 without running a test. This runs before that
directory is added: it imports the real pytest, which ``-m pytest`` then finds in
``sys.modules``. Scripts keep their usual ``sys.path`` (their own directory first), unlike
with ``PYTHONSAFEPATH``, which would break tests that run ``python3 /work/src/main.py``.
"""

import sys

_args = getattr(sys, "orig_argv", [])
if "-m" in _args[1:] and _args.index("-m", 1) + 1 < len(_args) and _args[_args.index("-m", 1) + 1] in ("pytest", "py.test"):
    try:
        import pytest  # noqa: F401
    except ImportError:
        pass
