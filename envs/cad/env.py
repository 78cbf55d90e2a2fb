"""The CAD domain: the model writes CadQuery code; tools ``run_cadquery`` and ``submit``.

One ``CadEnv`` hosts one episode: ``reset`` opens a :class:`CadSandbox` and starts its warm
interpreter in the background (the CadQuery import overlaps the model's first turn);
``run_cadquery(code)`` runs the code there and returns a text summary -- whether it made a
closed solid, whether OCP finds it valid, its bounding box, volume, surface area, solid / face /
edge counts, what it printed, or the error with the model's own line numbers -- and, with
``export`` set to ``"stl"`` or ``"step"``, also writes the part to ``/work/part.<ext>``.
In image mode (a task's ``metadata["mode"] == "image"``, or ``CadEnv(image=True)``) each call
that makes a solid also returns three shaded views of it as a PNG (``render.py``).
``submit(code)`` records the final program and ends the episode; ``verify_sandbox`` opens a
fresh sandbox holding only that code (``/work/submission.py``), where
``rewards/cad_geometry.py`` rebuilds and scores it.

Errors: a malformed call returns ``Observation(is_error=True)``; code that fails, times out
or crashes the interpreter is a *result* (the interpreter restarts on the next call); a
sandbox that cannot start raises ``EnvError``.
"""

from __future__ import annotations

import asyncio

from jointrl.envs.base import EnvError, Message, Observation, Task, ToolCall, ToolSpec, refuse, validate_call
from jointrl.envs.cad.interpreter import CadConfig, CadSandbox, Reply
from jointrl.envs.cad.render import png, render_views, triangles_from_stl
from jointrl.envs.sandbox.bwrap import BwrapSandbox

SUBMISSION = "submission.py"
VIEW_STL = ".view.stl"  # image mode: the mesh the host renders
EXPORTS = ("stl", "step")

