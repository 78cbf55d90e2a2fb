"""CadEnv and its warm interpreter over real bwrap: summaries, errors, hostile code, verification."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from jointrl.envs.base import Env, ToolCall, Verifiable
from jointrl.envs.cad import CadConfig, CadEnv, CadSandbox, load_tasks
from jointrl.envs.cad.env import SUBMISSION, describe

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or not os.path.exists(CadConfig().python),
    reason="needs root, bubblewrap and the CAD tool venv (.ci/setup.d/cad.sh)",
)
# Short limits, generous enough for a loaded 2-core machine to import CadQuery and build a box.
CAD = CadConfig(call_timeout_s=10.0, max_memory_bytes=1 << 30)


@pytest.fixture(scope="module")
def sandbox():
    """One warm interpreter shared by the checks below (each restart costs a CadQuery import)."""
    with CadSandbox(CAD) as sb:
        yield sb


def text(sandbox, code: str, **export) -> str:
    return describe(sandbox.call(code, **export), CAD.call_timeout_s)


def test_summary_of_a_part(sandbox):
    out = text(sandbox, "result = cq.Workplane('XY').box(10, 20, 5)\nprint('built')")
    assert out == ("closed solid: yes; valid: yes\nsolids: 1, faces: 6, edges: 12\n"
                   "bounding box: x [-5, 5], y [-10, 10], z [-2.5, 2.5] (size 10 x 20 x 5)\n"
                   "volume: 1000\nsurface area: 700\n[output]\nbuilt")


def test_errors_name_the_models_line(sandbox):
    out = text(sandbox, "a = cq.Workplane('XY').box(1, 1, 1)\nresult = a.fillet(\n")
    assert out.startswith("Error: the code does not parse: SyntaxError") and "line 2" in out
    out = text(sandbox, "a = cq.Workplane('XY').box(1, 1, 1)\nresult = a.faces('>Z').nosuch()")
    assert "AttributeError" in out and "line 2: result = a.faces('>Z').nosuch()" in out
    assert text(sandbox, "x = 1") == "Error: no result: assign the final part to a variable named `result`"
    out = text(sandbox, "result = cq.Workplane('XY').rect(2, 2)")
    assert "no solid" in out or "without any shape" in out


def test_each_call_starts_from_a_fresh_namespace(sandbox):
    text(sandbox, "leftover = 1\nresult = cq.Workplane().box(1, 1, 1)")
    assert "NameError" in text(sandbox, "result = cq.Workplane().box(leftover, 1, 1)")


def test_exports_on_request(sandbox):
    out = text(sandbox, "result = cq.Workplane().sphere(3)", stl="part.stl", step="part.step")
    assert "volume: 113.097" in out
    assert sandbox.read_file("part.stl")[:80] and b"ISO-10303-21" in sandbox.read_file("part.step")


@pytest.mark.parametrize(
    ("code", "expect"),
    [
        # An infinite loop and a huge boolean union run into the call's wall-clock limit.
        ("while True:\n    pass", "ran past the 10 s limit"),
        # (disjoint boxes: overlapping spheres made OpenCascade fail with a null shape before the limit on
        # a faster machine; each union of n boxes costs ~n, so the loop outlasts the limit anywhere)
        ("s = cq.Workplane()\nfor i in range(100000):\n"
         "    s = s.union(cq.Workplane().box(1, 1, 1).translate((i * 2, 0, 0)))\nresult = s",
         "ran past the 10 s limit"),
        # Memory beyond the sandbox's cgroup: the kernel kills the interpreter, nothing else.
        ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", "interpreter died"),
        ("import os\nos._exit(3)", "exited with code 3"),
    ],
    ids=["infinite-loop", "huge-union", "memory-bomb", "exit"],
)
def test_hostile_code_is_contained_and_the_interpreter_restarts(sandbox, code, expect):
    assert expect in text(sandbox, code)
    assert "volume: 8" in text(sandbox, "result = cq.Workplane().box(2, 2, 2)")  # a fresh interpreter


def test_no_writes_outside_work_and_no_network(sandbox):
    code = (
        "import os, socket\n"
        "for path in ('/etc/cad-pwned', '/usr/cad-pwned', '/opt/jointrl/venvs/cad/pwned', '/opt/jointrl-cad/pwned'):\n"
        "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except OSError as e:\n        print('refused', path, e.errno)\n"
        "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=3); print('network: open')\n"
        "except OSError as e:\n    print('network: refused')\n"
        "print('uid', os.getuid())\n"
        "result = cq.Workplane().box(1, 1, 1)"
    )
    out = text(sandbox, code)
    assert "wrote" not in out and out.count("refused /") == 4 and "network: refused" in out
    for path in ("/etc/cad-pwned", "/usr/cad-pwned", "/opt/jointrl/venvs/cad/pwned"):
        assert not os.path.exists(path)
    with open(f"/proc/{sandbox._proc.pid}/status") as f:  # the host-side uid of the interpreter's bwrap
        uid = next(line.split()[1] for line in f if line.startswith("Uid:"))
    assert int(uid) == sandbox.uid != 0


def run(coro):
    return asyncio.run(coro)


def test_env_tools_malformed_calls_and_verification_sandbox():
    task = load_tasks()[0]

    async def episode():
        env = CadEnv(CAD)
        try:
            messages = await env.reset(task)
            bad = [await env.step(c) for c in (
                ToolCall(name="python", arguments={"code": "1"}),
                ToolCall(name="run_cadquery", arguments={}),
                ToolCall(name="run_cadquery", arguments={"code": 3}),
                ToolCall(name="run_cadquery", arguments={"code": "x", "export": "obj"}),
                ToolCall(name="submit", arguments={}),
            )]
            ok = await env.step(ToolCall(name="run_cadquery", arguments={"code": task.metadata["reference"]}))
            done = await env.step(ToolCall(name="submit", arguments={"code": "result = cq.Workplane().box(1, 1, 1)"}))
            after = await env.step(ToolCall(name="submit", arguments={"code": ""}))
            verify = env.verify_sandbox()
            return messages, bad, ok, done, after, verify, env.num_tool_errors
        finally:
            await env.close()

    messages, bad, ok, done, after, verify, errors = run(episode())
    assert [m.role for m in messages] == ["system", "user"] and messages[1].content == task.prompt
    assert all(o.is_error and not o.done for o in bad) and errors == 6
    assert "unknown tool 'python'" in bad[0].text and "missing required argument(s) ['code']" in bad[1].text
    assert "must be string, got int" in bad[2].text and "must be one of ['stl', 'step'], got 'obj'" in bad[3].text
    assert "closed solid: yes; valid: yes" in ok.text and not ok.is_error
    assert done.done and not done.is_error and after.done and after.is_error
    with verify:  # fresh: the submitted code only, nothing the episode left behind
        assert verify.read_file(SUBMISSION) == b"result = cq.Workplane().box(1, 1, 1)"
        assert verify.exec("ls -A /work").stdout == f"{SUBMISSION}\n"


def test_env_protocols():
    env = CadEnv(CAD)
    assert isinstance(env, Env) and isinstance(env, Verifiable)
    assert [t.name for t in env.tools] == ["run_cadquery", "submit"]


def png_pixels(data: bytes):
    """(width, height, rows) of a grayscale 8-bit PNG as written by envs/cad/render.py."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    raw = zlib.decompress(data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8])
    return width, height, [raw[r * (width + 1) + 1 : (r + 1) * (width + 1)] for r in range(height)]


def test_image_mode_returns_the_views():
    task = load_tasks()[0]
    plate = "result = cq.Workplane('XY').box(40, 40, 5).faces('>Z').workplane().hole(12)"

    async def episode():
        env = CadEnv(CAD, image=True)
        try:
            await env.reset(task)
            return (await env.step(ToolCall(name="run_cadquery", arguments={"code": plate})),
                    await env.step(ToolCall(name="run_cadquery", arguments={"code": "result = 1 / 0"})))
        finally:
            await env.close()

    shown, failed = run(episode())
    assert shown.text.endswith("[image: front, top and isometric views]") and failed.image is None
    width, height, rows = png_pixels(shown.image)
    assert (width, height) == (480, 160)
    top = [row[160:320] for row in rows]  # the middle view looks down Z: the hole shows the background
    assert top[80][80] == 255 and top[80][80 - 40] < 255  # the plate beside the hole is shaded


def test_render_refuses_a_malformed_stl():
    from jointrl.envs.cad.render import triangles_from_stl

    with pytest.raises(ValueError, match="not a binary STL"):
        triangles_from_stl(b"solid x\n" * 20)
