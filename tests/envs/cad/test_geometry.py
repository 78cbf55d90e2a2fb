"""The CAD reward's geometry on hand-computed cases (host only: trimesh, manifold3d, libigl)."""

from __future__ import annotations

import math

import pytest

trimesh = pytest.importorskip("trimesh")
pytest.importorskip("manifold3d")
pytest.importorskip("igl")

from jointrl.rewards.cad_geometry import chamfer, iou, normalized  # noqa: E402


def box(x, y, z, at=(0.0, 0.0, 0.0)):
    mesh = trimesh.creation.box([x, y, z])
    mesh.apply_translation(at)
    return mesh


def l_part(mirrored: bool = False):
    """An L in XY, extruded 1 along Z: [0,2]x[0,1] plus [0,1]x[1,2] (area 3); mirrored: x -> 2 - x."""
    upright = box(1, 1, 1, (1.5 if mirrored else 0.5, 1.5, 0.5))
    return trimesh.boolean.union([box(2, 1, 1, (1, 0.5, 0.5)), upright], engine="manifold")


def test_two_offset_boxes():
    # Unit cubes shifted by 0.5 along x: overlap 0.5, union 1.5 (raw coordinates).
    a, b = box(1, 1, 1), box(1, 1, 1, (0.5, 0, 0))
    assert iou(normalized(a, a, "none"), normalized(b, a, "none")) == pytest.approx(1 / 3, abs=1e-9)
    # Centring each part's bounding box removes the offset.
    assert iou(normalized(b, a, "target"), normalized(a, a, "target")) == pytest.approx(1.0, abs=1e-9)


def test_cylinder_against_its_bounding_box():
    # A cylinder of diameter 1 and height 1 fills pi/4 of its bounding box; 1024 facets are
    # within 1e-5 of the true area.
    cylinder = trimesh.creation.cylinder(radius=0.5, height=1.0, sections=1024)
    for mode in ("none", "target", "each"):
        score = iou(normalized(cylinder, cylinder, mode), normalized(box(1, 1, 1), cylinder, mode))
        assert score == pytest.approx(math.pi / 4, abs=1e-4), mode


def test_mirrored_part():
    # L and its mirror image share the bottom bar (area 2) and cover area 4 together.
    a, b = l_part(), l_part(mirrored=True)
    assert a.is_watertight and a.volume == pytest.approx(3.0)
    assert iou(normalized(b, a, "target"), normalized(a, a, "target")) == pytest.approx(0.5, abs=1e-9)
    assert chamfer(normalized(b, a, "target"), normalized(a, a, "target")) > 0.05


@pytest.mark.parametrize(("mode", "expected"), [("each", 1.0), ("target", 1 / 8), ("none", 1 / 8)])
def test_scaled_part(mode, expected):
    # A 1x2x3 box and the same box scaled by 2 (both centred): the larger holds the smaller,
    # volume ratio 1/8 -- unless each part is scaled into the unit cube on its own.
    small, large = box(1, 2, 3), box(2, 4, 6)
    assert iou(normalized(large, small, mode), normalized(small, small, mode)) == pytest.approx(expected, abs=1e-9)
    distance = chamfer(normalized(large, small, mode), normalized(small, small, mode))
    assert (distance < 1e-9) if mode == "each" else (distance > 0.1)


def test_identical_parts_score_exactly_one_and_zero_distance():
    part = l_part()
    assert iou(part, part) == pytest.approx(1.0, abs=1e-12)
    assert chamfer(part, part) == pytest.approx(0.0, abs=1e-9)


def test_an_open_mesh_is_refused_and_a_bad_mode_named():
    open_box = box(1, 1, 1)
    open_box.update_faces(list(range(len(open_box.faces) - 2)))  # drop one face: not closed
    with pytest.raises(ValueError, match="not a closed solid"):
        iou(open_box, box(1, 1, 1))
    with pytest.raises(ValueError, match=r"normalize must be one of \('target', 'each', 'none'\)"):
        normalized(box(1, 1, 1), box(1, 1, 1), "unit")


def test_doctests():
    import doctest

    from jointrl.rewards import cad_geometry

    result = doctest.testmod(cad_geometry)
    assert result.attempted >= 9 and result.failed == 0
