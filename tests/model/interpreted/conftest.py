"""Model tests on the ``triton`` kernel backend, its kernels run on CPU in Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported (and would make every Triton kernel of
the process an interpreted one), so the default suite runs this folder in a child process
(``tests/model/test_interpreted.py``), as ``tests/kernels/interpreted/`` is run. Run directly with
``TRITON_INTERPRET=1 pytest tests/model/interpreted``; without the variable the folder is skipped.
"""

from __future__ import annotations

import os

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if not INTERPRETING:
    collect_ignore_glob = ["test_*.py"]
