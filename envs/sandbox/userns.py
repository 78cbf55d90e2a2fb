"""The start-up probe: can bwrap create the namespaces an episode needs, on this node, as this user?

Both bwrap modes need unprivileged user namespaces (root mode runs bwrap as a leased uid).
Where the kernel refuses them, every episode would fail with an ``env_error`` and no learner
step would ever run; ``probe`` finds that out in a few milliseconds, before Ray starts, and
returns one line naming the sysctls that decide it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from jointrl.envs.sandbox.bwrap_argv import check_rootfs

SYSCTLS = (  # (name, the value that allows unprivileged user namespaces)
    ("kernel.unprivileged_userns_clone", "1"),  # Debian / Ubuntu kernels
    ("user.max_user_namespaces", "> 0"),
    ("kernel.apparmor_restrict_unprivileged_userns", "0"),  # Ubuntu 23.10+
)


def sysctl_values(sysctl_dir: Path = Path("/proc/sys")) -> str:
    """``name=value`` for each of ``SYSCTLS`` (``absent`` where this kernel has no such knob)."""
    out = []
    for name, _ in SYSCTLS:
        try:
            value = (sysctl_dir / name.replace(".", "/")).read_text().strip()
        except OSError:
            value = "absent"
        out.append(f"{name}={value}")
    return ", ".join(out)


def probe(bwrap: str = "bwrap", sysctl_dir: Path = Path("/proc/sys")) -> str | None:
    """None when ``bwrap`` starts a sandbox with user, pid, mount, network, IPC and UTS namespaces
    here; else one line saying why and which sysctls to check (with their current values)."""
    if shutil.which(bwrap) is None:
        return f"sandbox: {bwrap!r} is not installed (apt-get install bubblewrap), so no episode can start"
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        return "sandbox: bwrap did not start a test sandbox within 30 s, so no episode can start"
    if r.returncode == 0:
        return None
    err = r.stderr.decode(errors="replace").strip().splitlines()
    want = ", ".join(f"{name} {v if v.startswith('>') else '= ' + v}" for name, v in SYSCTLS)
    why = err[-1] if err else f"exit {r.returncode}"
    return (f"sandbox: bwrap cannot create an unprivileged user namespace here ({why}), so no episode can start;"
            f" check the sysctls ({want}; now: {sysctl_values(sysctl_dir)}),"
            " or set envs.sandbox.backend=docker")


def preflight(sandbox_cfg) -> str | None:
    """For ``envs.sandbox`` (``rl.config.EnvSandboxConfig``): why no bwrap episode can start, or None.

    Checks the rootfs directory (when set) and runs ``probe``; the docker backend is not checked here.
    """
    if str(sandbox_cfg.backend) != "bwrap":
        return None
    if sandbox_cfg.rootfs is not None:
        try:
            check_rootfs(sandbox_cfg.rootfs)
        except ValueError as e:
            return f"sandbox: {e}"
    return probe()

