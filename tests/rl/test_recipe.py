"""``jointrl recipe`` (rl/recipe.py) in miniature: SFT on three terminal tasks' oracle transcripts
(two train, one held out), eval, a GRPO step, an eval of it, curves, wandb -- the real
sandboxes, Ray learner group, rollout engine and checkpoints of the full recipe."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from jointrl.envs.registry import load_tasks
from jointrl.rl.config import load_config
from jointrl.rl.checkpoint_format import read_policy
from jointrl.rl.learner.batch import logprobs_from_logits
from jointrl.rl.recipe import eval_steps, heldout_curves, summary

TASKS = Path(__file__).resolve().parents[2] / "envs" / "terminal" / "tasks"
TRAIN, HELDOUT, FRESH = ("count-lines", "write-file"), ("word-freq",), ("csv-sum",)


def test_eval_steps_start_at_the_sft_checkpoint_and_end_at_the_last_step():
    assert eval_steps(10, 4) == [0, 4, 8, 10] and eval_steps(3, 0) == [0, 3] and eval_steps(4, 2) == [0, 2, 4]


def test_summary_gain_is_the_last_heldout_point_minus_the_sft_point():
    rows = lambda p: {"rows": [{"domain": "cad", "tier": "low", "pass@1": p, "episodes": 100}]}  # noqa: E731
    curves = heldout_curves({0: rows(0.25), 5: rows(0.5), 10: rows(0.4)})
    assert curves == {"cad": {"step": [0, 5, 10], "pass@1": [0.25, 0.5, 0.4], "episodes": [100, 100, 100]}}
    (row,) = summary(curves, rows(0.0))
    assert (row["init"], row["sft"], row["grpo"]) == (0.0, 0.25, 0.4) and row["gain_points"] == pytest.approx(15.0)


def test_the_experiment_config_composes():
    cfg = load_config(["+experiment=cpu_joint"])
    assert cfg.model.name == "tiny_hybrid" and cfg.run_name == "cpu_joint" and len(cfg.envs.domains) >= 2
    assert cfg.recipe.eval_every and cfg.algo.total_steps % cfg.recipe.eval_every == 0
    with pytest.raises(ValueError, match="recipe.eval_tiers"):
        load_config(["+experiment=cpu_joint", "recipe.eval_tiers=[medium]"])


def test_the_five_domain_recipe_composes_with_its_preregistered_families():
    """conf/experiment/cpu_joint5.yaml: every domain, equal weights, each held-out family one its generator
    makes (and not an easy one), the comparisons' overrides compose, per-seed output folders."""
    from jointrl.envs.browser.tasks import KINDS
    from jointrl.envs.cad.families import EASY_FAMILIES as CAD_EASY
    from jointrl.envs.cad.families import FAMILIES as CAD
    from jointrl.envs.code_repo.generate import FAMILIES as CODE_REPO
    from jointrl.envs.office.generate import EASY_FAMILIES as OFFICE_EASY
    from jointrl.envs.office.generate import FAMILIES as OFFICE
    from jointrl.envs.terminal.generate import FAMILIES as TERMINAL
    from jointrl.rl.recipe import grpo_steps

    cfg = load_config(["+experiment=cpu_joint5", "seed=1"])
    made = {"terminal": set(TERMINAL), "code_repo": set(CODE_REPO), "office": set(OFFICE), "browser": set(KINDS),
            "cad": {f.__name__.replace("_", "-") for f in CAD}}
    assert set(cfg.envs.domains) == set(made) and {d.weight for d in cfg.envs.domains.values()} == {0.2}
    for name, d in cfg.envs.domains.items():
        assert d.heldout_families and set(d.heldout_families) <= made[name], name
    assert not {f.__name__ for f in CAD_EASY} & set(cfg.envs.domains["cad"].heldout_families)
    assert not set(OFFICE_EASY) & set(cfg.envs.domains["office"].heldout_families)
    assert cfg.output_dir == "runs/cpu_joint5_s1" and cfg.recipe.sft_demos == {"oracle": 0.5, "wrong": 0.5}
    oracle = load_config(["+experiment=cpu_joint5", "~recipe.sft_demos.wrong", "recipe.grpo=false",
                          "recipe.match_cpu_of=runs/cpu_joint5_s0"])
    assert oracle.recipe.sft_demos == {"oracle": 0.5} and not oracle.recipe.grpo
    single = load_config(["+experiment=cpu_joint5", "recipe.grpo_domains=[cad]", "recipe.sft_from=runs/cpu_joint5_s0",
                          "output_dir=runs/cpu_joint5_single_${recipe.grpo_domains.0}_s0"])
    assert single.output_dir == "runs/cpu_joint5_single_cad_s0"
    assert grpo_steps(single) == 9 and grpo_steps(cfg) == 45  # 45 x 0.2: the joint run's CAD share


