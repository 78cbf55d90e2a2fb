"""The image browser: Playwright driving Debian's Chromium, headless, inside the sandbox.

Same actions and element numbers as the text browser (``page.INTERACTIVE`` in document order,
tagged ``data-jrl-id`` after every navigation); each observation is the URL, the title and the
list of visible elements, and ``screenshot()`` the viewport as PNG. Chromium runs with
``--no-sandbox`` (the bwrap sandbox is the boundary; Chromium's own would need user
namespaces, which the sandbox disables) and is bounded by the sandbox's memory cgroup.
``playwright install`` is never run: ``executable_path`` is the system Chromium.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from .page import INTERACTIVE, describe
from .text_browser import KEYS, SCROLLS, BrowserError

CHROMIUM = "/usr/bin/chromium"
_TIMEOUT_MS = 20_000
# Tags the elements with their numbers and lists them with the text browser's kinds (page.Element.kind).
_TAG = """sel => { const text = ['text', 'search', 'email', 'number', 'password', 'tel', 'url', ''];
  const kind = el => { const t = (el.getAttribute('type') || '').toLowerCase();
    if (el.tagName === 'A') return 'link';
    if (el.tagName === 'BUTTON') return t === '' || t === 'submit' ? 'submit' : 'button';
    if (el.tagName === 'INPUT') return t === 'submit' ? 'submit' : ['button', 'image', 'reset'].includes(t)
      ? 'button' : text.includes(t) ? 'text' : t;
    return el.tagName.toLowerCase(); };
  const els = [...document.querySelectorAll(sel)];
  els.forEach((el, i) => el.setAttribute('data-jrl-id', String(i + 1)));
  return els.map((el, i) => { const r = el.getBoundingClientRect(); const k = kind(el);
    const options = k === 'select' ? [...el.options].map(o => o.text) : [];
    const value = k === 'checkbox' || k === 'radio' ? el.checked
      : k === 'select' ? (el.options[el.selectedIndex] || {}).text || '' : (el.value || '');
    return {id: i + 1, kind: k, name: el.name || '', options, value,
            text: (el.innerText || el.value || '').trim().replace(/\\s+/g, ' ').slice(0, 80),
            visible: r.bottom > 0 && r.top < innerHeight && r.width > 0}; }); }"""
# Numbered badges over the tagged elements, drawn only for the screenshot (then removed).
_BADGES = """() => { const box = document.createElement('div'); box.id = 'jrl-badges';
  for (const el of document.querySelectorAll('[data-jrl-id]')) { const r = el.getBoundingClientRect();
    if (r.width === 0) continue; const b = document.createElement('span'); b.textContent = el.dataset.jrlId;
    b.style.cssText = `position:absolute;left:${r.left + scrollX}px;top:${r.top + scrollY - 6}px;z-index:99999;`
      + 'background:#ffd400;color:#000;font:bold 10px/11px monospace;padding:0 2px;border:1px solid #000;pointer-events:none';
    box.appendChild(b); }
  document.body.appendChild(box); }"""


class ImageBrowser:
    def __init__(self, width: int = 640, height: int = 448) -> None:
        if not Path(CHROMIUM).exists():
            raise RuntimeError(f"image mode needs Chromium at {CHROMIUM} (apt-get install chromium)")
        from playwright.sync_api import sync_playwright  # the tool venv's

        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--disable-extensions", "--disable-background-networking"])
        self._ctx = self._browser.new_context(viewport={"width": width, "height": height}, accept_downloads=False)
        self.page = self._ctx.new_page()
        self.page.set_default_timeout(_TIMEOUT_MS)
        self.elements: list[dict] = []
        self.opened = False

    # -- actions ----------------------------------------------------------------------------

    def goto(self, url: str) -> str:
        target = url.strip()
        if self.opened:
            from urllib.parse import urljoin

            target = urljoin(self.page.url, target)
        if not target.startswith(("http://", "https://")):
            raise BrowserError(f"only http(s) URLs can be opened, got {url!r}")
        try:
            self.page.goto(target, wait_until="load")
        except Exception as err:  # noqa: BLE001  (playwright's Error: unreachable host etc.)
            raise BrowserError(f"cannot load {target}: {str(err).splitlines()[0]}") from None
        self.opened = True
        return self.view()

    def click(self, id: int) -> str:
        el = self._element(id)
        loc = self._locator(id)
        if el["kind"] in ("text", "textarea", "select"):
            loc.focus()
            return f"Focused [{id}]; use type(id, text) to fill it.\n\n" + self.view()
        with self.page.expect_navigation(wait_until="load", timeout=_TIMEOUT_MS) if el["kind"] in (
                "link", "submit") else nullcontext():
            loc.click()
        return self.view()

    def type(self, id: int, text: str) -> str:
        el = self._element(id)
        loc = self._locator(id)
        if el["kind"] == "select":
            match = [lbl for lbl in el["options"] if lbl.casefold() == text.strip().casefold()]
            if not match:
                raise BrowserError(f"[{id}] has no option {text!r}; options: {el['options']}")
            loc.select_option(label=match[0])
        elif el["kind"] in ("text", "textarea"):
            loc.fill(text)
        else:
            raise BrowserError(f"[{id}] is a {el['kind']}, not a text field or select; use click({id})")
        return self.view()

    def press(self, key: str) -> str:
        if key not in KEYS:
            raise BrowserError(f"unsupported key {key!r}; supported: {list(KEYS)}")
        if key == "Enter":
            focused = self.page.evaluate("() => !!(document.activeElement && document.activeElement.form)")
            if not focused:
                raise BrowserError("Enter submits the form of the focused field, and no form field is focused")
            with self.page.expect_navigation(wait_until="load", timeout=_TIMEOUT_MS):
                self.page.keyboard.press("Enter")
        else:
            self.page.keyboard.press(key)
        return self.view()

    def scroll(self, direction: str) -> str:
        if direction not in SCROLLS:
            raise BrowserError(f"scroll direction must be one of {list(SCROLLS)}, got {direction!r}")
        js = {"down": "scrollBy(0, innerHeight * 0.9)", "up": "scrollBy(0, -innerHeight * 0.9)",
              "top": "scrollTo(0, 0)", "bottom": "scrollTo(0, document.body.scrollHeight)"}[direction]
        self.page.evaluate(f"() => {js}")
        return self.view()

    def back(self) -> str:
        if self.page.go_back(wait_until="load") is None:
            raise BrowserError("there is no previous page in the history")
        return self.view()

    def find(self, text: str) -> str:
        needle = text.strip().casefold()
        if not needle:
            raise BrowserError("find needs a non-empty text")
        lines = [ln.strip() for ln in self.page.inner_text("body").splitlines() if needle in ln.casefold()]
        if not lines:
            return f"No match for {text!r} on this page.\n\n" + self.view()
        self.page.get_by_text(text.strip(), exact=False).first.scroll_into_view_if_needed()
        found = "\n".join(lines[:10])
        return f"{len(lines)} line(s) match {text!r}:\n{found}\n\n" + self.view()

    # -- observation ------------------------------------------------------------------------

    def view(self) -> str:
        if not self.opened:
            return "No page is open. Use goto(url)."
        self.elements = self.page.evaluate(_TAG, INTERACTIVE)
        shown = [describe(el["id"], el["kind"], el["name"], el["text"], el["value"], el["options"])
                 for el in self.elements if el["visible"]]
        hidden = len(self.elements) - len(shown)
        more = f"\n({hidden} more elements outside the screen: scroll)" if hidden else ""
        return f"URL: {self.page.url}\nTitle: {self.page.title()}\nElements on screen:\n" + "\n".join(shown) + more

    def screenshot(self) -> bytes | None:
        """The viewport as PNG, with each element's number on a yellow badge at its top left."""
        if not self.opened:
            return None
        self.page.evaluate(_BADGES)
        try:
            return self.page.screenshot(type="png")
        finally:
            self.page.evaluate("() => document.getElementById('jrl-badges')?.remove()")

    def _element(self, id: int) -> dict:
        if not self.opened:
            raise BrowserError("no page is open; use goto(url) first")
        if not 1 <= id <= len(self.elements):
            raise BrowserError(f"no element [{id}] on this page (elements are numbered 1..{len(self.elements)})")
        return self.elements[id - 1]

    def _locator(self, id: int):
        return self.page.locator(f'[data-jrl-id="{id}"]')

