"""rl/recipe_report.py: the pre-registered analysis rule and the report's tables. Its run on real
recipe outputs: tests/rl/test_recipe.py (one seed, in the default tier) and the slow test here
(the whole chain in miniature: joint, oracle-only and single-domain runs, two seeds)."""

from __future__ import annotations

import json

import pytest

from jointrl.rl.recipe_report import Runs, Verdict, plot, report, verdict


def test_verdict_is_outside_the_spread_only_when_every_seed_of_one_side_beats_every_seed_of_the_other():
    assert verdict([0.1, 0.2], [0.21, 0.3]) is Verdict.b_wins
    assert verdict([0.1, 0.2], [0.2, 0.3]) is Verdict.within  # a tie is no win
    assert verdict([0.3, 0.1], [0.2, 0.4]) is Verdict.within  # the spreads overlap
    assert verdict([0.5, 0.6], [0.1, 0.49]) is Verdict.a_wins
    assert verdict([0.1, 0.2], [0.3, None]) is Verdict.incomplete and verdict([], []) is Verdict.incomplete


def _curves(domains, heldout, train=None, stages=None, sft_from=None, grpo_steps=2):
    return {"domains": domains, "heldout": heldout, "train": train or {}, "stages": stages or {},
            "sft_steps": 4, "grpo_steps": grpo_steps, "sft_from": sft_from, "cpu_exact": True}


def test_report_tables_take_each_number_from_its_run_and_count_the_c1_bar(tmp_path):
    """Two seeds of the joint run, one oracle run and one single-domain run on disk: every number
    comes from the file it belongs to, a missing run is printed as missing."""
    def write(name, curves):
        (tmp_path / name).mkdir()
        (tmp_path / name / "curves.json").write_text(json.dumps(curves))

    h = lambda sft, grpo: {"step": [0, 2], "pass@1": [sft, grpo], "episodes": [10, 10]}  # noqa: E731
    tr = {"cad": {"step": [1, 2], "reward": [0.1, 0.2], "success": [0.0, 0.1], "episodes": [3, 5]}}
    write("cpu_joint5_s0", _curves(["cad"], {"cad": h(0.1, 0.5), "cad/unseen": h(0.0, 0.1)}, tr,
                                   {"sft": {"cpu_s": 3600.0, "wall_s": 7200.0}, "grpo": {"cpu_s": 1800.0, "wall_s": 1.0}}))
    write("cpu_joint5_s1", _curves(["cad"], {"cad": h(0.2, 0.4), "cad/unseen": h(0.05, 0.0)}, tr))
    write("cpu_joint5_oracle_s0", _curves(["cad"], {"cad": {"step": [0], "pass@1": [0.6], "episodes": [10]}},
                                          grpo_steps=0))  # SFT only: its final number is step 0's
    write("cpu_joint5_single_cad_s1", _curves(["cad"], {"cad": h(0.2, 0.3)}, sft_from="runs/cpu_joint5_s1"))
    runs = Runs.find(tmp_path, [0, 1], min_episodes=10)  # 10 episodes: no domain amended (amendment 2's test below)
    assert runs.amended() == [] and runs.domains == ["cad"] and runs.joint[0].grpo_episodes("cad") == 8 and runs.joint[0].episodes_at("cad")(1) == 3
    text = report(runs)
    rows = {c: [line for line in text.split("### " + c)[1].split("###")[0].splitlines() if line.startswith("| cad |")] for c in ("C1", "C2", "C3")}
    assert rows["C1"] == ["| cad | trained | 10/10 | 0.100 | 0.200 | 0.500 | 0.400 | GRPO gain outside the spread |",
                          "| cad | unseen | 10/10 | 0.000 | 0.050 | 0.100 | 0.000 | within the spread |"]
    assert rows["C2"][0] == "| cad | trained | 10/10 | 0.600 | missing | 0.500 | 0.400 | incomplete |"
    assert rows["C3"][0] == "| cad | trained | 10/10 | missing | 0.300 | 0.500 | 0.400 | - / 8, - / 8 | incomplete |"
    assert "C1 bar (#40: GRPO's gain outside the seed spread on >= 3 of 1 domains, trained families): 1 of 1 (cad)." in text
    assert f"| joint | 0 | {tmp_path / 'cpu_joint5_s0'} | 4 | 2 | sft 60.0, grpo 30.0 | 1.50 | 2.00 | True |" in text
    assert f"| oracle | 1 | {tmp_path / 'cpu_joint5_oracle_s1'} | missing" in text
    assert "4 (from runs/cpu_joint5_s1)" in text
    with pytest.raises(KeyError):  # a domain no run has is not invented: it has no single runs to read
        runs.single["terminal"]
    plot(runs, tmp_path / "curves.png")  # oracle seed 0's line drawn, seed 1's (missing) and the absent runs skipped
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_numbers_are_read_by_step_and_a_missing_step_makes_the_bar_incomplete(tmp_path):
    """SFT is step 0 and the final number the run's last GRPO step (``grpo_steps``), looked up by step: a run
    whose last evaluation is an earlier step (unfinished) or whose curve lacks step 0 reads as missing, and
    the C1 bar says incomplete although every run's curves.json is there."""
    def write(name, curves):
        (tmp_path / name).mkdir()
        (tmp_path / name / "curves.json").write_text(json.dumps(curves))

    row = lambda steps, p: {"step": steps, "pass@1": p, "episodes": [10] * len(steps)}  # noqa: E731
    write("cpu_joint5_s0", _curves(["cad"], {"cad": row([0, 1], [0.1, 0.9])}))  # step 2 never evaluated
    write("cpu_joint5_s1", _curves(["cad"], {"cad": row([1, 2], [0.8, 0.7])}))  # no SFT (step 0) row
    write("cpu_joint5_oracle_s0", _curves(["cad"], {"cad": row([0], [0.6])}, grpo_steps=0))
    write("cpu_joint5_oracle_s1", _curves(["cad"], {"cad": row([0], [0.5])}, grpo_steps=0))
    runs = Runs.find(tmp_path, [0, 1], domains=["cad"], min_episodes=10)
    j = runs.joint
    assert (j[0].sft("cad"), j[0].final("cad"), j[1].sft("cad"), j[1].final("cad")) == (0.1, None, None, 0.7)
    assert runs.oracle[1].final("cad") == 0.5 and j[0].pass1("cad", 1) == 0.9
    text = report(runs)
    c1 = [line for line in text.split("### C1")[1].split("###")[0].splitlines() if line.startswith("| cad | trained")]
    assert c1 == ["| cad | trained | 10/10 | 0.100 | missing | missing | 0.700 | incomplete |"]
    assert "on >= 3 of 1 domains, trained families): 0 of 1 (incomplete: a run, row or step missing)." in text


