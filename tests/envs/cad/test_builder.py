"""The reward's warm CadQuery builder (envs/cad/builder.py) over real bwrap: the same mesh as a
one-shot build, nothing of one build left for the next, the server out of a build's reach, and the
reward's fallback to one-shot builds when the server fails. Runs as root (the root-mode sandbox) and
as whoever runs it; ``tests/envs/sandbox/test_rootless.py`` runs its isolation checks as an ordinary
user (rootless sandboxes)."""

from __future__ import annotations

import os
import platform
import shutil
import time

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
    linked = "import os\nos.symlink('m.stl', 'part.stl')\n" + BOX  # written through a link inside /work
    for code in (BOX, flange, "a = cq.Workplane().box(1, 1, 1)\nresult = a.nosuch()", linked, moved):
        warm, cold = builder.build(code), one_shot(code)
        assert warm == cold, code  # the same STL bytes and the same summary
    assert warm[1]["error"] == "the build wrote no mesh" and builder.build(flange)[0][:5] != b"solid"  # binary STL
    assert builder.build("import os\nos._exit(3)") == (None, {"ok": False, "error": "the build died (exit 3)"})
    huge = "raise ValueError('x' * 100_000)"  # a summary past the one-shot path's stdout cap: none, both ways
    for stl, summary in (builder.build(huge), one_shot(huge)):
        assert stl is None and summary["error"].startswith("the build died (exit 0)"), summary["error"][:200]


MARK = "zq-mark-7f3a9c"

LEAVE = r"""
import ctypes, os, socket, subprocess
names = []
for folder in ('/work', '/tmp', '/dev/shm'):
    for i in range(50):  # file names a later build could look for in the server's memory
        open(f'{folder}/{MARK}-{i:03d}-' + 'x' * 120, 'w').write('a submission')
os.makedirs('/work/d/e')
os.chmod('/work/d', 0)
os.setxattr('/tmp', 'user.leak', b'a submission')
try:
    open('/dev/leak', 'w')
    dev = 'wrote /dev'
except OSError as e:
    dev = e.errno
subprocess.Popen(['sleep', '300'], start_new_session=True)
try:  # a connection left in TIME_WAIT (where loopback is up: in a build's own network namespace it is down)
    server = socket.socket()
    server.bind(('127.0.0.1', 4242))
    server.listen()
    client = socket.create_connection(('127.0.0.1', 4242))
    server.accept()[0].close()
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(77, 4096, 0o1666), ctypes.get_errno()
key = libc.syscall(%d, b'user', b'leak', b'data', 4, ctypes.c_int(-4)), ctypes.get_errno()
userns = libc.unshare(0x10000000), ctypes.get_errno()
procs = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
raise RuntimeError(repr((dev, shm, key, userns, procs)))
""".replace("{MARK}", MARK)

LOOK = r"""
import ctypes, os
seen = {'work': os.listdir('/work'), 'tmp': os.listdir('/tmp'), 'shm': os.listdir('/dev/shm'),
        'xattr': os.listxattr('/tmp'), 'procs': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
        'tcp': open('/proc/net/tcp').read().count('\n') - 1, 'sysv': open('/proc/sysvipc/shm').read().count('\n') - 1}
found = 0  # the earlier build's file names anywhere in this process's writable memory
for line in open('/proc/self/maps'):
    span, perms = line.split()[:2]
    if perms.startswith('rw') and '[vvar' not in line:
        lo, hi = (int(x, 16) for x in span.split('-'))
        found += ctypes.string_at(lo, hi - lo).count(b'{MARK}')
seen['mark'] = found
raise RuntimeError(repr(seen))
""".replace("{MARK}", MARK)


def test_a_build_leaves_nothing_for_the_next(builder):
    add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    # /dev read-only (EROFS); kernel keyring and SysV objects and a new user namespace refused
    # (EPERM); alone in its own pid namespace, as its pid 1.
    dev, shm, key, userns, procs = reported(builder, LEAVE % add_key)
    assert (dev, shm, key, userns) == (30, (-1, 1), (-1, 1), (-1, 1)) and procs[0] == 1 and len(procs) >= 2
    starts = builder.starts
    # Files, an xattr, a detached process, a connection: none in the next build's view.
    seen = reported(builder, LOOK)
    assert {k: v for k, v in seen.items() if k != "mark"} == {
        "work": ["part.py"], "tmp": [], "shm": [], "xattr": [], "procs": [1], "tcp": 0, "sysv": 0}
    # Nor the earlier build's 150 file names in its memory (a fork of the server's, which removed that
    # build's job folder in a fork of its own): as many marks as after a build that wrote none -- the
    # ones this code makes itself while it searches.
    assert reported(builder, LOOK)["mark"] == seen["mark"] < 50
    assert builder.starts == starts


