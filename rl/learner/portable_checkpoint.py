"""A learner rank's part of a checkpoint (``rl/checkpoint_format.py``): taken from its optimizer,
and loaded back into any number of learner ranks and any ``ep_size``.

``host_part`` copies what this rank holds to host memory, no collective and no gather: with ZeRO,
per parameter its fragment of ZeRO's flat fp32 master and of Adam's two moments (DeepSpeed's
``_hp_mapping``); without ZeRO (one rank, ``setup.zero_stage``) the optimizer is torch's AdamW
itself: the parameters (or, in bf16, DeepSpeed's fp32 masters of them) and its state's moments,
whole (float64 for a float64 model, and so in the file).

``load_into_rank`` reads a checkpoint back. Written by the same ``num_ranks`` / ``ep_size`` with ZeRO
(every rank's fragments where they were): each rank reads its own part only, writes its fragments
into its ZeRO partition, and the ranks all-gather the model's weights from the masters, as a step
does. Any other topology: every rank rebuilds the whole tensors from all parts (memory-mapped),
cuts the rows of its experts, and writes model weights, fp32 masters and moments into its
partition (``safe_set_full_*``); while it loads, each rank's host memory holds the whole fp32
master and moments. Either way the update that follows is the one the writer would have taken,
up to fp32 summation order (tests/rl/learner/test_reshard.py; bit for bit in the same topology).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from jointrl.rl.checkpoint_format import MOMENTS, read_part, read_parts, topology


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (one copy, from the device or within the host)."""
    return t.detach().to("cpu", copy=True)


def host_part(module: nn.Module, zero_optimizer, *, rank: int, step: int, row_offsets: dict[str, int],
              zero_stage: int) -> dict:
    """This rank's part (``rl/checkpoint_format.py``) copied to host memory: the training step may
    change the live tensors as soon as this returns. With ZeRO, per parameter this rank's fragment
    (``flat`` = (start, numel) within the parameter as this rank holds it, ``shape``, ``row_offset``
    its first expert row); a rank that holds no fragment of a parameter writes none.
    ``zero_optimizer``: DeepSpeed's ZeRO optimizer, or with ``zero_stage`` 0 torch's AdamW (or
    DeepSpeed's bf16 wrapper of it)."""
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
            params[name] = {k: _host(v).to(torch.promote_types(v.dtype, torch.float32)) for k, v in entry.items()}
        else:
            frag = p._hp_mapping
            if frag is None:  # all of p lives in other ranks' partitions
                continue
            keys = frag.get_optim_state_keys() if frag.optim_fragment else []
            params[name] = {"fp32": _host(frag.get_hp_fragment()),
                            **{k: _host(frag.get_hp_fragment(k)) if k in keys else None for k in MOMENTS},
                            "flat": (frag.lp_fragment_address.start, frag.lp_fragment_address.numel),
                            "shape": tuple(p.shape)}
        params[name]["row_offset"] = row_offsets.get(name)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen = {k: _host(v) for k, v in module.state_dict().items() if k not in trainable} if rank == 0 else {}
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    return {"params": params, "frozen": frozen, "adam_step": max(steps, default=0.0), "step": step}


def load_into_rank(module: nn.Module, zero_optimizer, path: str | os.PathLike, row_offsets: dict[str, int],
                   zero_stage: int, *, rank: int, num_ranks: int, ep_size: int) -> int:
    """Load the checkpoint at ``path`` (a complete ``step_N``) into this rank's model and optimizer
    (module docstring); every rank of the group calls together. → the step it was saved at."""
    saved = topology(path)
    assert saved is not None, path
    # checkpoints that did not record a stage were written with ZeRO
    same = (saved["num_ranks"], saved["ep_size"], saved.get("zero_stage", 1) > 0) == (num_ranks, ep_size, zero_stage > 0)
    if same and zero_stage > 0:
        return _load_own_part(module, zero_optimizer, path, rank)
    return _load_whole(module, zero_optimizer, path, row_offsets, zero_stage)


def _load_own_part(module: nn.Module, zero_optimizer, path, rank: int) -> int:
    """The writer's topology with ZeRO: this rank's fragments straight into its partition, then the
    model's weights all-gathered from the masters (``update_lp_params``: a collective)."""
    part = read_part(path, rank)
    _init_adam_state(zero_optimizer, 1)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        frag, entry = p._hp_mapping, part["params"].get(name)
        if frag is None:
            assert entry is None, f"{path}: rank {rank} holds no fragment of {name}, its part does"
            continue
        assert entry is not None and tuple(entry["flat"]) == (frag.lp_fragment_address.start, frag.lp_fragment_address.numel), \
            f"{path}: rank {rank}'s fragment of {name} is not where the writer held it"
        with torch.no_grad():
            frag.get_hp_fragment().copy_(entry["fp32"])
            for key in MOMENTS:
                if entry[key] is not None:
                    frag.get_hp_fragment(key).copy_(entry[key])
    zero_optimizer.update_lp_params()
    frozen = part["frozen"] if rank == 0 else read_part(path, 0)["frozen"]
    return _finish(module, zero_optimizer, 1, frozen, part)


def _load_whole(module: nn.Module, zero_optimizer, path, row_offsets: dict[str, int], zero_stage: int) -> int:
    """Another topology (or without ZeRO): whole tensors from all parts, this rank's rows of them."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    saved = read_parts(path)
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
    return _finish(module, zero_optimizer, zero_stage, saved["frozen"], saved)


def _finish(module: nn.Module, zero_optimizer, zero_stage: int, frozen: dict, saved: dict) -> int:
    """The non-trainable tensors and Adam's step count; → the run's step."""
    with torch.no_grad():
        state = module.state_dict()
        for name, t in frozen.items():
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
