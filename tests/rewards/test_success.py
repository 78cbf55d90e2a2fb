"""What counts as solved (``rewards.base.succeeded``): 1 for pass/fail modules, a stated threshold
for CAD's continuous scores -- and that threshold separates the same part built another way (or
with a dimension rounded) from a part with a wrong feature size."""

from __future__ import annotations

import os
import shutil

import pytest

from jointrl.rewards.base import SUCCESS_TOL, register, succeeded, success_threshold
from jointrl.rewards.cad_geometry import CHAMFER_SUCCESS, IOU_SUCCESS


def test_pass_fail_modules_need_one_and_cad_has_its_stated_thresholds():
    assert success_threshold("tests_pass") == success_threshold("swe_tests") == 1.0 - SUCCESS_TOL
    assert (success_threshold("cad_iou"), success_threshold("cad_chamfer")) == (IOU_SUCCESS, CHAMFER_SUCCESS)
    assert not succeeded({"tests_pass": 0.99}) and succeeded({"office_checks": 1.0, "format": 0.0})
    assert succeeded({"cad_iou": 0.9992, "cad_chamfer": 0.996})  # a rounded dimension
    assert not succeeded({"cad_iou": 0.9958, "cad_chamfer": 0.928})  # a 12 fillet made 11
    assert not succeeded({"cad_iou": 0.999, "cad_chamfer": 0.5}) and not succeeded({"cad_iou": 0.9, "cad_chamfer": 1.0})
    with pytest.raises(ValueError, match="success_at must be in \\(0, 1\\]"):
        register("never_registered", success_at=1.5)


PLATE = "result = (cq.Workplane('XY').box(57, 71, 11)\n          .faces('>Z').workplane().rarray(17, 21, 3, 3).hole(9))\n"
HEX = "import math\nresult = (cq.Workplane('XY').polygon(6, 10 / math.cos(math.pi / 6)).extrude(41)\n" \
      "          .faces('>Z').workplane().hole(6))\n"
POCKET = "result = (cq.Workplane('XY').box(81, 63, 25).edges('|Z').fillet(12)\n" \
         "          .faces('>Z').workplane().rect(35, 13).cutBlind(-16))\n"
CASES = [  # (reference, candidate, solved?)
    (PLATE, "pts = [(x, y) for x in (-17, 0, 17) for y in (-21, 0, 21)]\nresult = cq.Workplane('XY').box(57, 71, 11)"
            ".cut(cq.Workplane('XY').workplane(offset=-5.5).pushPoints(pts).circle(4.5).extrude(11))\n", True),
    (HEX, HEX.replace("10 / math.cos(math.pi / 6)", "11.55"), True),
    (POCKET, POCKET.replace("fillet(12)", "fillet(11)"), False),
    (PLATE, PLATE.replace("hole(9)", "hole(8.5)"), False),
    (PLATE, PLATE.replace("box(57", "box(56"), False),
]


@pytest.mark.slow
@pytest.mark.parametrize("reference, candidate, solved", CASES)
def test_cad_thresholds_separate_an_equivalent_part_from_a_wrong_feature(reference, candidate, solved):
    from jointrl.envs.cad.interpreter import CadConfig, build_stl
    from jointrl.envs.sandbox.bwrap import BwrapSandbox
    from jointrl.rewards.cad_geometry import DEFAULT_TAU, chamfer, iou, mesh_from_stl, normalized

    if os.geteuid() != 0 or shutil.which("bwrap") is None or not os.path.exists(CadConfig().python):
        pytest.skip("needs root, bubblewrap and the CAD tool venv (.ci/setup.d/cad.sh)")
    with BwrapSandbox(CadConfig().sandbox_config(), shell=False) as sandbox:
        target, candidate_mesh = (mesh_from_stl(build_stl(sandbox, code, CadConfig())[0]) for code in (reference, candidate))
    a, b = normalized(candidate_mesh, target, "target"), normalized(target, target, "target")
    info = {"cad_iou": iou(a, b), "cad_chamfer": max(0.0, 1.0 - chamfer(a, b) / DEFAULT_TAU)}
    assert succeeded(info) == solved, info
