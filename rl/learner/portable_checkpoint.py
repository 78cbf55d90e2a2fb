"""A checkpoint that loads into any number of learner ranks and any ``ep_size``.

DeepSpeed's ZeRO files hold each rank's slice of one flat fp32 buffer per parameter group, and
the expert-parallel files (``worker._save_ep_checkpoint``) each rank's experts: both load into
the ``learner.num_ranks`` / ``learner.ep_size`` that wrote them only. Beside them every
checkpoint gets ``step_N/portable/``: every rank writes ``part_{rank}.pt`` with what it holds, no
collective and no gather: per parameter (by name) its fragment of ZeRO's flat fp32 master and of
Adam's two moments (``flat``: start and length within the parameter as the rank holds it;
``row_offset``: the first expert row, with expert parallelism), so the parts together hold each
element once; rank 0's part also holds the non-trainable tensors (buffers, frozen ones). Each
part has Adam's step count and the run's step; ``topology.json`` names the writer's
``num_ranks`` / ``ep_size`` / ZeRO stage. Without ZeRO (one rank, ``setup.zero_stage``) the
optimizer is torch's AdamW itself: the parameters are the masters and its state holds the
moments (both float64 for a float64 model, and so in the file). Parts written before fragments
(rank 0 held every replicated tensor whole) still read.

Loading (``LearnerWorker.load_checkpoint`` when the topology differs): every rank rebuilds the
whole tensors, cuts the rows of its experts, and writes model weights, fp32 masters and moments
into its ZeRO partition (``safe_set_full_*``). The update that follows is the one the old
topology would have taken, up to fp32 summation order (tests/rl/learner/test_reshard.py).
Loading still rebuilds whole tensors on every rank: while it loads, each rank's host memory holds
the whole fp32 master and moments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


def topology(path: str | os.PathLike) -> dict | None:
    """``{"num_ranks", "ep_size", "zero_stage"}`` of the checkpoint at ``path`` (a ``step_N`` dir;
    no ``zero_stage`` when written before it was recorded), or None when it has no portable copy
    (written before it existed)."""
    f = Path(path) / "portable" / "topology.json"
    return json.loads(f.read_text()) if f.is_file() else None


def save_portable(module: nn.Module, zero_optimizer, path: str | os.PathLike, *, rank: int, num_ranks: int,
                  ep_size: int, step: int, row_offsets: dict[str, int], zero_stage: int = 1) -> None:
    """Every rank writes ``part_{rank}.pt`` with what it holds; no collective, no gather.
    With ZeRO: per parameter, this rank's fragment of the flattened fp32 master and of Adam's two
    moments (DeepSpeed's ``_hp_mapping``: ``flat`` = (start, numel) within the parameter as this
    rank holds it, ``shape`` that parameter's shape, ``row_offset`` its first expert row); a rank
    that holds no fragment of a parameter writes none. ``zero_optimizer``: DeepSpeed's ZeRO
    optimizer, or with ``zero_stage`` 0 torch's AdamW (one rank: whole tensors, rank 0 only)."""
    _init_adam_state(zero_optimizer, zero_stage)
    inner, masters = _adam(zero_optimizer, zero_stage), _masters(zero_optimizer, zero_stage)
    params: dict[str, dict] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if zero_stage == 0:
            m = masters.get(p, p)
            entry = {"fp32": m, **{key: inner.state[m][key] for key in MOMENTS}}
            # without ZeRO a float64 model's weights and moments stay float64
            params[name] = {k: v.detach().cpu().to(torch.promote_types(v.dtype, torch.float32)).clone()
                            for k, v in entry.items()}
        else:
            frag = p._hp_mapping
            if frag is None:  # all of p lives in other ranks' partitions
                continue
            keys = frag.get_optim_state_keys() if frag.optim_fragment else []
            params[name] = {"fp32": frag.get_hp_fragment().detach().cpu().clone(),
                            **{k: frag.get_hp_fragment(k).detach().cpu().clone() if k in keys else None for k in MOMENTS},
                            "flat": (frag.lp_fragment_address.start, frag.lp_fragment_address.numel),
                            "shape": tuple(p.shape)}
        params[name]["row_offset"] = row_offsets.get(name)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen = {k: v.detach().cpu() for k, v in module.state_dict().items() if k not in trainable} if rank == 0 else {}
    steps = [float(s["step"]) for s in _adam(zero_optimizer, zero_stage).state.values() if "step" in s]
    out = Path(path) / "portable"
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"params": params, "frozen": frozen, "adam_step": max(steps, default=0.0), "step": step},
               out / f"part_{rank:03d}.pt")
    if rank == 0:
        (out / "topology.json").write_text(json.dumps({"num_ranks": num_ranks, "ep_size": ep_size, "zero_stage": zero_stage,
                                                       "step": step}))


