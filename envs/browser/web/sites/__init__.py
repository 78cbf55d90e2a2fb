"""The three shipped sites, each a ``handle(request, state)`` app on its own loopback port."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from .app import Handler, Request, State
from .settings import Settings, initial_state
from .shop import Shop
from .wiki import Wiki
from .world import World, make_world

PORTS = {"wiki": 8001, "shop": 8002, "settings": 8003}


def base_url(site: str) -> str:
    return f"http://127.0.0.1:{PORTS[site]}"


def build(seed: int, state_path: Path | None = None) -> tuple[World, dict[int, Handler], State]:
    """The world of ``seed``, its sites by port, and a fresh app state (saved at ``state_path``)."""
    world = make_world(seed)
    sites: dict[int, Handler] = {PORTS["wiki"]: Wiki(world), PORTS["shop"]: Shop(world),
                                 PORTS["settings"]: Settings(world)}
    state = State({"cart": {}, **initial_state(world)}, state_path)
    return world, sites, state


def in_process_fetch(sites: dict[int, Handler], state: State):
    """A ``TextBrowser`` fetch that calls the site handlers directly (no sockets): the host's
    oracle planner. Follows 303 redirects as a browser does (then GET)."""
    def fetch(method: str, url: str, body: bytes | None) -> tuple[str, str]:
        for _ in range(5):
            u = urllib.parse.urlsplit(url)
            site = sites.get(u.port or 80) if u.hostname == "127.0.0.1" else None
            if site is None:
                raise ValueError(f"no in-process site at {url!r}")
            form = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True)) if body else {}
            resp = site(Request(method, urllib.parse.unquote(u.path),
                                dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True)), form), state)
            if resp.status != 303:
                return url, resp.body
            url, method, body = urllib.parse.urljoin(url, resp.location), "GET", None
        raise ValueError(f"too many redirects from {url!r}")

    return fetch