REACH = r"""
import ctypes, os, resource
libc = ctypes.CDLL(None, use_errno=True)
got = [os.getpid(), os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit())]
got.append(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
for pid in (2, 3, 100):  # no number names the server or bwrap's init from here
    got.append(libc.syscall(302, pid, resource.RLIMIT_FSIZE, None, None) == -1 and ctypes.get_errno())  # prlimit64
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
    if platform.machine() != "x86_64":
        pytest.skip("prlimit64's syscall number is x86_64's")
    # pid 1 of its own namespace, no parent in it, no capabilities, no process to prlimit (ESRCH),
    # and no pipe of the server's (its requests and replies to the host).
    assert reported(builder, REACH) == [1, 0, [1], "0000000000000000", 3, 3, 3, []]


COUNT = r"""
import os, sys
for i in range(%d):
    open(f'/work/f{i}', 'w').close()
    os.unlink(f'/work/f{i}')
inode = os.stat('/work/part.py').st_ino
frame, held = sys._getframe(), []
while frame is not None:  # an earlier build's outcome anywhere in the frames this one was forked from
    held += [k for k, v in frame.f_locals.items() if isinstance(v, dict) and v.get('exit') == 42]
    frame = frame.f_back
raise RuntimeError(repr((inode, held)))
"""


def test_no_counter_or_outcome_carries_over(builder):
    # A build's files never reach the server's /work (its own is a fresh tmpfs): the next build's
    # part.py gets the same inode number whether the one before made a thousand files or none, and
    # the earlier build's exit code is in no frame it was forked from.
    assert builder.build("import os\nos._exit(42)")[1]["error"] == "the build died (exit 42)"
    after_none = reported(builder, COUNT % 0)
    reported(builder, COUNT % 1000)
    assert reported(builder, COUNT % 0) == after_none and after_none[1] == []
    assert os.listdir(builder._server.sandbox.workdir) == []  # each job folder removed after its read


def test_a_build_that_stops_itself_is_killed_not_waited_for(builder):
    starts = builder.starts
    stop = "import ctypes, os, signal\nctypes.CDLL(None).ptrace(0, 0, 0, 0)\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    assert builder.build(stop + BOX) == (None, {"ok": False, "error": "the build died (exit 137)"})
    assert builder.build(BOX)[0] is not None and builder.starts == starts


def test_outputs_are_taken_only_from_inside_the_builds_work(builder):
    # A link loop makes a lax realpath stop half-way and a textual '..' step back into /work: the copy
    # back resolves strictly, so part.stl through /work/d -> /etc is no mesh, not /etc/hostname.
    code = ("import os\nos.symlink('L', '/work/L')\nos.symlink('/etc', '/work/d')\n"
            "os.symlink('L/../d/hostname', '/work/part.stl')\n"
            "open('/work/summary.json', 'w').write('{\"ok\": true}')\nos._exit(0)")
    assert builder.build(code) == (None, {"ok": False, "error": "the build wrote no mesh"})


def test_timeouts_signals_and_a_dead_server():
    b = CadBuilder(CadConfig(build_timeout_s=6.0, max_memory_bytes=1 << 30))
    try:
        assert b.build("while True: pass") == (None, {"ok": False, "error": "building the part timed out after 6 s"})
        # Its own session and pid namespace (as their init): kill(0) and kill(-1) reach neither the
        # server nor bwrap's init; no EnvError, and the build goes on.
        assert b.build("import os, signal\nos.kill(0, signal.SIGKILL)\n" + BOX)[0] is not None
        assert "No such process" in b.build("import os, signal\nos.kill(-1, signal.SIGKILL)\n" + BOX)[1]["error"]
        assert b.build(BOX)[0] is not None and b.starts == 1  # the server lived through all of it
        b._server.sandbox.kill_processes()  # the server dies (a crash, the memory cgroup's OOM kill)
        deadline = time.monotonic() + 30
        while b._server.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.build(BOX)[0] is not None and b.starts == 2  # a fresh server
    finally:
        b.close()


def test_the_reward_builds_one_shot_when_the_builder_fails(monkeypatch):
    from jointrl.rewards import cad_geometry

    setup_failed = "import os\nos._exit(71)"  # what a build that could not be set up exits with: EnvError
    with pytest.raises(EnvError, match="could not set up"):
        CadBuilder(CAD).build(setup_failed)
    with BwrapSandbox(CAD.sandbox_config(), env=CAD.env, shell=False) as sandbox:
        warm = cad_geometry._build(sandbox, setup_failed)
    assert warm == one_shot(setup_failed) and warm[1]["error"].startswith("the build died (exit 71)")
    monkeypatch.setenv("JOINTRL_CAD_BUILD", "cold")
    assert shared_builder() is None
