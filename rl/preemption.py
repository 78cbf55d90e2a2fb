"""Preemption: finish the current step, checkpoint, and exit so the job can be requeued.

Slurm sends ``SIGUSR1`` to the batch shell 120 s before the time limit
(``#SBATCH --signal=B:USR1@120``); ``slurm/train.sbatch`` forwards it to the driver. The
driver never stops mid-step: at the end of the step it saves a checkpoint, waits until every
learner rank's part is on disk and ``latest`` names it (``rl/checkpoint_format.py``; otherwise
checkpoints are written in the background), and exits with ``REQUEUE_EXIT_CODE``, which tells the
batch script to ``scontrol requeue`` the job; the requeued job starts with ``resume=true`` and
continues at the next step. The signal's lead time must cover the rest of a step plus writing
one checkpoint (12 bytes a parameter over all ranks).
"""

from __future__ import annotations

import signal

REQUEUE_EXIT_CODE = 3


class PreemptionFlag:
    """Set by SIGUSR1 (and SIGTERM) once installed; the driver polls ``requested`` between steps."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> PreemptionFlag:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        self.requested, self.signal_name = True, signal.Signals(signum).name
