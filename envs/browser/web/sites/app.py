"""The sites' plumbing: requests, responses, page layout, the episode's app state, the server.

Each site is a pure ``handle(request, state) -> Response`` (testable in-process, and what the
host's oracle planner calls); ``serve`` puts the sites on loopback ports with the stdlib's
threading HTTP server. App state (cart, saved forms) lives in one JSON file under ``/work``,
rewritten atomically on every change: it is what the ``app_state`` reward reads after the
episode.
"""

from __future__ import annotations

import html
import json
import os
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Request:
    method: str  # GET or POST
    path: str
    query: dict[str, str] = field(default_factory=dict)
    form: dict[str, str] = field(default_factory=dict)

    def param(self, name: str, default: str = "") -> str:
        return self.form.get(name, self.query.get(name, default))


@dataclass(frozen=True)
class Response:
    status: int
    body: str = ""
    location: str = ""  # for a 303 redirect

    @staticmethod
    def redirect(location: str) -> Response:
        return Response(303, "", location)


class State:
    """The episode's app state, a JSON document; ``path`` (if set) is rewritten on every change."""

    def __init__(self, initial: dict[str, Any], path: Path | None = None) -> None:
        self.data = json.loads(json.dumps(initial))
        self.path = path
        self.lock = threading.Lock()
        self.save()

    def update(self, fn: Callable[[dict[str, Any]], None]) -> None:
        with self.lock:
            fn(self.data)
            self.save()

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, ensure_ascii=False, sort_keys=True))
        os.replace(tmp, self.path)


Handler = Callable[[Request, State], Response]

e = html.escape


def link(href: str, text: str) -> str:
    return f'<a href="{e(href)}">{e(text)}</a>'


def page(title: str, body: str, nav: list[tuple[str, str]] = ()) -> str:
    """A whole HTML page: the site's navigation bar, a heading, the body."""
    bar = " | ".join(link(h, t) for h, t in nav)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
            "<style>body{font-family:DejaVu Sans,sans-serif;margin:12px;font-size:14px}"
            "table{border-collapse:collapse}td,th{border:1px solid #999;padding:2px 6px;text-align:left}"
            ".err{color:#b00}</style></head>"
            f"<body><nav>{bar}</nav><h1>{e(title)}</h1>{body}</body></html>")


def table(rows: list[tuple[str, str]], cls: str = "infobox") -> str:
    """A two-column table; cells are HTML (escape text before)."""
    return f"<table class='{cls}'>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def not_found(path: str) -> Response:
    return Response(404, page("Not found", f"<p>There is no page at {e(path)}.</p>"))


def serve(sites: dict[int, Handler], state: State, host: str = "127.0.0.1") -> list[ThreadingHTTPServer]:
    """Start one threaded HTTP server per ``port -> site`` on ``host``; returns them (running)."""
    servers = []
    for port, site in sites.items():
        server = ThreadingHTTPServer((host, port), _handler_class(site, state))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True, name=f"site-{port}").start()
        servers.append(server)
    return servers


def _handler_class(site: Handler, state: State) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
            form: dict[str, str] = {}
            if method == "POST":
                n = min(int(self.headers.get("Content-Length") or 0), 1 << 20)
                form = dict(urllib.parse.parse_qsl(self.rfile.read(n).decode("utf-8", "replace"), keep_blank_values=True))
            try:
                resp = site(Request(method, urllib.parse.unquote(url.path), query, form), state)
            except Exception as err:  # noqa: BLE001  (a site bug is a 500 page, not a dead server)
                resp = Response(500, page("Server error", f"<p>{e(repr(err))}</p>"))
            body = resp.body.encode()
            self.send_response(resp.status)
            if resp.location:
                self.send_header("Location", resp.location)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args: Any) -> None:  # stdout is the driver's protocol channel
            pass

    return _Handler
