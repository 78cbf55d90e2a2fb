"""The reward's warm CadQuery builder (envs/cad/builder.py) over real bwrap: the same mesh as a
one-shot build, nothing of one build left for the next, the server out of a build's reach, and the
reward's fallback to one-shot builds when the server fails. Runs as root (the root-mode sandbox) and
as whoever runs it; ``tests/envs/sandbox/test_rootless.py`` runs its isolation checks as an ordinary
user (rootless sandboxes)."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from jointrl.envs.base import EnvError
from jointrl.envs.cad import CadConfig, load_tasks
from jointrl.envs.cad.builder import CadBuilder, shared_builder
from jointrl.envs.cad.interpreter import build_stl
from jointrl.envs.sandbox.bwrap import BwrapSandbox

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or not os.path.exists(CadConfig().python),
    reason="needs bubblewrap and the CAD tool venv (.ci/setup.d/cad.sh)",
)
CAD = CadConfig(build_timeout_s=20.0, max_memory_bytes=1 << 30)
BOX = "result = cq.Workplane().box(1, 2, 3)"


@pytest.fixture(scope="module")
def builder():
    b = CadBuilder(CAD)
    yield b
    b.close()


def one_shot(code: str):
    with BwrapSandbox(CAD.sandbox_config(), env=CAD.env, shell=False) as sandbox:
        return build_stl(sandbox, code, CAD)


def reported(builder, code: str):
    """What ``code`` put in the RuntimeError it raised (a build's way to report what it saw)."""
    stl, summary = builder.build(code)
    assert stl is None and "RuntimeError: " in summary["error"], summary
    return eval(summary["error"].split("RuntimeError: ", 1)[1].split("\n")[0])  # noqa: S307 (our own repr)


def test_a_warm_build_is_the_one_shot_build(builder):
    flange = load_tasks()[2].metadata["reference"]  # holes on a bolt circle, a hub, a bore
    moved = "import os\nos.chdir('/tmp')\n" + BOX  # the STL lands outside /work: no mesh, both ways
    for code in (BOX, flange, "a = cq.Workplane().box(1, 1, 1)\nresult = a.nosuch()", moved):
        warm, cold = builder.build(code), one_shot(code)
        assert warm == cold, code  # the same STL bytes and the same summary
    assert warm[1]["error"] == "the build wrote no mesh" and builder.build(flange)[0][:5] != b"solid"  # binary STL
    assert builder.build("import os\nos._exit(3)") == (None, {"ok": False, "error": "the build died (exit 3)"})
    huge = "raise ValueError('x' * 100_000)"  # a summary past the one-shot path's stdout cap: none, both ways
    for stl, summary in (builder.build(huge), one_shot(huge)):
        assert stl is None and summary["error"].startswith("the build died (exit 0)"), summary["error"][:200]


LEAVE = r"""
import ctypes, os, subprocess
for path in ('/work/leak', '/tmp/leak', '/dev/shm/leak', '/dev/leak'):
    open(path, 'w').write('a submission')
os.makedirs('/work/d/e')
open('/work/d/e/f', 'w').write('x')
os.chmod('/work/d/e', 0)
os.chmod('/work/d', 0)
os.symlink('/work', '/dev/link')
subprocess.Popen(['sleep', '300'], start_new_session=True)
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(77, 4096, 0o1666), ctypes.get_errno()
key = libc.syscall(%d, b'user', b'leak', b'data', 4, ctypes.c_int(-4)), ctypes.get_errno()
raise RuntimeError(repr((shm, key)))
"""

LOOK = r"""
import os
procs = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
seen = {'work': os.listdir('/work'), 'tmp': os.listdir('/tmp'), 'shm': os.listdir('/dev/shm'),
        'dev': sorted(n for n in os.listdir('/dev') if n in ('leak', 'link')),
        'others': [p for p in procs if p not in (1, os.getpid(), os.getppid())],
        'sysv': open('/proc/sysvipc/shm').read().count('\n') - 1}
raise RuntimeError(repr(seen))
"""


def test_a_build_leaves_nothing_for_the_next(builder):
    add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    # Kernel objects that would outlive the build: refused by its seccomp filter (EPERM).
    assert reported(builder, LEAVE % add_key) == ((-1, 1), (-1, 1))
    starts = builder.starts
    # Files, dirs it made unreadable, /dev entries, a detached process: gone before the next build.
    assert reported(builder, LOOK) == {"work": ["part.py"], "tmp": [], "shm": [], "dev": [], "others": [], "sysv": 0}
    assert builder.starts == starts  # cleaned in place, no new sandbox


REACH = r"""
import os
parent, got = os.getppid(), []
for name in ('environ', 'mem', 'maps', 'fd/0'):
    try:
        open(f'/proc/{parent}/{name}', 'rb').read(1)
        got.append('read ' + name)
    except OSError as e:
        got.append(type(e).__name__)
links = []
for fd in os.listdir('/proc/self/fd'):
    try:
        links.append(os.readlink(f'/proc/self/fd/{fd}'))
    except OSError:  # the listing's own fd, closed by now
        pass
got.append(sorted(link for link in links if link.startswith('pipe:')))
raise RuntimeError(repr(got))
"""


def test_a_build_cannot_reach_the_server(builder):
    # Not dumpable: its memory, environment and fds are closed to a build; the build holds no pipe of
    # the server's (its requests and replies to the host).
    assert reported(builder, REACH) == ["PermissionError"] * 4 + [[]]


def test_timeouts_and_a_killed_server():
    b = CadBuilder(CadConfig(build_timeout_s=3.0, max_memory_bytes=1 << 30))
    try:
        assert b.build("while True: pass") == (None, {"ok": False, "error": "building the part timed out after 3 s"})
        assert b.build(BOX)[0] is not None and b.starts == 1  # the server lived through it
        with pytest.raises(EnvError, match="warm CAD builder"):
            b.build("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + BOX)
        assert b.build(BOX)[0] is not None and b.starts == 2  # a fresh server
    finally:
        b.close()


def test_the_reward_builds_one_shot_when_the_builder_fails(monkeypatch):
    from jointrl.rewards import cad_geometry

    kill = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + BOX  # in a one-shot build: init, spared
    with BwrapSandbox(CAD.sandbox_config(), env=CAD.env, shell=False) as sandbox:
        assert cad_geometry._build(sandbox, kill) == one_shot(kill)
    assert one_shot(kill)[0] is not None
    monkeypatch.setenv("JOINTRL_CAD_BUILD", "cold")
    assert shared_builder() is None
