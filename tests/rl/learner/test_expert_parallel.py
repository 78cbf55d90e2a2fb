"""Expert parallelism: 2 DeepSpeed ranks (gloo, 2 processes) with ep_size=2 take the same update
as 1 rank on the same data and seed, including a step where rank 1's experts get no tokens."""

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from jointrl.rl.build import build_model
from jointrl.rl.config import load_config
from jointrl.rl.learner.batch import TrainBatch
from jointrl.rl.learner.expert_parallel import ShardedExperts
from jointrl.rl.types import ROUTE_DTYPE

OVERRIDES = ["model.dtype=float64", "learner.micro_batch_size=1", "learner.eps=1.0", "learner.grad_clip=0.0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches() -> list[TrainBatch]:
    """Ragged lengths, 5 sequences (rank shards of 3 and 2: unequal micro-batch counts). Step 2
    replays routes that use experts 0 and 1 only: rank 1 (experts 2, 3) receives zero tokens."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 5, 12, 7, 3)]
    masks = [[0] * 2 + [1] * (len(s) - 2) for s in seqs]
    old = [[0.0 if m == 0 else -5.5 + 0.1 * i for i, m in enumerate(mk)] for mk in masks]
    step1 = TrainBatch(seqs, masks, old, [1.0, -0.5, 0.25, -1.0, 0.5])
    routes = [torch.tensor([[[t % 2, 1 - t % 2]] * 2 for t in range(len(s))], dtype=ROUTE_DTYPE) for s in seqs]
    step2 = TrainBatch(seqs, masks, old, [-1.0, 0.5, 1.0, -0.25, 0.75], routed_experts=routes)
    return [step1, step2]


def _full_state(worker) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in worker.engine.module.state_dict().items()}
    offsets = {f"{n}.{p}": m.first_expert for n, m in worker.engine.module.named_modules()
               if isinstance(m, ShardedExperts) for p in ("gate_up_proj", "down_proj")}
    return {k: (v, offsets.get(k)) for k, v in state.items()}


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    from jointrl.rl.learner.worker import LearnerWorker

    torch.set_num_threads(1)
    cfg = load_config([*OVERRIDES, f"learner.num_ranks={world}", f"learner.ep_size={world}"])
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    states, metrics = [], []
    for batch in _batches():
        metrics.append(worker.train_step(batch.shard(rank, world), batch.num_loss_tokens, batch.num_loss_seqs))
        states.append(_full_state(worker))
    torch.save({"states": states, "metrics": metrics}, f"{out_dir}/rank{rank}.pt")


def _assemble(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Whole tensors from the ranks' states (expert slices placed at their offsets)."""
    out = {}
    for part in parts:
        for k, (v, offset) in part.items():
            if offset is None:
                out[k] = v
            else:
                out.setdefault(k, {})[offset] = v
    return {k: (torch.cat([v[o] for o in sorted(v)]) if isinstance(v, dict) else v) for k, v in out.items()}


@pytest.fixture(autouse=True)
def _children_can_import_this_module(monkeypatch):
    """Spawned ranks unpickle their target by module name (tests.rl.learner....) with the
    parent's sys.path, which needs the repo root; `pytest` (unlike `python -m pytest`) does
    not put it there."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))


def test_two_ep_ranks_equal_one_rank(tmp_path, monkeypatch):
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    from jointrl.rl.learner.worker import LearnerWorker

    cfg = load_config(OVERRIDES)
    init = build_model(cfg).state_dict()
    # with ZeRO's fp32 master weights like the two ranks (one rank runs without ZeRO: float64 updates),
    # so the second step starts from the same weights and its loss agrees to 1e-9
    monkeypatch.setattr("jointrl.rl.learner.setup.zero_stage", lambda cfg, world_size: 1)
    single = LearnerWorker(cfg, 0, 1, "127.0.0.1", _port())
    for step, batch in enumerate(_batches()):
        m1 = single.train_step(batch, batch.num_loss_tokens, batch.num_loss_seqs)
        ep = _assemble([r["states"][step] for r in ranks])
        ref = single.engine.module.state_dict()
        assert set(ep) == set(ref)
        for k in ref:  # the update (delta from init) agrees to fp32 master-weight rounding
            torch.testing.assert_close(ep[k] - init[k], ref[k] - init[k], rtol=1e-4, atol=2.5e-7, msg=f"step {step + 1}: {k}")
        assert sum(r["metrics"][step]["loss"] for r in ranks) == pytest.approx(m1["loss"], rel=1e-9, abs=1e-12)
    # step 2 really starved rank 1's experts: the global load shows experts 2 and 3 idle in every layer
    assert ranks[0]["metrics"][1]["experts/dead_total"] == 4 == ranks[1]["metrics"][1]["experts/dead_total"]
    assert ranks[0]["metrics"][0]["experts/dead_total"] == 0


def _ckpt_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    from jointrl.rl.learner.worker import LearnerWorker

    torch.set_num_threads(1)
    cfg = load_config([*OVERRIDES, f"learner.num_ranks={world}", f"learner.ep_size={world}"])
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    batch = _batches()[0]
    step = lambda: worker.train_step(batch.shard(rank, world), batch.num_loss_tokens, batch.num_loss_seqs)  # noqa: E731
    step()
    worker.save_checkpoint(f"{out_dir}/ckpt", 1)
    step()
    after_two = {k: v.clone() for k, v in worker.engine.module.state_dict().items()}
    resumed_at = worker.load_checkpoint(f"{out_dir}/ckpt")
    step()  # replays step 2 from the checkpoint: weights, fp32 master copy and Adam moments restored
    replay = worker.engine.module.state_dict()
    torch.save({"step": resumed_at, "equal": all(torch.equal(after_two[k], replay[k]) for k in replay)},
               f"{out_dir}/ckpt_rank{rank}.pt")


@pytest.mark.slow
def test_ep_checkpoint_resumes_bit_for_bit(tmp_path):
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=_ckpt_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for r in range(2):
        res = torch.load(tmp_path / f"ckpt_rank{r}.pt")
        assert res == {"step": 1, "equal": True}
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_1"
