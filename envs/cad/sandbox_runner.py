"""Runs model-written CadQuery code *inside* the sandbox, under the CAD tool venv's Python.

This file is copied into each CAD sandbox (read-only, ``/opt/jointrl-cad/runner.py``) and
imports nothing of jointrl: the tool venv has only CadQuery. Two modes:

- ``serve FD``: the episode's warm interpreter. CadQuery is imported once; then each request
  (one JSON line on stdin: ``{"code": ..., "stl": path|null, "step": path|null}``) is executed
  in a fresh namespace and answered by one JSON line on fd ``FD``. The host kills and restarts
  this process on a timeout or a crash.
- ``build CODE_FILE STL_FILE``: one-shot, for the reward: run the code in a fresh process,
  export the result as binary STL, print the JSON summary on stdout.

The code's result is the variable ``result`` (a ``cq.Workplane``, ``cq.Shape`` or
``cq.Assembly``), else the last object passed to ``show_object``. Its printed output (Python
and C level) is captured through fds 1 and 2 and returned, capped. The summary is information
for the model only: rewards never trust it (they rebuild the submitted code in a fresh sandbox).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

CODE_NAME = "<model code>"
MAX_OUTPUT_CHARS = 4000
# Tessellation of exported meshes: deviation relative to the bounding-box diagonal. The target
# and the candidate are tessellated by the same rule, so an exact answer gives the same mesh.
LINEAR_TOLERANCE = 1e-3
ANGULAR_TOLERANCE = 0.1  # radians


def _error(kind: str, exc: BaseException, code: str = "") -> dict:
    """A failure with the model's own line numbers (frames of this file are left out)."""
    source = code.splitlines()
    numbers = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == CODE_NAME]
    if isinstance(exc, SyntaxError) and exc.filename == CODE_NAME:
        numbers.append(exc.lineno)
        message = f"{type(exc).__name__}: {exc.msg}"
    else:
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = [f"  line {n}: {source[n - 1].strip() if n and 0 < n <= len(source) else ''}" for n in numbers]
    return {"ok": False, "error": f"{kind}: {message}" + "".join("\n" + line for line in lines)}


def _as_shape(cq, obj):
    """The CadQuery shape of the code's result, or a string saying why there is none."""
    if obj is None:
        return "no result: assign the final part to a variable named `result`"
    if isinstance(obj, cq.Workplane):
        shapes = [v for v in obj.vals() if isinstance(v, cq.Shape)]
        if not shapes:
            return "`result` is a Workplane without any shape on its stack"
        return shapes[0] if len(shapes) == 1 else cq.Compound.makeCompound(shapes)
    if isinstance(obj, cq.Assembly):
        return obj.toCompound()
    if isinstance(obj, cq.Shape):
        return obj
    return f"`result` must be a cq.Workplane, cq.Shape or cq.Assembly, got {type(obj).__name__}"


def evaluate(cq, code: str, stl: str | None = None, step: str | None = None) -> dict:
    """Run ``code``; summarize its solid; export it where asked."""
    shown: list = []
    namespace = {"__name__": "__main__", "cq": cq, "cadquery": cq,
                 "show_object": lambda obj, *a, **k: shown.append(obj)}
    try:
        compiled = compile(code, CODE_NAME, "exec")
    except SyntaxError as e:
        return _error("the code does not parse", e, code)
    try:
        exec(compiled, namespace)  # noqa: S102  (the sandbox is the boundary)
    except BaseException as e:  # SystemExit too: the model's code does not end the interpreter
        return _error("the code raised", e, code)
    shape = _as_shape(cq, namespace.get("result", shown[-1] if shown else None))
    if isinstance(shape, str):
        return {"ok": False, "error": shape}
    try:
        return _summarize(cq, shape, stl, step)
    except Exception as e:  # OCP raises on degenerate shapes (e.g. measuring an empty compound)
        return _error("the result could not be measured or exported", e)


def _summarize(cq, shape, stl: str | None, step: str | None) -> dict:
    solids = shape.Solids()
    if len(solids) > 1:  # overlapping solids would count their shared volume twice in a mesh
        shape = solids[0].fuse(*solids[1:]).clean()
        solids = shape.Solids()
    bb = shape.BoundingBox()
    summary = {
        "ok": bool(solids), "valid": bool(shape.isValid()), "num_solids": len(solids),
        "num_faces": len(shape.Faces()), "num_edges": len(shape.Edges()),
        "bbox": [bb.xmin, bb.ymin, bb.zmin, bb.xmax, bb.ymax, bb.zmax],
        "volume": float(shape.Volume()), "area": float(shape.Area()),
    }
    if not solids:
        summary["error"] = "the result has no solid (a closed volume is needed)"
        return summary
    if stl:
        tolerance = LINEAR_TOLERANCE * max(bb.DiagonalLength, 1e-9)
        cq.exporters.export(shape, stl, tolerance=tolerance, angularTolerance=ANGULAR_TOLERANCE)
    if step:
        cq.exporters.export(shape, step)
    return summary


class _Captured:
    """Point fds 1 and 2 at a fresh temporary file for one call; read it back, capped."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        self.file.seek(0)
        raw = self.file.read(MAX_OUTPUT_CHARS + 1).decode("utf-8", errors="replace")
        self.file.close()
        self.text = raw[:MAX_OUTPUT_CHARS] + ("\n[output cut]" if len(raw) > MAX_OUTPUT_CHARS else "")


def serve(reply_fd: int) -> None:
    reply = os.fdopen(reply_fd, "w", buffering=1)
    try:
        with _Captured():
            import cadquery as cq
    except BaseException as e:  # noqa: BLE001  (reported to the host, which raises EnvError)
        reply.write(json.dumps(_error("cannot import cadquery", e)) + "\n")
        return
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        with _Captured() as out:
            result = evaluate(cq, request["code"], request.get("stl"), request.get("step"))
        reply.write(json.dumps({**result, "output": out.text}) + "\n")


def build(code_file: str, stl_file: str) -> None:
    with open(code_file, encoding="utf-8") as f:
        code = f.read()
    with _Captured() as out:
        import cadquery as cq

        result = evaluate(cq, code, stl=stl_file)
    print(json.dumps({**result, "output": out.text}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["build"] and len(sys.argv) == 4:
        build(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: runner.py serve FD | build CODE_FILE STL_FILE")
