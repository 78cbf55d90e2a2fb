"""``python -m jointrl.rl.recipe_report [--runs runs] [--seeds 0 1] [--out DIR]``: the five-domain
recipe's pre-registered comparisons (docs/recipe.md, "Pre-registration: the five-domain recipe"),
read from the runs' ``curves.json`` (rl/recipe.py), written as ``report.md`` and ``curves.png``.

    C1  SFT vs GRPO in the joint run: held-out pass@1 after SFT (its step 0) and after GRPO (its last step)
    C2  the oracle-only SFT run (no GRPO, SFT at the joint run's SFT + GRPO CPU seconds) vs SFT(mixed) + GRPO
    C3  GRPO on one domain alone from the joint run's SFT (its weight share of the steps) vs the joint run

each per domain, on held-out seeds of the trained families (``<d>``) and on the held-out families
(``<d>/unseen``), with every seed's number and the analysis rule's verdict: B beats A **outside the
seed spread** when min_s p_B(s) > max_s p_A(s), A beats B when max_s p_B(s) < min_s p_A(s), else the
difference is within the spread. A run whose ``curves.json`` is absent, a row it lacks, or a row
without an evaluation at the step read (step 0, or the run's ``grpo_steps``: looked up by step, never by
position) is printed as missing and makes the verdict ``incomplete``: nothing is filled in. The runs are found by the names
``conf/experiment/cpu_joint5.yaml``'s commands give them (``--joint``, ``--oracle``, ``--single``
templates with ``{seed}`` and ``{domain}``, under ``--runs``). Also per run: the GRPO episodes scored
per domain, the held-out episodes per row, and the CPU seconds of each stage the run itself executed
(``curves.json`` ``stages``, summed over the invocations of that run that spent them; a stage taken
from another run, ``recipe.sft_from``'s SFT, is not counted).

Amendment 2 (docs/recipe.md): where a joint run's trained-family eval of a domain has fewer than
``MIN_EPISODES`` (100) episodes, the C1 verdict and bar for that domain read its k = 2 evals instead,
``<joint run>/eval_k2/step_<S>/eval.json`` at step 0 and the last GRPO step (``jointrl eval ... k=2
unseen=false``, the same held-out tasks, sample 0 at the k = 1 eval's sampling seeds); its own table
prints them beside the pre-registered k = 1 C1 table, which is unchanged.

The PNG has a column per domain: the training reward (top) and held-out pass@1 (bottom, trained
families solid markers, unseen hollow) against the GRPO episodes of that domain, joint runs solid
lines, single-domain runs dashed, the oracle-only SFT's trained-family pass@1 dotted, one colour per seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

JOINT, ORACLE, SINGLE = "cpu_joint5_s{seed}", "cpu_joint5_oracle_s{seed}", "cpu_joint5_single_{domain}_s{seed}"
MIN_EPISODES = 100  # #40: >= 100 held-out episodes per domain on trained families (amendment 2 below it)


class Verdict(StrEnum):
    """The pre-registered analysis rule's outcome for A against B over the seeds."""

    b_wins = "b"  # min_s p_B(s) > max_s p_A(s)
    a_wins = "a"  # max_s p_B(s) < min_s p_A(s)
    within = "within"  # otherwise
    incomplete = "incomplete"  # a seed's number is missing on either side


def verdict(a: list[float | None], b: list[float | None]) -> Verdict:
    """The analysis rule over per-seed pass@1 ``a`` and ``b`` (``None``: missing).

    >>> verdict([0.1, 0.2], [0.3, 0.25]), verdict([0.1, 0.3], [0.2, 0.4]), verdict([0.5, 0.4], [0.1, 0.3])
    (<Verdict.b_wins: 'b'>, <Verdict.within: 'within'>, <Verdict.a_wins: 'a'>)
    >>> verdict([0.1, None], [0.3, 0.4])
    <Verdict.incomplete: 'incomplete'>
    """
    if not a or not b or None in a or None in b:
        return Verdict.incomplete
    if min(b) > max(a):
        return Verdict.b_wins
    if max(b) < min(a):
        return Verdict.a_wins
    return Verdict.within