RUN_CADQUERY = ToolSpec(
    name="run_cadquery",
    description=(
        "Run a CadQuery (Python) program and describe the part it builds. `cq` is already imported; "
        "assign the final part to `result`. Returns whether it is a valid closed solid, its bounding box, "
        "volume, surface area and solid/face/edge counts, what it printed, or the error with line numbers. "
        "Each call starts from a fresh namespace."
    ),
    parameters={
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "the CadQuery program"},
            "export": {"type": "string", "description": "optional: 'stl' or 'step' also writes /work/part.<ext>"},
        },
        "required": ["code"],
        "additionalProperties": False,
    },
)
SUBMIT = ToolSpec(
    name="submit",
    description="Submit your final CadQuery program (it must assign the part to `result`). Ends the episode.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the final CadQuery program"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
SYSTEM_PROMPT = (
    "You design mechanical parts in CadQuery (Python). Use `run_cadquery` to build and inspect a part "
    "(each call is limited to {timeout:g} s), then `submit` the final program. The part is compared with "
    "the target by volume overlap and surface distance, so dimensions matter; its placement does not."
)


def describe(reply: Reply, timeout_s: float) -> str:
    """The observation text of one ``run_cadquery`` call."""
    if reply.timed_out:
        return (f"Error: the code ran past the {timeout_s:g} s limit and was stopped. The interpreter was "
                "restarted (the next call imports CadQuery again).")
    if reply.crashed:
        return f"Error: the CadQuery interpreter died: {reply.crashed}. It restarts on the next call."
    s = reply.summary
    lines = []
    if "bbox" in s:
        x0, y0, z0, x1, y1, z1 = s["bbox"]
        lines += [
            f"closed solid: {'yes' if s.get('num_solids') else 'no'}; valid: {'yes' if s.get('valid') else 'no'}",
            f"solids: {s.get('num_solids')}, faces: {s.get('num_faces')}, edges: {s.get('num_edges')}",
            f"bounding box: x [{x0:.4g}, {x1:.4g}], y [{y0:.4g}, {y1:.4g}], z [{z0:.4g}, {z1:.4g}] "
            f"(size {x1 - x0:.4g} x {y1 - y0:.4g} x {z1 - z0:.4g})",
            f"volume: {s.get('volume', 0.0):.6g}",
            f"surface area: {s.get('area', 0.0):.6g}",
        ]
    if s.get("error"):
        lines.append(f"Error: {s['error']}")
    if s.get("output"):
        lines.append("[output]\n" + s["output"].rstrip("\n"))
    return "\n".join(lines)


class CadEnv:
    """``Env`` for CAD tasks; ``cad`` sets the sandbox limits and the per-call timeout;
    ``image`` turns image mode on for every task (else a task's ``metadata["mode"]`` decides)."""

    def __init__(self, cad: CadConfig | None = None, image: bool = False) -> None:
        self.cad = cad or CadConfig()
        self.image_default, self.image = image, image
        self.tools: list[ToolSpec] = [RUN_CADQUERY, SUBMIT]
        self.task: Task | None = None
        self.sandbox: CadSandbox | None = None
        self.submitted: str | None = None
        self.done = False
        self.num_tool_errors = 0
        self._warmup: asyncio.Future | None = None

    async def reset(self, task: Task) -> list[Message]:
        await self.close()
        try:
            self.sandbox = await asyncio.to_thread(CadSandbox, self.cad)
        except OSError as e:
            raise EnvError(f"cannot open a CAD sandbox for task {task.id!r}: {e}") from e
        self._warmup = asyncio.ensure_future(asyncio.to_thread(self.sandbox.warm))
        self.task, self.submitted, self.done, self.num_tool_errors = task, None, False, 0
        self.image = self.image_default or task.metadata.get("mode") == "image"
        system = SYSTEM_PROMPT.format(timeout=self.cad.call_timeout_s)
        return [Message(role="system", content=system), Message(role="user", content=task.prompt)]

    async def step(self, call: ToolCall) -> Observation:
        if self.sandbox is None:
            raise RuntimeError("CadEnv.step() called before reset()")
        problem = validate_call(call, self.tools)
        export = call.arguments.get("export") if problem is None else None
        if export is not None and export not in EXPORTS:
            problem = f"run_cadquery: argument 'export' must be one of {list(EXPORTS)}, got {export!r}"
        if (refused := refuse(self, problem, "submit")) is not None:
            return refused
        code = call.arguments["code"]
        if call.name == "submit":
            self.submitted, self.done = code, True
            await asyncio.to_thread(self.sandbox.interrupt)  # its CPU goes to the reward's builds
            return Observation("Submitted.", done=True)
        stl = "part.stl" if export == "stl" else VIEW_STL if self.image else None
        try:
            reply = await asyncio.to_thread(self.sandbox.call, code, stl=stl,
                                            step="part.step" if export == "step" else None)
            made_solid = bool(reply.summary.get("num_solids"))
            image = await asyncio.to_thread(self._views, stl) if made_solid and self.image else None
        except OSError as e:
            raise EnvError(f"the CAD sandbox failed: {e}") from e
        text = describe(reply, self.cad.call_timeout_s)
        if export and made_solid:
            text += f"\nwritten: /work/part.{export}"
        if image is not None:
            text += "\n[image: front, top and isometric views]"
        return Observation(text, image=image)

    def _views(self, stl: str) -> bytes | None:
        """The PNG of the part's views, or None if its mesh cannot be read (the code wrote over it)."""
        assert self.sandbox is not None
        try:
            return png(render_views(triangles_from_stl(self.sandbox.read_file(stl))))
        except (FileNotFoundError, ValueError):
            return None

    def verify_sandbox(self) -> BwrapSandbox:
        """A fresh sandbox holding only the submitted code, as ``/work/submission.py`` (none if
        nothing was submitted). The caller closes it; raises ``EnvError`` if it cannot start."""
        if self.task is None:
            raise RuntimeError("CadEnv.verify_sandbox() called before reset()")
        sandbox = BwrapSandbox(self.cad.sandbox_config(), env=self.cad.env, shell=False)
        try:
            if self.submitted is not None:
                sandbox.write_file(SUBMISSION, self.submitted)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    async def close(self) -> None:
        """Stop the interpreter and close the sandbox. Idempotent."""
        if self._warmup is not None:
            await asyncio.gather(self._warmup, return_exceptions=True)
            self._warmup = None
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)
