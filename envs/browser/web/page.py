"""A page's interactive elements, numbered, and the page text with those numbers in it.

Both browsers number the same elements in the same order: every ``a[href]``, ``button``,
``select``, ``textarea`` and non-hidden ``input``, in document order, from 1 (the image
browser does it with the equivalent CSS selector, ``INTERACTIVE``). Stdlib only: the host's
oracle planner uses it too.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from html.parser import HTMLParser

INTERACTIVE = "a[href], button, select, textarea, input:not([type=hidden])"
_VOID_CONTROLS = {"input"}
_TEXT_INPUTS = {"text", "search", "email", "number", "password", "tel", "url", ""}


@dataclass
class Form:
    action: str
    method: str  # "get" or "post"
    hidden: dict[str, str] = field(default_factory=dict)


@dataclass
class Element:
    id: int
    tag: str  # a, button, select, textarea, input
    attrs: dict[str, str]
    form: int | None  # index into Page.forms
    text: str = ""  # link / button text, textarea content
    options: list[tuple[str, str]] = field(default_factory=list)  # select: (value, label)
    selected: str = ""  # select: the initially selected value
    span: tuple[int, int] = (0, 0)  # where the element is in the HTML (start tag .. end of element)

    @property
    def kind(self) -> str:
        """link, button, select, textarea, checkbox, radio, submit or text (a text field)."""
        if self.tag == "input":
            t = self.attrs.get("type", "").lower()
            if t in ("submit", "button", "image", "reset"):
                return "button" if t != "submit" else "submit"
            return "text" if t in _TEXT_INPUTS else t
        if self.tag == "a":
            return "link"
        if self.tag == "button":
            return "submit" if self.attrs.get("type", "submit").lower() == "submit" else "button"
        return self.tag

    @property
    def name(self) -> str:
        return self.attrs.get("name", "")


@dataclass
class Page:
    html: str
    title: str
    elements: list[Element]
    forms: list[Form]


class _Parser(HTMLParser):
    def __init__(self, source: str) -> None:
        super().__init__(convert_charrefs=True)
        self.source = source
        self.line_starts = [0]
        for i, ch in enumerate(source):
            if ch == "\n":
                self.line_starts.append(i + 1)
        self.elements: list[Element] = []
        self.forms: list[Form] = []
        self.title, self._in_title = "", False
        self._form: int | None = None
        self._open: Element | None = None  # the a / button / select / textarea whose text we collect
        self._option: list[str] | None = None  # [value, label, selected]

    def _offset(self) -> int:
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v if v is not None else "" for k, v in attrs_list}
        start = self._offset()
        if tag == "title":
            self._in_title = True
        elif tag == "form":
            self.forms.append(Form(attrs.get("action", ""), attrs.get("method", "get").lower()))
            self._form = len(self.forms) - 1
        elif tag == "option" and self._open is not None and self._open.tag == "select":
            self._option = [attrs.get("value"), "", "selected" in attrs]
        elif tag == "input" and attrs.get("type", "").lower() == "hidden":
            if self._form is not None and attrs.get("name"):
                self.forms[self._form].hidden[attrs["name"]] = attrs.get("value", "")
        elif (tag == "a" and "href" in attrs) or tag in ("button", "select", "textarea", "input"):
            el = Element(len(self.elements) + 1, tag, attrs, self._form, span=(start, start))
            self.elements.append(el)
            if tag in _VOID_CONTROLS:
                el.span = (start, start + len(self.get_starttag_text() or ""))
            else:
                self._open = el

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag == "form":
            self._form = None
        elif tag == "option" and self._option is not None and self._open is not None:
            value, label, selected = self._option
            label = " ".join(label.split())
            self._open.options.append((label if value is None else value, label))
            if selected or not self._open.selected:
                self._open.selected = label if value is None else value
            self._option = None
        elif self._open is not None and tag == self._open.tag:
            el, self._open = self._open, None
            el.text = " ".join(el.text.split())
            end = self.source.find(">", self._offset()) + 1
            el.span = (el.span[0], end)

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._option is not None:
            self._option[1] += data
        elif self._open is not None:
            self._open.text += data


def parse(source: str) -> Page:
    p = _Parser(source)
    p.feed(source)
    p.close()
    return Page(source, " ".join(p.title.split()), p.elements, p.forms)


def describe(id: int, kind: str, name: str, text: str, value: str | bool | None, options: list[str] = ()) -> str:
    """How an element reads in an observation (both browsers): ``[3] Paris`` for a link,
    ``[5: text "q" = ""]`` for a field; ``value`` is a select's shown label, a checkbox's state."""
    if kind == "link":
        return f"[{id}] {text}"
    if kind in ("submit", "button"):
        return f"[{id}: button \"{text}\"]"
    if kind in ("checkbox", "radio"):
        return f"[{id}: {kind} \"{name}\" {'on' if value else 'off'}]"
    if kind == "select":
        return f"[{id}: select \"{name}\" = \"{value}\"; options: {' | '.join(options)}]"
    return f"[{id}: {kind} \"{name}\" = \"{value or ''}\"]"


def _describe_element(el: Element, value: str | bool | None) -> str:
    if el.kind == "select":
        value = next((lbl for v, lbl in el.options if v == value), "")
    return describe(el.id, el.kind, el.name, el.text or el.attrs.get("value", ""), value, [lbl for _, lbl in el.options])


def annotate(page: Page, values: dict[int, str | bool]) -> str:
    """The page's HTML with each element replaced by its ``describe`` text (current values)."""
    out, pos = [], 0
    for el in page.elements:
        start, end = el.span
        out.append(page.html[pos:start])
        out.append(f"<span>{html.escape(_describe_element(el, values.get(el.id)))}</span>")
        pos = end
    out.append(page.html[pos:])
    return "".join(out)
