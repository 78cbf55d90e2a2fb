"""``intervals``: half-open integer intervals, their union and gaps, dates and a day planner."""

from jointrl.envs.code_repo.specs.base import Bug, RepoSpec

FILES = {
    "README.md": '''\
# intervals

Half-open intervals `[start, end)` (`Interval`), unions and gaps (`merge`, `gaps`), calendar
arithmetic (`is_leap`, `days_in_month`, `add_days`) and free slots in a working day
(`free_slots`). Run the tests with `python3 -m pytest`.
''',
    "intervals/__init__.py": '''\
"""intervals: half-open integer intervals, dates and a day planner."""

from intervals.dates import add_days, days_in_month, is_leap
from intervals.interval import Interval
from intervals.merge import gaps, merge, total_length
from intervals.schedule import free_slots, from_minutes, to_minutes

__all__ = ["Interval", "add_days", "days_in_month", "free_slots", "from_minutes", "gaps",
           "is_leap", "merge", "to_minutes", "total_length"]
''',
    "intervals/interval.py": '''\
"""The half-open integer interval [start, end)."""

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    start: int
    end: int

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(f"interval end {self.end} is before its start {self.start}")

    @property
    def length(self) -> int:
        return self.end - self.start

    def contains(self, point: int) -> bool:
        return self.start <= point < self.end

    def overlaps(self, other: "Interval") -> bool:
        """Whether the two share at least one point (touching intervals do not)."""
        return self.start < other.end and other.start < self.end

    def intersection(self, other: "Interval") -> "Interval | None":
        if not self.overlaps(other):
            return None
        return Interval(max(self.start, other.start), min(self.end, other.end))
''',
    "intervals/merge.py": '''\
"""Unions and gaps of collections of intervals."""

from intervals.interval import Interval


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union as sorted, disjoint intervals; overlapping or touching ones are joined."""
    out: list[Interval] = []
    for iv in sorted(intervals):
        if out and iv.start <= out[-1].end:
            out[-1] = Interval(out[-1].start, max(out[-1].end, iv.end))
        else:
            out.append(iv)
    return out


def total_length(intervals: list[Interval]) -> int:
    return sum(iv.length for iv in merge(intervals))


def gaps(intervals: list[Interval], within: Interval) -> list[Interval]:
    """The parts of ``within`` that no interval covers."""
    out, cursor = [], within.start
    for iv in merge(intervals):
        if iv.end <= within.start or iv.start >= within.end:
            continue
        if iv.start > cursor:
            out.append(Interval(cursor, iv.start))
        cursor = max(cursor, iv.end)
    if cursor < within.end:
        out.append(Interval(cursor, within.end))
    return out
''',
    "intervals/dates.py": '''\
"""Gregorian calendar arithmetic on (year, month, day) tuples."""

_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year: int, month: int) -> int:
    if not 1 <= month <= 12:
        raise ValueError(f"month must be in 1..12, got {month}")
    return 29 if month == 2 and is_leap(year) else _DAYS[month - 1]


def add_days(date: tuple[int, int, int], n: int) -> tuple[int, int, int]:
    """The date ``n`` days after ``date`` (before it if ``n`` < 0)."""
    y, m, d = date
    while n > 0:
        d += 1
        if d > days_in_month(y, m):
            d, m = 1, m + 1
            if m > 12:
                m, y = 1, y + 1
        n -= 1
    while n < 0:
        d -= 1
        if d < 1:
            m -= 1
            if m < 1:
                m, y = 12, y - 1
            d = days_in_month(y, m)
        n += 1
    return (y, m, d)
''',
    "intervals/schedule.py": '''\
"""Free slots in a working day, with times written "HH:MM"."""

import re

from intervals.interval import Interval
from intervals.merge import gaps


def to_minutes(hhmm: str) -> int:
    """"09:30" -> 570. ValueError unless it is a time of day from 00:00 to 24:00."""
    m = re.fullmatch(r"(\\d{1,2}):(\\d{2})", hhmm.strip())
    if not m:
        raise ValueError(f"not a time: {hhmm!r}")
    hours, minutes = int(m.group(1)), int(m.group(2))
    if hours > 24 or minutes > 59 or (hours == 24 and minutes):
        raise ValueError(f"not a time of day: {hhmm!r}")
    return hours * 60 + minutes


def from_minutes(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def free_slots(busy: list[tuple[str, str]], day_start: str = "09:00", day_end: str = "17:00",
               min_length: int = 0) -> list[tuple[str, str]]:
    """The free (start, end) slots of the day, at least ``min_length`` minutes long."""
    day = Interval(to_minutes(day_start), to_minutes(day_end))
    taken = [Interval(to_minutes(a), to_minutes(b)) for a, b in busy]
    return [(from_minutes(g.start), from_minutes(g.end)) for g in gaps(taken, day) if g.length >= min_length]
''',
    "tests/test_interval.py": '''\
import pytest

from intervals import Interval


def test_length():
    assert Interval(3, 10).length == 7


def test_contains_is_half_open():
    iv = Interval(1, 4)
    assert iv.contains(1) and iv.contains(3) and not iv.contains(4)


def test_reversed_interval_raises():
    with pytest.raises(ValueError):
        Interval(5, 2)


def test_overlapping_intervals():
    assert Interval(1, 5).overlaps(Interval(4, 8))
    assert Interval(1, 5).intersection(Interval(4, 8)) == Interval(4, 5)


def test_disjoint_intervals():
    assert not Interval(1, 2).overlaps(Interval(5, 8))
    assert Interval(1, 2).intersection(Interval(5, 8)) is None
''',
    "tests/test_merge.py": '''\
from intervals import Interval, gaps, merge, total_length


def test_merge_overlapping():
    assert merge([Interval(1, 4), Interval(2, 6)]) == [Interval(1, 6)]


def test_merge_unsorted_input():
    assert merge([Interval(8, 9), Interval(1, 3)]) == [Interval(1, 3), Interval(8, 9)]


def test_merge_keeps_separate_intervals():
    assert merge([Interval(1, 3), Interval(4, 6)]) == [Interval(1, 3), Interval(4, 6)]


def test_total_length_counts_overlap_once():
    assert total_length([Interval(0, 10), Interval(5, 15)]) == 15


def test_gaps():
    assert gaps([Interval(2, 4), Interval(6, 7)], Interval(0, 10)) == [
        Interval(0, 2), Interval(4, 6), Interval(7, 10)]
''',
    "tests/test_dates.py": '''\
import pytest

from intervals import add_days, days_in_month, is_leap


def test_2024_is_leap():
    assert is_leap(2024)


def test_2000_is_leap():
    assert is_leap(2000)


def test_2023_is_not_leap():
    assert not is_leap(2023)


def test_days_in_february():
    assert days_in_month(2024, 2) == 29 and days_in_month(2023, 2) == 28


def test_bad_month_raises():
    with pytest.raises(ValueError):
        days_in_month(2024, 13)


def test_add_days_within_month():
    assert add_days((2024, 3, 1), 10) == (2024, 3, 11)


def test_subtract_days_across_month():
    assert add_days((2024, 3, 1), -1) == (2024, 2, 29)
''',
    "tests/test_schedule.py": '''\
import pytest

from intervals import free_slots, from_minutes, to_minutes


def test_to_minutes():
    assert to_minutes("09:30") == 570


def test_from_minutes():
    assert from_minutes(570) == "09:30"


def test_to_minutes_rejects_text():
    with pytest.raises(ValueError):
        to_minutes("nine")


def test_free_slots():
    assert free_slots([("10:00", "11:00"), ("13:00", "14:30")]) == [
        ("09:00", "10:00"), ("11:00", "13:00"), ("14:30", "17:00")]


def test_free_slots_min_length():
    assert free_slots([("09:30", "16:00")], min_length=45) == [("16:00", "17:00")]
''',
}

