"""The one checkpoint format: files, commit, retention, and the policy read back out of it.

A run's checkpoints live in ``<output_dir>/checkpoints``::

    latest              "step_N": the newest complete checkpoint (what resume reads)
    step_N/part_000.pt  rank 0's shard ... step_N/part_{R-1}.pt: rank R-1's
    step_N/topology.json  {"num_ranks", "ep_size", "zero_stage", "step"}: written last

Each learner rank writes its own ``part_{rank}.pt`` (``rl/learner/portable_checkpoint.py`` takes
it from the optimizer): per trainable parameter (by name) its fragment of the fp32 master and of
Adam's two moments (``flat``: start and length within the parameter as the rank holds it; ``shape``;
``row_offset``: the first expert row, with expert parallelism), so the parts together hold each
element once; without ZeRO (one rank) whole tensors, without ``flat``. Each part also holds Adam's
step count and the run's step; rank 0's the non-trainable tensors (buffers: the router's bias).
Nothing else is needed to resume: the model's weights are the masters cast to the model's dtype,
the learning rate follows from the step (``learner.lr_schedule``), the driver's sampling from the
seed and the step, and no loss scaling runs (fp32 / bf16).

Commit: a part is written to ``part_R.pt.tmp``, flushed to disk and renamed; once every rank's
part is in place, rank 0 writes ``topology.json``, then ``latest`` (each by rename), then removes
checkpoints beyond ``learner.checkpoint_keep``. A run killed mid-write leaves ``latest`` at the
previous complete checkpoint, and a ``step_N`` without ``topology.json`` is never read.

Readers: resume (``rl/learner/checkpoint.py``) in any number of ranks / ``ep_size``; the policy's
weights (``read_policy``: ``jointrl export``, ``jointrl serve`` / ``eval``, ``checkpoint=`` as a
run's initial weights). Checkpoints written before this layout kept the parts in
``step_N/portable/`` beside DeepSpeed's own files: the parts still read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from jointrl.model.moe_transformer import MoETransformer
from jointrl.rl.build import build_model
from jointrl.rl.device import HOST
from jointrl.rl.config import Config

MOMENTS = ("exp_avg", "exp_avg_sq")
LATEST = "latest"
TOPOLOGY = "topology.json"
_STEP_DIR = re.compile(r"step_(\d+)$")


def part_name(rank: int) -> str:
    return f"part_{rank:03d}.pt"


def _root(path: Path) -> Path:
    """Where ``step_N``'s parts lie: itself, or ``portable/`` in checkpoints of the older layout."""
    legacy = path / "portable"
    return legacy if not (path / TOPOLOGY).is_file() and (legacy / TOPOLOGY).is_file() else path


def topology(path: str | os.PathLike) -> dict | None:
    """``{"num_ranks", "ep_size", "zero_stage", "step"}`` of the checkpoint ``step_N`` at ``path``;
    None while (or when) it is incomplete: a write in progress, or one a killed run left."""
    f = _root(Path(path)) / TOPOLOGY
    return json.loads(f.read_text()) if f.is_file() else None


def resolve(checkpoint: str | os.PathLike) -> Path:
    """A complete ``step_N`` directory from ``checkpoint``: a run's ``checkpoints`` (its ``latest``) or
    a ``step_N`` itself. ValueError naming ``checkpoint`` when it holds no complete checkpoint."""
    path = Path(checkpoint)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if topology(path) is None:
        old = any(path.glob("mp_rank_*_model_states.pt")) or any(path.glob("ep_rank_*.pt"))
        why = ("holds only DeepSpeed's own files, written before checkpoints had parts: read it with the jointrl "
               "version that wrote it" if old else
               f"is not a complete checkpoint (no {LATEST}, and no {TOPOLOGY}: a write that did not finish?)")
        raise ValueError(f"checkpoint {str(checkpoint)!r} {why}")
    return path


