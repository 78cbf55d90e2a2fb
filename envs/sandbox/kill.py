"""``sigkill``: SIGKILL each of a list of pids, skipping those already gone (the sweeps of every backend)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable


def sigkill(pids: Iterable[int]) -> None:
    """Send SIGKILL to every pid; a pid that has already exited (``ProcessLookupError``) is skipped.
    Permission errors are raised: a sweep that cannot kill what it was asked to must say so."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
