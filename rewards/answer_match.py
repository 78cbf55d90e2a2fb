"""Rewards on the final answer text (``Episode.final_answer``, e.g. the browser's ``answer``).

- ``answer_match``: normalized exact match against ``metadata["answer"]`` or one of its
  ``metadata["aliases"]``;
- ``answer_includes``: every phrase of ``metadata["must_include"]`` occurs in the answer (as
  whole words) and none of ``metadata["must_exclude"]`` does (the wrong alternatives: listing
  every candidate is not an answer);
- ``answer_number``: the answer states exactly one number (a hedge such as "1733 or 1734" scores
  0), and that number, converted to ``metadata["number"]["unit"]``, is within ``rel_tol`` /
  ``abs_tol`` of ``value``. A number given with a unit of another dimension (or an unknown unit)
  scores 0; a bare number is read in the expected unit.

Normalization (``normalize``) forgives what a reader would: case, accents, punctuation, extra
spaces, a leading article. A missing answer scores 0.
"""

from __future__ import annotations

import math
import re
import unicodedata

from jointrl.envs.base import Task
from jointrl.rewards.base import Episode, RewardResult, register

_ARTICLES = ("the ", "a ", "an ")
# unit -> (dimension, factor to the dimension's base unit); lowercase keys, after _unit_key
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "metre": ("length", 1.0), "meter": ("length", 1.0), "km": ("length", 1e3),
    "kilometre": ("length", 1e3), "kilometer": ("length", 1e3), "cm": ("length", 1e-2), "mm": ("length", 1e-3),
    "ft": ("length", 0.3048), "feet": ("length", 0.3048), "foot": ("length", 0.3048), "mi": ("length", 1609.344),
    "mile": ("length", 1609.344),
    "m2": ("area", 1.0), "sqm": ("area", 1.0), "km2": ("area", 1e6), "sqkm": ("area", 1e6), "ha": ("area", 1e4),
    "hectare": ("area", 1e4), "mi2": ("area", 2_589_988.110336), "sqmi": ("area", 2_589_988.110336),
    "kg": ("mass", 1.0), "g": ("mass", 1e-3), "t": ("mass", 1e3), "tonne": ("mass", 1e3), "lb": ("mass", 0.45359237),
    "l": ("volume", 1.0), "litre": ("volume", 1.0), "liter": ("volume", 1.0), "ml": ("volume", 1e-3),
    "%": ("percent", 1.0), "percent": ("percent", 1.0),
    "$": ("usd", 1.0), "usd": ("usd", 1.0), "dollar": ("usd", 1.0),
    "h": ("time", 3600.0), "hour": ("time", 3600.0), "min": ("time", 60.0), "minute": ("time", 60.0),
    "s": ("time", 1.0), "second": ("time", 1.0),
}
_SCALES = {"thousand": 1e3, "million": 1e6, "billion": 1e9}
_NUMBER = re.compile(r"(?<![\w.])([-−]?\d{1,3}(?:[,\u00a0\u202f ]\d{3})+(?:\.\d+)?|[-−]?\d+(?:\.\d+)?)")


def normalize(text: str) -> str:
    """Casefolded, accents and punctuation dropped, spaces collapsed, no leading article.

    >>> normalize("  The São-Paulo  River! ")
    'sao paulo river'
    >>> normalize("ÅNGSTRÖM") == normalize("angstrom")
    True
    >>> normalize("日本語")
    '日本語'
    """
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).casefold()
    text = re.sub(r"[^\w\s]|_", " ", text)
    text = " ".join(text.split())
    for art in _ARTICLES:
        if text.startswith(art):
            text = text[len(art):]
    return text


def _unit_key(unit: str) -> str:
    """``"km²"`` -> ``"km2"``, ``"sq. km"`` -> ``"sqkm"``, ``"metres"`` -> ``"metre"``."""
    u = unicodedata.normalize("NFKC", unit).casefold().replace("²", "2").replace(".", "").replace(" ", "")
    u = u.replace("square", "sq")
    return u[:-1] if len(u) > 3 and u.endswith("s") and u[:-1] in UNITS else u


