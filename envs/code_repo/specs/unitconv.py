"""``unitconv``: convert quantities between units of length, mass, time and temperature."""

from jointrl.envs.code_repo.specs.base import Bug, RepoSpec

FILES = {
    "README.md": '''\
# unitconv

Convert quantities between units: `convert(212, "F", "C") == 100.0`,
`parse_quantity("3.5 km")`, `parse_sum("5 ft 3 in", "in")`, `format_quantity(q)`.
Run the tests with `python3 -m pytest`.
''',
    "unitconv/__init__.py": '''\
"""unitconv: convert quantities between units of length, mass, time and temperature."""

from unitconv.convert import DimensionError, convert, convert_all
from unitconv.format import format_quantity
from unitconv.parse import Quantity, parse_quantity, parse_sum

__all__ = ["DimensionError", "Quantity", "convert", "convert_all", "format_quantity",
           "parse_quantity", "parse_sum"]
''',
    "unitconv/units.py": '''\
"""The unit table: each unit's dimension and how it maps to the dimension's base unit."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    symbol: str
    dimension: str
    factor: float  # base units per unit
    offset: float = 0.0  # base = value * factor + offset (temperatures)


UNITS = {u.symbol: u for u in [
    Unit("m", "length", 1.0), Unit("km", "length", 1000.0), Unit("cm", "length", 0.01),
    Unit("mm", "length", 0.001), Unit("in", "length", 0.0254), Unit("ft", "length", 0.3048),
    Unit("mi", "length", 1609.344),
    Unit("kg", "mass", 1.0), Unit("g", "mass", 0.001), Unit("lb", "mass", 0.45359237),
    Unit("oz", "mass", 0.028349523125),
    Unit("s", "time", 1.0), Unit("min", "time", 60.0), Unit("h", "time", 3600.0),
    Unit("day", "time", 86400.0),
    Unit("K", "temperature", 1.0), Unit("C", "temperature", 1.0, 273.15),
    Unit("F", "temperature", 5 / 9, 273.15 - 32 * 5 / 9),
]}

ALIASES = {
    "meter": "m", "meters": "m", "kilometer": "km", "kilometers": "km", "inch": "in",
    "inches": "in", "foot": "ft", "feet": "ft", "mile": "mi", "miles": "mi", "gram": "g",
    "grams": "g", "pound": "lb", "pounds": "lb", "second": "s", "seconds": "s",
    "minute": "min", "minutes": "min", "hour": "h", "hours": "h", "days": "day",
    "kelvin": "K", "celsius": "C", "fahrenheit": "F",
}


def lookup(name: str) -> Unit:
    """The unit named by its symbol ("km") or an alias ("Kilometers"); aliases ignore case."""
    key = name.strip()
    key = ALIASES.get(key.lower(), key)
    if key not in UNITS:
        raise KeyError(f"unknown unit {name!r}")
    return UNITS[key]
''',
    "unitconv/convert.py": '''\
"""Conversion between units of one dimension."""

from unitconv.units import Unit, lookup


class DimensionError(ValueError):
    """The two units measure different things."""


def to_base(value: float, unit: Unit) -> float:
    return value * unit.factor + unit.offset


def from_base(value: float, unit: Unit) -> float:
    return (value - unit.offset) / unit.factor


def convert(value: float, src: str, dst: str) -> float:
    """``value`` in unit ``src`` expressed in unit ``dst``."""
    a, b = lookup(src), lookup(dst)
    if a.dimension != b.dimension:
        raise DimensionError(f"cannot convert {a.dimension} ({src}) to {b.dimension} ({dst})")
    return from_base(to_base(value, a), b)


def convert_all(values: list[float], src: str, dst: str) -> list[float]:
    return [convert(v, src, dst) for v in values]
''',
    "unitconv/parse.py": '''\
"""Parsing quantities written as text: "3.5 km", "-40 C", "5 ft 3 in"."""

import re
from dataclasses import dataclass

from unitconv.convert import convert
from unitconv.units import lookup


@dataclass(frozen=True)
class Quantity:
    value: float
    unit: str  # a unit symbol


_NUMBER = r"[-+]?\\d+(?:\\.\\d+)?"
_QUANTITY = re.compile(rf"^\\s*({_NUMBER})\\s*([A-Za-z]+)\\s*$")
_PART = re.compile(rf"({_NUMBER})\\s*([A-Za-z]+)")


def parse_quantity(text: str) -> Quantity:
    """"3.5 km" -> Quantity(3.5, "km"); aliases become symbols. ValueError if malformed."""
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    return Quantity(float(m.group(1)), lookup(m.group(2)).symbol)


def parse_sum(text: str, unit: str) -> Quantity:
    """"5 ft 3 in" -> the sum of the parts, in ``unit``. ValueError unless the whole text is parts."""
    parts = list(_PART.finditer(text))
    rest = _PART.sub("", text)
    if not parts or rest.strip():
        raise ValueError(f"not a sum of quantities: {text!r}")
    total = sum(convert(float(p.group(1)), p.group(2), unit) for p in parts)
    return Quantity(total, lookup(unit).symbol)
''',
    "unitconv/format.py": '''\
"""Formatting quantities for people."""

from unitconv.parse import Quantity


def format_quantity(q: Quantity, precision: int = 2) -> str:
    """Rounded to ``precision`` decimals, trailing zeros dropped: "1.5 km", "3 m", "0 C"."""
    text = f"{q.value:.{precision}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if text == "-0":
        text = "0"
    return f"{text} {q.unit}"
''',
    "tests/test_convert.py": '''\
import pytest

from unitconv import DimensionError, convert, convert_all


def test_km_to_m():
    assert convert(2.5, "km", "m") == 2500.0


def test_inches_to_cm():
    assert convert(10, "in", "cm") == pytest.approx(25.4)


def test_pounds_to_kg():
    assert convert(1, "lb", "kg") == pytest.approx(0.45359237)


def test_celsius_to_kelvin():
    assert convert(25, "C", "K") == pytest.approx(298.15)


def test_hours_to_minutes():
    assert convert(1.5, "h", "min") == pytest.approx(90.0)


def test_dimension_mismatch_raises():
    with pytest.raises(DimensionError):
        convert(1, "kg", "m")


def test_convert_all():
    assert convert_all([1, 2], "km", "m") == [1000.0, 2000.0]
''',
    "tests/test_parse.py": '''\
import pytest

from unitconv import Quantity, parse_quantity, parse_sum


def test_parse_simple():
    assert parse_quantity("3.5 km") == Quantity(3.5, "km")


def test_parse_without_space():
    assert parse_quantity("12kg") == Quantity(12.0, "kg")


def test_parse_alias():
    assert parse_quantity("2 miles") == Quantity(2.0, "mi")


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_quantity("three km")


def test_parse_sum():
    assert parse_sum("5 ft 3 in", "in").value == pytest.approx(63.0)
''',
    "tests/test_format.py": '''\
from unitconv import Quantity, format_quantity


def test_format_trims_zeros():
    assert format_quantity(Quantity(1.5, "km")) == "1.5 km"


def test_format_integer():
    assert format_quantity(Quantity(3.0, "m")) == "3 m"


def test_format_precision():
    assert format_quantity(Quantity(3.14159, "m"), precision=3) == "3.142 m"


def test_format_negative():
    assert format_quantity(Quantity(-2.5, "C")) == "-2.5 C"
''',
}

