"""The page driver: the episode's sites and browser in one process, inside the sandbox.

``python -m web.driver --seed N --mode text|image --state /work/site/state.json`` starts the
three sites on loopback (the sandbox's own network namespace: nothing else can reach them, and
they are the only thing the browser can reach), prints ``{"ready": true}``, then answers one
JSON request per line on stdin -- ``{"op": "click", "args": {"id": 3}}`` -- with one JSON line
on stdout: ``{"ok": bool, "text": str, "image": base64 PNG or null}``. ``ok`` is false for the
policy's mistakes (the text says why); a ``"fatal"`` key marks a broken browser.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

from .image_browser import ImageBrowser
from .sites import build
from .sites.app import serve
from .text_browser import BrowserError, TextBrowser

OPS = {"goto", "click", "type", "press", "scroll", "back", "find"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--mode", choices=("text", "image"), default="text")
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--viewport", default="640x448")
    args = ap.parse_args(argv)
    args.state.parent.mkdir(parents=True, exist_ok=True)
    _, sites, state = build(args.seed, args.state)
    serve(sites, state)
    if args.mode == "image":
        width, height = (int(x) for x in args.viewport.split("x"))
        browser = ImageBrowser(width, height)
    else:
        browser = TextBrowser()
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(_answer(browser, line)) + "\n")
        out.flush()


def _answer(browser, line: str) -> dict:
    try:
        req = json.loads(line)
        op, kwargs = req["op"], req.get("args", {})
        if op not in OPS:
            raise BrowserError(f"unknown browser action {op!r}")
        text = getattr(browser, op)(**kwargs)
    except BrowserError as err:
        text, ok = f"Error: {err}", False
    except Exception as err:  # noqa: BLE001  (the host turns this into an EnvError)
        return {"ok": False, "text": f"browser failure: {err!r}", "image": None, "fatal": True}
    else:
        ok = True
    shot = browser.screenshot() if hasattr(browser, "screenshot") else None
    return {"ok": ok, "text": text, "image": base64.b64encode(shot).decode() if shot else None}


if __name__ == "__main__":
    main()
