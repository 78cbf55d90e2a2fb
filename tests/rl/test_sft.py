"""SFT on oracle transcripts (rl/sft.py, rl/losses/sft.py): the terminal domain's oracles played
through the agent loop and bwrap sandboxes, trained on by the DeepSpeed learner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jointrl.rl.config import load_config
from jointrl.rl.learner.group import _free_port
from jointrl.rl.losses import LossInputs, SFTLoss
from jointrl.rl.sft import demo_draws, oracle_transcripts, sft_batch

LONG_TURNS = ["rollout.max_tokens_per_turn=1024", "rollout.max_context=4096"]  # oracle turns are a few hundred bytes


def test_sft_loss_is_the_mean_nll_of_the_loss_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    inp = LossInputs(logp, torch.zeros(2, 3), torch.zeros(2, 3), mask, torch.tensor([[0, 0, 0], [1, 1, 1]]), 2, norm=3.0)
    loss, metrics = SFTLoss()(inp)
    assert loss.item() == pytest.approx((2 + 3 + 6) / 3) and metrics["nll"] == pytest.approx(11 / 3)
    loss.backward()
    assert torch.equal(logp.grad, -mask / 3)  # advantages and behaviour log-probs play no part


def test_sft_draws_every_demonstration_per_epoch_or_each_domain_by_its_weight():
    """No ``recipe.sft_domain_weights``: a seeded shuffle of all demonstrations, each once per epoch
    (a domain gets its share of them). With weights: rows by domain in those proportions, each
    domain cycling through its own demonstrations; a domain of weight 0 gets none."""
    from collections import Counter
    from itertools import islice
    from types import SimpleNamespace

    demos = [SimpleNamespace(domain="terminal", n=i) for i in range(6)] + \
            [SimpleNamespace(domain="code_repo", n=i) for i in range(2)]
    stream = demo_draws(demos, {}, seed=3)
    for _ in range(3):
        assert sorted(map(id, islice(stream, len(demos)))) == sorted(map(id, demos))
    rows = list(islice(demo_draws(demos, {"terminal": 1.0, "code_repo": 3.0}, seed=3), 4000))
    share = Counter(t.domain for t in rows)
    assert share["code_repo"] / len(rows) == pytest.approx(0.75, abs=0.03)  # 2 of 8 demonstrations, 3/4 of the rows
    per_demo = Counter(id(t) for t in rows if t.domain == "code_repo")
    assert max(per_demo.values()) - min(per_demo.values()) <= 1  # a domain's own epochs: evenly cycled
    assert {t.domain for t in islice(demo_draws(demos, {"terminal": 1.0, "code_repo": 0.0}, seed=3), 100)} == {"terminal"}
    with pytest.raises(ValueError, match=r"sft_domain_weights.*missing \['code_repo'\]"):
        demo_draws(demos, {"terminal": 1.0}, seed=3)
    with pytest.raises(ValueError, match=r"without demonstrations \['office'\]"):
        demo_draws(demos, {"terminal": 1.0, "code_repo": 1.0, "office": 1.0}, seed=3)
    with pytest.raises(ValueError, match="recipe.sft_domain_weights"):
        load_config(["+recipe.sft_domain_weights={terminal: -1.0}"])
    with pytest.raises(ValueError, match="recipe.sft_domain_weights"):
        load_config(["+recipe.sft_domain_weights={terminal: 0.0}"])


def test_mixed_demonstrations_keep_the_oracles_that_solve_and_the_slips_that_end(tmp_path):
    """``recipe.sft_demos={oracle: 0.5, wrong: 0.5}``: each task gets one seeded policy; the slips
    are kept although they fail (that is their point), and a bad policy name is refused."""
    from jointrl.envs.terminal.generate import build
    from jointrl.rewards.base import succeeded
    from jointrl.rl.sft import demo_policy

    build(tmp_path, seeds=2, split="train")
    cfg = load_config([f"envs.domains.terminal.task_dir={tmp_path}", "+recipe.sft_demos={oracle: 0.5, wrong: 0.5}",
                       *LONG_TURNS])
    demos, left_out = oracle_transcripts(cfg, limit=12)
    chosen = {t.task_id: demo_policy(cfg, t.task_id) for t in demos}
    assert left_out == 0 and len(demos) == 12 and set(chosen.values()) == {"oracle", "wrong"}
    assert all(succeeded(t.reward_info) == (chosen[t.task_id] == "oracle") for t in demos)
    assert chosen == {t: demo_policy(load_config([f"envs.domains.terminal.task_dir={tmp_path}",
                                                   "+recipe.sft_demos={oracle: 0.5, wrong: 0.5}"]), t) for t in chosen}
    with pytest.raises(ValueError, match=r"recipe.sft_demos.*'oracle', 'wrong'"):
        load_config(["+recipe.sft_demos={oracle: 0.5, noop: 0.5}"])


@pytest.mark.slow  # ~80 s here: DeepSpeed's engine, two sandboxed oracle episodes, 5 steps over ~4k tokens
def test_sft_on_oracle_transcripts_lowers_their_loss():
    from jointrl.rl.learner.worker import LearnerWorker

    cfg = load_config(["algo.name=sft", "learner.lr=3e-3", *LONG_TURNS])
    demos, unsolved = oracle_transcripts(cfg, limit=2)
    assert len(demos) == 2 and unsolved == 0
    tok = torch.tensor  # the loss sits on the assistant turns only: each trained span ends its turn
    for t in demos:
        spans = [i for i in range(1, len(t.loss_mask)) if t.loss_mask[i - 1] and not t.loss_mask[i]] + \
            ([len(t.loss_mask)] if t.loss_mask[-1] else [])
        assert len(spans) == t.num_turns and all(t.token_ids[i - 1] == 258 for i in spans), tok(t.token_ids)[spans]
    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    batch = sft_batch(demos)
    losses = [lw.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)["loss"] for _ in range(5)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.85 * losses[0], losses  # measured: 5.60 -> 4.48 in 5 steps


@pytest.mark.slow
def test_jointrl_sft_writes_a_checkpoint_that_eval_loads(tmp_path):
    """The driver end to end (Ray learner group, oracle transcripts of all 23 train terminal tasks,
    2 steps), then ``jointrl eval`` on its checkpoint."""
    import ray

    from jointrl.rl.eval import main as eval_main
    from jointrl.rl.sft import sft

    cfg = load_config([f"output_dir={tmp_path}", "algo.total_steps=2", "algo.prompts_per_step=2", "checkpoint_every=0",
                       "logger.wandb_mode=disabled", "recipe.sft_heldout_every=1", "recipe.sft_heldout_limit=3",
                       *LONG_TURNS])
    try:
        metrics = sft(cfg)
    finally:
        ray.shutdown()
    assert metrics["sft/tokens"] > 0 and (tmp_path / "checkpoints" / "latest").read_text().strip().endswith("2")
    # held-out oracles scored by the learner: an untrained byte model is far from them
    assert metrics["sft/heldout/terminal/nll"] > 1.0 and 0.0 <= metrics["sft/heldout/terminal/oracle_prob"] < 1e-6
    result = eval_main([f"checkpoint={tmp_path / 'checkpoints'}", "tier=low", "k=1", "limit=1", f"out={tmp_path / 'eval'}",
                        "logger.wandb_mode=disabled", "rollout.max_tokens_per_turn=32"])
    assert result["policy_version"] == 2 and result["rows"][0]["episodes"] == 1
    # jointrl train checkpoint=<sft run>/checkpoints: the learner starts from (and pushes) the SFT weights
    from jointrl.rl.build import build_model
    from jointrl.rl.checkpoint_format import read_policy
    from jointrl.rl.learner.worker import LearnerWorker

    grpo = load_config([f"checkpoint={tmp_path / 'checkpoints'}", "seed=1"])
    lw = LearnerWorker(grpo, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    saved = read_policy(grpo, tmp_path / "checkpoints")[0].state_dict()
    assert any(not torch.equal(v, saved[k]) for k, v in build_model(load_config(["seed=1"])).state_dict().items())
    assert all(torch.equal(v, saved[k]) for k, v in lw.engine.module.state_dict().items())


@pytest.mark.slow  # ~60 s here: two SFT driver runs (Ray learner group)
def test_sft_resumed_after_a_kill_ends_with_the_uninterrupted_runs_weights(tmp_path, monkeypatch):
    """A run stopped after step 1 of 3 (its later checkpoints gone) resumes from step 1 on the
    demonstrations it played before -- none played again -- and ends bit for bit where the
    uninterrupted run ended: the same rows drawn, the same optimizer state and cosine lr."""
    import shutil

    import ray

    import jointrl.rl.sft as sft_module
    from jointrl.rl.checkpoint_format import read_policy

    ckpts = tmp_path / "checkpoints"
    cfg = load_config([f"output_dir={tmp_path}", "algo.total_steps=3", "algo.prompts_per_step=2", "checkpoint_every=1",
                       "learner.lr_schedule=cosine", "learner.checkpoint_keep=0", "logger.wandb_mode=disabled",
                       *LONG_TURNS])
    try:
        whole = sft_module.sft(cfg)
    finally:
        ray.shutdown()
    reference = read_policy(cfg, ckpts / "step_3")[0].state_dict()
    for step in (2, 3):  # killed after step 1's checkpoint
        shutil.rmtree(ckpts / f"step_{step}")
    (ckpts / "latest").write_text("step_1")

    def no_replay(*args, **kwargs):
        raise AssertionError("a resumed run played its demonstrations again")

    monkeypatch.setattr(sft_module, "oracle_transcripts", no_replay)
    try:
        resumed = sft_module.sft(dataclasses.replace(cfg, resume=True))
    finally:
        ray.shutdown()
    assert (ckpts / "latest").read_text().strip() == "step_3" and resumed["sft/loss"] == whole["sft/loss"]
    again = read_policy(cfg, ckpts / "step_3")[0].state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in again.items())


def test_heldout_fit_scores_only_the_assistant_tokens():
    """``heldout_fit``'s arithmetic on known log-probs (the learner's convention: entry i is
    log p(token i | tokens before it), 0 at i = 0); a learner stand-in returns them."""
    import math
    from types import SimpleNamespace

    from jointrl.rl.sft import heldout_fit

    held = [SimpleNamespace(domain="terminal", token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 0]),
            SimpleNamespace(domain="terminal", token_ids=[5, 6, 7], loss_mask=[0, 0, 1]),
            SimpleNamespace(domain="code_repo", token_ids=[8, 9], loss_mask=[0, 1])]
    logps = {(1, 2, 3, 4): [0.0, -0.1, -2.0, -9.0], (5, 6, 7): [0.0, -5.0, -0.5], (8, 9): [0.0, -0.2]}
    learner = SimpleNamespace(logprobs=lambda ids: [logps[tuple(x)] for x in ids])
    fit = heldout_fit(learner, held)
    assert fit["sft/heldout/terminal/nll"] == pytest.approx((0.1 + 2.0 + 0.5) / 3)
    assert fit["sft/heldout/terminal/oracle_prob"] == pytest.approx((math.exp(-2.1) + math.exp(-0.5)) / 2)
    assert fit["sft/heldout/terminal/sure_tokens"] == pytest.approx(2 / 3)  # p > 1/2: -0.1 and -0.5
    assert fit["sft/heldout/code_repo/oracle_prob"] == pytest.approx(math.exp(-0.2))


@pytest.mark.parametrize("style,families", [("shell", ["count-above", "mean"]), ("sed", ["page", "mean", "share"])])
def test_code_repo_styled_demonstrations_solve_with_the_oracle_and_fail_with_the_slip(tmp_path, style, families):
    """``recipe.sft_demo_style={code_repo: shell}``: code_repo tasks are demonstrated by one ``bash``
    call that edits the file its glob finds (no package name to copy); ``{code_repo: sed}``: by the
    family's edit as one ``sed -i`` on ``*/<module>.py`` (under 130 bytes). Either way the oracle's
    solves its task in the real sandbox and the slip's does not; a style no domain has is refused,
    naming the allowed ones."""
    from jointrl.envs.code_repo.generate import build
    from jointrl.rewards.base import succeeded
    from jointrl.rl.sft import demo_policy

    build(tmp_path, seeds=3, split="train", families=families)
    cfg = load_config(["envs=code_repo", f"envs.domains.code_repo.task_dir={tmp_path}",
                       "+recipe.sft_demos={oracle: 0.5, wrong: 0.5}", f"+recipe.sft_demo_style={{code_repo: {style}}}",
                       *LONG_TURNS])
    demos, left_out = oracle_transcripts(cfg)
    roles = {t.task_id: demo_policy(cfg, t.task_id) for t in demos}
    assert left_out == 0 and len(demos) >= 4 and set(roles.values()) == {"oracle", "wrong"}
    for t in demos:
        calls = [c for m in t.messages if m.tool_calls for c in m.tool_calls]
        command = calls[0].arguments["command"]
        assert [c.name for c in calls] == ["bash", "submit"]
        if style == "shell":
            assert "glob.glob('*/" in command
        else:
            assert command.startswith("sed -i '") and len(command) < 130
        assert succeeded(t.reward_info) == (roles[t.task_id] == "oracle")
    with pytest.raises(ValueError, match=r"recipe.sft_demo_style.code_repo.*'shell', 'sed'"):
        load_config(["+recipe.sft_demo_style={code_repo: awk}"])