def parse_quantity(text: str) -> tuple[float, str] | None:
    """The first number in ``text`` and the unit right after it (``""`` if none).

    >>> parse_quantity("about 1,234.5 km long")
    (1234.5, 'km')
    >>> parse_quantity("2.4 million people")
    (2400000.0, '')
    >>> parse_quantity("It is 523 570 km².")
    (523570.0, 'km2')
    >>> parse_quantity("$24.00")
    (24.0, '$')
    >>> parse_quantity("no digits here") is None
    True
    """
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = float(re.sub(r"[,\u00a0\u202f ]", "", m.group(1)).replace("−", "-"))
    before, rest = text[: m.start()].rstrip(), text[m.end():]
    scale = re.match(r"\s*(thousand|million|billion)\b", rest, re.IGNORECASE)
    if scale:
        value *= _SCALES[scale.group(1).lower()]
        rest = rest[scale.end():]
    if before.endswith("$"):
        return value, "$"
    um = re.match(r"\s*(%|(?:sq(?:uare)?\.?\s*)?[^\W\d_]+(?:²|2)?)", rest)
    if um and _unit_key(um.group(1)) in UNITS:
        return value, _unit_key(um.group(1))
    return value, ""


def number_matches(answer: str, value: float, unit: str = "", rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Whether ``answer`` states ``value`` (in ``unit``) within the tolerances.

    >>> number_matches("1.733 km", 1733, "m")
    True
    >>> number_matches("1733", 1733, "m")
    True
    >>> number_matches("1733 ft", 1733, "m")
    False
    >>> number_matches("746,380 m²", 746380, "km²")
    False
    >>> number_matches("1733 or 1734 m", 1733, "m")
    False
    """
    got = parse_quantity(answer)
    if got is None or len(_NUMBER.findall(answer)) != 1:
        return False
    x, u = got
    if u and unit:
        have, want = UNITS.get(u), UNITS.get(_unit_key(unit))
        if have is None or want is None or have[0] != want[0]:
            return False
        x = x * have[1] / want[1]
    elif u and not unit and UNITS[u][0] != "percent":
        return False  # a unit where a plain count was asked: some other quantity
    return math.isclose(x, value, rel_tol=rel_tol, abs_tol=max(abs_tol, 1e-9))


def _answer(task: Task, episode: Episode, key: str) -> tuple[str, object]:
    if key not in task.metadata:
        raise ValueError(f"task {task.id!r} has no metadata[{key!r}] to check the answer against")
    return episode.final_answer or "", task.metadata[key]


@register("answer_match")
def answer_match(task: Task, episode: Episode) -> RewardResult:
    answer, expected = _answer(task, episode, "answer")
    accepted = {normalize(str(a)) for a in [expected, *task.metadata.get("aliases", [])]}
    got = normalize(answer)
    return RewardResult(1.0 if got and got in accepted else 0.0, {"normalized": got})


@register("answer_includes")
def answer_includes(task: Task, episode: Episode) -> RewardResult:
    answer, phrases = _answer(task, episode, "must_include")
    got = f" {normalize(answer)} "
    missing = [p for p in phrases if f" {normalize(p)} " not in got]
    extra = [p for p in task.metadata.get("must_exclude", []) if f" {normalize(p)} " in got]
    return RewardResult(0.0 if missing or extra else 1.0, {"missing": missing, "excluded_present": extra})


@register("answer_number")
def answer_number(task: Task, episode: Episode) -> RewardResult:
    answer, spec = _answer(task, episode, "number")
    ok = number_matches(answer, float(spec["value"]), spec.get("unit", ""), float(spec.get("rel_tol", 0.0)),
                        float(spec.get("abs_tol", 0.0)))
    return RewardResult(1.0 if ok else 0.0, {"parsed": parse_quantity(answer)})