BUGS = [
    Bug(
        id="unitconv-1",
        problem=(
            "Converting *from* Celsius works, but converting *to* Celsius or Fahrenheit gives "
            "nonsense: `convert(300, \"K\", \"C\")` returns 300.0 instead of 26.85, and "
            "`convert(100, \"C\", \"F\")` returns about 672 instead of 212."
        ),
        breaks=[("unitconv/convert.py", "return (value - unit.offset) / unit.factor", "return value / unit.factor")],
        tests={"tests/test_convert.py": '''

def test_kelvin_to_celsius():
    assert convert(300, "K", "C") == pytest.approx(26.85)


def test_celsius_to_fahrenheit():
    assert convert(100, "C", "F") == pytest.approx(212.0)
'''},
        fail_to_pass=["tests/test_convert.py::test_kelvin_to_celsius", "tests/test_convert.py::test_celsius_to_fahrenheit"],
        wrong=[("unitconv/convert.py", "return value / unit.factor",
                "if unit.symbol == \"C\":\n        return value - unit.offset\n    return value / unit.factor")],
    ),
    Bug(
        id="unitconv-2",
        problem=(
            "Unit aliases are documented as case-insensitive, but `parse_quantity(\"2 Miles\")` "
            "raises `KeyError: unknown unit 'Miles'` (lower-case \"miles\" works). The same "
            "happens with `convert(1, \"Feet\", \"in\")`."
        ),
        breaks=[("unitconv/units.py", "key = ALIASES.get(key.lower(), key)", "key = ALIASES.get(key, key)")],
        tests={"tests/test_parse.py": '''

def test_alias_ignores_case():
    assert parse_quantity("2 Miles") == Quantity(2.0, "mi")


def test_alias_ignores_case_in_convert():
    from unitconv import convert

    assert convert(1, "Feet", "in") == pytest.approx(12.0)
'''},
        fail_to_pass=["tests/test_parse.py::test_alias_ignores_case", "tests/test_parse.py::test_alias_ignores_case_in_convert"],
        wrong=[("unitconv/units.py", '"mile": "mi", "miles": "mi",', '"mile": "mi", "miles": "mi", "Miles": "mi",')],
    ),
    Bug(
        id="unitconv-3",
        problem=(
            "Signed numbers are rejected: `parse_quantity(\"-40 C\")` raises "
            "`ValueError: not a quantity: '-40 C'`, and so does `parse_quantity(\"+3 km\")`."
        ),
        breaks=[("unitconv/parse.py", '_NUMBER = r"[-+]?\\d+', '_NUMBER = r"\\d+')],
        tests={"tests/test_parse.py": '''

def test_parse_negative():
    assert parse_quantity("-40 C") == Quantity(-40.0, "C")


def test_parse_explicit_plus():
    assert parse_quantity("+3 km") == Quantity(3.0, "km")
'''},
        fail_to_pass=["tests/test_parse.py::test_parse_negative", "tests/test_parse.py::test_parse_explicit_plus"],
        wrong=[("unitconv/parse.py", '_NUMBER = r"\\d+', '_NUMBER = r"-?\\d+')],
    ),
    Bug(
        id="unitconv-4",
        problem=(
            "`format_quantity` prints a negative zero: "
            "`format_quantity(Quantity(-0.001, \"m\"))` gives `\"-0 m\"`; it should be `\"0 m\"`."
        ),
        breaks=[("unitconv/format.py", '    if text == "-0":\n        text = "0"\n    return', "    return")],
        tests={"tests/test_format.py": '''

def test_format_negative_zero():
    assert format_quantity(Quantity(-0.001, "m")) == "0 m"
'''},
        fail_to_pass=["tests/test_format.py::test_format_negative_zero"],
        wrong=[("unitconv/format.py", 'text = f"{q.value:.{precision}f}"', 'text = f"{abs(q.value):.{precision}f}"')],
    ),
    Bug(
        id="unitconv-5",
        problem=(
            "`parse_sum` silently ignores text it cannot read: `parse_sum(\"5 ft and 3 in\", \"in\")` "
            "returns 63 inches, and `parse_sum(\"\", \"m\")` returns 0 m. Both should raise "
            "`ValueError` like `parse_quantity` does."
        ),
        breaks=[("unitconv/parse.py", "    if not parts or rest.strip():\n", "    if rest.strip() and not parts:\n")],
        tests={"tests/test_parse_sum.py": '''\
import pytest

from unitconv import parse_sum


def test_parse_sum_rejects_words_between_parts():
    with pytest.raises(ValueError):
        parse_sum("5 ft and 3 in", "in")


def test_parse_sum_rejects_empty_text():
    with pytest.raises(ValueError):
        parse_sum("", "m")


def test_parse_sum_hours_and_minutes():
    assert parse_sum("1 h 30 min", "min").value == pytest.approx(90.0)
'''},
        fail_to_pass=["tests/test_parse_sum.py::test_parse_sum_rejects_words_between_parts",
                      "tests/test_parse_sum.py::test_parse_sum_rejects_empty_text"],
        wrong=[("unitconv/parse.py", "    if rest.strip() and not parts:\n", "    if not parts:\n")],
    ),
]

REPO = RepoSpec(name="unitconv", files=FILES, bugs=BUGS)
