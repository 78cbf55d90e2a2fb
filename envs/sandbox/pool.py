"""A warm pool of sandboxes, so that an episode's reset does not wait for a sandbox to start.

Each env worker process keeps a few sandboxes of one configuration started ahead (uid leased,
``/work`` tmpfs mounted, cgroup made, persistent shell running) by one background thread.
``acquire`` hands one out, copies the task's files into its ``/work`` and wakes the filler to
start a replacement. A sandbox is never handed out twice: the episode closes it, so no state
leaks from one episode to the next (a fresh one costs a background start, not a reset).
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from pathlib import Path
from typing import Any

from jointrl.envs.sandbox import Sandbox, make_sandbox
from jointrl.envs.sandbox.base import SandboxConfig


class SandboxPool:
    """Up to ``size`` warm sandboxes of ``backend`` and ``config`` (``kwargs`` go to the constructor:
    for docker, the image; a docker sandbox is a started container with the image's WORKDIR)."""

    def __init__(self, config: SandboxConfig | None = None, size: int = 4, backend: str = "bwrap",
                 **kwargs: Any) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self.config, self.size, self.backend, self.kwargs = config or SandboxConfig(), size, backend, kwargs
        self._ready: deque[Sandbox] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.errors = 0  # background starts that failed (the next acquire starts one itself)
        self._filler = threading.Thread(target=self._fill, name="jointrl-sandbox-pool", daemon=True)
        self._filler.start()

    def _fill(self) -> None:
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.size:
                    self._cv.wait()
                if self._closed:
                    return
            try:
                sb = make_sandbox(self.backend, self.config, **self.kwargs)
            except Exception:  # noqa: BLE001  (counted; acquire falls back to a cold start)
                with self._cv:
                    self.errors += 1
                    self._cv.wait(timeout=1.0)
                continue
            with self._cv:
                if self._closed:
                    sb.close()
                    return
                self._ready.append(sb)
                self._cv.notify_all()

    def acquire(self, workdir_from: Path | None = None) -> Sandbox:
        """A started sandbox with ``workdir_from``'s files in ``/work``; the caller closes it."""
        with self._cv:
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            sb = self._ready.popleft() if self._ready else None
            self._cv.notify_all()
        if sb is None:  # the pool is drained: start one here, as without a pool
            return make_sandbox(self.backend, self.config, workdir_from=workdir_from, **self.kwargs)
        try:
            if workdir_from is not None:
                sb.populate(Path(workdir_from))
        except BaseException:
            sb.close()
            raise
        return sb

    def warm(self, timeout: float = 30.0) -> int:
        """Wait until the pool is full (or ``timeout``); returns how many are ready."""
        with self._cv:
            self._cv.wait_for(lambda: len(self._ready) >= self.size or self._closed, timeout=timeout)
            return len(self._ready)

    def close(self) -> None:
        """Close every warm sandbox and stop the filler. Idempotent."""
        with self._cv:
            self._closed = True
            ready, self._ready = list(self._ready), deque()
            self._cv.notify_all()
        for sb in ready:
            sb.close()
        self._filler.join(timeout=30)


_SHARED: dict[str, SandboxPool] = {}
_SHARED_LOCK = threading.Lock()


@atexit.register
def _close_shared() -> None:
    """Close this process's pools at exit: a docker pool's containers outlive the process otherwise."""
    for pool in list(_SHARED.values()):
        pool.close()


def shared_pool(config: SandboxConfig, size: int = 4, backend: str = "bwrap") -> SandboxPool:
    """This process's pool for ``config`` (one per env worker, backend and configuration)."""
    key = repr((config, size, backend))
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        if pool is None or pool._closed:
            pool = _SHARED[key] = SandboxPool(config, size, backend)
        return pool
