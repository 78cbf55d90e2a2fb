"""The text browser: real HTTP fetches, history, forms, and the page as compact markdown.

``fetch(method, url, body) -> (final_url, html)`` is injected: over loopback HTTP in the
sandbox (``http_fetch``), straight into the site handlers on the host (the oracle planner).
Every action returns the new view, or raises ``BrowserError`` (the model sees the message).
Markdown comes from ``markdownify`` (the tool venv), imported on first render.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from .page import Element, Page, annotate, parse

Fetch = Callable[[str, str, bytes | None], tuple[str, str]]
VIEW_LINES = 40  # lines of markdown per screen
KEYS = ("Enter", "PageDown", "PageUp", "Home", "End")
SCROLLS = ("down", "up", "top", "bottom")


class BrowserError(Exception):
    """The action could not be done (bad id, unreachable URL): an error observation."""


def http_fetch(method: str, url: str, body: bytes | None, timeout: float = 10.0) -> tuple[str, str]:
    """Fetch over the network namespace's own interfaces; redirects followed (303 -> GET)."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise BrowserError(f"only http(s) URLs can be opened, got {url!r}")
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.geturl(), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:  # 4xx / 5xx pages are pages (a form's validation errors)
        return err.geturl() or url, err.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise BrowserError(f"cannot load {url}: {reason}") from None


