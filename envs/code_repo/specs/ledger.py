"""``ledger``: money amounts in cents, a stock inventory and a double-entry-ish ledger."""

from jointrl.envs.code_repo.specs.base import Bug, RepoSpec

FILES = {
    "README.md": '''\
# ledger

Amounts are integers of cents (`parse_amount("$1,234.50") == 123450`,
`format_amount(-307) == "-$3.07"`); `Inventory` tracks stock per SKU; `Ledger` holds dated
entries per account and answers balances; `summary` prints one line per account.
Run the tests with `python3 -m pytest`.
''',
    "ledger/__init__.py": '''\
"""ledger: money amounts, a stock inventory and a ledger of dated entries."""

from ledger.book import Entry, Ledger
from ledger.inventory import Inventory
from ledger.money import format_amount, parse_amount
from ledger.report import summary

__all__ = ["Entry", "Inventory", "Ledger", "format_amount", "parse_amount", "summary"]
''',
    "ledger/money.py": '''\
"""Amounts of money as integers of cents, parsed from and formatted as dollars."""

import re

_AMOUNT = re.compile(r"^(-)?\\$?(\\d{1,3}(?:,\\d{3})+|\\d+)(?:\\.(\\d{1,2}))?$")


def parse_amount(text: str) -> int:
    """"$1,234.5" -> 123450 cents. ValueError for anything else (misplaced commas included)."""
    m = _AMOUNT.match(text.strip())
    if not m:
        raise ValueError(f"not an amount: {text!r}")
    sign, whole, frac = m.groups()
    cents = int(whole.replace(",", "")) * 100 + int((frac or "").ljust(2, "0"))
    return -cents if sign else cents


def format_amount(cents: int) -> str:
    """123456 -> "$1,234.56"; -307 -> "-$3.07"."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}${whole:,}.{frac:02d}"
''',
    "ledger/inventory.py": '''\
"""Stock on hand, per SKU."""


class Inventory:
    def __init__(self):
        self._stock: dict[str, int] = {}

    def add(self, sku: str, qty: int) -> None:
        if qty <= 0:
            raise ValueError(f"quantity must be positive, got {qty}")
        self._stock[sku] = self._stock.get(sku, 0) + qty

    def remove(self, sku: str, qty: int) -> None:
        """Take ``qty`` out of stock; ValueError (and no change) if there is not enough."""
        if qty <= 0:
            raise ValueError(f"quantity must be positive, got {qty}")
        have = self._stock.get(sku, 0)
        if qty > have:
            raise ValueError(f"cannot remove {qty} of {sku!r}: only {have} in stock")
        if have == qty:
            del self._stock[sku]
        else:
            self._stock[sku] = have - qty

    def quantity(self, sku: str) -> int:
        return self._stock.get(sku, 0)

    def skus(self) -> list[str]:
        return sorted(self._stock)

    def total_value(self, prices: dict[str, int]) -> int:
        """Cents: the stock of every SKU times its price."""
        return sum(qty * prices[sku] for sku, qty in self._stock.items())
''',
    "ledger/book.py": '''\
"""The ledger: dated entries of signed amounts, per account."""

import re
from dataclasses import dataclass

_DATE = re.compile(r"^\\d{4}-\\d{2}-\\d{2}$")


@dataclass(frozen=True)
class Entry:
    date: str  # YYYY-MM-DD
    account: str
    amount: int  # cents; negative is money out
    memo: str = ""


class Ledger:
    def __init__(self):
        self.entries: list[Entry] = []

    def post(self, entry: Entry) -> None:
        if not _DATE.match(entry.date):
            raise ValueError(f"date must be YYYY-MM-DD, got {entry.date!r}")
        self.entries.append(entry)

    def transfer(self, date: str, src: str, dst: str, amount: int, memo: str = "") -> None:
        """Move ``amount`` cents from ``src`` to ``dst`` (two entries)."""
        if amount <= 0:
            raise ValueError(f"transfer amount must be positive, got {amount}")
        self.post(Entry(date, src, -amount, memo))
        self.post(Entry(date, dst, amount, memo))

    def balance(self, account: str | None = None, until: str | None = None) -> int:
        """Sum of the entries of ``account`` (all if None) dated on or before ``until``."""
        return sum(e.amount for e in self.entries
                   if (account is None or e.account == account) and (until is None or e.date <= until))

    def accounts(self) -> list[str]:
        return sorted({e.account for e in self.entries})
''',
    "ledger/report.py": '''\
"""A plain-text summary of a ledger."""

from ledger.book import Ledger
from ledger.money import format_amount


def summary(ledger: Ledger) -> str:
    """One "account: balance" line per account, sorted, then the total."""
    lines = [f"{a}: {format_amount(ledger.balance(a))}" for a in ledger.accounts()]
    lines.append(f"total: {format_amount(ledger.balance())}")
    return "\\n".join(lines)
''',
    "tests/test_money.py": '''\
import pytest

from ledger import format_amount, parse_amount


def test_parse_dollars_and_cents():
    assert parse_amount("12.34") == 1234


def test_parse_dollar_sign():
    assert parse_amount("$7") == 700


def test_parse_negative():
    assert parse_amount("-3.07") == -307


def test_parse_rejects_misplaced_commas():
    with pytest.raises(ValueError):
        parse_amount("12,34")


def test_parse_rejects_three_decimals():
    with pytest.raises(ValueError):
        parse_amount("1.234")


def test_format_thousands():
    assert format_amount(123456) == "$1,234.56"


def test_format_small():
    assert format_amount(5) == "$0.05"
''',
    "tests/test_inventory.py": '''\
import pytest

from ledger import Inventory


def test_add_and_quantity():
    inv = Inventory()
    inv.add("apple", 3)
    inv.add("apple", 2)
    assert inv.quantity("apple") == 5


def test_remove_some():
    inv = Inventory()
    inv.add("pear", 4)
    inv.remove("pear", 1)
    assert inv.quantity("pear") == 3


def test_remove_all_forgets_sku():
    inv = Inventory()
    inv.add("fig", 2)
    inv.remove("fig", 2)
    assert inv.skus() == []


def test_add_rejects_zero():
    with pytest.raises(ValueError):
        Inventory().add("fig", 0)


def test_total_value():
    inv = Inventory()
    inv.add("a", 2)
    inv.add("b", 3)
    assert inv.total_value({"a": 150, "b": 99}) == 597
''',
    "tests/test_book.py": '''\
import pytest

from ledger import Entry, Ledger, summary


def make():
    book = Ledger()
    book.post(Entry("2024-01-05", "cash", 10000))
    book.transfer("2024-01-10", "cash", "rent", 4000)
    book.post(Entry("2024-02-01", "cash", 2500))
    return book


def test_balance_per_account():
    book = make()
    assert book.balance("cash") == 8500 and book.balance("rent") == 4000


def test_balance_until_excludes_later_entries():
    assert make().balance("cash", until="2024-01-31") == 6000


def test_bad_date_raises():
    with pytest.raises(ValueError):
        Ledger().post(Entry("5 Jan 2024", "cash", 1))


def test_transfer_must_be_positive():
    with pytest.raises(ValueError):
        Ledger().transfer("2024-01-01", "a", "b", 0)


def test_summary():
    assert summary(make()) == "cash: $85.00\\nrent: $40.00\\ntotal: $125.00"
''',
}

