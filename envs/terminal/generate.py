"""Procedural text-processing tasks: ``generate(family, seed)`` and ``build`` into Harbor folders.

    python -m jointrl.envs.terminal.generate --out DIR --seeds 50 [--split heldout] [--families ...]
    # then envs.domains.terminal.task_dir=DIR

Each family is one small shell job over data drawn from ``random.Random(f"{family}/{seed}")``:
the file names stay, the contents, the asked-for pattern / column / word / line and hence the
answer change with the seed, so a memorized answer does not carry over. The oracle is one short
command (then ``submit``); the plausible-but-``wrong`` one is a classic slip (case-insensitive
grep, the neighbouring column, a lexicographic sort, ``grep -v f > f`` ...) that the data is
drawn to expose (each family asserts the slip's result differs). Answers are short: mostly one
number or one word in ``/work/answer.txt``.

A generated task is an ordinary Harbor folder (``tasks.py``): ``instruction.md``,
``environment/`` (the data), ``tests/test.sh`` + ``tests/expected.txt`` (the verifier compares
one file, a listing or an answer with ``expected.txt``, ignoring blanks at line ends and
trailing newlines; it writes the reward only on a match), ``policies.json`` (``oracle``,
``wrong``) and ``solution/solve.sh``. Its id is ``<family>-s<seed>``; its split is the stable
hash of that id like every task's (``envs/splits.py``), and ``--split`` builds only one split's
tasks (40 seeds give ``heldout_count(40)`` = 119 held-out tasks of 480, 500 seeds 1,507).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jointrl.envs.base import ToolCall
from jointrl.envs.splits import SPLITS, seeded_id, seeded_ids
from jointrl.envs.terminal.policies import render_solution
from jointrl.envs.terminal.tasks import DOMAIN

WORDS = ["apple", "brick", "cloud", "delta", "ember", "fjord", "grape", "heron", "igloo", "jelly", "koala", "lemon",
         "mango", "nylon", "olive", "pearl", "quilt", "raven", "sugar", "tiger", "umbra", "viola", "wagon", "xenon",
         "yacht", "zebra", "amber", "basil", "cedar", "daisy", "eagle", "flint"]
LEVELS = ["ERROR", "WARN", "INFO", "DEBUG"]
MESSAGES = ["disk check done", "user login", "cache miss", "job started", "job finished", "retry scheduled",
            "config loaded", "request timed out", "connection reset", "backup written"]
COLUMNS = ["qty", "price", "weight", "score", "age", "stock", "views", "points"]
EXTS = ["log", "txt", "csv", "json", "md"]
MAX_TURNS = 6


@dataclass(frozen=True)
class Spec:
    """One generated task before it is written: what it asks, its data, its check and its two policies."""

    instruction: str
    files: dict[str, str]  # path under /work -> text
    target: str  # what the verifier reads: a file under /work, or "ls:<dir>" for a directory listing
    expected: str
    oracle: str  # one bash command
    wrong: str  # one bash command: a plausible slip
    wrong_result: str = ""  # what the slip leaves in ``target`` (asserted to differ)


def _norm(text: str) -> str:
    """What the verifier compares: each line stripped of surrounding blanks, trailing newlines dropped."""
    return "\n".join(line.strip() for line in text.rstrip("\n").split("\n")).rstrip("\n")


def _log(rng: random.Random, level: str) -> tuple[list[str], int, int]:
    """Log lines ``LEVEL message``; some other lines mention the level in lower case."""
    lines, exact, folded = [], 0, 0
    for _ in range(rng.randint(25, 45)):
        lv = rng.choice(LEVELS)
        msg = rng.choice(MESSAGES)
        if lv != level and rng.random() < 0.25:
            msg += f" ({level.lower()} threshold)"
        lines.append(f"2024-03-{rng.randint(1, 28):02d} {lv} {msg}")
        exact += level in lines[-1]
        folded += level.lower() in lines[-1].lower()
    return lines, exact, folded


def count_matches(rng: random.Random) -> Spec:
    level = rng.choice(LEVELS)
    lines, exact, folded = _log(rng, level)
    if exact == folded:  # make sure the case-insensitive slip counts more
        lines.append(f"2024-03-01 INFO note ({level.lower()} threshold)" if level != "INFO"
                     else "2024-03-01 DEBUG note (info threshold)")
        folded += 1
    return Spec(f"How many lines of /work/app.log contain `{level}`? Write the number to /work/answer.txt.",
                {"app.log": "\n".join(lines) + "\n"}, "answer.txt", str(exact),
                f"grep -c {level} app.log > answer.txt", f"grep -ci {level} app.log > answer.txt", str(folded))


def sum_column(rng: random.Random) -> Spec:
    cols = rng.sample(COLUMNS, 4)
    rows = [[rng.randint(1, 99) for _ in cols] for _ in range(rng.randint(8, 20))]
    i = rng.randrange(1, 4)  # never the first column, so the slip ($i, one to the left) is a real column
    sums = [sum(r[j] for r in rows) for j in range(4)]
    if sums[i - 1] == sums[i]:
        rows[0][i] += 1
        sums[i] += 1
    text = ",".join(cols) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)
    return Spec(f"/work/data.csv has a header line. Sum its `{cols[i]}` column and write the total to "
                "/work/answer.txt.", {"data.csv": text}, "answer.txt", str(sums[i]),
                f"awk -F, 'NR>1{{s+=${i + 1}}}END{{print s}}' data.csv > answer.txt",
                f"awk -F, 'NR>1{{s+=${i}}}END{{print s}}' data.csv > answer.txt", str(sums[i - 1]))


def count_unique(rng: random.Random) -> Spec:
    pool = rng.sample(WORDS, rng.randint(4, 9))
    names = pool + [rng.choice(pool) for _ in range(rng.randint(3, 12))]
    rng.shuffle(names)
    return Spec("How many distinct names are in /work/names.txt (one name per line)? Write the number to "
                "/work/answer.txt.", {"names.txt": "\n".join(names) + "\n"}, "answer.txt", str(len(pool)),
                "sort -u names.txt | wc -l > answer.txt", "wc -l < names.txt > answer.txt", str(len(names)))


def extreme_number(rng: random.Random) -> Spec:
    nums = rng.sample(range(100, 899), rng.randint(6, 14)) + [rng.randint(90, 99), rng.randint(1000, 8999)]
    rng.shuffle(nums)
    text = "\n".join(map(str, nums)) + "\n"
    by_text = sorted(map(str, nums))
    if rng.random() < 0.5:  # the lexicographic sort puts the 9x last, not the 4-digit number
        return Spec("Write the largest number in /work/nums.txt (one per line) to /work/answer.txt.",
                    {"nums.txt": text}, "answer.txt", str(max(nums)), "sort -n nums.txt | tail -1 > answer.txt",
                    "sort nums.txt | tail -1 > answer.txt", by_text[-1])
    return Spec("Write the smallest number in /work/nums.txt (one per line) to /work/answer.txt.",
                {"nums.txt": text}, "answer.txt", str(min(nums)), "sort -n nums.txt | head -1 > answer.txt",
                "sort nums.txt | head -1 > answer.txt", by_text[0])


def largest_file(rng: random.Random) -> Spec:
    names = rng.sample(WORDS, rng.randint(4, 7))
    sizes = rng.sample(range(20, 1500), len(names))
    files = {f"files/{n}.dat": "x" * (s - 1) + "\n" for n, s in zip(names, sizes)}
    big, small = names[sizes.index(max(sizes))], names[sizes.index(min(sizes))]
    if rng.random() < 0.5:
        return Spec("Which file in /work/files is the largest? Write its name (e.g. `name.dat`) to /work/answer.txt.",
                    files, "answer.txt", f"{big}.dat", "ls -S files | head -1 > answer.txt",
                    "ls -S files | tail -1 > answer.txt", f"{small}.dat")
    return Spec("Which file in /work/files is the smallest? Write its name (e.g. `name.dat`) to /work/answer.txt.",
                files, "answer.txt", f"{small}.dat", "ls -S files | tail -1 > answer.txt",
                "ls -S files | head -1 > answer.txt", f"{big}.dat")


def word_count(rng: random.Random) -> Spec:
    word, *others = rng.sample(WORDS, 5)
    longer = [word + "s", "re" + word, word + "er"]
    items = [word] * rng.randint(2, 9) + rng.sample(longer, rng.randint(1, 3)) + \
        [rng.choice(others) for _ in range(rng.randint(5, 15))]
    rng.shuffle(items)
    exact = items.count(word)
    return Spec(f"How many lines of /work/words.txt are exactly the word `{word}`? Write the number to "
                "/work/answer.txt.", {"words.txt": "\n".join(items) + "\n"}, "answer.txt", str(exact),
                f"grep -cx {word} words.txt > answer.txt", f"grep -c {word} words.txt > answer.txt",
                str(sum(word in w for w in items)))


def line_at(rng: random.Random) -> Spec:
    lines = [f"{rng.choice(WORDS)} {rng.randint(1, 999)}" for _ in range(rng.randint(10, 30))]
    k = rng.randint(2, len(lines) - 1)
    if lines[k] == lines[k - 1]:
        lines[k] += "0"
    return Spec(f"Write line {k} of /work/lines.txt (counting from 1) to /work/answer.txt.",
                {"lines.txt": "\n".join(lines) + "\n"}, "answer.txt", lines[k - 1],
                f"sed -n {k}p lines.txt > answer.txt", f"sed -n {k + 1}p lines.txt > answer.txt", lines[k])


def replace_word(rng: random.Random) -> Spec:
    old, new, *rest = rng.sample(WORDS, 8)
    lines = []
    for _ in range(rng.randint(5, 10)):
        words = rng.sample(rest, 3)
        for _ in range(rng.choice([0, 1, 1, 2])):
            words.insert(rng.randrange(len(words) + 1), old)
        lines.append(" ".join(words))
    lines[rng.randrange(len(lines))] = f"{old} {rng.choice(rest)} {old}"  # twice on one line: s/// without g slips
    text = "\n".join(lines) + "\n"
    first_only = "".join(line.replace(old, new, 1) + "\n" for line in lines)
    return Spec(f"Replace every occurrence of the word `{old}` with `{new}` in /work/notes.txt (edit the file "
                "in place).", {"notes.txt": text}, "notes.txt", text.replace(old, new),
                f"sed -i 's/{old}/{new}/g' notes.txt", f"sed -i 's/{old}/{new}/' notes.txt", first_only)


def delete_lines(rng: random.Random) -> Spec:
    level = rng.choice(LEVELS)
    lines, exact, _ = _log(rng, level)
    if not exact:
        lines.insert(rng.randrange(len(lines)), f"2024-03-02 {level} {rng.choice(MESSAGES)}")
    kept = [line for line in lines if level not in line]
    return Spec(f"Delete every line containing `{level}` from /work/app.log (edit the file in place, keep the "
                "other lines in order).", {"app.log": "\n".join(lines) + "\n"}, "app.log",
                "\n".join(kept), f"sed -i '/{level}/d' app.log", f"grep -v {level} app.log > app.log", "")


def rename_ext(rng: random.Random) -> Spec:
    src, dst = rng.sample(["txt", "md", "log", "csv"], 2)
    names = rng.sample(WORDS, rng.randint(3, 7))
    other = [n for n in rng.sample(WORDS, 3) if n not in names][:2]
    files = {f"docs/{n}.{src}": f"{n}\n" for n in names} | {f"docs/{n}.dat": f"{n}\n" for n in other}
    after = sorted([f"{n}.{dst}" for n in names] + [f"{n}.dat" for n in other])
    slip = sorted([f"{n}.{src}.{dst}" for n in names] + [f"{n}.dat" for n in other])
    return Spec(f"Rename every `.{src}` file in /work/docs to the `.{dst}` extension (`a.{src}` becomes "
                f"`a.{dst}`); leave the other files alone.", files, "ls:docs", "\n".join(after),
                f'cd docs && for f in *.{src}; do mv "$f" "${{f%.{src}}}.{dst}"; done',
                f'cd docs && for f in *.{src}; do mv "$f" "$f.{dst}"; done', "\n".join(slip))


def count_files(rng: random.Random) -> Spec:
    ext = rng.choice(EXTS)
    names = rng.sample(WORDS, rng.randint(5, 12))
    exts = [ext] * rng.randint(1, len(names) - 2)
    exts += [rng.choice([e for e in EXTS if e != ext]) for _ in range(len(names) - len(exts))]
    rng.shuffle(exts)
    files = {f"logs/{n}.{e}": f"{n}\n" for n, e in zip(names, exts)}
    return Spec(f"How many files in /work/logs have the extension `.{ext}`? Write the number to /work/answer.txt.",
                files, "answer.txt", str(exts.count(ext)), f"ls logs/*.{ext} | wc -l > answer.txt",
                "ls logs | wc -l > answer.txt", str(len(names)))


def filter_count(rng: random.Random) -> Spec:
    cols = rng.sample(COLUMNS, 3)
    i = rng.randrange(3)
    rows = [[rng.randint(1, 60) for _ in cols] for _ in range(rng.randint(8, 20))]
    t = rows[rng.randrange(len(rows))][i]  # some row sits exactly at the threshold: >= slips
    text = ",".join(cols) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)
    return Spec(f"How many rows of /work/data.csv (it has a header line) have `{cols[i]}` greater than {t}? "
                "Write the number to /work/answer.txt.", {"data.csv": text}, "answer.txt",
                str(sum(r[i] > t for r in rows)), f"awk -F, 'NR>1 && ${i + 1}>{t}' data.csv | wc -l > answer.txt",
                f"awk -F, 'NR>1 && ${i + 1}>={t}' data.csv | wc -l > answer.txt", str(sum(r[i] >= t for r in rows)))


FAMILIES: dict[str, Callable[[random.Random], Spec]] = {f.__name__.replace("_", "-"): f for f in (
    count_matches, sum_column, count_unique, extreme_number, largest_file, word_count, line_at, replace_word,
    delete_lines, rename_ext, count_files, filter_count)}


def generate(family: str, seed: int) -> Spec:
    """The task of ``family`` for ``seed``: the same on every machine and Python version."""
    if family not in FAMILIES:
        raise ValueError(f"unknown terminal family {family!r}; available: {sorted(FAMILIES)}")
    spec = FAMILIES[family](random.Random(f"{family}/{seed}"))
    assert _norm(spec.wrong_result) != _norm(spec.expected), (family, seed, "the slip must not pass")
    return spec


task_id = seeded_id


def ids(seeds: int, split: str = "all", families: list[str] | None = None, first_seed: int = 0) -> list[str]:
    """The ids ``build`` writes for seeds ``first_seed..first_seed+seeds-1`` (only ``split``'s), without
    building them."""
    return seeded_ids(DOMAIN, families or list(FAMILIES), seeds, split, first_seed)


def heldout_count(seeds: int) -> int:
    return len(ids(seeds, "heldout"))


_TEST = """#!/bin/bash
# Verifier (generated: {family}, seed {seed}): {what} equals /tests/expected.txt
# (blanks at line ends and trailing newlines ignored). Runs in a fresh sandbox over the final /work.
set -u
fail() {{ echo "FAIL: $*"; exit 1; }}
norm() {{ sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//'; }}
cd /work || fail "no /work"
{exists}
got=$({read} | norm)
want=$(norm < /tests/expected.txt)
[ "$got" = "$want" ] || fail "expected '$want', got '$got'"
echo 1 > /logs/verifier/reward.txt
echo PASS
"""


def write_task(out: Path, family: str, seed: int) -> Path:
    """Write the task folder ``out/<family>-s<seed>`` (replacing it); returns it."""
    spec = generate(family, seed)
    folder = out / task_id(family, seed)
    shutil.rmtree(folder, ignore_errors=True)
    for rel, text in spec.files.items():
        (folder / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / "environment" / rel).write_text(text)
    (folder / "tests").mkdir(parents=True)
    (folder / "solution").mkdir()
    if spec.target.startswith("ls:"):
        d = spec.target[3:]
        what, exists, read = f"the listing of /work/{d}", f'[ -d {d} ] || fail "{d}/ missing"', f"ls -1 {d}"
    else:
        t = spec.target
        what, exists, read = f"/work/{t}", f'[ -f {t} ] || fail "{t} missing"', f"cat {t}"
    (folder / "tests" / "test.sh").write_text(_TEST.format(family=family, seed=seed, what=what, exists=exists,
                                                           read=read))
    (folder / "tests" / "expected.txt").write_text(spec.expected + "\n")
    (folder / "instruction.md").write_text(spec.instruction + "\n")
    (folder / "task.toml").write_text(f'id = "{folder.name}"\ntier = "low"\nmax_turns = {MAX_TURNS}\n\n'
                                      f'[reward]\ntests_pass = 1.0\n\n[metadata]\ncategory = "generated"\n'
                                      f'family = "{family}"\nseed = {seed}\n')
    submit = [{"name": "submit", "arguments": {}}]
    policies = {name: [[{"name": "bash", "arguments": {"command": cmd}}], submit]
                for name, cmd in (("oracle", spec.oracle), ("wrong", spec.wrong))}
    (folder / "policies.json").write_text(json.dumps(policies, indent=1) + "\n")
    oracle = [[ToolCall("bash", {"command": spec.oracle})]]
    (folder / "solution" / "solve.sh").write_text(render_solution(oracle))
    return folder


def build(out: Path, seeds: int, split: str = "all", families: list[str] | None = None,
          first_seed: int = 0) -> list[str]:
    """Write the tasks of seeds ``first_seed..first_seed+seeds-1`` of every family (only ``split``'s)
    under ``out``; their ids."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not allowed; allowed values: {list(SPLITS)}")
    out.mkdir(parents=True, exist_ok=True)
    chosen = set(ids(seeds, split, families, first_seed))
    written = []
    for seed in range(first_seed, first_seed + seeds):
        for family in families or FAMILIES:
            if task_id(family, seed) in chosen:
                written.append(write_task(out, family, seed).name)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write generated terminal tasks (Harbor folders) to a directory.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, required=True, help="seeds K..K+N-1 of every family (K: --first-seed)")
    p.add_argument("--first-seed", type=int, default=0, help="K: e.g. fresh GRPO tasks beyond the SFT's seeds")
    p.add_argument("--split", default="all", choices=SPLITS, help="only this split's tasks (envs/splits.py)")
    p.add_argument("--families", nargs="*", choices=sorted(FAMILIES))
    a = p.parse_args(argv)
    print(f"{len(build(a.out, a.seeds, a.split, a.families, a.first_seed))} tasks in {a.out}")


if __name__ == "__main__":
    main()
