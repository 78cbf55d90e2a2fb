"""``jointrl eval``: pass@1 / pass@k per domain and tier on held-out tasks, through the engine,
the agent loop and the terminal domain's bwrap sandboxes."""

from __future__ import annotations

import json
import pytest
import torch
from omegaconf import OmegaConf

from jointrl.envs.registry import DOMAINS, load_tasks, scripted_policy
from jointrl.rewards.base import succeeded
from jointrl.rl.config import load_config
from jointrl.rl.learner.group import _free_port
from jointrl.rl.eval import EvalSpec, evaluate, main, pass_at, row_name, scripted_limits
from jointrl.rl.rollout.scripted import ScriptedEngine


def test_pass_at_is_the_unbiased_estimator():
    assert pass_at(4, 1, 1) == 0.25 and pass_at(4, 1, 4) == 1.0 and pass_at(4, 0, 4) == 0.0
    assert pass_at(4, 1, 2) == pytest.approx(0.5) and pass_at(5, 2, 2) == pytest.approx(1 - 3 / 10)
    with pytest.raises(ValueError, match="1 <= j <= n"):
        pass_at(2, 1, 3)


def test_success_is_every_outcome_module_at_one_format_aside():
    assert succeeded({"tests_pass": 1.0, "format": 0.0, "tests_pass/failed": 0})
    assert succeeded({"cad_iou": 0.9999999999989, "cad_chamfer": 1.0})  # an exact part, up to rounding
    assert not succeeded({"cad_iou": 0.99, "cad_chamfer": 1.0}) and not succeeded({"format": 1.0})


