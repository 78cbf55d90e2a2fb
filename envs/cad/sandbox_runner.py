"""Runs model-written CadQuery code *inside* the sandbox, under the CAD tool venv's Python.

This file is copied into each CAD sandbox (read-only, ``/opt/jointrl-cad/runner.py``) and
imports nothing of jointrl: the tool venv has only CadQuery. Two modes:

- ``serve FD``: the episode's warm interpreter. CadQuery is imported once; then each request
  (one JSON line on stdin: ``{"code": ..., "stl": path|null, "step": path|null}``) is executed
  in a fresh namespace and answered by one JSON line on fd ``FD``. The host kills and restarts
  this process on a timeout or a crash.
- ``build CODE_FILE STL_FILE``: one-shot, for the reward: run the code in a fresh process,
  export the result as binary STL, print the JSON summary on stdout.
- ``forkserve FD``: the reward's warm builder (``envs/cad/builder.py``). CadQuery is imported once
  and no model code ever runs in this process. Each request (``{"op": "build", "job": NAME, ...}``
  on stdin, from the host) is handled by a fork of it, the *worker*, which replies on fd ``FD``
  (echoing the request's ``nonce``); the server itself never holds an outcome. The worker forks a
  process that enters namespaces of its own -- user, mount, pid, IPC, network, UTS -- mounts fresh
  tmpfs on ``/work``, ``/tmp`` and ``/dev/shm`` and a devpts of its own, makes ``/dev`` read-only,
  copies ``part.py`` in from the job folder ``/work/NAME`` and forks the build: pid 1 of the new pid
  namespace, with its own ``/proc`` and session, no capabilities, a seccomp filter refusing new
  namespaces, keyrings and IPC objects, and no inherited fd. Then ``part.stl`` and ``summary.json``
  (what ``build`` writes) are copied back into the job folder, regular files only, capped. The
  server refuses to start (an ``error`` reply) where this cannot hold: a second thread or a writable
  shared mapping after the import, no nested user namespaces, or an architecture without a syscall
  table below.

The code's result is the variable ``result`` (a ``cq.Workplane``, ``cq.Shape`` or
``cq.Assembly``), else the last object passed to ``show_object``. Its printed output (Python
and C level) is captured through fds 1 and 2 and returned, capped. The summary is information
for the model only: rewards never trust it (they rebuild the submitted code in a fresh sandbox).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
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


# -- forkserve: the reward's warm builder ------------------------------------------------------

SETUP_FAILED = 71  # a build's exit code when it could not be set up (the host then builds one-shot)
_CLONE_NEW = {"NS": 0x20000, "UTS": 0x04000000, "IPC": 0x08000000, "USER": 0x10000000, "PID": 0x20000000,
              "NET": 0x40000000}
_NAMESPACE_FLAGS = 0x02000000 | sum(_CLONE_NEW.values())  # with CLONE_NEWCGROUP (clone cannot take NEWTIME)
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP = 1, 4, 22
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38
_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "relatime": 1 << 21, "noatime": 1024, "nodiratime": 2048,
       "strictatime": 1 << 24}
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
# Per architecture: AUDIT_ARCH and the numbers of the syscalls a build may not make -- a namespace of
# its own (unshare, setns; clone with a CLONE_NEW* flag is checked apart, clone3 answers ENOSYS so
# that libc falls back to clone) and kernel objects (shmget, semget, msgget, mq_open, add_key,
# request_key, keyctl: private to its namespaces anyway, refused as a second wall).
_SYSCALLS = {
    "x86_64": (0xC000003E, {"clone": 56, "clone3": 435, "deny": (272, 308, 29, 64, 68, 240, 248, 249, 250)}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "deny": (97, 268, 194, 190, 186, 180, 217, 218, 219)}),
}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _prctl(option: int, value: int, arg: int = 0) -> None:
    args = (ctypes.c_ulong(option), ctypes.c_ulong(value), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _check(_libc().prctl(*args), f"prctl({option}, {value})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda v: None if v is None else v.encode()  # noqa: E731
    _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _seccomp_filter() -> bytes:
    """A classic-BPF seccomp program for builds: EPERM for the ``deny`` syscalls, for ``clone`` with a
    CLONE_NEW* flag, for any other architecture's calling convention (i386 on x86_64) and x32 numbers;
    ENOSYS for ``clone3``; everything else allowed."""
    arch, calls = _SYSCALLS[platform.machine()]
    eperm, enosys, allow = 0x00050000 | 1, 0x00050000 | 38, 0x7FFF0000  # SECCOMP_RET_ERRNO | errno, RET_ALLOW
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|JGE|JSET|K, BPF_RET|K
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),  # seccomp_data.arch
            (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm),  # seccomp_data.nr; x32
            (jeq, 0, 1, calls["clone3"]), (ret, 0, 0, enosys)]
    for number in calls["deny"]:
        prog += [(jeq, 0, 1, number), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 3, calls["clone"]), (ld, 0, 0, 16),  # clone's flags: the low word of args[0]
             (jset, 0, 1, _NAMESPACE_FLAGS), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *op) for op in prog)


def _install_seccomp(program: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    fprog = SockFprog(len(program) // 8, program)
    _prctl(_PR_SET_SECCOMP, 2, ctypes.addressof(fprog))  # SECCOMP_MODE_FILTER


def _drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable sets (those of the build's own user namespace)."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()  # two __user_cap_data_struct of three words, all zero
    _check(_libc().capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")  # _LINUX_CAPABILITY_VERSION_3
    with open("/proc/self/status") as status:
        if any(line.startswith(("CapEff:", "CapPrm:")) and int(line.split()[1], 16) for line in status):
            raise RuntimeError("capabilities left after capset")


def _mount_flags(target: str) -> int:
    """The per-mount flags of ``target`` (a bind remount in a less privileged namespace must keep them)."""
    with open("/proc/self/mountinfo") as mounts:
        options = next(line.split()[5] for line in mounts if line.split()[4] == target).split(",")
    return sum(_MS.get(option, 0) for option in options if option != "rw")


def _enter_namespaces() -> None:
    """Namespaces of the build's own (user, mount, pid, IPC, network, UTS), mapped to our uid and gid."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc().unshare(sum(_CLONE_NEW.values())), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _private_view(disk: int) -> None:
    """The build's mounts (in the mount namespace the waiting process and the build share): fresh tmpfs
    on /work, /tmp and /dev/shm, a devpts instance of its own, /dev read-only. Everything else is the
    server's read-only view. The build adds a /proc of its pid namespace (``_build``)."""
    dev = _mount_flags("/dev")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for target in ("/work", "/tmp", "/dev/shm"):
        _mount("tmpfs", target, "tmpfs", _MS["nosuid"] | _MS["nodev"], f"size={disk},mode=1777")
    _mount("devpts", "/dev/pts", "devpts", _MS["nosuid"] | _MS["noexec"], "newinstance,ptmxmode=0666,mode=0620")
    _mount(None, "/dev", None, _MS_REMOUNT | _MS_BIND | _MS["ro"] | dev)


