"""The CAD reward's reference parts: built once per machine in a real sandbox, then read from the
disk cache by every process (rewards/cad_geometry.py ``_target``)."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("trimesh")
pytest.importorskip("manifold3d")

from jointrl.envs.cad import CadConfig  # noqa: E402
from jointrl.rewards import cad_geometry  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or not os.path.exists(CadConfig().python),
    reason="needs root, bubblewrap and the CAD tool venv (.ci/setup.d/cad.sh)")

BOX = "result = cq.Workplane().box(2, 3, 4)"
CYLINDER = "result = cq.Workplane().cylinder(5, 1)"


def test_a_reference_part_is_built_once_then_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTRL_CAD_CACHE", str(tmp_path))
    cad_geometry._target.cache_clear()
    box = cad_geometry._target(BOX).mesh  # built in a sandbox, written to the cache
    path = tmp_path / f"{cad_geometry.target_key(BOX)}.stl"
    assert path.is_file() and sorted(box.extents.round(6)) == [2, 3, 4]
    assert cad_geometry.target_key(CYLINDER) != cad_geometry.target_key(BOX)

    # A new process (the in-memory cache cleared) reads the file and builds nothing: here the file is
    # replaced by another part's mesh, which is what comes back.
    cylinder_stl = tmp_path / "other"
    cylinder_stl.mkdir()
    monkeypatch.setenv("JOINTRL_CAD_CACHE", str(cylinder_stl))
    cad_geometry._target.cache_clear()
    cad_geometry._target(CYLINDER)
    shutil.copyfile(cylinder_stl / f"{cad_geometry.target_key(CYLINDER)}.stl", path)
    monkeypatch.setenv("JOINTRL_CAD_CACHE", str(tmp_path))
    cad_geometry._target.cache_clear()
    assert sorted(cad_geometry._target(BOX).mesh.extents.round(2)) == [2, 2, 5]  # the cylinder's, from disk
    cad_geometry._target.cache_clear()