def test_bad_arguments_name_the_allowed_values(tmp_path):
    with pytest.raises(SystemExit, match="tier='medium' is not allowed; allowed values: \\['low', 'high', 'max'\\]"):
        main(["checkpoint=null", "tier=low,medium", f"out={tmp_path}"])
    with pytest.raises(SystemExit, match="split='test' is not allowed"):
        main(["checkpoint=null", "split=test", f"out={tmp_path}"])
    with pytest.raises(SystemExit, match="unseen='no' is not allowed; allowed values: \\['true', 'false'\\]"):
        main(["checkpoint=null", "unseen=no", f"out={tmp_path}"])
    with pytest.raises(SystemExit, match="usage: jointrl eval"):
        main(["checkpoint=null", "heldout", f"out={tmp_path}"])
    # a Hydra deletion (one domain of a joint experiment) is an override, not a usage error
    with pytest.raises(SystemExit, match="tier='medium' is not allowed"):
        main(["checkpoint=null", "+experiment=cpu_joint", "~envs.domains.code_repo", "tier=medium", f"out={tmp_path}"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run as the driver leaves it: config.yaml and a checkpoint at step 3."""
    from jointrl.rl.learner.worker import LearnerWorker

    out = tmp_path_factory.mktemp("run")
    cfg = load_config([f"output_dir={out}", "seed=5"])
    OmegaConf.save(OmegaConf.structured(cfg), out / "config.yaml")
    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    with torch.no_grad():
        for p in lw.engine.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0), dtype=p.dtype))
    lw.save_checkpoint(str(out / "checkpoints"), 3)
    lw.wait_checkpoint()
    return out / "checkpoints"


def test_eval_of_the_fresh_model_reports_a_table_consistent_with_its_episodes(tmp_path):
    check_eval("null", tmp_path, policy_version=0)


@pytest.mark.slow  # DeepSpeed's engine for the checkpoint costs ~10-30 s
def test_eval_of_a_deepspeed_checkpoint(checkpoint, tmp_path):
    check_eval(str(checkpoint), tmp_path, policy_version=3)


def check_eval(checkpoint: str, tmp_path, policy_version: int) -> None:
    """Two held-out terminal tasks, k=2, tier low: the table's rows agree with the episodes it recorded."""
    import wandb

    result = main([f"checkpoint={checkpoint}", "envs=terminal", "tier=low", "k=2", "limit=2", f"out={tmp_path}",
                   "logger.wandb_mode=offline", "rollout.max_tokens_per_turn=32"])
    wandb.teardown()  # flushes the offline run
    assert result["policy_version"] == policy_version and result["split"] == "heldout"
    assert json.loads((tmp_path / "eval.json").read_text()) == result
    (row,) = result["rows"]
    assert set(row) == {"domain", "tier", "split", "tasks", "episodes", "pass@1", "pass@2", "reward", "env_error"}
    assert (row["domain"], row["tier"], row["split"], row["tasks"], row["episodes"], row["env_error"]) == \
        ("terminal", "low", "heldout", 2, 4, 0)
    heldout = {t.id for t in load_tasks("terminal", split="heldout")}
    episodes = result["episodes"]
    assert {e["task_id"] for e in episodes} <= heldout and sorted(e["sample"] for e in episodes) == [0, 0, 1, 1]
    by_task = {}
    for e in episodes:
        by_task.setdefault(e["task_id"], []).append(e["success"])
    assert row["pass@1"] == pytest.approx(sum(sum(s) / 2 for s in by_task.values()) / 2)
    assert row["pass@2"] == pytest.approx(sum(any(s) for s in by_task.values()) / 2)
    recorded = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in recorded] == [e["reward"] for e in episodes]
    assert row["reward"] == pytest.approx(sum(e["reward"] for e in episodes) / 4)
    assert all(r["token_ids"] and r["tier"] == "low" for r in recorded)  # the engine sampled every episode
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/eval_*.table.json")
    assert json.loads(table.read_text())["data"] == [list(row.values())]


def test_oracle_through_the_eval_path_solves_every_heldout_task(tmp_path):
    """Sample 0 of each task plays the task's oracle, sample 1 its no-op: pass@1 = 1/2 (the
    oracle's alone: 1), pass@2 = 1, through the same episodes, rewards and table."""
    cfg = load_config(["envs=terminal", "logger.wandb_mode=disabled", "rollout.max_tokens_per_turn=4096",
                       "rollout.max_context=16384"])
    engine_for = lambda task, sample: ScriptedEngine(scripted_policy(task, "oracle" if sample == 0 else "noop"))  # noqa: E731
    result = evaluate(cfg, EvalSpec(tiers=("low",), k=2, limit=3), tmp_path, engine_for)
    (row,) = result["rows"]
    assert (row["tasks"], row["pass@1"], row["pass@2"]) == (3, 0.5, 1.0)
    assert all(e["success"] == (e["sample"] == 0) for e in result["episodes"])


def test_heldout_families_are_reported_apart_from_heldout_seeds(tmp_path):
    """With held-out families, one eval plays the held-out seeds of the trained families and every task
    of the held-out ones, and reports them in separate rows (``split``: heldout / unseen)."""
    held = ["base64-decode", "word-freq"]
    cfg = load_config(["envs=terminal", "logger.wandb_mode=disabled", f"envs.domains.terminal.heldout_families=[{','.join(held)}]"])
    engine_for = lambda task, sample: ScriptedEngine(scripted_policy(task, "oracle" if task.id == held[0] else "noop"))  # noqa: E731
    result = evaluate(scripted_limits(cfg), EvalSpec(tiers=("low",), k=1, limit=2), tmp_path, engine_for)
    seeds, unseen = result["rows"]
    assert (seeds["split"], seeds["tasks"], seeds["pass@1"]) == ("heldout", 2, 0.0)
    assert (unseen["split"], unseen["tasks"], unseen["pass@1"]) == ("unseen", 2, 0.5)
    assert {e["task_id"] for e in result["episodes"] if e["split"] == "unseen"} == set(held)
    assert not {e["task_id"] for e in result["episodes"] if e["split"] == "heldout"} & set(held)
    assert row_name(unseen) == "terminal/unseen" and row_name(seeds) == "terminal"
    # unseen=false: the held-out seeds alone, the same episodes (sampling seeds depend on the task, not the set)
    alone = evaluate(scripted_limits(cfg), EvalSpec(tiers=("low",), k=1, limit=2, unseen=False), tmp_path / "alone", engine_for)
    assert alone["rows"] == [seeds] and {e["split"] for e in alone["episodes"]} == {"heldout"}


def test_jointrl_eval_policy_oracle_with_the_defaults_scores_one(tmp_path):
    """As the README says it: no token limits to raise (a scripted policy lifts them), the default
    ``envs`` (terminal), its held-out split; the first 4 tasks here (all of every domain: slow tier)."""
    result = main(["policy=oracle", "tier=low", "k=1", "limit=4", f"out={tmp_path}", "logger.wandb_mode=disabled"])
    (row,) = result["rows"]
    assert (row["domain"], row["tasks"], row["pass@1"], row["env_error"]) == ("terminal", 4, 1.0, 0), result["episodes"]


@pytest.mark.slow
@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_every_heldout_task_is_solved_by_its_oracle(domain, tmp_path):
    """``jointrl eval policy=oracle``: pass@1 = 1 on every domain's whole held-out split."""
    result = main([f"envs={domain}", "policy=oracle", "tier=low", "k=1", f"out={tmp_path}", "logger.wandb_mode=disabled"])
    (row,) = result["rows"]
    assert row["tasks"] == len(load_tasks(domain, split="heldout")) and row["env_error"] == 0
    assert row["pass@1"] == 1.0, [e for e in result["episodes"] if not e["success"]]