@dataclass(frozen=True)
class Run:
    """One recipe run: its folder and its ``curves.json`` (``None``: the run is missing)."""

    kind: str  # joint / oracle / single <domain>
    seed: int
    path: Path
    curves: dict | None

    @classmethod
    def load(cls, kind: str, seed: int, path: Path) -> Run:
        f = path / "curves.json"
        return cls(kind, seed, path, json.loads(f.read_text()) if f.is_file() else None)

    def pass1(self, row: str, step: int | None) -> float | None:
        """Held-out pass@1 of ``row`` (``<d>`` or ``<d>/unseen``) evaluated at GRPO step ``step`` (0: the
        SFT checkpoint); None when the run, the row or that step's evaluation is missing."""
        c = (self.curves or {}).get("heldout", {}).get(row)
        if step is None or not c or step not in c["step"]:
            return None
        return c["pass@1"][c["step"].index(step)]

    def sft(self, row: str) -> float | None:
        """``row``'s pass@1 after SFT (step 0)."""
        return self.pass1(row, 0)

    def final(self, row: str) -> float | None:
        """``row``'s pass@1 at the run's last GRPO step (``curves.json`` ``grpo_steps``; 0 for a run
        without GRPO, the oracle-only SFT): None when that step was not evaluated (an unfinished run)."""
        return self.pass1(row, (self.curves or {}).get("grpo_steps"))

    def k2(self, domain: str, step: int | None) -> tuple[float | None, int | None]:
        """Amendment 2: ``domain``'s trained-family pass@1 and episode count in the k = 2 eval of the
        checkpoint at GRPO step ``step`` (0: SFT; ``<run>/eval_k2/step_<step>/eval.json``); (None, None)
        when that eval or its row is absent."""
        f = self.path / "eval_k2" / f"step_{step}" / "eval.json"
        rows = json.loads(f.read_text())["rows"] if step is not None and f.is_file() else []
        row = next((r for r in rows if r["domain"] == domain and r["split"] == "heldout"), None)
        return (row["pass@1"], row["episodes"]) if row else (None, None)

    def eval_episodes(self, row: str) -> int | None:
        c = (self.curves or {}).get("heldout", {}).get(row)
        return c["episodes"][-1] if c and c["episodes"] else None

    def grpo_episodes(self, domain: str) -> int | None:
        """Scored GRPO episodes of ``domain`` over the run (None: not recorded, or no GRPO stage)."""
        c = (self.curves or {}).get("train", {}).get(domain)
        return sum(c["episodes"]) if c and "episodes" in c else None

    def episodes_at(self, domain: str):
        """A function GRPO step -> episodes of ``domain`` scored up to and including it; the step
        itself where the run did not record its episodes."""
        c = (self.curves or {}).get("train", {}).get(domain)
        if not c or "episodes" not in c:
            return lambda step: step
        return lambda step: sum(n for s, n in zip(c["step"], c["episodes"]) if s <= step)