def test_grpo_task_dirs_must_name_configured_domains():
    from jointrl.rl.recipe import grpo_envs

    cfg = load_config(["envs=cpu_joint", "+recipe.grpo_task_dirs={terminal: /fresh}"])
    envs = grpo_envs(cfg)
    assert envs.domains["terminal"].task_dir == "/fresh" and cfg.envs.domains["terminal"].task_dir != "/fresh"
    assert envs.domains["code_repo"].task_dir == cfg.envs.domains["code_repo"].task_dir
    with pytest.raises(ValueError, match=r"recipe.grpo_task_dirs names \['cad'\]"):
        grpo_envs(load_config(["envs=cpu_joint", "+recipe.grpo_task_dirs={cad: /fresh}"]))
    with pytest.raises(ValueError, match="recipe.grpo_task_dirs"):
        load_config(["+recipe.grpo_task_dirs={nosuch: /fresh}"])


def test_comparison_runs_size_and_share_their_stages(tmp_path):
    """Joint vs single: a single-domain run trains its domain alone for its weight share of the steps
    and evaluates it alone; the oracle-only baseline's SFT buys another run's SFT + GRPO CPU seconds."""
    from jointrl.rl.recipe import eval_envs, grpo_envs, grpo_steps, matched_sft_steps

    cfg = load_config(["+experiment=cpu_joint", "algo.total_steps=40", "recipe.grpo_domains=[terminal]"])
    assert grpo_steps(cfg) == 30 and grpo_steps(load_config(["+experiment=cpu_joint", "algo.total_steps=40"])) == 40
    assert list(grpo_envs(cfg).domains) == ["terminal"] == list(eval_envs(cfg).domains)
    with pytest.raises(ValueError, match="recipe.grpo_domains"):
        load_config(["+experiment=cpu_joint", "recipe.grpo_domains=[nosuch]"])
    with pytest.raises(ValueError, match=r"recipe.grpo_domains names \['cad'\], not among envs.domains"):
        grpo_envs(load_config(["+experiment=cpu_joint", "recipe.grpo_domains=[cad]"]))
    ref = tmp_path / "ref"
    ref.mkdir()
    matched = load_config(["+experiment=cpu_joint", f"recipe.match_cpu_of={ref}"])
    with pytest.raises(ValueError, match="no curves.json there"):
        matched_sft_steps(matched)
    (ref / "curves.json").write_text(json.dumps({"sft_steps": 1200, "stages": {"sft": {"cpu_s": 2000.0},
                                                                               "grpo": {"cpu_s": 1000.0}}}))
    assert matched_sft_steps(matched) == 1800 and matched_sft_steps(load_config(["+experiment=cpu_joint"])) == 1200