def test_amendment_2_reads_the_k2_evals_of_a_domain_under_100_trained_episodes(tmp_path):
    """A domain whose trained-family eval has fewer than 100 episodes: C1's bar and its own table read the
    k = 2 evals (``eval_k2/step_<S>/eval.json``, at step 0 and the last GRPO step); the pre-registered
    k = 1 table keeps its numbers; a missing k = 2 eval makes the verdict incomplete, nothing filled in."""
    h = lambda n, sft, grpo: {"step": [0, 2], "pass@1": [sft, grpo], "episodes": [n, n]}  # noqa: E731
    k2 = {0: {0: 0.20, 2: 0.30}, 1: {0: 0.25, 2: 0.35}}  # seed -> step -> code_repo pass@1 at k = 2
    for s in (0, 1):
        run = tmp_path / f"cpu_joint5_s{s}"
        run.mkdir()
        (run / "curves.json").write_text(json.dumps(_curves(["code_repo", "cad"], {
            "code_repo": h(94, 0.2, 0.2), "cad": h(128, 0.1 + s / 10, 0.5)})))
        for step, p in k2[s].items():
            if (s, step) == (1, 2):
                continue  # written below, after the incomplete report
            (run / "eval_k2" / f"step_{step}").mkdir(parents=True)
            (run / "eval_k2" / f"step_{step}" / "eval.json").write_text(json.dumps({"rows": [
                {"domain": "code_repo", "split": "heldout", "pass@1": p, "episodes": 188},
                {"domain": "code_repo", "split": "unseen", "pass@1": 0.9, "episodes": 120}]}))
    runs = Runs.find(tmp_path, [0, 1])
    assert runs.amended() == ["code_repo"] and runs.joint[0].k2("code_repo", 2) == (0.30, 188)
    text = report(runs)
    assert "trained families): 1 of 2 (cad); code_repo read at k = 2 (amendment 2) (incomplete" in text  # cad wins; code_repo lacks s1's step 2
    k2_section = text.split("### C1 at >= 100 episodes (amendment 2)")[1].split("###")[0]
    assert "| code_repo | 188/188 | 0.200 | 0.250 | 0.300 | missing | incomplete |" in k2_section and "| cad |" not in k2_section
    c1 = text.split("### C1: SFT vs GRPO")[1].split("###")[0]
    assert "| code_repo | trained | 94/94 | 0.200 | 0.200 | 0.200 | 0.200 | within the spread |" in c1  # k = 1, unchanged
    (tmp_path / "cpu_joint5_s1" / "eval_k2" / "step_2").mkdir()
    (tmp_path / "cpu_joint5_s1" / "eval_k2" / "step_2" / "eval.json").write_text(json.dumps({"rows": [
        {"domain": "code_repo", "split": "heldout", "pass@1": 0.35, "episodes": 188}]}))
    text = report(Runs.find(tmp_path, [0, 1]))
    assert "trained families): 2 of 2 (code_repo, cad); code_repo read at k = 2 (amendment 2)." in text
    assert "| code_repo | 188/188 | 0.200 | 0.250 | 0.300 | 0.350 | GRPO gain outside the spread |" in text