@dataclass(frozen=True)
class Runs:
    """Every run the comparisons read, per seed: ``joint[i]``, ``oracle[i]``, ``single[domain][i]``."""

    seeds: list[int]
    domains: list[str]
    joint: list[Run]
    oracle: list[Run]
    single: dict[str, list[Run]]
    min_episodes: int = MIN_EPISODES  # amendment 2's threshold

    @classmethod
    def find(cls, root: Path, seeds: list[int], domains: list[str] | None = None,
             joint: str = JOINT, oracle: str = ORACLE, single: str = SINGLE, min_episodes: int = MIN_EPISODES) -> Runs:
        """The runs under ``root`` named by the templates; ``domains`` None: the joint (else oracle) runs'
        own, else the five-domain experiment's."""
        j = [Run.load("joint", s, root / joint.format(seed=s)) for s in seeds]
        o = [Run.load("oracle", s, root / oracle.format(seed=s)) for s in seeds]
        if domains is None:
            found = [r.curves["domains"] for r in j + o if r.curves]
            if found:
                domains = found[0]
            else:
                from jointrl.rl.config import load_config  # lazy: Hydra only when no run names its domains

                domains = list(load_config(["+experiment=cpu_joint5"]).envs.domains)
        singles = {d: [Run.load(f"single {d}", s, root / single.format(seed=s, domain=d)) for s in seeds]
                   for d in domains}
        return cls(seeds, list(domains), j, o, singles, min_episodes)

    def amended(self) -> list[str]:
        """The domains amendment 2 evaluates at k = 2: a joint run's trained-family eval of it has fewer
        than ``min_episodes`` episodes."""
        return [d for d in self.domains if any((n := r.eval_episodes(d)) is not None and n < self.min_episodes
                                               for r in self.joint)]

    def c1_pair(self, domain: str) -> tuple[list[float | None], list[float | None]]:
        """C1 on ``domain``'s trained families, per seed: (SFT, GRPO) pass@1, from the k = 2 evals for an
        amended domain (amendment 2), else the pre-registered k = 1 evals."""
        if domain in self.amended():
            return ([r.k2(domain, 0)[0] for r in self.joint],
                    [r.k2(domain, (r.curves or {}).get("grpo_steps"))[0] for r in self.joint])
        return [r.sft(domain) for r in self.joint], [r.final(domain) for r in self.joint]

    def all(self) -> list[Run]:
        return self.joint + self.oracle + [r for d in self.domains for r in self.single[d]]


def _p(x: float | None) -> str:
    return "missing" if x is None else f"{x:.3f}"


def _n(x: int | None) -> str:
    return "-" if x is None else str(x)


def comparison(runs: Runs, title: str, a_name: str, b_name: str, a_of, b_of, wins: dict[Verdict, str],
               episodes_of=None) -> list[str]:
    """One markdown table: a row per domain and split, both seeds of A and B, the verdict.
    ``a_of(domain, seed_index, row)`` / ``b_of(...)``: the pass@1 compared; ``episodes_of(domain, i)``
    an extra column of GRPO episodes (A / B) per seed."""
    seeds = runs.seeds
    head = (["domain", "split", "eval episodes"] + [f"{a_name} s{s}" for s in seeds] + [f"{b_name} s{s}" for s in seeds]
            + (["GRPO episodes (A / B)"] if episodes_of else []) + ["verdict"])
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in runs.domains:
        for split, row in (("trained", d), ("unseen", f"{d}/unseen")):
            a = [a_of(d, i, row) for i in range(len(seeds))]
            b = [b_of(d, i, row) for i in range(len(seeds))]
            eps = "/".join(_n(r.eval_episodes(row)) for r in runs.joint)
            cells = [d, split, eps, *map(_p, a), *map(_p, b)]
            if episodes_of:
                cells.append(", ".join(episodes_of(d, i) for i in range(len(seeds))))
            cells.append(wins[verdict(a, b)])
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def c1_bar(runs: Runs) -> tuple[list[str], bool]:
    """The domains whose GRPO gain over SFT on trained families is outside the seed spread (#40's bar:
    >= 3 of them; amended domains read at k = 2), and whether any domain's verdict is incomplete (a run,
    a row or a step missing: the count is a floor)."""
    verdicts = {d: verdict(*runs.c1_pair(d)) for d in runs.domains}
    return [d for d, v in verdicts.items() if v is Verdict.b_wins], Verdict.incomplete in verdicts.values()


C1_WINS = {Verdict.b_wins: "GRPO gain outside the spread", Verdict.a_wins: "GRPO loss outside the spread",
           Verdict.within: "within the spread", Verdict.incomplete: "incomplete"}