def test_stage_ledger_sums_a_killed_invocation_and_its_resume(tmp_path):
    """A stage's seconds are summed over the invocations that ran it; while it runs, its running total
    is on disk, so a run killed mid-stage still counts what it spent once resumed."""
    import time

    from jointrl.rl.recipe import StageLedger, grpo_checkpoint_every

    path = tmp_path / "stages.json"
    seen = []

    def busy(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        seen.append(json.loads(path.read_text())["grpo"])  # written by the ticker while the stage ran
        return "ok"

    first = StageLedger(path, tick_s=0.05).run("grpo", busy, 0.3)
    assert first["result"] == "ok" and first["cpu_s"] >= 0.3 and seen[0]["done"] is False and seen[0]["cpu_s"] > 0.1
    killed = json.loads(path.read_text())
    assert killed["grpo"]["done"] is True and killed["grpo"]["runs"] == 1
    killed["grpo"]["done"] = False  # as the ticker leaves it when the process is killed
    path.write_text(json.dumps(killed))
    ledger = StageLedger(path, tick_s=0.05)
    second = ledger.run("grpo", busy, 0.2)
    with pytest.raises(RuntimeError):
        ledger.run("eval_sft", lambda: (_ for _ in ()).throw(RuntimeError("env")))
    saved = json.loads(path.read_text())
    assert saved == ledger.entries and saved["grpo"]["runs"] == 2 and saved["grpo"]["done"] is True
    assert saved["grpo"]["cpu_s"] == pytest.approx(killed["grpo"]["cpu_s"] + second["cpu_s"])
    assert saved["eval_sft"]["done"] is False and saved["eval_sft"]["runs"] == 1  # a failed stage counts, undone
    # GRPO checkpoints: every eval step's, and with recipe.checkpoint_every at least that often
    assert [grpo_checkpoint_every(e, c) for e, c in ((45, 0), (45, 5), (15, 10), (45, 45))] == [45, 5, 5, 45]


def test_grpo_temperature_changes_only_the_grpo_stage():
    from jointrl.rl.recipe import grpo_rollout

    cfg = load_config(["+experiment=cpu_joint", "+recipe.grpo_temperature=0.8"])
    assert grpo_rollout(cfg).temperature == 0.8 and cfg.rollout.temperature == 0.5
    assert grpo_rollout(load_config(["+experiment=cpu_joint"])).temperature == 0.5
    with pytest.raises(ValueError, match="recipe.grpo_temperature"):
        load_config(["+recipe.grpo_temperature=0"])


def test_recipe_in_miniature_end_to_end(tmp_path):
    import ray
    import wandb

    from jointrl.rl.recipe import recipe

    task_dir = tmp_path / "tasks"
    for name in TRAIN + HELDOUT:
        shutil.copytree(TASKS / name, task_dir / name)
    assert {t.id for t in load_tasks("terminal", str(task_dir), "heldout")} == set(HELDOUT)
    fresh_dir = tmp_path / "fresh"  # the GRPO stage's own tasks (recipe.grpo_task_dirs)
    for name in FRESH:
        shutil.copytree(TASKS / name, fresh_dir / name)
    assert {t.id for t in load_tasks("terminal", str(fresh_dir), "train")} == set(FRESH)
    out = tmp_path / "mini_s0"  # the report's names (cpu_joint5.yaml's with another prefix)
    cfg = load_config([f"output_dir={out}", "run_name=mini", f"envs.domains.terminal.task_dir={task_dir}",
                       "envs.num_workers=1", "algo.total_steps=1", "algo.prompts_per_step=2", "algo.group_size=2",
                       "algo.max_refill_attempts=0", "rollout.max_tokens_per_turn=256", "rollout.max_context=4096",
                       "recipe.sft_steps=2", "recipe.sft_prompts_per_step=2", "recipe.eval_k=2", "recipe.eval_every=1",
                       "recipe.copy_warmup=[[2,32],[1,64]]",
                       f"+recipe.grpo_task_dirs={{terminal: {fresh_dir}}}", "+recipe.grpo_temperature=0.7",
                       "logger.wandb_mode=offline",
                       "logger.table_rows=0"])
    try:
        result = recipe(cfg)
    finally:
        ray.shutdown()
        wandb.teardown()
    assert json.loads((out / "curves.json").read_text()) == result
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the held-out curve: the SFT checkpoint (step 0, its weights after 2 SFT steps), then the GRPO step's
    assert result["heldout"] == {"terminal": {"step": [0, 1], "pass@1": result["heldout"]["terminal"]["pass@1"],
                                              "episodes": [2, 2]}}
    versions = [json.loads((out / "eval" / f"step_{s}" / "eval.json").read_text())["policy_version"] for s in (0, 1)]
    assert versions == [2, 1]  # the SFT run's step 2, then GRPO's step 1
    episodes = json.loads((out / "eval" / "step_0" / "eval.json").read_text())["episodes"]
    assert {e["task_id"] for e in episodes} == set(HELDOUT)
    # the training curve comes from the GRPO step's trajectories: 2 prompts x 2 samples
    train = result["train"]["terminal"]
    trajs = [json.loads(line) for line in (out / "grpo" / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 and {t["task_id"] for t in trajs} == set(FRESH)  # GRPO trains on its own tasks
    assert train["step"] == [1] and train["reward"] == [pytest.approx(sum(t["reward"] for t in trajs) / 4)]
    assert train["episodes"] == [sum(t["finish_reason"] != "env_error" for t in trajs)]
    # GRPO sampled at recipe.grpo_temperature: the engine's log-probs are the SFT policy's at T = 0.7, not
    # at rollout.temperature (1.0, which the evals keep)
    assert OmegaConf.load(out / "grpo" / "config.yaml").rollout.temperature == 0.7 and cfg.rollout.temperature == 1.0
    policy, _ = read_policy(cfg, out / "sft" / "checkpoints")
    t = trajs[0]
    with torch.no_grad():
        logits = policy(torch.tensor([t["token_ids"]])).logits.double()
    mask = torch.tensor(t["loss_mask"][1:], dtype=torch.bool)
    engine_lp = torch.tensor(t["logprobs"][1:], dtype=torch.float64)[mask]
    gap = {temp: (logprobs_from_logits(logits, torch.tensor([t["token_ids"]]), temp)[0, 1:][mask] - engine_lp).abs().mean()
           for temp in (0.7, 1.0)}
    assert gap[0.7] < 0.02 and gap[1.0] > 10 * gap[0.7], gap  # 0.001 (MXFP4 experts) vs 0.08 measured
    assert set(result["stages"]) == {"warmup", "sft", "eval_sft", "grpo", "eval_step_1"}
    # the copy warm-up's weights are where the SFT started (its config's checkpoint), 3 steps of copying
    warm = out / "warmup" / "checkpoints"
    assert OmegaConf.load(out / "sft" / "config.yaml").checkpoint == str(warm)
    assert read_policy(cfg, warm)[1] == 0 and json.loads((out / "warmup" / "warmup.json").read_text())["steps"][-1] == 3
    assert all(s["cpu_s"] > 0 for s in result["stages"].values())
    (row,) = result["summary"]
    assert row["sft"] == result["heldout"]["terminal"]["pass@1"][0] and row["episodes"] == 2
    # wandb: the recipe's own offline run holds the curves' PNG
    assert list(out.glob("wandb/offline-run-*/files/media/images/recipe/curves_*.png"))
    # a rerun reuses every finished stage: no SFT or GRPO step again, the same evals
    try:
        again = recipe(cfg)
    finally:
        ray.shutdown()
        wandb.teardown()
    assert again["heldout"] == result["heldout"]
    assert {k: v["runs"] for k, v in again["stages"].items()} == {"warmup": 1, "sft": 1, "eval_sft": 2, "grpo": 1,
                                                                   "eval_step_1": 2}
    assert again["stages"]["sft"] == result["stages"]["sft"] and again["stages"]["grpo"] == result["stages"]["grpo"]
    # a run on this one's SFT (recipe.sft_from) without GRPO: nothing trained, its step-0 eval reused
    other = tmp_path / "mini_oracle_s0"
    try:
        sft_only = recipe(dataclasses.replace(cfg, output_dir=str(other), recipe=dataclasses.replace(
            cfg.recipe, sft_from=str(out), grpo=False, sft_steps=cfg.recipe.sft_steps + 5)))
    finally:
        ray.shutdown()
        wandb.teardown()
    assert set(sft_only["stages"]) == {"eval_sft"} and sft_only["grpo_steps"] == 0 and sft_only["sft_from"] == str(out)
    assert sft_only["sft_steps"] == result["sft_steps"]  # the reused checkpoint's steps, not its own config's
    assert sft_only["heldout"]["terminal"]["pass@1"] == result["heldout"]["terminal"]["pass@1"][:1]
    # the report of the comparisons reads these runs' outputs: this seed's numbers, seed 1 and the
    # single-domain runs reported missing, not filled in
    from jointrl.rl.recipe_report import Verdict, main as report_main

    runs = report_main(["--runs", str(tmp_path), "--seeds", "0", "1", "--joint", "mini_s{seed}", "--oracle",
                        "mini_oracle_s{seed}", "--single", "mini_single_{domain}_s{seed}", "--out", str(tmp_path / "report")])
    assert runs.domains == ["terminal"] and runs.joint[0].grpo_episodes("terminal") == train["episodes"][0]
    assert runs.joint[1].curves is None and runs.single["terminal"][0].curves is None
    text = (tmp_path / "report" / "report.md").read_text()
    sft_p, grpo_p = result["heldout"]["terminal"]["pass@1"]
    c1, c2, c3 = (next(line for line in text.split("### " + c)[1].split("###")[0].splitlines() if line.startswith("| terminal | trained |"))
                  for c in ("C1", "C2", "C3"))
    assert c1 == f"| terminal | trained | 2/- | {sft_p:.3f} | missing | {grpo_p:.3f} | missing | {Verdict.incomplete} |"
    assert c2.startswith(f"| terminal | trained | 2/- | {sft_only['heldout']['terminal']['pass@1'][0]:.3f} | missing | "
                         f"{grpo_p:.3f} | missing |")
    assert c3 == (f"| terminal | trained | 2/- | missing | missing | {grpo_p:.3f} | missing | "
                  f"- / {train['episodes'][0]}, - / - | incomplete |")
    assert f"| joint | 0 | {out} | 2 | 1 |" in text and f"| single terminal | 1 | {tmp_path / 'mini_single_terminal_s1'} | missing" in text
    assert (tmp_path / "report" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_copy_warmup_phases_are_checked_before_anything_runs():
    assert load_config([]).recipe.copy_warmup == []
    assert load_config(["recipe.copy_warmup=[[1500,32],[600,128]]"]).recipe.copy_warmup == [[1500, 32], [600, 128]]
    for bad, why in (("[[10]]", r"\[\[steps, context\], ...\]"), ("[[10,0]]", r"\[\[steps, context\], ...\]"),
                     ("[[10,16]]", "too short")):
        with pytest.raises(ValueError, match=why):
            load_config([f"recipe.copy_warmup={bad}"])
