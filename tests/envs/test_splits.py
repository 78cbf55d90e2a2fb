"""Train / held-out splits (envs/splits.py): deterministic, a partition, and what training samples."""

from __future__ import annotations

import dataclasses

import pytest

from jointrl.envs.base import Task
from jointrl.envs.registry import DOMAINS, load_tasks
from jointrl.envs.splits import HELDOUT_FRACTION, families, family_of, select, task_split
from jointrl.rl.config import load_config
from jointrl.rl.joint_sampler import JointSampler


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_every_domain_splits_its_tasks_into_a_partition(domain):
    every = load_tasks(domain, split="all")
    train, heldout = load_tasks(domain, split="train"), load_tasks(domain, split="heldout")
    ids = lambda ts: {t.id for t in ts}  # noqa: E731
    assert train and heldout, (domain, len(train), len(heldout))
    assert ids(train) | ids(heldout) == ids(every) and not ids(train) & ids(heldout)
    assert ids(load_tasks(domain, split="heldout")) == ids(heldout)  # same on every load


def test_split_depends_only_on_the_task_id_not_on_its_neighbours():
    tasks = [Task(id=f"t{i}", domain="terminal", prompt="p") for i in range(400)]
    heldout = {t.id for t in select(tasks, "heldout")}
    assert heldout == {t.id for t in select(list(reversed(tasks[:200])), "heldout")} | \
        {t.id for t in select(tasks[200:], "heldout")}
    assert abs(len(heldout) / len(tasks) - HELDOUT_FRACTION) < 0.08  # the hash spreads ids evenly


def test_a_task_may_name_its_own_split_and_a_bad_one_is_rejected():
    t = Task(id="t0", domain="terminal", prompt="p")
    flipped = "train" if task_split(t) == "heldout" else "heldout"
    assert task_split(dataclasses.replace(t, metadata={"split": flipped})) == flipped
    with pytest.raises(ValueError, match="metadata\\['split'\\] must be 'train' or 'heldout'"):
        task_split(dataclasses.replace(t, metadata={"split": "test"}))
    with pytest.raises(ValueError, match="allowed values: \\['train', 'heldout', 'unseen', 'all'\\]"):
        select([t], "validation")


def test_config_defaults_to_train_and_names_a_bad_split():
    assert load_config([]).envs.domains["terminal"].split == "train"
    with pytest.raises(ValueError, match="envs.domains.terminal.split"):
        load_config(["envs.domains.terminal.split=test"])


def test_heldout_tasks_never_appear_in_a_training_batch():
    """The driver's sampler (``JointSampler.from_config``) over the default and the joint config."""
    for overrides in ([], ["envs=joint"]):
        cfg = load_config(overrides)
        heldout = {(d, t.id) for d in cfg.envs.domains for t in load_tasks(d, split="heldout")}
        sampler = JointSampler.from_config(cfg.envs.domains, cfg.seed)
        drawn = {(task.domain, task.id) for step in range(1, 60) for task, _ in sampler.sample(step, 16)}
        assert drawn and not drawn & heldout
        assert len(drawn) == sum(len(load_tasks(d, split="train")) for d in cfg.envs.domains)  # every train task is reachable


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_heldout_families_make_three_disjoint_splits(domain):
    """train and heldout lose the held-out families, unseen has all of them (both sides of the hash)."""
    every = load_tasks(domain, split="all")
    held = families(every)[:2]
    split = {s: load_tasks(domain, split=s, heldout_families=held) for s in ("train", "heldout", "unseen")}
    ids = lambda ts: {t.id for t in ts}  # noqa: E731
    assert ids(split["train"]) | ids(split["heldout"]) | ids(split["unseen"]) == ids(every)
    assert not ids(split["train"]) & ids(split["heldout"]) and not (ids(split["train"]) | ids(split["heldout"])) & ids(split["unseen"])
    assert {family_of(t) for t in split["unseen"]} == set(held)
    assert ids(split["unseen"]) == {t.id for t in every if family_of(t) in held}
    assert not {family_of(t) for t in split["train"] + split["heldout"]} & set(held)


def test_an_unknown_or_total_heldout_family_is_named():
    with pytest.raises(ValueError, match=r"heldout_families names \['no-such'\], not a family of domain 'office'"):
        load_tasks("office", split="train", heldout_families=["budget-lookup", "no-such"])
    with pytest.raises(ValueError, match="holds out every family of domain 'cad'"):
        load_tasks("cad", split="train", heldout_families=families(load_tasks("cad")))


def test_a_heldout_family_never_appears_in_a_training_batch_whatever_the_split():
    for split in ("train", "all"):
        cfg = load_config(["envs=office", f"envs.domains.office.split={split}",
                           "envs.domains.office.heldout_families=[fix-formula,deck-edit]"])
        sampler = JointSampler.from_config(cfg.envs.domains, cfg.seed)
        drawn = {task.id for step in range(1, 40) for task, _ in sampler.sample(step, 16)}
        assert drawn and not {t for t in drawn if t.startswith(("fix-formula", "deck-edit"))}, split