def amended_table(runs: Runs) -> list[str]:
    """C1 on the trained families of the domains amendment 2 evaluates at k = 2: episodes, both seeds'
    SFT and GRPO pass@1 from the k = 2 evals, the verdict."""
    seeds, amended = runs.seeds, runs.amended()
    if not amended:
        return []
    head = ["domain", "eval episodes (k = 2)"] + [f"SFT s{s}" for s in seeds] + [f"GRPO s{s}" for s in seeds] + ["verdict"]
    lines = [f"### C1 at >= {runs.min_episodes} episodes (amendment 2): k = 2 evals of the trained families", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in amended:
        a, b = runs.c1_pair(d)
        eps = "/".join(_n(r.k2(d, 0)[1]) for r in runs.joint)
        lines.append("| " + " | ".join([d, eps, *map(_p, a), *map(_p, b), C1_WINS[verdict(a, b)]]) + " |")
    return lines + [""]


def run_table(runs: Runs) -> list[str]:
    """A row per run: found or missing, its steps, each stage's CPU minutes, the total in CPU hours."""
    lines = ["### Runs", "", "| run | seed | folder | SFT steps | GRPO steps | CPU min per stage | CPU h | wall h | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs.all():
        if r.curves is None:
            lines.append(f"| {r.kind} | {r.seed} | {r.path} | missing (no curves.json) | | | | | |")
            continue
        st = r.curves.get("stages", {})
        per = ", ".join(f"{k} {v['cpu_s'] / 60:.1f}" for k, v in st.items()) or "none run here"
        sft = f"{r.curves['sft_steps']} (from {r.curves['sft_from']})" if r.curves.get("sft_from") else str(r.curves["sft_steps"])
        lines.append(f"| {r.kind} | {r.seed} | {r.path} | {sft} | {r.curves['grpo_steps']} | {per} | "
                     f"{sum(v['cpu_s'] for v in st.values()) / 3600:.2f} | {sum(v['wall_s'] for v in st.values()) / 3600:.2f} | "
                     f"{r.curves.get('cpu_exact', False)} |")
    return lines + [""]


def report(runs: Runs) -> str:
    """The markdown report: the three comparisons, the C1 bar, the runs."""
    j, o, single = runs.joint, runs.oracle, runs.single
    grpo_eps = lambda d, i: f"{_n(single[d][i].grpo_episodes(d))} / {_n(j[i].grpo_episodes(d))}"  # noqa: E731
    missing = [f"{r.kind} seed {r.seed} ({r.path})" for r in runs.all() if r.curves is None]
    bar, bar_incomplete = c1_bar(runs)
    lines = ["# Five-domain recipe: the pre-registered comparisons (docs/recipe.md)", "",
             "Held-out pass@1 per seed; verdict by the pre-registered rule (outside the seed spread: both seeds "
             "of one side above both of the other). Eval episodes: the joint runs' (seed order).", "",
             f"Missing runs: {'; '.join(missing) if missing else 'none'}.", "",
             f"C1 bar (#40: GRPO's gain outside the seed spread on >= 3 of {len(runs.domains)} domains, trained "
             f"families): {len(bar)} of {len(runs.domains)}" + (f" ({', '.join(bar)})" if bar else "")
             + (f"; {', '.join(runs.amended())} read at k = 2 (amendment 2)" if runs.amended() else "")
             + (" (incomplete: a run, row or step missing)" if bar_incomplete else "") + ".", ""]
    lines += comparison(runs, "C1: SFT vs GRPO (joint)", "SFT", "GRPO", lambda d, i, row: j[i].sft(row),
                        lambda d, i, row: j[i].final(row), C1_WINS)
    lines += amended_table(runs)
    lines += comparison(runs, "C2: oracle-only SFT at equal CPU (A) vs SFT(mixed) + GRPO (B)", "oracle-only",
                        "SFT(mixed)+GRPO", lambda d, i, row: o[i].final(row), lambda d, i, row: j[i].final(row),
                        {Verdict.b_wins: "SFT(mixed)+GRPO wins", Verdict.a_wins: "oracle-only wins",
                         Verdict.within: "neither (within the spread)", Verdict.incomplete: "incomplete"})
    lines += comparison(runs, "C3: single-domain GRPO (A) vs joint (B), from the same SFT", "single", "joint",
                        lambda d, i, row: single[d][i].final(row), lambda d, i, row: j[i].final(row),
                        {Verdict.b_wins: "joint wins", Verdict.a_wins: "single wins",
                         Verdict.within: "neither (within the spread)", Verdict.incomplete: "incomplete"},
                        episodes_of=grpo_eps)
    return "\n".join(lines + run_table(runs))


def plot(runs: Runs, path: Path) -> None:
    """Per domain (a column): training reward and held-out pass@1 against the domain's GRPO episodes
    (the GRPO step where a run did not record its episodes); joint solid, single dashed, seeds by colour,
    trained families filled markers and unseen hollow; the oracle-only SFT run's trained-family pass@1
    (C2: it has no GRPO episodes) a dotted horizontal line. One legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n = max(len(runs.domains), 1)
    fig, axes = plt.subplots(2, n, figsize=(3.4 * n, 6.8), squeeze=False)
    for col, d in enumerate(runs.domains):
        ax_r, ax_h = axes[0][col], axes[1][col]
        for i in range(len(runs.seeds)):
            for run, style in ((runs.joint[i], "-"), (runs.single[d][i], "--")):
                if run.curves is None:
                    continue
                x_of = run.episodes_at(d)
                tr = run.curves.get("train", {}).get(d)
                if tr:
                    ax_r.plot([x_of(t) for t in tr["step"]], tr["reward"], style, color=f"C{i}", marker=".")
                for row, fill in ((d, None), (f"{d}/unseen", "none")):
                    c = run.curves.get("heldout", {}).get(row)
                    if c:
                        ax_h.plot([x_of(t) for t in c["step"]], c["pass@1"], style, color=f"C{i}", marker="o",
                                  markerfacecolor=fill)
            oracle = runs.oracle[i].final(d) if runs.oracle[i].curves is not None else None
            if oracle is not None:
                ax_h.axhline(oracle, linestyle=":", color=f"C{i}")
        ax_r.set(title=d, ylabel="training reward" if col == 0 else None)
        ax_h.set(xlabel="GRPO episodes of the domain", ylabel="held-out pass@1" if col == 0 else None, ylim=(-0.02, 1.02))
        for ax in (ax_r, ax_h):
            ax.grid(alpha=0.3)
    key = [Line2D([], [], color=f"C{i}", label=f"seed {s}") for i, s in enumerate(runs.seeds)]
    key += [Line2D([], [], color="k", linestyle="-", label="joint GRPO"),
            Line2D([], [], color="k", linestyle="--", label="single-domain GRPO"),
            Line2D([], [], color="k", linestyle=":", label="oracle-only SFT (trained families)"),
            Line2D([], [], color="k", marker="o", linestyle="", label="trained families"),
            Line2D([], [], color="k", marker="o", markerfacecolor="none", linestyle="", label="unseen families")]
    fig.legend(handles=key, loc="lower center", ncol=len(key), fontsize=8, frameon=False)
    fig.suptitle("five-domain recipe: joint vs single-domain GRPO vs oracle-only SFT", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Runs:
    ap = argparse.ArgumentParser(prog="python -m jointrl.rl.recipe_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs"), help="the folder the runs' output_dirs are in")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--domains", nargs="+", default=None, help="default: the joint runs' own")
    ap.add_argument("--joint", default=JOINT)
    ap.add_argument("--oracle", default=ORACLE)
    ap.add_argument("--single", default=SINGLE)
    ap.add_argument("--min-episodes", type=int, default=MIN_EPISODES,
                    help="amendment 2: C1 reads the k = 2 evals of a domain whose trained-family eval has fewer")
    ap.add_argument("--out", type=Path, default=None, help="default: <runs>/cpu_joint5_report")
    args = ap.parse_args(argv)
    runs = Runs.find(args.runs, args.seeds, args.domains, args.joint, args.oracle, args.single, args.min_episodes)
    out = args.out or args.runs / "cpu_joint5_report"
    out.mkdir(parents=True, exist_ok=True)
    text = report(runs)
    (out / "report.md").write_text(text + "\n")
    plot(runs, out / "curves.png")
    print(text, flush=True)
    print(f"recipe_report: {out / 'report.md'}, {out / 'curves.png'}", file=sys.stderr, flush=True)
    return runs


if __name__ == "__main__":
    main()
