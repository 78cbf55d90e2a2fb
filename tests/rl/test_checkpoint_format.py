"""The checkpoint directory's rules (rl/checkpoint_format.py) on real files: what ``latest`` may name,
which checkpoints pruning removes, and what a reader refuses."""

import json

import pytest
import torch

from jointrl.rl.checkpoint_format import TOPOLOGY, commit, prune, read_parts, resolve, topology, write_part


def _part(step: int, rank: int, values: list[float]) -> dict:
    t = torch.tensor(values)
    return {"params": {"w": {"fp32": t, "exp_avg": t * 0, "exp_avg_sq": t * 0, "flat": (2 * rank, len(values)),
                             "shape": (4,), "row_offset": None}},
            "frozen": {"b": torch.ones(1)} if rank == 0 else {}, "adam_step": float(step), "step": step}


def _write(d, step: int, keep: int, ranks: int = 2) -> None:
    for r in range(ranks):
        write_part(_part(step, r, [float(step), float(step) + 0.5]), d / f"step_{step}", r)
    commit(d, step, {"num_ranks": ranks, "ep_size": 1, "zero_stage": 2, "step": step}, keep)


def test_parts_join_and_pruning_keeps_the_newest_complete(tmp_path):
    for step in (1, 2):
        _write(tmp_path, step, keep=2)
    saved = read_parts(resolve(tmp_path))
    assert saved["step"] == 2 and torch.equal(saved["params"]["w"]["fp32"], torch.tensor([2.0, 2.5, 2.0, 2.5]))
    assert not list(tmp_path.rglob("*.tmp"))
    # a failed write of step 3 (rank 1's part never came), then step 4 commits
    write_part(_part(3, 0, [3.0, 3.5]), tmp_path / "step_3", 0)
    assert topology(tmp_path / "step_3") is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve(tmp_path / "step_3")
    _write(tmp_path, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_4"]  # step_1 old, step_3 partial
    # a write in progress newer than latest stays; keep=0 keeps every complete one
    write_part(_part(5, 0, [5.0, 5.5]), tmp_path / "step_5", 0)
    assert prune(tmp_path, 0) == [] and (tmp_path / "step_5").is_dir()
    assert [p.name for p in prune(tmp_path, 1)] == ["step_2"]


def test_a_killed_run_of_more_ranks_leaves_no_part_in_the_checkpoint(tmp_path):
    """A run of 2 ranks killed while writing step 1 left part_001; a 1-rank run then writes step 1:
    only the parts its topology names are read."""
    write_part(_part(1, 1, [9.0, 9.0]), tmp_path / "step_1", 1)
    write_part({**_part(1, 0, [1.0, 1.5, 1.0, 1.5]), "params": {"w": {
        "fp32": torch.tensor([1.0, 1.5, 1.0, 1.5]), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4),
        "flat": (0, 4), "shape": (4,), "row_offset": None}}}, tmp_path / "step_1", 0)
    commit(tmp_path, 1, {"num_ranks": 1, "ep_size": 1, "zero_stage": 1, "step": 1}, 2)
    assert json.loads((tmp_path / "step_1" / TOPOLOGY).read_text())["num_ranks"] == 1
    assert torch.equal(read_parts(resolve(tmp_path))["params"]["w"]["fp32"], torch.tensor([1.0, 1.5, 1.0, 1.5]))


def test_readers_name_what_they_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve(tmp_path)
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("step_1")
    with pytest.raises(ValueError, match="only DeepSpeed's own files"):
        resolve(tmp_path)


def test_a_weights_only_checkpoint_reads_back_as_the_same_policy(tmp_path):
    from jointrl.rl.build import build_model
    from jointrl.rl.checkpoint_format import read_policy, write_weights
    from jointrl.rl.config import load_config

    cfg = load_config(["model=tiny_hybrid", "seed=3"])
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # not the seed's initialisation
    step_dir = write_weights(model, tmp_path / "checkpoints")
    assert step_dir == tmp_path / "checkpoints" / "step_0" and topology(step_dir)["step"] == 0
    assert resolve(tmp_path / "checkpoints") == step_dir
    saved = read_parts(step_dir)
    assert all(e["exp_avg"] is None and e["exp_avg_sq"] is None for e in saved["params"].values())
    policy, step = read_policy(cfg, tmp_path / "checkpoints")
    assert step == 0
    got, want = policy.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