@pytest.mark.slow
def test_the_preregistered_comparisons_in_miniature_over_two_seeds(tmp_path):
    """The pre-registration's chain in miniature on terminal's hand-written tasks, one family held out:
    per seed the joint run, the oracle-only SFT at its SFT + GRPO CPU seconds, and the single-domain run
    from its SFT; then the report over those real outputs: every number is its run's, every verdict
    the rule's, the single run draws the joint run's GRPO episodes."""
    import shutil
    from pathlib import Path

    import ray

    from jointrl.envs.registry import load_tasks
    from jointrl.rl.config import load_config
    from jointrl.rl.recipe import recipe
    from jointrl.rl.recipe_report import main as report_main

    tasks = Path(__file__).resolve().parents[2] / "envs" / "terminal" / "tasks"
    task_dir = tmp_path / "tasks"
    for name in ("count-lines", "write-file", "word-freq", "csv-sum"):
        shutil.copytree(tasks / name, task_dir / name)
    base = [f"envs.domains.terminal.task_dir={task_dir}", "envs.domains.terminal.heldout_families=[write-file]",
            "envs.num_workers=1", "algo.total_steps=1", "algo.prompts_per_step=2", "algo.group_size=2",
            "algo.max_refill_attempts=0", "rollout.max_tokens_per_turn=256", "rollout.max_context=4096",
            "recipe.sft_steps=2", "recipe.sft_prompts_per_step=2", "recipe.eval_k=2", "recipe.eval_every=1",
            "logger.wandb_mode=disabled"]
    cfg0 = load_config(base)
    assert {t.id for t in load_tasks("terminal", str(task_dir), "heldout", heldout_families=["write-file"])} == {"word-freq"}

    def run(*overrides):
        try:
            return recipe(load_config(base + list(overrides)))
        finally:
            ray.shutdown()

    for s in (0, 1):
        joint = tmp_path / f"mini_s{s}"
        run(f"seed={s}", f"output_dir={joint}")
        run(f"seed={s}", f"output_dir={tmp_path / f'mini_oracle_s{s}'}", "recipe.sft_demos={oracle: 1.0}",
            "recipe.grpo=false", f"recipe.match_cpu_of={joint}")
        run(f"seed={s}", f"output_dir={tmp_path / f'mini_single_terminal_s{s}'}", f"recipe.sft_from={joint}",
            "recipe.grpo_domains=[terminal]")
    runs = report_main(["--runs", str(tmp_path), "--joint", "mini_s{seed}", "--oracle", "mini_oracle_s{seed}",
                        "--single", "mini_single_{domain}_s{seed}", "--out", str(tmp_path / "report")])
    assert runs.domains == ["terminal"] and all(r.curves is not None for r in runs.all()) and cfg0.seed == 0
    text = (tmp_path / "report" / "report.md").read_text()
    single = runs.single["terminal"]
    for i, s in enumerate(runs.seeds):
        j, o = runs.joint[i].curves, runs.oracle[i].curves
        assert o["sft_steps"] == round(2 * (j["stages"]["sft"]["cpu_s"] + j["stages"]["grpo"]["cpu_s"])
                                       / j["stages"]["sft"]["cpu_s"]) > 2 and o["grpo_steps"] == 0
        assert single[i].curves["grpo_steps"] == j["grpo_steps"] == 1  # all of the weight: all of the steps
        assert single[i].grpo_episodes("terminal") == runs.joint[i].grpo_episodes("terminal") > 0
        assert single[i].sft("terminal") == runs.joint[i].sft("terminal")  # the joint run's SFT eval
        assert j["heldout"]["terminal/unseen"]["episodes"] == [2, 2]  # write-file, k = 2
    for c, a_of, b_of in (("C1", lambda i, row: runs.joint[i].sft(row), lambda i, row: runs.joint[i].final(row)),
                          ("C2", lambda i, row: runs.oracle[i].final(row), lambda i, row: runs.joint[i].final(row)),
                          ("C3", lambda i, row: single[i].final(row), lambda i, row: runs.joint[i].final(row))):
        lines = [line for line in text.split("### " + c)[1].split("###")[0].splitlines() if line.startswith("| terminal |")]
        assert len(lines) == 2, c
        for line, row in zip(lines, ("terminal", "terminal/unseen")):
            a, b = [a_of(i, row) for i in (0, 1)], [b_of(i, row) for i in (0, 1)]
            cells = [x.strip() for x in line.strip("|").split("|")]
            assert cells[3:7] == [f"{x:.3f}" for x in a + b], (c, line)
            assert None not in a + b and verdict(a, b) is not Verdict.incomplete
    assert "Missing runs: none." in text and (tmp_path / "report" / "curves.png").stat().st_size > 10_000
