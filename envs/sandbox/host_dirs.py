"""The host side of a bwrap sandbox's files: one private dir per sandbox under one root.

Layout: ``<root>/sb-<random>/`` (mode 0700, owned by the sandbox's leased uid) holds ``work``
(the sandbox's ``/work``, a size-bounded tmpfs where the host allows: ``disk.py``), ``ro-<i>``
(staged copies of read-only binds) and ``rw-<i>`` (extra writable dirs). ``<root>/.locks``
holds the uid leases (``uids.py``). A crashed holder's dirs are found by their owner uid and
removed by the next holder of that uid. Rootless, everything is owned by the job's own uid,
under a root of its own (``/tmp/jointrl-sandboxes-<uid>``), and ``work`` is a plain dir that
the sandbox's keeper covers with its tmpfs in its own namespace (``rootless.py``).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from jointrl.envs.base import EnvError
from jointrl.envs.sandbox.disk import is_mount, unmount
from jointrl.envs.sandbox.files import copy_tree

SANDBOX_ROOT = Path(os.environ.get("JOINTRL_SANDBOX_ROOT") or
                    ("/tmp/jointrl-sandboxes" if os.geteuid() == 0 else f"/tmp/jointrl-sandboxes-{os.geteuid()}"))


def sandbox_root() -> Path:
    """Create (once) and check the host directory holding every sandbox's private dir.

    It must be a real directory owned by us, because it lives in world-writable /tmp where
    anyone could have planted it first. Mode 0711: the leased uids may traverse it to reach
    their own dir (bwrap runs as them) but cannot list it.
    """
    SANDBOX_ROOT.mkdir(mode=0o711, parents=True, exist_ok=True)
    st = os.lstat(SANDBOX_ROOT)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise EnvError(f"{SANDBOX_ROOT} is not a directory owned by uid {os.geteuid()} and writable only by it")
    os.chmod(SANDBOX_ROOT, 0o711)
    (SANDBOX_ROOT / ".locks").mkdir(mode=0o700, exist_ok=True)
    return SANDBOX_ROOT


def make_owned_dir(path: Path, uid: int | None) -> None:
    """A new dir, mode 0700, owned by ``uid`` (None: by us)."""
    os.mkdir(path, 0o700)
    if uid is not None:
        os.chown(path, uid, uid)


def stage(src: Path, dest: Path, *, owner: int | None) -> None:
    """Copy a read-only bind's source into the private dir, readable by ``owner`` wherever it lives."""
    if src.is_dir():
        copy_tree(src, dest, owner=owner)
    else:
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o444)
        if owner is not None:
            os.chown(dest, owner, owner)


def remove_private_dir(private_dir: Path) -> None:
    """Unmount the work tmpfs and delete the whole private dir (no error if already gone)."""
    work = private_dir / "work"
    if is_mount(work):
        unmount(work)
    shutil.rmtree(private_dir, ignore_errors=True)


def remove_stale_dirs(root: Path, uid: int) -> None:
    """Delete private dirs a crashed holder of ``uid`` left behind (the caller holds its lease now)."""
    for entry in os.scandir(root):
        if not entry.name.startswith("sb-"):
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except FileNotFoundError:  # another sandbox (another uid) closed meanwhile
            continue
        if owner == uid:
            remove_private_dir(Path(entry.path))
