"""The settings app: forms with server-side validation (profile, address, notifications).

A valid submission is saved to ``state[<form>]`` and redirects to the form with "Saved.";
an invalid one re-renders the form with the entered values and one error per bad field,
and saves nothing. The saved values are what form tasks are checked against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .app import Request, Response, State, e, link, not_found, page
from .world import World

TIMEZONES = ["UTC-08:00", "UTC-05:00", "UTC+00:00", "UTC+01:00", "UTC+05:30", "UTC+09:00"]
LANGUAGES = ["English", "Deutsch", "Français", "Español", "日本語"]
FREQUENCIES = ["never", "daily", "weekly", "monthly"]
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$", re.IGNORECASE)


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str  # text, select, checkbox
    options: tuple[str, ...] = ()
    check: str = ""  # a validation rule name (see _validate)


def forms(world: World) -> dict[str, tuple[str, list[Field]]]:
    """form name -> (title, fields); the address form's countries come from the wiki's world."""
    return {
        "profile": ("Profile", [
            Field("display_name", "Display name", "text", check="name"),
            Field("email", "Email", "text", check="email"),
            Field("timezone", "Time zone", "select", tuple(TIMEZONES)),
            Field("language", "Language", "select", tuple(LANGUAGES)),
            Field("newsletter", "Send me the newsletter", "checkbox"),
        ]),
        "address": ("Shipping address", [
            Field("street", "Street", "text", check="required"),
            Field("city", "City", "text", check="required"),
            Field("postcode", "Postcode", "text", check="postcode"),
            Field("country", "Country", "select", tuple(sorted(world.countries))),
        ]),
        "notifications": ("Notifications", [
            Field("email_alerts", "Email alerts", "checkbox"),
            Field("sms_alerts", "SMS alerts", "checkbox"),
            Field("digest", "Digest frequency", "select", tuple(FREQUENCIES)),
        ]),
    }


def initial_state(world: World) -> dict[str, dict[str, object]]:
    return {
        "profile": {"display_name": "Guest", "email": "guest@example.com", "timezone": "UTC+00:00",
                    "language": "English", "newsletter": False},
        "address": {"street": "", "city": "", "postcode": "", "country": sorted(world.countries)[0]},
        "notifications": {"email_alerts": True, "sms_alerts": False, "digest": "weekly"},
    }


def _validate(f: Field, value: str) -> str:
    """The problem with ``value`` for field ``f``, or ''."""
    if f.kind == "select" and value not in f.options:
        return f"choose one of the listed options, got {value!r}"
    if f.check == "required" and not value.strip():
        return "this field is required"
    if f.check == "name" and not 2 <= len(value.strip()) <= 40:
        return "must be 2 to 40 characters"
    if f.check == "email" and not _EMAIL.match(value.strip()):
        return f"not a valid email address: {value!r}"
    if f.check == "postcode" and not re.fullmatch(r"\d{5}", value.strip()):
        return "must be exactly 5 digits"
    return ""


class Settings:
    def __init__(self, world: World) -> None:
        self.forms = forms(world)
        self.nav = [("/", "Settings home")] + [(f"/{k}", t) for k, (t, _) in self.forms.items()]

    def __call__(self, req: Request, state: State) -> Response:
        path = req.path.rstrip("/") or "/"
        if path == "/":
            items = "".join(f"<li>{link(h, t)}</li>" for h, t in self.nav[1:])
            return Response(200, page("Settings", f"<ul>{items}</ul>", self.nav))
        name = path[1:]
        if name not in self.forms:
            return not_found(path)
        if req.method == "POST":
            return self.submit(name, req, state)
        return self.render(name, dict(state.data[name]), {}, saved=req.param("saved") == "1")

    def submit(self, name: str, req: Request, state: State) -> Response:
        _, fields = self.forms[name]
        values: dict[str, object] = {}
        errors: dict[str, str] = {}
        for f in fields:
            if f.kind == "checkbox":
                values[f.name] = f.name in req.form
                continue
            raw = req.form.get(f.name, "")
            values[f.name] = raw.strip()
            problem = _validate(f, raw)
            if problem:
                errors[f.name] = problem
        if errors:
            return self.render(name, values, errors, status=400)
        state.update(lambda d: d.__setitem__(name, values))
        return Response.redirect(f"/{name}?saved=1")

    def render(self, name: str, values: dict[str, object], errors: dict[str, str], saved: bool = False,
               status: int = 200) -> Response:
        title, fields = self.forms[name]
        rows = ""
        for f in fields:
            v = values.get(f.name, "")
            if f.kind == "checkbox":
                ctl = f"<input type='checkbox' name='{f.name}'{' checked' if v else ''}>"
            elif f.kind == "select":
                ctl = f"<select name='{f.name}'>" + "".join(
                    f"<option{' selected' if o == v else ''}>{e(o)}</option>" for o in f.options) + "</select>"
            else:
                ctl = f"<input type='text' name='{f.name}' value='{e(str(v))}'>"
            err = f" <span class='err'>Error: {e(errors[f.name])}</span>" if f.name in errors else ""
            rows += f"<p><label>{e(f.label)} {ctl}</label>{err}</p>"
        head = "<p>Saved.</p>" if saved else ("<p class='err'>Please fix the errors below.</p>" if errors else "")
        body = f"{head}<form action='/{name}' method='post'>{rows}<button type='submit'>Save</button></form>"
        return Response(status, page(title, body, self.nav))
