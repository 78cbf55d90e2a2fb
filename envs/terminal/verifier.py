"""Fresh verification sandboxes over an episode's final files (``Episode.verify_sandbox``).

Reward integrity (docs/architecture.md): the verifier never runs in the sandbox the agent had
its hands on. At the end of the episode the agent's ``/work`` is snapshotted on the host
(root-owned, mode 0700); every call of :class:`FinalFiles` opens a new sandbox, under a new
uid, over a *copy* of that snapshot, with

- the task's ``tests/`` mounted read-only at ``/tests`` (taken from the task folder, so the
  agent cannot have changed them),
- a fresh, empty, writable ``/logs/verifier`` for the verifier's ``reward.txt`` (the agent
  never had it: a ``reward.txt`` it wrote anywhere in ``/work`` is not read),
- ``HOME=/tmp`` (a fresh tmpfs), so dotfiles the agent left in ``/work`` do not configure
  the verifier's tools; ``PATH`` is the read-only system one;
- ``verifier_site/sitecustomize.py`` on ``PYTHONPATH`` (mounted read-only at
  ``/opt/jointrl-verifier``), so ``python3 -m pytest`` run from ``/work`` imports the real
  pytest, not a ``pytest.py`` the agent planted there (checked: without it, that hack scores
  1); ``PYTHONNOUSERSITE=1`` and no bytecode cache. A test script that sets its own
  ``PYTHONPATH`` drops this guard.

tests/rewards/test_reward_hacking.py plays each known hack (reward files, a fake pytest on
PATH or as a module, planted conftest.py / pytest.ini, edited tests) and checks it scores 0.
"""

from __future__ import annotations

import secrets
import shutil
import weakref
from pathlib import Path
from typing import Any

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox import Sandbox, make_sandbox
from jointrl.envs.sandbox.base import SandboxConfig
from jointrl.envs.sandbox.bwrap import sandbox_root

TESTS_MOUNT = "/tests"
VERIFIER_LOGS = "/logs/verifier"
REWARD_FILE = f"{VERIFIER_LOGS}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOGS}/reward.json"  # Harbor's alternative: {"reward": 1.0, ...}
SITE_DIR = Path(__file__).parent / "verifier_site"
SITE_MOUNT = "/opt/jointrl-verifier"
VERIFIER_ENV = {"HOME": "/tmp", "PYTHONPATH": SITE_MOUNT, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class FinalFiles:
    """A host snapshot of an episode's final ``/work``; calling it opens a verification sandbox.

    The snapshot is deleted by :meth:`discard`, or when this object is garbage-collected (it
    outlives the episode's own sandbox, so rewards may be computed after ``env.close()``).
    The caller closes each sandbox it opens.
    """

    def __init__(self, snapshot: Path, tests_dir: Path, config: SandboxConfig,
                 extra_ro_binds: dict[str, str] | None = None, backend: str = "bwrap",
                 backend_kwargs: dict[str, Any] | None = None) -> None:
        self.snapshot, self.tests_dir, self.config = snapshot, tests_dir, config
        self.extra_ro_binds = dict(extra_ro_binds or {})  # e.g. a TB1 task's run-tests.sh
        self.backend, self.backend_kwargs = backend, dict(backend_kwargs or {})  # the episode's backend and image
        self._finalizer = weakref.finalize(self, shutil.rmtree, snapshot, True)

    @classmethod
    def take(cls, sandbox: Sandbox, tests_dir: Path, config: SandboxConfig,
             extra_ro_binds: dict[str, str] | None = None, backend: str = "bwrap",
             backend_kwargs: dict[str, Any] | None = None) -> FinalFiles:
        """Snapshot ``sandbox``'s ``/work`` now."""
        if not tests_dir.is_dir():
            raise ValueError(f"tests dir {str(tests_dir)!r} is not a directory")
        snapshot = sandbox_root() / f"snap-{secrets.token_hex(8)}"
        sandbox.copy_workdir_to(snapshot)
        return cls(snapshot, tests_dir, config, extra_ro_binds, backend, backend_kwargs)

    def __call__(self) -> Sandbox:
        if not self._finalizer.alive:
            raise RuntimeError("the episode's final files were discarded")
        if not self.snapshot.is_dir():  # removed behind our back: infrastructure, not the policy
            raise EnvError(f"the snapshot of the episode's final files is gone: {str(self.snapshot)!r}")
        return make_sandbox(
            self.backend,
            self.config,
            workdir_from=self.snapshot,
            ro_binds={str(self.tests_dir): TESTS_MOUNT, str(SITE_DIR): SITE_MOUNT, **self.extra_ro_binds},
            rw_dirs=(VERIFIER_LOGS,),
            env=VERIFIER_ENV,
            shell=False,  # the verifier runs one command, one-shot
            **self.backend_kwargs,
        )

    def discard(self) -> None:
        """Delete the snapshot now. Idempotent."""
        self._finalizer()