BUGS = [
    Bug(
        id="ledger-1",
        problem=(
            "Amounts with thousands separators are rejected: `parse_amount(\"$1,234.56\")` raises "
            "`ValueError: not an amount`, as does `parse_amount(\"1,000,000\")`."
        ),
        breaks=[("ledger/money.py", "(\\d{1,3}(?:,\\d{3})+|\\d+)", "(\\d+)")],
        tests={"tests/test_money.py": '''

def test_parse_thousands():
    assert parse_amount("$1,234.56") == 123456


def test_parse_millions():
    assert parse_amount("1,000,000") == 100000000
'''},
        fail_to_pass=["tests/test_money.py::test_parse_thousands", "tests/test_money.py::test_parse_millions"],
        wrong=[("ledger/money.py", "    m = _AMOUNT.match(text.strip())\n",
                "    m = _AMOUNT.match(text.strip().replace(\",\", \"\"))\n")],
    ),
    Bug(
        id="ledger-2",
        problem=(
            "One decimal digit is read as cents: `parse_amount(\"12.5\")` returns 1205 (twelve "
            "dollars five) instead of 1250, and `parse_amount(\"-0.5\")` returns -5 instead of -50."
        ),
        breaks=[("ledger/money.py", 'int((frac or "").ljust(2, "0"))', 'int(frac or "0")')],
        tests={"tests/test_money.py": '''

def test_parse_one_decimal():
    assert parse_amount("12.5") == 1250


def test_parse_negative_one_decimal():
    assert parse_amount("-0.5") == -50
'''},
        fail_to_pass=["tests/test_money.py::test_parse_one_decimal", "tests/test_money.py::test_parse_negative_one_decimal"],
        wrong=[("ledger/money.py", 'int(frac or "0")', 'int((frac or "0") + "0")')],
    ),
    Bug(
        id="ledger-3",
        problem=(
            "Negative amounts are formatted wrongly: `format_amount(-307)` returns `\"$-4.93\"` "
            "instead of `\"-$3.07\"`, and `format_amount(-5)` returns `\"$-1.95\"`."
        ),
        breaks=[("ledger/money.py",
                 '    sign = "-" if cents < 0 else ""\n    whole, frac = divmod(abs(cents), 100)\n'
                 '    return f"{sign}${whole:,}.{frac:02d}"\n',
                 '    whole, frac = divmod(cents, 100)\n    return f"${whole:,}.{frac:02d}"\n')],
        tests={"tests/test_money.py": '''

def test_format_negative():
    assert format_amount(-307) == "-$3.07"


def test_format_negative_cents():
    assert format_amount(-5) == "-$0.05"
'''},
        fail_to_pass=["tests/test_money.py::test_format_negative", "tests/test_money.py::test_format_negative_cents"],
        wrong=[("ledger/money.py", '    whole, frac = divmod(cents, 100)\n    return f"${whole:,}.{frac:02d}"\n',
                '    sign = "-" if cents < 0 else ""\n    whole, frac = divmod(abs(cents), 100)\n'
                '    return f"{sign}${whole}.{frac:02d}"\n')],
    ),
    Bug(
        id="ledger-4",
        problem=(
            "`Inventory.remove` lets stock go negative: removing 5 apples when 3 are in stock "
            "leaves -2, and removing an unknown SKU records a negative quantity. It should raise "
            "`ValueError` and leave the stock unchanged."
        ),
        breaks=[("ledger/inventory.py",
                 "        if qty > have:\n"
                 "            raise ValueError(f\"cannot remove {qty} of {sku!r}: only {have} in stock\")\n"
                 "        if have == qty", "        if have == qty")],
        tests={"tests/test_inventory.py": '''

def test_remove_more_than_stock_raises():
    inv = Inventory()
    inv.add("apple", 3)
    with pytest.raises(ValueError):
        inv.remove("apple", 5)
    assert inv.quantity("apple") == 3


def test_remove_unknown_sku_raises():
    inv = Inventory()
    with pytest.raises(ValueError):
        inv.remove("kiwi", 1)
    assert inv.skus() == []
'''},
        fail_to_pass=["tests/test_inventory.py::test_remove_more_than_stock_raises",
                      "tests/test_inventory.py::test_remove_unknown_sku_raises"],
        wrong=[("ledger/inventory.py", "        have = self._stock.get(sku, 0)\n",
                "        if sku not in self._stock:\n            raise ValueError(f\"unknown SKU {sku!r}\")\n"
                "        have = self._stock.get(sku, 0)\n")],
    ),
    Bug(
        id="ledger-5",
        problem=(
            "`Ledger.balance(until=...)` leaves out the entries dated on the `until` day itself: "
            "with a deposit on 2024-01-05, `balance(\"cash\", until=\"2024-01-05\")` is 0. The "
            "docstring says \"on or before\"."
        ),
        breaks=[("ledger/book.py", "e.date <= until", "e.date < until")],
        tests={"tests/test_book.py": '''

def test_balance_until_includes_that_day():
    assert make().balance("cash", until="2024-01-05") == 10000
'''},
        fail_to_pass=["tests/test_book.py::test_balance_until_includes_that_day"],
        wrong=[("ledger/book.py", "e.date < until", "e.date[:7] <= until[:7]")],
    ),
]

REPO = RepoSpec(name="ledger", files=FILES, bugs=BUGS)