class TextBrowser:
    def __init__(self, fetch: Fetch = http_fetch) -> None:
        self.fetch = fetch
        self.url = ""
        self.page: Page | None = None
        self.history: list[str] = []
        self.values: dict[int, str | bool] = {}
        self.focus: Element | None = None
        self.top = 0  # first markdown line on screen
        self._lines: list[str] | None = None

    # -- actions ----------------------------------------------------------------------------

    def goto(self, url: str) -> str:
        target = urllib.parse.urljoin(self.url, url.strip()) if self.url else url.strip()
        if not urllib.parse.urlsplit(target).scheme:
            raise BrowserError(f"not an absolute URL (no page is open to resolve it against): {url!r}")
        self._load("GET", target, None)
        return self.view()

    def click(self, id: int) -> str:
        el = self._element(id)
        kind = el.kind
        if kind == "link":
            self._load("GET", urllib.parse.urljoin(self.url, el.attrs["href"]), None)
        elif kind == "checkbox":
            self.values[el.id] = not self.values.get(el.id)
        elif kind == "radio":
            for other in self._form_elements(el):
                if other.kind == "radio" and other.name == el.name:
                    self.values[other.id] = other.id == el.id
        elif kind == "submit":
            self._submit(el.form, el)
        else:  # a field: clicking focuses it
            self.focus = el
            return f"Focused [{el.id}] ({kind}); use type(id, text) to fill it.\n\n" + self.view()
        return self.view()

    def type(self, id: int, text: str) -> str:
        el = self._element(id)
        if el.kind in ("text", "textarea"):
            self.values[el.id] = text
        elif el.kind == "select":
            want = text.strip().casefold()
            match = [v for v, lbl in el.options if want in (v.casefold(), lbl.casefold())]
            if not match:
                raise BrowserError(f"[{id}] has no option {text!r}; options: {[lbl for _, lbl in el.options]}")
            self.values[el.id] = match[0]
        else:
            raise BrowserError(f"[{id}] is a {el.kind}, not a text field or select; use click({id})")
        self.focus = el
        return self.view()

    def press(self, key: str) -> str:
        if key == "Enter":
            if self.focus is None or self.focus.form is None:
                raise BrowserError("Enter submits the form of the focused field, and no form field is focused")
            self._submit(self.focus.form, None)
            return self.view()
        if key in ("PageDown", "PageUp", "Home", "End"):
            return self.scroll({"PageDown": "down", "PageUp": "up", "Home": "top", "End": "bottom"}[key])
        raise BrowserError(f"unsupported key {key!r}; supported: {list(KEYS)}")

    def scroll(self, direction: str) -> str:
        if direction not in SCROLLS:
            raise BrowserError(f"scroll direction must be one of {list(SCROLLS)}, got {direction!r}")
        n = len(self.lines())
        last = max(0, n - VIEW_LINES)
        self.top = {"down": min(last, self.top + VIEW_LINES), "up": max(0, self.top - VIEW_LINES),
                    "top": 0, "bottom": last}[direction]
        return self.view()

    def back(self) -> str:
        if len(self.history) < 2:
            raise BrowserError("there is no previous page in the history")
        self.history.pop()
        self._load("GET", self.history.pop(), None)
        return self.view()

    def find(self, text: str) -> str:
        needle = text.strip().casefold()
        if not needle:
            raise BrowserError("find needs a non-empty text")
        hits = [i for i, line in enumerate(self.lines()) if needle in line.casefold()]
        if not hits:
            return f"No match for {text!r} on this page.\n\n" + self.view()
        self.top = max(0, min(hits[0], len(self.lines()) - VIEW_LINES))
        found = "\n".join(f"line {i + 1}: {self.lines()[i].strip()}" for i in hits[:10])
        return f"{len(hits)} line(s) match {text!r}:\n{found}\n\n" + self.view()

    # -- rendering --------------------------------------------------------------------------

    def lines(self) -> list[str]:
        if self.page is None:
            return []
        if self._lines is None:
            from bs4 import BeautifulSoup  # the tool venv's, with markdownify
            from markdownify import MarkdownConverter

            soup = BeautifulSoup(annotate(self.page, self.values), "html.parser")
            for junk in soup(["head", "script", "style"]):
                junk.decompose()
            md = MarkdownConverter(heading_style="ATX", escape_underscores=False, escape_asterisks=False).convert_soup(soup)
            self._lines = [ln.rstrip() for ln in md.splitlines()]
            self._lines = [ln for i, ln in enumerate(self._lines) if ln or (i and self._lines[i - 1])]  # one blank max
            while self._lines and not self._lines[0]:
                self._lines.pop(0)
        return self._lines

    def view(self) -> str:
        if self.page is None:
            return "No page is open. Use goto(url)."
        lines = self.lines()
        self._lines = None  # values may change before the next view
        shown = lines[self.top: self.top + VIEW_LINES]
        head = f"URL: {self.url}\nTitle: {self.page.title}\n"
        above, below = self.top > 0, self.top + VIEW_LINES < len(lines)
        tail = ""
        if above or below:
            where = "up or down" if above and below else "down" if below else "up"
            tail = f"\n[lines {self.top + 1}-{self.top + len(shown)} of {len(lines)}; scroll {where} for more]"
        return head + "\n".join(shown) + tail

    # -- internals --------------------------------------------------------------------------

    def _load(self, method: str, url: str, body: bytes | None) -> None:
        final, source = self.fetch(method, url, body)
        self.url, self.page = final, parse(source)
        self.history.append(final)
        self.values = {el.id: _initial(el) for el in self.page.elements}
        self.focus, self.top, self._lines = None, 0, None

    def _element(self, id: int) -> Element:
        if self.page is None:
            raise BrowserError("no page is open; use goto(url) first")
        if not 1 <= id <= len(self.page.elements):
            raise BrowserError(f"no element [{id}] on this page (elements are numbered 1..{len(self.page.elements)})")
        return self.page.elements[id - 1]

    def _form_elements(self, el: Element) -> list[Element]:
        assert self.page is not None
        return [o for o in self.page.elements if o.form is not None and o.form == el.form]

    def _submit(self, form_index: int | None, button: Element | None) -> None:
        assert self.page is not None
        if form_index is None:
            raise BrowserError("this button is not part of a form")
        form = self.page.forms[form_index]
        fields: list[tuple[str, str]] = list(form.hidden.items())
        for el in self.page.elements:
            if el.form != form_index or not el.name:
                continue
            v = self.values.get(el.id)
            if el.kind in ("checkbox", "radio"):
                if v:
                    fields.append((el.name, el.attrs.get("value", "on")))
            elif el.kind in ("submit", "button"):
                if el is button:
                    fields.append((el.name, el.attrs.get("value", "")))
            else:
                fields.append((el.name, str(v or "")))
        data = urllib.parse.urlencode(fields)
        action = urllib.parse.urljoin(self.url, form.action or self.url)
        if form.method == "post":
            self._load("POST", action, data.encode())
        else:
            self._load("GET", urllib.parse.urlsplit(action)._replace(query=data).geturl(), None)


def _initial(el: Element) -> str | bool:
    if el.kind in ("checkbox", "radio"):
        return "checked" in el.attrs
    if el.kind == "select":
        return el.selected
    if el.kind == "textarea":
        return el.text
    return el.attrs.get("value", "")
