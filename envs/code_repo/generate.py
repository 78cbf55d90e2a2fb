"""Procedural code-repository instances: small Python repositories with a bug from a template.

    python -m jointrl.envs.code_repo.generate --out DIR --seeds 60 [--split heldout] [--families ...]
    # then envs.domains.code_repo.task_dir=DIR

A seed makes one repository, ``jointrl/<package>-s<seed>``: a package (its name drawn from the
seed) with one module per family -- ``window_sums``, ``count_above``, ``share``, ``mean``,
``top_k``, ``page``, ``slugify``, ``product`` -- and their tests, every one passing. Each family
injects its bug into that module (``BUGS``: off-by-one, wrong operator, swapped arguments,
missing edge case, wrong sort order, off-by-one index, missing normalization, wrong initial
value); the issue text, the hidden tests (the ``test_patch``) and their data are drawn from
``random.Random(f"{family}/{seed}")``, so each seed asks about other values. The gold patch
undoes the bug; the ``wrong_patch`` is a plausible fix that fails a hidden or an old test.

Instances are built and checked by ``build_instances.build_repo`` exactly like the shipped ones
(git bundle per repository, SWE-bench records in ``instances.jsonl``, every FAIL_TO_PASS test
failing at the base commit and passing with the gold patch, the wrong patch failing, at least
five PASS_TO_PASS tests): 1-3 s per instance on 2 cores, most of it running pytest.
An instance's id is ``<family>-s<seed>``; its split is the stable hash of that id like every
task's (``envs/splits.py``), and ``--split`` builds only one split's instances (60 seeds hold
``heldout_count(60)`` = 107 held-out instances).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jointrl.envs.code_repo import build_instances
from jointrl.envs.code_repo.records import DOMAIN
from jointrl.envs.code_repo.specs import Bug, RepoSpec
from jointrl.envs.splits import SPLITS, seeded_id, seeded_ids

PACKAGES = ["toolbox", "listkit", "numkit", "datakit", "helpers", "utilkit", "seqtools", "textkit"]


@dataclass(frozen=True)
class Family:
    """One module of the repository and the bug a seed injects into it.

    ``source`` / ``tests``: the correct module and its old tests (``PKG`` stands for the package);
    ``make(rng)`` -> (problem, hidden tests, hidden test names, breaks, wrong): ``breaks`` and
    ``wrong`` are (old, new) edits of the module, applied to the correct version and to the
    base commit respectively.
    """

    module: str
    kind: str
    source: str
    tests: str
    make: Callable[[random.Random], tuple[str, str, list[str], list[tuple[str, str]], list[tuple[str, str]]]]


def _ints(rng: random.Random, n: int, lo: int = 1, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _window_sums(rng: random.Random):
    xs, k = _ints(rng, rng.randint(4, 7)), rng.randint(2, 3)
    want = [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]
    problem = (f"`window_sums({xs}, {k})` returns `{want[:-1]}`: the last window is missing. It should return "
               f"`{want}`.")
    tests = f"\n\ndef test_last_window_is_included():\n    assert window_sums({xs}, {k}) == {want}\n"
    return (problem, tests, ["test_last_window_is_included"], [("len(xs) - k + 1)", "len(xs) - k)")],
            [("len(xs) - k)", "len(xs) - k + 2)")])


def _count_above(rng: random.Random):
    xs = _ints(rng, rng.randint(5, 8), 1, 20)
    t = rng.choice(xs)
    xs.append(t + 0.5)
    want, got = sum(x > t for x in xs), sum(x >= t for x in xs)
    problem = (f"`count_above({xs}, {t})` returns {got}, but values equal to the threshold must not count: it "
               f"should be {want}.")
    tests = f"\n\ndef test_equal_values_do_not_count():\n    assert count_above({xs}, {t}) == {want}\n"
    return (problem, tests, ["test_equal_values_do_not_count"], [("if x > threshold", "if x >= threshold")],
            [("if x >= threshold", "if x >= threshold + 1")])


def _share(rng: random.Random):
    keys = rng.sample(["red", "green", "blue", "cyan", "gold", "gray", "pink"], 3)
    counts = dict(zip(keys, _ints(rng, 3, 1, 40)))
    key = rng.choice(keys)
    want = round(100 * counts[key] / sum(counts.values()), 1)
    problem = (f"`share({counts}, {key!r})` should be {want} (percent of the total count), but it returns a "
               "number above 100.")
    tests = f"\n\ndef test_share_is_a_percentage_of_the_total():\n    assert share({counts}, {key!r}) == {want}\n"
    return (problem, tests, ["test_share_is_a_percentage_of_the_total"],
            [("return percent(counts[key], sum(counts.values()))", "return percent(sum(counts.values()), counts[key])")],
            [("def percent(part, whole):", "def percent(whole, part):")])


def _mean(rng: random.Random):
    xs = _ints(rng, rng.randint(2, 6))
    problem = "`mean([])` raises `ZeroDivisionError`; as documented, the mean of an empty list is 0.0."
    tests = (f"\n\ndef test_mean_of_empty_is_zero():\n    assert mean([]) == 0.0\n\n\n"
             f"def test_mean_still_averages():\n    assert mean({xs}) == pytest.approx({sum(xs) / len(xs)!r})\n")
    return (problem, tests, ["test_mean_of_empty_is_zero"],
            [("    if not xs:\n        return 0.0\n    return sum", "    return sum")],
            [("    return sum(xs) / len(xs)", "    if len(xs) == 0:\n        return None\n    return sum(xs) / len(xs)")])


def _top_k(rng: random.Random):
    xs, k = rng.sample(range(1, 100), rng.randint(5, 8)), rng.randint(2, 4)
    want = sorted(xs, reverse=True)[:k]
    problem = f"`top_k({xs}, {k})` returns `{sorted(xs)[:k]}`, the smallest items; it should return `{want}`."
    tests = f"\n\ndef test_top_k_returns_the_largest_first():\n    assert top_k({xs}, {k}) == {want}\n"
    return (problem, tests, ["test_top_k_returns_the_largest_first"],
            [("sorted(xs, reverse=True)[:k]", "sorted(xs)[:k]")], [("sorted(xs)[:k]", "sorted(xs)[-k:]")])


def _page(rng: random.Random):
    size = rng.randint(2, 4)
    items = list(range(rng.randint(1, 20), 100))[: size * 3 + rng.randint(0, size - 1)]
    n = rng.randint(1, 2)
    want = items[(n - 1) * size:n * size]
    problem = (f"Pages are numbered from 1, but `page({items}, {n}, {size})` returns "
               f"`{items[n * size:(n + 1) * size]}` instead of `{want}`.")
    tests = f"\n\ndef test_pages_start_at_one():\n    assert page({items}, {n}, {size}) == {want}\n"
    return (problem, tests, ["test_pages_start_at_one"], [("start = (number - 1) * size", "start = number * size")],
            [("start = number * size", "start = (number - 1) * size + 1")])


def _slugify(rng: random.Random):
    words = [w.capitalize() if rng.random() < 0.6 else w
             for w in rng.sample(["quick", "brown", "fox", "lazy", "dog", "river", "stone", "night"], 3)]
    words[0] = words[0].capitalize()
    title = words[0] + "  " + " ".join(words[1:])  # a double space: split(" ") slips
    want = "-".join(w.lower() for w in words)
    problem = f"`slugify({title!r})` returns `{'-'.join(words)!r}`; slugs must be lower case: `{want!r}`."
    tests = f"\n\ndef test_slug_is_lower_case():\n    assert slugify({title!r}) == {want!r}\n"
    return (problem, tests, ["test_slug_is_lower_case"], [("title.lower().split()", "title.split()")],
            [("title.split()", "title.lower().split(\" \")")])


def _product(rng: random.Random):
    xs = _ints(rng, rng.randint(2, 4), 2, 9)
    want = 1
    for x in xs:
        want *= x
    problem = f"`product({xs})` returns 0 instead of {want}, and `product([])` should be 1."
    tests = (f"\n\ndef test_product_multiplies():\n    assert product({xs}) == {want}\n\n\n"
             f"def test_product_of_empty_is_one():\n    assert product([]) == 1\n")
    return (problem, tests, ["test_product_multiplies", "test_product_of_empty_is_one"],
            [("result = 1\n", "result = 0\n")],
            [("    result = 0\n", "    if not xs:\n        return 1\n    result = 0\n")])


FAMILIES: dict[str, Family] = {f.module.replace("_", "-"): f for f in [
    Family("window_sums", "off-by-one", '''\
def window_sums(xs, k):
    """Sums of every run of ``k`` consecutive items of ``xs``, in order."""
    if k <= 0:
        raise ValueError("k must be positive")
    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]
''', '''\
import pytest

from PKG.window_sums import window_sums


def test_k_must_be_positive():
    with pytest.raises(ValueError):
        window_sums([1, 2], 0)


def test_short_input_has_no_window():
    assert window_sums([5], 3) == []
''', _window_sums),
    Family("count_above", "wrong operator", '''\
def count_above(xs, threshold):
    """How many items of ``xs`` are strictly greater than ``threshold``."""
    return sum(1 for x in xs if x > threshold)
''', '''\
from PKG.count_above import count_above


def test_empty():
    assert count_above([], 3) == 0


def test_all_below():
    assert count_above([1, 2, 3], 10) == 0
''', _count_above),
    Family("share", "swapped arguments", '''\
def percent(part, whole):
    """``part`` as a percentage of ``whole``, rounded to one decimal."""
    if whole == 0:
        raise ZeroDivisionError("whole is zero")
    return round(100 * part / whole, 1)


def share(counts, key):
    """The percentage of the total count that ``key`` holds."""
    return percent(counts[key], sum(counts.values()))
''', '''\
import pytest

from PKG.share import percent, share


def test_percent():
    assert percent(1, 4) == 25.0


def test_percent_of_zero_raises():
    with pytest.raises(ZeroDivisionError):
        percent(1, 0)
''', _share),
    Family("mean", "missing edge case", '''\
def mean(xs):
    """The arithmetic mean of ``xs``; 0.0 for an empty list."""
    if not xs:
        return 0.0
    return sum(xs) / len(xs)
''', '''\
import pytest

from PKG.mean import mean


def test_mean_of_one():
    assert mean([4]) == 4.0


def test_mean_of_two():
    assert mean([1, 2]) == pytest.approx(1.5)
''', _mean),
    Family("top_k", "wrong sort order", '''\
def top_k(xs, k):
    """The ``k`` largest items of ``xs``, largest first."""
    return sorted(xs, reverse=True)[:k]
''', '''\
from PKG.top_k import top_k


def test_top_of_nothing():
    assert top_k([], 3) == []


def test_top_of_one():
    assert top_k([7], 1) == [7]
''', _top_k),
    Family("page", "off-by-one index", '''\
def page(items, number, size):
    """Page ``number`` (numbered from 1) of ``items`` cut into pages of ``size``."""
    start = (number - 1) * size
    return items[start:start + size]


def page_count(items, size):
    """How many pages of ``size`` the items fill (the last one may be short)."""
    return (len(items) + size - 1) // size
''', '''\
from PKG.page import page, page_count


def test_page_of_nothing():
    assert page([], 1, 3) == []


def test_page_count():
    assert page_count(list(range(7)), 3) == 3
''', _page),
    Family("slugify", "missing normalization", '''\
def slugify(title):
    """"Hello  World" -> "hello-world": lower case, words joined by single hyphens."""
    return "-".join(title.lower().split())
''', '''\
from PKG.slugify import slugify


def test_slug_of_lower_case_words():
    assert slugify("hello world") == "hello-world"


def test_slug_of_one_word():
    assert slugify("  single ") == "single"
''', _slugify),
    Family("product", "wrong initial value", '''\
def product(xs):
    """The product of ``xs``; 1 for an empty list."""
    result = 1
    for x in xs:
        result *= x
    return result
''', '''\
from PKG.product import product


def test_product_with_a_zero():
    assert product([3, 0, 5]) == 0
''', _product),
]}


def package(seed: int) -> str:
    return random.Random(f"package/{seed}").choice(PACKAGES)


instance_id = seeded_id


def ids(seeds: int, split: str = "all", families: list[str] | None = None, first_seed: int = 0) -> list[str]:
    """The ids ``build`` writes for seeds ``first_seed..first_seed+seeds-1`` (only ``split``'s), without
    building them."""
    return seeded_ids(DOMAIN, families or list(FAMILIES), seeds, split, first_seed)


def heldout_count(seeds: int) -> int:
    return len(ids(seeds, "heldout"))


def repo_spec(seed: int, families: list[str] | None = None) -> RepoSpec:
    """Seed ``seed``'s repository with the bugs of ``families`` (default: every family)."""
    pkg = package(seed)
    files = {"README.md": f"# {pkg}\n\nSmall helpers for lists, numbers and text. Run the tests with "
                          "`python3 -m pytest`.\n",
             f"{pkg}/__init__.py": f'"""{pkg}: small helpers for lists, numbers and text."""\n'}
    bugs = []
    for name, fam in FAMILIES.items():
        src, test_path = f"{pkg}/{fam.module}.py", f"tests/test_{fam.module}.py"
        files[src] = fam.source
        files[test_path] = fam.tests.replace("PKG", pkg)
        if families is not None and name not in families:
            continue
        problem, tests, names, breaks, wrong = fam.make(random.Random(f"{name}/{seed}"))
        bugs.append(Bug(id=instance_id(name, seed), problem=problem,
                        breaks=[(src, old, new) for old, new in breaks], tests={test_path: tests},
                        fail_to_pass=[f"{test_path}::{n}" for n in names],
                        wrong=[(src, old, new) for old, new in wrong]))
    return RepoSpec(name=f"{pkg}-s{seed}", files=files, bugs=bugs)


def build(out: Path, seeds: int, split: str = "all", families: list[str] | None = None,
          first_seed: int = 0) -> list[dict]:
    """Build the instances of seeds ``first_seed..first_seed+seeds-1`` (only ``split``'s) into ``out``
    (``repos/``, ``instances.jsonl``, replacing it); returns the records."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not allowed; allowed values: {list(SPLITS)}")
    chosen = set(ids(seeds, split, families, first_seed))
    mine = {seed: [f for f in families or FAMILIES if instance_id(f, seed) in chosen]
            for seed in range(first_seed, first_seed + seeds)}
    return build_instances.build(out, [repo_spec(seed, fams) for seed, fams in mine.items() if fams])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build generated code-repository instances into a task folder.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, required=True, help="seeds K..K+N-1, one repository each (K: --first-seed)")
    p.add_argument("--first-seed", type=int, default=0, help="K: e.g. fresh GRPO tasks beyond the SFT's seeds")
    p.add_argument("--split", default="all", choices=SPLITS, help="only this split's instances (envs/splits.py)")
    p.add_argument("--families", nargs="*", choices=sorted(FAMILIES))
    a = p.parse_args(argv)
    records = build(a.out.resolve(), a.seeds, a.split, a.families, a.first_seed)
    print(f"{len(records)} instances in {a.out}")


if __name__ == "__main__":
    main()