def read_portable(path: str | os.PathLike) -> dict:
    """The parts of ``path/portable`` joined: ``{"params": {name: {fp32, exp_avg, exp_avg_sq}},
    "frozen", "adam_step", "step"}`` with whole tensors: fragments placed at their flat offsets
    within each rank-held tensor, then expert rows of all parts concatenated in row order. Parts
    written before fragments (whole tensors, or whole expert rows) read the same way."""
    parts = [torch.load(f, map_location="cpu", weights_only=False) for f in sorted((Path(path) / "portable").glob("part_*.pt"))]
    if not parts:
        raise ValueError(f"checkpoint {path} has no portable copy (portable/part_*.pt); it loads into the "
                         "learner.num_ranks / learner.ep_size that wrote it only")
    pieces: dict[str, dict[int, dict]] = {}  # name -> row offset -> {key: tensor of that rank-held shape}
    for part in parts:
        for name, entry in part["params"].items():
            held = pieces.setdefault(name, {})
            r = entry["row_offset"] or 0
            if "flat" not in entry:
                held[r] = {k: entry[k] for k in ("fp32", *MOMENTS)}
                continue
            start, n = entry["flat"]
            whole = held.setdefault(r, {k: None if entry[k] is None else torch.zeros(entry["shape"], dtype=entry[k].dtype)
                                        for k in ("fp32", *MOMENTS)} | {"covered": 0})
            for k in ("fp32", *MOMENTS):
                if entry[k] is not None:
                    whole[k].view(-1)[start:start + n] = entry[k]
            whole["covered"] += n
    params = {}
    for name, held in pieces.items():
        rows = [held[r] for r in sorted(held)]
        for w in rows:
            assert w.pop("covered", w["fp32"].numel()) == w["fp32"].numel(), f"{path}: fragments of {name} miss elements"
        params[name] = {k: (None if rows[0][k] is None else torch.cat([w[k] for w in rows])) for k in ("fp32", *MOMENTS)}
    return {"params": params, "frozen": parts[0]["frozen"], "adam_step": parts[0]["adam_step"], "step": parts[0]["step"]}


def load_portable(module: nn.Module, zero_optimizer, path: str | os.PathLike, row_offsets: dict[str, int],
                  zero_stage: int = 1) -> int:
    """Write the portable checkpoint at ``path`` into this rank's model and ZeRO partition (with
    ``zero_stage`` 0: into the model and torch's AdamW ``zero_optimizer``); → the step it was saved at."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    saved = read_portable(path)
    _init_adam_state(zero_optimizer, zero_stage)
    inner, masters = _adam(zero_optimizer, zero_stage), _masters(zero_optimizer, zero_stage)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name not in saved["params"]:
            raise ValueError(f"checkpoint {path} has no parameter {name!r} (saved with another model or algo?)")
        first = row_offsets.get(name)
        rows = (lambda t: t) if first is None else (lambda t: t[first:first + p.shape[0]])  # noqa: E731
        entry = saved["params"][name]
        if tuple(rows(entry["fp32"]).shape) != tuple(p.shape):
            raise ValueError(f"checkpoint {path}: {name} has shape {tuple(entry['fp32'].shape)}, "
                             f"this rank's parameter {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(rows(entry["fp32"]).to(p.dtype))
        if zero_stage == 0:
            m = masters.get(p, p)
            if m is not p:  # bf16 without ZeRO: DeepSpeed's fp32 master of p
                with torch.no_grad():
                    m.copy_(rows(entry["fp32"]))
            state = inner.state[m]
            for key in MOMENTS:
                if entry[key] is not None:
                    state[key].copy_(rows(entry[key]))
            continue
        safe_set_full_fp32_param(p, rows(entry["fp32"]))
        for key in MOMENTS:
            if entry[key] is not None:
                safe_set_full_optimizer_state(p, rows(entry[key]), key)
    with torch.no_grad():
        state = module.state_dict()
        for name, t in saved["frozen"].items():
            if name in state:
                state[name].copy_(t)
    for s in _adam(zero_optimizer, zero_stage).state.values():
        s["step"] = torch.tensor(saved["adam_step"], dtype=s["step"].dtype)
    return int(saved["step"])


def _adam(zero_optimizer, zero_stage: int) -> torch.optim.Optimizer:
    """The torch optimizer that holds Adam's state: ZeRO's inner one (over its flat partitions), or
    without ZeRO the optimizer itself (over the parameters; in bf16 DeepSpeed's ``FP16_UnfusedOptimizer``
    wraps it, over its fp32 masters)."""
    if zero_stage == 0 and not _has_masters(zero_optimizer):
        return zero_optimizer
    return zero_optimizer.optimizer


def _has_masters(optimizer) -> bool:
    return hasattr(optimizer, "fp16_groups") and hasattr(optimizer, "fp32_groups")


def _masters(zero_optimizer, zero_stage: int) -> dict:
    """Without ZeRO in bf16: each model parameter's fp32 master (``FP16_UnfusedOptimizer``'s groups,
    in order); else empty (the parameters are the masters)."""
    if zero_stage or not _has_masters(zero_optimizer):
        return {}
    return {p: m for ps, ms in zip(zero_optimizer.fp16_groups, zero_optimizer.fp32_groups) for p, m in zip(ps, ms)}


def _init_adam_state(zero_optimizer, zero_stage: int = 1) -> None:
    """Adam's per-partition state as its first step would create it (zeros) where no step has run
    yet, and every parameter linked to its slices of that state. DeepSpeed 0.19 links them once,
    after the first parameter group's first step, so with expert parallelism (a second group, the
    experts') the experts stay unlinked and their moments unreadable: link again here."""
    inner = _adam(zero_optimizer, zero_stage)
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state.get(p):
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    if zero_stage:
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()