BUGS = [
    Bug(
        id="intervals-1",
        problem=(
            "`merge` does not join intervals that touch: `merge([Interval(1, 3), Interval(3, 5)])` "
            "returns both instead of `[Interval(1, 5)]`, although the docstring says touching "
            "intervals are joined."
        ),
        breaks=[("intervals/merge.py", "if out and iv.start <= out[-1].end:", "if out and iv.start < out[-1].end:")],
        tests={"tests/test_merge.py": '''

def test_merge_touching_intervals():
    assert merge([Interval(1, 3), Interval(3, 5)]) == [Interval(1, 5)]
'''},
        fail_to_pass=["tests/test_merge.py::test_merge_touching_intervals"],
        wrong=[("intervals/merge.py", "if out and iv.start < out[-1].end:", "if out and iv.start <= out[-1].end + 1:")],
    ),
    Bug(
        id="intervals-2",
        problem=(
            "`is_leap(1900)` returns True and `days_in_month(1900, 2)` returns 29. Century years "
            "are leap years only when divisible by 400."
        ),
        breaks=[("intervals/dates.py", "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
                 "return year % 4 == 0")],
        tests={"tests/test_dates.py": '''

def test_century_is_not_leap():
    assert not is_leap(1900) and not is_leap(2100)


def test_february_1900():
    assert days_in_month(1900, 2) == 28
'''},
        fail_to_pass=["tests/test_dates.py::test_century_is_not_leap", "tests/test_dates.py::test_february_1900"],
        wrong=[("intervals/dates.py", "return year % 4 == 0", "return year % 4 == 0 and year % 100 != 0")],
    ),
    Bug(
        id="intervals-3",
        problem=(
            "Adding days cannot cross a new year: `add_days((2023, 12, 31), 1)` returns the "
            "impossible date `(2023, 13, 1)` instead of `(2024, 1, 1)`, and "
            "`add_days((2024, 1, 1), 366)` raises `ValueError: month must be in 1..12, got 13`."
        ),
        breaks=[("intervals/dates.py", "            d, m = 1, m + 1\n            if m > 12:\n                m, y = 1, y + 1\n",
                 "            d, m = 1, m + 1\n")],
        tests={"tests/test_dates.py": '''

def test_add_days_across_new_year():
    assert add_days((2023, 12, 31), 1) == (2024, 1, 1)


def test_add_a_leap_year_of_days():
    assert add_days((2024, 1, 1), 366) == (2025, 1, 1)
'''},
        fail_to_pass=["tests/test_dates.py::test_add_days_across_new_year", "tests/test_dates.py::test_add_a_leap_year_of_days"],
        wrong=[("intervals/dates.py", "            d, m = 1, m + 1\n",
                "            d, m = 1, m + 1\n            if m > 12:\n                m = 1\n")],
    ),
    Bug(
        id="intervals-4",
        problem=(
            "`to_minutes` accepts impossible times: `to_minutes(\"9:75\")` returns 615 and "
            "`to_minutes(\"25:00\")` returns 1500. Both should raise `ValueError`."
        ),
        breaks=[("intervals/schedule.py",
                 "    if hours > 24 or minutes > 59 or (hours == 24 and minutes):\n"
                 "        raise ValueError(f\"not a time of day: {hhmm!r}\")\n    return hours",
                 "    return hours")],
        tests={"tests/test_schedule.py": '''

def test_to_minutes_rejects_bad_minutes():
    with pytest.raises(ValueError):
        to_minutes("9:75")


def test_to_minutes_rejects_bad_hours():
    with pytest.raises(ValueError):
        to_minutes("25:00")
'''},
        fail_to_pass=["tests/test_schedule.py::test_to_minutes_rejects_bad_minutes",
                      "tests/test_schedule.py::test_to_minutes_rejects_bad_hours"],
        wrong=[("intervals/schedule.py", "    return hours * 60 + minutes\n",
                "    if minutes > 59:\n        raise ValueError(f\"not a time of day: {hhmm!r}\")\n"
                "    return hours * 60 + minutes\n")],
    ),
    Bug(
        id="intervals-5",
        problem=(
            "Intervals that only touch are reported as overlapping: "
            "`Interval(1, 3).overlaps(Interval(3, 5))` is True, and their `intersection` is the "
            "empty `Interval(3, 3)` instead of None."
        ),
        breaks=[("intervals/interval.py", "return self.start < other.end and other.start < self.end",
                 "return self.start <= other.end and other.start <= self.end")],
        tests={"tests/test_interval.py": '''

def test_touching_intervals_do_not_overlap():
    assert not Interval(1, 3).overlaps(Interval(3, 5))


def test_touching_intervals_have_no_intersection():
    assert Interval(1, 3).intersection(Interval(3, 5)) is None
'''},
        fail_to_pass=["tests/test_interval.py::test_touching_intervals_do_not_overlap",
                      "tests/test_interval.py::test_touching_intervals_have_no_intersection"],
        wrong=[("intervals/interval.py", "        if not self.overlaps(other):\n            return None\n",
                "        if not self.overlaps(other) or self.end == other.start or other.end == self.start:\n"
                "            return None\n")],
    ),
]

REPO = RepoSpec(name="intervals", files=FILES, bugs=BUGS)
