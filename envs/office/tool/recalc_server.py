"""A warm headless LibreOffice that recalculates workbooks, run inside its own sandbox.

``/usr/bin/python3 -I recalc_server.py serve FD``: Debian's Python with ``python3-uno``
(``.ci/setup.d/office.sh``), not the tool venv. It starts one ``soffice`` (headless, its own
profile in a fresh ``/tmp`` directory, listening on a private UNO pipe), says ``{"ready": true}``
on fd ``FD``, then answers one request per line of stdin, one JSON line each on ``FD``:

- ``{"job": NAME}``: ``/work/NAME/in.xlsx`` is loaded (hidden, macros never executed, links never
  updated), every formula recalculated (``calculateAll``), saved as ``/work/NAME/out.xlsx``,
  closed; the reply is ``{"ok": true, "data": <base64 of out.xlsx>}`` or ``{"ok": false,
  "error": ...}``. ``/work/NAME`` is deleted before the reply, whatever happened, so no document
  outlives its own request in this sandbox.

The host (``envs/office/recalc.py``) sends one request at a time and restarts the whole sandbox
after a fixed number of jobs, a timeout or a crash. Imports nothing of jointrl.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

WORK = "/work"
START_TIMEOUT_S = 120.0
# The profile: recalculate OOXML / ODF on load (LibreOffice keeps cached values by default), never run
# a macro, never update a link to another file.
PROFILE_XCU = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" xmlns:xs="http://www.w3.org/2001/XMLSchema" \
xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Calc/Formula/Load"><prop oor:name="OOXMLRecalcMode" oor:op="fuse">\
<value>0</value></prop></item>
<item oor:path="/org.openoffice.Office.Calc/Formula/Load"><prop oor:name="ODFRecalcMode" oor:op="fuse">\
<value>0</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Security/Scripting"><prop oor:name="MacroSecurityLevel" \
oor:op="fuse"><value>3</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Security/Scripting"><prop oor:name="DisableMacrosExecution" \
oor:op="fuse"><value>true</value></prop></item>
<item oor:path="/org.openoffice.Office.Calc/Content/Update"><prop oor:name="Link" oor:op="fuse">\
<value>1</value></prop></item>
</oor:items>
"""


def _props(**kw):
    from com.sun.star.beans import PropertyValue  # noqa: PLC0415  (a UNO type: importable only after `import uno`)

    return tuple(PropertyValue(Name=k, Value=v) for k, v in kw.items())


def start_office():
    """Start soffice and connect to it; returns (process, desktop)."""
    import uno

    tmp = tempfile.mkdtemp(prefix="lo-")
    os.makedirs(f"{tmp}/profile/user")
    with open(f"{tmp}/profile/user/registrymodifications.xcu", "w") as f:
        f.write(PROFILE_XCU)
    pipe = f"jointrl-{secrets.token_hex(8)}"
    proc = subprocess.Popen(
        ["soffice", "--headless", "--invisible", "--norestore", "--nologo", "--nolockcheck", "--nodefault",
         f"-env:UserInstallation=file://{tmp}/profile", f"--accept=pipe,name={pipe};urp;StarOffice.ComponentContext"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HOME": tmp})
    local = uno.getComponentContext()
    resolver = local.ServiceManager.createInstanceWithContext("com.sun.star.bridge.UnoUrlResolver", local)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            ctx = resolver.resolve(f"uno:pipe,name={pipe};urp;StarOffice.ComponentContext")
            break
        except Exception:  # noqa: BLE001  (NoConnectException until soffice listens)
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"soffice did not start (exit {proc.poll()})") from None
            time.sleep(0.1)
    return proc, ctx.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", ctx)


def convert(desktop, job: str) -> bytes:
    import uno

    folder = os.path.realpath(os.path.join(WORK, job))
    if os.path.dirname(folder) != WORK:
        raise ValueError(f"job {job!r} is not a folder of {WORK}")
    src, dst = os.path.join(folder, "in.xlsx"), os.path.join(folder, "out.xlsx")
    # MacroExecutionMode 0 = NEVER_EXECUTE; UpdateDocMode 0 = NO_UPDATE (no external link is fetched)
    doc = desktop.loadComponentFromURL(uno.systemPathToFileUrl(src), "_blank", 0,
                                       _props(Hidden=True, MacroExecutionMode=0, UpdateDocMode=0))
    if doc is None:
        raise ValueError("LibreOffice could not open the workbook")
    try:
        doc.calculateAll()
        doc.storeToURL(uno.systemPathToFileUrl(dst), _props(FilterName="Calc MS Excel 2007 XML", Overwrite=True))
    finally:
        doc.close(True)
    with open(dst, "rb") as f:
        return f.read()


def serve(fd: int) -> None:
    out = os.fdopen(fd, "w", buffering=1)
    try:
        proc, desktop = start_office()
    except Exception as e:  # noqa: BLE001  (reported to the host, which raises EnvError)
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job = ""
        try:
            job = str(json.loads(line)["job"])
            reply = {"ok": True, "data": base64.b64encode(convert(desktop, job)).decode()}
        except Exception as e:  # noqa: BLE001  (a document LibreOffice refuses: the host decides)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            if job and os.path.dirname(os.path.realpath(os.path.join(WORK, job))) == WORK:
                shutil.rmtree(os.path.join(WORK, job), ignore_errors=True)
        if proc.poll() is not None:
            reply = {"ok": False, "error": f"soffice exited with {proc.returncode}"}
        out.write(json.dumps(reply) + "\n")
        if proc.poll() is not None:
            return


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        raise SystemExit("usage: recalc_server.py serve FD")
    serve(int(sys.argv[2]))
