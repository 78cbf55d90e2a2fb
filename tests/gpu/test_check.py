"""``tests/gpu/check.sh``, the prepared GPU check: it runs on the host in its dry mode (Triton
interpreted, tiny shapes) with Ray, DeepSpeed, Hydra and OmegaConf unimportable, as on the lent GPU
machine, and the tree it ships fits that machine's 64 MiB."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "gpu" / "check.sh"
ABSENT = ("ray", "deepspeed", "hydra", "omegaconf")  # not installed on the GPU machine


def test_the_shipped_tree_fits_the_gpu_machine():
    """What a device run carries (tracked and untracked-but-not-ignored files) stays under 64 MiB."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    total = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())
    assert 1 << 20 < total <= 64 << 20, f"{total / 2**20:.1f} MiB"


@pytest.mark.slow
def test_dry_check_runs_without_ray_deepspeed_or_hydra(tmp_path):
    for name in ABSENT:  # packages that refuse to import, first on the path
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHON": sys.executable}
    env.pop("DS_ACCELERATOR", None)
    out = subprocess.run(["bash", str(CHECK), "--dry"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=540)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "FAIL" not in log, log[-4000:]
    for line in ("bit-exact", "ids equal", "paged prefill", "engine kernels: triton", "engine vs HF generate", "decode graphs",
                 "all on cpu", "log-prob mismatch"):
        assert line in log, log[-4000:]
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True)
    assert "not on the GPU machine" in probe.stderr  # the blocking held
