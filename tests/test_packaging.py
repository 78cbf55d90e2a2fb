"""The code folders install under one import package, ``jointrl``; bare names stay free."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bare_top_level_names_are_not_importable(tmp_path):
    for name in ("kernels", "rl", "envs", "rewards", "model"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode != 0 and "No module named" in r.stderr, name
    r = subprocess.run([sys.executable, "-c", "import jointrl.kernels.mxfp4, jointrl.rl.train"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"jointrl"}
    for top in ("rl", "model", "kernels", "envs", "rewards", "conf"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(("jointrl", *init.parent.relative_to(ROOT).parts)))
    assert found == listed


def test_console_script_reports_usage():
    r = subprocess.run(["jointrl", "fly"], capture_output=True, text=True)
    assert r.returncode != 0 and "usage: jointrl {train|serve|export|eval|sft|recipe}" in r.stderr and "fly" in r.stderr
