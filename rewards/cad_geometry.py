"""``cad_iou`` and ``cad_chamfer``: the submitted CadQuery part against the task's target part.

Both solids are built the same way -- their code run once in a fresh sandbox (CAD tool venv,
``envs/cad/interpreter.py``) and exported as a binary STL with the same tessellation rule --
then compared on the host (trimesh reads and samples the meshes, manifold3d does the booleans,
libigl the point-to-surface distances):

- **normalization** (``task.metadata["normalize"]``): ``"target"`` (default) moves each part's
  bounding-box centre to the origin and scales *both* by the target's largest extent, so
  placement does not matter but size does; ``"each"`` scales each part by its own largest
  extent (into the unit cube: a part right in shape but not in size scores 1); ``"none"``
  compares raw coordinates.
- ``cad_iou`` = vol(A ∩ B) / vol(A ∪ B), with vol(A ∪ B) = vol(A) + vol(B) - vol(A ∩ B).
- ``cad_chamfer`` = max(0, 1 - CD / tau) with CD = mean_a min_b |a - b| + mean_b min_a |a - b|
  over ``CHAMFER_SAMPLES`` points sampled uniformly (by area, fixed seed) on each surface,
  in normalized units; tau = ``task.metadata["chamfer_tau"]`` (default 0.01: 1 % of the
  target's size).

The config combines them (``reward: {cad_iou: 0.5, cad_chamfer: 0.5}``). An episode counts as
solved (pass@k, ``<domain>/success``) when ``cad_iou`` >= ``IOU_SUCCESS`` (0.995) and
``cad_chamfer`` >= ``CHAMFER_SUCCESS`` (0.95: a Chamfer distance of at most 0.05 % of the
target's size), thresholds measured below. No submission, an
empty one, code that fails, or a result that is not one closed solid scores 0 on both.

Integrity: the submitted code is rebuilt from the text the env recorded at ``submit``, read from a
fresh verification sandbox (``Episode.verify_sandbox``, ``CadEnv.verify_sandbox``); nothing the
episode's interpreter printed or exported is read. The rebuild is a fork of this process's warm
builder (``envs/cad/builder.py``: a sandbox of its own where CadQuery is imported once and no model
code runs; its docstring says what a build can and cannot reach), else -- ``JOINTRL_CAD_BUILD=cold``,
or when the builder fails -- one-shot in the verification sandbox; both give the same mesh. That
code may write any STL it likes -- which is just another way of answering, checked like any other
(closed, compared to the target).
The target is built from the task's reference program in a sandbox of its own, and cached: in
memory and on disk (``target_cache_dir``, keyed by the program, the runner and the venv), so each
reference part is built once per machine, not once per process.
A sandbox or target-build failure raises ``EnvError`` (infrastructure, never scored 0).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jointrl.envs.base import EnvError, Task
from jointrl.envs.cad.builder import shared_builder
from jointrl.envs.cad.env import SUBMISSION
from jointrl.envs.cad.interpreter import RUNNER, CadConfig, build_stl
from jointrl.envs.sandbox.bwrap import BwrapSandbox
from jointrl.rewards.base import Episode, RewardResult, register

NORMALIZE = ("target", "each", "none")
CHAMFER_SAMPLES = 4096
DEFAULT_TAU = 0.01
# Success (``rewards.base.succeeded``: jointrl eval's pass@k, train's <domain>/success) needs both.
# Measured on shipped parts: the same part built another way (holes cut instead of drilled, a
# revolve as stacked cylinders, a shell as a cut) scores 1.0 on both; a hex standoff's 11.547
# across corners rounded to 11.55 scores IoU 0.9992 / Chamfer 0.996 (solved); a 12 fillet made 11
# 0.9958 / 0.928, a 9 hole made 8.5 0.983 / 0.85, a 57 plate made 56 0.980 / 0.83 (not solved).
IOU_SUCCESS = 0.995
CHAMFER_SUCCESS = 0.95


# -- geometry (pure) -----------------------------------------------------------------------

def mesh_from_stl(data: bytes):
    """A trimesh mesh from STL bytes, coincident vertices merged (STL is a triangle soup)."""
    import trimesh

    return trimesh.load(io.BytesIO(data), file_type="stl", process=True)


def normalized(mesh, target, mode: str):
    """``mesh`` moved (and scaled) as ``mode`` says; ``target`` sets the scale of ``"target"``."""
    if mode not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {mode!r}")
    if mode == "none":
        return mesh
    lo, hi = mesh.bounds
    size = float(np.max((mesh if mode == "each" else target).extents))
    out = mesh.copy()
    out.apply_translation(-(lo + hi) / 2)
    out.apply_scale(1.0 / max(size, 1e-12))
    return out


def _manifold(mesh):
    import manifold3d

    m = manifold3d.Manifold(manifold3d.Mesh(vert_properties=np.asarray(mesh.vertices, np.float32),
                                            tri_verts=np.asarray(mesh.faces, np.uint32)))
    if m.status() != manifold3d.Error.NoError:
        raise ValueError(f"not a closed solid mesh ({m.status().name})")
    return m


def iou(a, b) -> float:
    """Volumetric IoU of two closed meshes (raises ``ValueError`` for an open one).

    >>> import trimesh
    >>> a, b = trimesh.creation.box([1, 1, 1]), trimesh.creation.box([1, 1, 1])
    >>> _ = b.apply_translation([0.5, 0, 0])
    >>> round(iou(a, b), 6)  # overlap 0.5, union 1.5
    0.333333
    """
    ma, mb = _manifold(a), _manifold(b)
    inter = (ma ^ mb).volume()
    union = ma.volume() + mb.volume() - inter
    return float(inter / union) if union > 0 else 0.0


def chamfer(a, b, samples: int = CHAMFER_SAMPLES, seed: int = 0) -> float:
    """Symmetric Chamfer distance between two surfaces: the mean distance from points sampled
    on a (by area, ``seed``) to b's surface, plus the reverse (not squared).

    Distances go to the other *surface*, not to its samples: point-to-point distances would
    add a sampling noise floor (~0.5 * sqrt(area / samples) per direction) as large as the
    signal of a small feature such as a missing hole.

    >>> import trimesh
    >>> a, b = trimesh.creation.box([1, 1, 1]), trimesh.creation.box([1, 1, 1])
    >>> round(chamfer(a, b), 9)
    0.0
    >>> _ = b.apply_translation([0, 0, 0.1])  # a's top and bottom faces 0.1 away, its sides 0
    >>> round(chamfer(a, b), 2)  # a point of a top face: min(0.1, its distance to b's side edges)
    0.07
    """
    from trimesh.sample import sample_surface

    pa, _ = sample_surface(a, samples, seed=seed)
    pb, _ = sample_surface(b, samples, seed=seed)
    return float(_to_surface(pa, b).mean() + _to_surface(pb, a).mean())


def _to_surface(points, mesh):
    """Exact distance from each point to the mesh's surface (libigl's AABB tree)."""
    import igl

    squared = igl.point_mesh_squared_distance(np.asarray(points, np.float64), np.asarray(mesh.vertices, np.float64),
                                              np.asarray(mesh.faces, np.int64))[0]
    return np.sqrt(squared)


# -- the episode's part and the target's ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Built:
    """A part built from code: its mesh, or the reason there is none."""

    mesh: object | None
    error: str = ""


def _key(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def target_cache_dir() -> Path:
    """Where reference parts' STLs are kept across processes: ``$JOINTRL_CAD_CACHE``, else
    ``$XDG_CACHE_HOME/jointrl/cad_targets``, else ``~/.cache/jointrl/cad_targets``."""
    if os.environ.get("JOINTRL_CAD_CACHE"):
        return Path(os.environ["JOINTRL_CAD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jointrl" / "cad_targets"


def target_key(reference: str) -> str:
    """The cache key of a reference part: its code, the runner that builds and tessellates it, and the venv."""
    runner = hashlib.sha256(RUNNER.read_bytes()).hexdigest()
    return hashlib.sha256(f"{runner}\0{CadConfig().venv}\0{reference}".encode()).hexdigest()


@functools.lru_cache(maxsize=256)
def _target(reference: str) -> Built:
    """The reference part's mesh: built once per machine (a fresh sandbox, as a submission is), then
    read from :func:`target_cache_dir` by every process (each env worker of each recipe stage). Only the
    host writes the cache, from the task's own reference program; no sandbox ever mounts it."""
    path = target_cache_dir() / f"{target_key(reference)}.stl"
    if path.is_file():
        return Built(mesh_from_stl(path.read_bytes()))
    with BwrapSandbox(CadConfig().sandbox_config(), shell=False) as sandbox:
        stl, summary = build_stl(sandbox, reference, CadConfig())
    if stl is None:
        raise EnvError(f"the task's reference part does not build: {summary.get('error')}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(stl)
        tmp.replace(path)  # atomic: a concurrent reader sees the whole file or none
    except OSError:
        pass  # a read-only cache costs a rebuild per process, nothing else
    return Built(mesh_from_stl(stl))


_CANDIDATES: dict[str, Built] = {}  # by code hash: cad_iou and cad_chamfer build a submission once
_MAX_CANDIDATES = 64


def _candidate(episode: Episode) -> Built:
    if episode.verify_sandbox is None:
        raise ValueError("the CAD rewards need episode.verify_sandbox (CadEnv.verify_sandbox)")
    try:
        sandbox = episode.verify_sandbox()
    except OSError as e:
        raise EnvError(f"cannot open the CAD verification sandbox: {e}") from e
    try:
        try:
            code = sandbox.read_file(SUBMISSION).decode("utf-8", errors="replace")
        except FileNotFoundError:
            return Built(None, "nothing was submitted")
        if not code.strip():
            return Built(None, "the submitted code is empty")
        if _key(code) in _CANDIDATES:
            return _CANDIDATES[_key(code)]
        stl, summary = _build(sandbox, code)
    except OSError as e:
        raise EnvError(f"the CAD verification sandbox failed: {e}") from e
    finally:
        sandbox.close()
    built = Built(None, str(summary.get("error", "no solid"))) if stl is None else Built(mesh_from_stl(stl))
    if len(_CANDIDATES) >= _MAX_CANDIDATES:
        _CANDIDATES.pop(next(iter(_CANDIDATES)))
    _CANDIDATES[_key(code)] = built
    return built


def _build(sandbox: BwrapSandbox, code: str):
    """The submission's (STL, summary): from the warm builder, or one-shot in ``sandbox`` (the
    verification sandbox) without one or when it fails (``EnvError``: it restarts on its next build)."""
    builder = shared_builder()
    if builder is not None:
        try:
            return builder.build(code)
        except (EnvError, OSError) as e:
            print(f"cad reward: the warm builder failed ({e}); this submission is rebuilt one-shot",
                  file=sys.stderr, flush=True)
    return build_stl(sandbox, code, CadConfig())


def _pair(task: Task, episode: Episode):
    """(candidate, target) normalized as the task says, or (None, why) when there is no candidate."""
    reference = task.metadata.get("reference")
    if not isinstance(reference, str):
        raise ValueError(f"CAD task {task.id!r} has no reference program (metadata['reference'])")
    target = _target(reference).mesh
    built = _candidate(episode)
    if built.mesh is None:
        return None, built.error
    mode = task.metadata.get("normalize", "target")
    return normalized(built.mesh, target, mode), normalized(target, target, mode)


@register("cad_iou", success_at=IOU_SUCCESS)
def cad_iou(task: Task, episode: Episode) -> RewardResult:
    candidate, target = _pair(task, episode)
    if candidate is None:
        return RewardResult(0.0, {"error": target})
    try:
        return RewardResult(iou(candidate, target))
    except ValueError as e:  # the submission's mesh is not closed
        return RewardResult(0.0, {"error": str(e)})


@register("cad_chamfer", success_at=CHAMFER_SUCCESS)
def cad_chamfer(task: Task, episode: Episode) -> RewardResult:
    candidate, target = _pair(task, episode)
    if candidate is None:
        return RewardResult(0.0, {"error": target})
    tau = float(task.metadata.get("chamfer_tau", DEFAULT_TAU))
    distance = chamfer(candidate, target)
    return RewardResult(max(0.0, 1.0 - distance / tau), {"distance": distance})