def _open_inside(name: str, limit: int) -> int | None:
    """An fd of ``/work/<name>`` of the build's view as the host's ``read_file`` would take it there
    (symlinks resolved, all of them, only inside /work; a regular file of at most ``limit`` bytes), or None."""
    try:
        path = os.path.realpath(os.path.join("/work", name), strict=True)  # strict: a loop raises, never half-resolves
        if os.path.commonpath([path, "/work"]) != "/work":
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_size <= limit:
        return fd
    os.close(fd)
    return None


def _close_fds() -> None:
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, 1 << 30)  # every inherited fd (the server's pipes to the host), whatever RLIMIT_NOFILE says


def _build(cq, seccomp: bytes, nproc: int) -> None:
    """The build process, pid 1 of its own pid namespace (every process it starts dies with it): a
    /proc of that namespace, its own session, RLIMIT_NPROC, no capabilities, the seccomp filter, no
    inherited fd; then it runs /work/part.py and writes what ``build`` prints to /work/summary.json."""
    code = SETUP_FAILED
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker kills the waiting process on a timeout
        os.setsid()  # a process group of its own: kill(0) would reach the server's, across namespaces
        _mount("proc", "/proc", "proc", _MS["nosuid"] | _MS["nodev"] | _MS["noexec"])
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        limit = nproc if hard == resource.RLIM_INFINITY else min(nproc, hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        _drop_capabilities()
        _install_seccomp(seccomp)
        _close_fds()
        os.chdir("/work")
        code = 70
        with open("part.py", encoding="utf-8") as f:
            source = f.read()
        with _Captured() as out:
            result = evaluate(cq, source, stl="part.stl")
        with open("/work/summary.json", "w", encoding="utf-8") as f:  # absolute: the code may have moved
            f.write(json.dumps({**result, "output": out.text}))
        code = 0
    finally:
        os._exit(code)


def _wait_exit(pid: int) -> int:
    """Exit code of child ``pid`` (128 + N when killed by signal N); a child that stops instead (it
    made us its tracer) is killed."""
    while True:
        _, status = os.waitpid(pid, 0)
        if os.WIFSTOPPED(status):
            os.kill(pid, signal.SIGKILL)
            continue
        code = os.waitstatus_to_exitcode(status)
        return code if code >= 0 else 128 - code


def _isolated_build(cq, request: dict, seccomp: bytes) -> None:
    """The process between the worker and the build, in the build's new namespaces (it runs no model
    code): copies the host's ``part.py`` from the job folder into the build's fresh /work, starts the
    build, waits for it, copies ``part.stl`` and ``summary.json`` back (regular files, capped) and
    exits with the build's exit code -- ``SETUP_FAILED`` if anything of its own fails. The job folder
    on the server's /work only ever holds those three files: nothing a build chose reaches it."""
    code = SETUP_FAILED
    try:
        # Writing its own uid_map needs a dumpable process; no build can name this one (it is outside
        # the build's pid namespace, and earlier builds are gone).
        _prctl(_PR_SET_DUMPABLE, 1)
        _enter_namespaces()
        job = os.open(f"/work/{request['job']}", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        with open(os.open("part.py", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=job), "rb") as f:
            source = f.read()
        _private_view(int(request["disk"]))
        with open("/work/part.py", "wb") as f:
            f.write(source)
        pid = os.fork()
        if pid == 0:
            _build(cq, seccomp, int(request["nproc"]))
        status = _wait_exit(pid)
        for name, limit in (("summary.json", int(request["summary_limit"])), ("part.stl", int(request["disk"]))):
            src = _open_inside(name, limit)
            if src is not None:
                dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=job)
                with open(src, "rb") as f, open(dst, "wb") as g:
                    shutil.copyfileobj(f, g, 1 << 20)  # in chunks: a large mesh is not held in memory
        code = status
    finally:
        os._exit(code)


def _worker(cq, request: dict, seccomp: bytes, reply_fd: int) -> None:
    """One request, in a fork of the server, which thus never holds a build's outcome: removes earlier
    job folders (they hold only the three files above), runs the build with its timeout, replies."""
    answer: dict = {"ok": False, "error": "the worker failed"}
    try:
        if request.get("op") != "build":
            raise ValueError(f"unknown op {request.get('op')!r}")
        for name in os.listdir("/work"):
            if name != request["job"]:
                shutil.rmtree(os.path.join("/work", name))
        pid = os.fork()
        if pid == 0:
            _isolated_build(cq, request, seccomp)
        pidfd = os.pidfd_open(pid)
        try:
            timed_out = not select.select([pidfd], [], [], float(request["timeout"]))[0]
        finally:
            os.close(pidfd)
        if timed_out:
            os.kill(pid, signal.SIGKILL)  # and the build with it (PDEATHSIG; the server's sweep after us)
        answer = {"ok": True, "exit": _wait_exit(pid), "timed_out": timed_out}
    except Exception as e:  # noqa: BLE001  (the host restarts the sandbox and builds one-shot)
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        try:
            os.write(reply_fd, (json.dumps({**answer, "nonce": request.get("nonce")}) + "\n").encode())
        finally:
            os._exit(0)


def _others() -> list[int]:
    """Processes of the server's pid namespace but its init (bwrap's, pid 1) and the server."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]


def _sweep() -> None:
    """SIGKILL every other process of the sandbox (``kill(-1)`` spares init and the caller) and reap."""
    for _ in range(1000):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not _others():
            return
        time.sleep(0.002)
    raise RuntimeError(f"the build's processes did not end: {_others()}")


def _fork_hazard() -> str:
    """Why a fork of this process could not be isolated as ``_isolated_build`` says ("" when it can)."""
    if len(os.listdir("/proc/self/task")) != 1:
        return "more than one thread after importing CadQuery"
    with open("/proc/self/maps") as maps:
        for line in maps:
            perms = line.split()[1]
            if perms[1] == "w" and perms[3] == "s":
                return f"a writable shared mapping: {line.strip()}"
    if platform.machine() not in _SYSCALLS:
        return f"no seccomp syscall table for {platform.machine()}"
    return ""


def _isolation_works(seccomp: bytes) -> str:
    """"" when a fork can enter namespaces of its own and its seccomp filter refuses another one."""
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            _enter_namespaces()
            _drop_capabilities()
            _install_seccomp(seccomp)
            refused = _libc().unshare(_CLONE_NEW["USER"]) == -1 and ctypes.get_errno() == 1
            ok = refused and _libc().shmget(0, 4096, 0o1600) == -1
        finally:
            os._exit(0 if ok else 2)
    code = _wait_exit(pid)
    return "" if code == 0 else f"a build cannot be given namespaces of its own here (probe exit {code})"


def forkserve(reply_fd: int) -> None:
    reply = os.fdopen(reply_fd, "w", buffering=1)
    started = time.monotonic()
    try:
        with _Captured():
            import cadquery as cq
        imported = time.monotonic()
    except BaseException as e:  # noqa: BLE001  (reported to the host, which falls back to one-shot builds)
        reply.write(json.dumps(_error("cannot import cadquery", e)) + "\n")
        return
    seccomp = _seccomp_filter() if platform.machine() in _SYSCALLS else b""
    hazard = _fork_hazard() or _isolation_works(seccomp)
    if hazard:
        reply.write(json.dumps({"ok": False, "error": f"cannot fork builds safely: {hazard}"}) + "\n")
        return
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a build's orphans come back here, to the sweep
    reply.write(json.dumps({"ready": True, "import_s": imported - started}) + "\n")
    for line in sys.stdin.buffer:  # host-written requests: a job name (random), limits, a nonce
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _worker(cq, request, seccomp, reply_fd)
        if _wait_exit(pid) != 0:  # it died before replying: say so (and nothing else about the build)
            reply.write(json.dumps({"ok": False, "error": "the worker died", "nonce": request.get("nonce")}) + "\n")
        _sweep()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["build"] and len(sys.argv) == 4:
        build(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["forkserve"] and len(sys.argv) == 3:
        forkserve(int(sys.argv[2]))
    else:
        sys.exit("usage: runner.py serve FD | build CODE_FILE STL_FILE | forkserve FD")