def write_atomic(path: Path, write) -> None:
    """``write(file)`` into ``path.tmp``, flushed to disk, then renamed to ``path``: a reader sees the
    old file or the whole new one, never part of it (a crash of the machine included)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(part: dict, path: str | os.PathLike, rank: int) -> None:
    """``path/part_{rank}.pt`` (a ``step_N`` directory), written atomically."""
    Path(path).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(path) / part_name(rank), lambda f: torch.save(part, f))


def commit(directory: str | os.PathLike, step: int, topo: dict, keep: int) -> None:
    """Rank 0, once every rank's part of ``step_N`` is on disk: its ``topology.json``, then ``latest``
    -> ``step_N``, then ``prune(directory, keep)``."""
    d = Path(directory)
    write_atomic(d / f"step_{step}" / TOPOLOGY, lambda f: f.write(json.dumps(topo).encode()))
    write_atomic(d / LATEST, lambda f: f.write(f"step_{step}".encode()))
    prune(d, keep)


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (``keep`` 0: keep all), and incomplete
    ones older than ``latest`` (writes that failed); never the one ``latest`` names, nor an incomplete
    one newer than it (a write in progress). → the removed directories."""
    d = Path(directory)
    latest = (d / LATEST).read_text().strip() if (d / LATEST).is_file() else None
    if latest is None:
        return []
    newest = int(latest.removeprefix("step_"))
    steps = sorted((int(m.group(1)), p) for p in d.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    complete = [p for _, p in steps if topology(p) is not None]
    doomed = complete[:-keep] if keep else []
    doomed += [p for s, p in steps if s < newest and p not in complete]
    for p in doomed:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
    return [p for p in doomed if p.name != latest]


def write_weights(model: torch.nn.Module, directory: str | os.PathLike, step: int = 0) -> Path:
    """A weights-only checkpoint of ``model`` as ``directory/step_{step}`` (one part, no Adam moments:
    a run that starts from it with ``checkpoint=`` begins a fresh optimizer), committed as every
    checkpoint is (``topology.json``, then ``latest``). → the ``step_N`` directory."""
    path = Path(directory) / f"step_{step}"
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {name: t.detach().to(HOST) for name, t in model.state_dict().items()}
    params = {name: {"fp32": state[name].float().clone(), "exp_avg": None, "exp_avg_sq": None, "row_offset": None}
              for name in trainable}
    frozen = {name: t.clone() for name, t in state.items() if name not in trainable}
    write_part({"params": params, "frozen": frozen, "adam_step": 0.0, "step": step}, path, 0)
    commit(directory, step, {"num_ranks": 1, "ep_size": 1, "zero_stage": 0, "step": step}, keep=0)
    return path


def read_part(path: str | os.PathLike, rank: int) -> dict:
    """Rank ``rank``'s part of the checkpoint at ``path``, memory-mapped (tensors are read as used)."""
    return torch.load(_root(Path(path)) / part_name(rank), map_location="cpu", mmap=True, weights_only=True)


def read_parts(path: str | os.PathLike, moments: bool = True) -> dict:
    """The parts of the checkpoint at ``path`` joined: ``{"params": {name: {fp32, exp_avg, exp_avg_sq}},
    "frozen", "adam_step", "step"}`` with whole tensors: fragments placed at their flat offsets
    within each rank-held tensor, then expert rows of all parts concatenated in row order. Without
    ``moments`` only ``fp32`` (the moments are not read). Parts of the older layout (whole tensors,
    or whole expert rows) read the same way. Memory: the whole fp32 master (and moments) once."""
    topo = topology(path)
    if topo is None:
        raise ValueError(f"checkpoint {str(path)!r} is not complete (no {TOPOLOGY})")
    root = _root(Path(path))
    files = sorted(root.glob("part_*.pt"))
    if "num_ranks" in topo and root == Path(path):  # a killed run of another size may have left more parts
        files = [root / part_name(r) for r in range(topo["num_ranks"])]
    keys = ("fp32", *MOMENTS) if moments else ("fp32",)
    pieces: dict[str, dict[int, dict]] = {}  # name -> row offset -> {key: tensor of that rank-held shape}
    first = None
    for f in files:
        part = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        first = first or part
        for name, entry in part["params"].items():
            held = pieces.setdefault(name, {})
            r = entry["row_offset"] or 0
            if "flat" not in entry:
                held[r] = {k: entry[k] for k in keys}
                continue
            start, n = entry["flat"]
            whole = held.setdefault(r, {k: None if entry[k] is None else torch.zeros(entry["shape"], dtype=entry[k].dtype)
                                        for k in keys} | {"covered": 0})
            for k in keys:
                if entry[k] is not None:
                    whole[k].view(-1)[start:start + n] = entry[k]
            whole["covered"] += n
    if first is None:
        raise ValueError(f"checkpoint {str(path)!r} has no parts (part_*.pt)")
    params = {}
    for name, held in pieces.items():
        rows = [held[r] for r in sorted(held)]
        for w in rows:
            assert w.pop("covered", w["fp32"].numel()) == w["fp32"].numel(), f"{path}: fragments of {name} miss elements"
        params[name] = {k: (None if rows[0][k] is None else torch.cat([w[k] for w in rows])) for k in keys}
    return {"params": params, "frozen": first["frozen"], "adam_step": first["adam_step"], "step": first["step"]}


def read_policy(cfg: Config, checkpoint: str | os.PathLike) -> tuple[MoETransformer, int]:
    """(policy, step) from ``checkpoint`` (a run's ``checkpoints`` or a ``step_N``; ``resolve``), in
    ``cfg.model``'s shape and dtype: each weight is its fp32 master cast to the model's dtype (what
    the learner's model held), buffers as saved; a critic's value head is left out. Any
    ``learner.num_ranks`` / ``ep_size`` wrote it."""
    path = resolve(checkpoint)
    saved = read_parts(path, moments=False)
    model = build_model(cfg, HOST)  # read into host memory: a reader moves it where it computes
    want = model.state_dict()
    got = {k: saved["params"][k]["fp32"].to(t.dtype) if k in saved["params"] else saved["frozen"].get(k)
           for k, t in want.items()}
    missing = [k for k, v in got.items() if v is None]
    if missing:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no {missing[:3]} (saved with another model shape?)")
    model.load_state_dict(got)
    return model, int(saved["step"])
