"""Expert parallelism for the learner, applied from outside the model (gpt-fast's ``tp.py`` way).

``shard_experts(model, ep_size, ep_rank, group)`` replaces every ``mlp.experts`` of a
single-device ``MoETransformer`` with ``ShardedExperts``: the rank keeps experts
``[ep_rank * E_l, (ep_rank + 1) * E_l)`` (E_l = E / ep_size) and exchanges tokens with the
other ranks of its expert-parallel group by all-to-all::

    assignments (token, expert) sorted by expert ──all_to_all──► the ranks owning the experts
    each rank runs its local experts on what it received (expert-major order)
    outputs ──all_to_all (reverse splits)──► back to the token's rank; weighted sum over k

Router, attention, embeddings and norms stay replicated (data parallel). The expert
parameters are marked for DeepSpeed as MoE parameters (``allreduce = False``, ``group_name =
"ep_size_<n>"``), so ZeRO reduces their gradients over the expert-data-parallel group
(``deepspeed.utils.groups``) and the optimizer's param groups are split by
``split_params_into_different_moe_groups_for_optimizer``. With ``ep_size > 1`` the module is
an ``ExpertParallelExperts``, which also subclasses DeepSpeed's ``MoE`` only because that is
how DeepSpeed's engine detects MoE layers (``isinstance(module, MoE)``); it does not run
DeepSpeed's gate or experts (softmax-only, capacity-dropping) — ``MoE.__init__`` is
deliberately not called.

``fake_quant=True`` runs the local experts through ``fake_quantize_mxfp4`` (straight-through),
so the learner's forward sees the MXFP4 weights the rollout runs. Works with ``ep_size=1``
too (no communication). Every local expert runs, on an empty slice if it got no tokens, so
each expert parameter is in the graph and gets a (zero) gradient on every rank.

All ranks of an expert-parallel group must run the same sequence of forwards and backwards
(the learner pads ranks with fewer micro-batches with empty ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from deepspeed.moe.layer import MoE
except ImportError:  # a process without DeepSpeed (tests/gpu/check.sh) runs one rank: ShardedExperts only
    MoE = None

from jointrl.rl.learner.fake_quant import fake_quantize_mxfp4
from jointrl.model.moe import Experts


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with the reverse exchange as its backward. x [R_in, ...]."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


def _run_experts(x_AH: torch.Tensor, counts: list[int], gate_up_EoH: torch.Tensor, down_EHI: torch.Tensor) -> torch.Tensor:
    """y_a = down_e(silu(gate_e x_a) ⊙ up_e x_a) for rows sorted by local expert (counts per expert)."""
    outs, start = [], 0
    for e, count in enumerate(counts):
        gate_aI, up_aI = F.linear(x_AH[start:start + count], gate_up_EoH[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate_aI) * up_aI, down_EHI[e]))
        start += count
    return torch.cat(outs)


class ShardedExperts(nn.Module):
    """This rank's slice of one layer's routed experts; same ``forward`` contract as ``Experts``."""

    def __init__(self, experts: Experts, ep_size: int, ep_rank: int, group, fake_quant: bool = False) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: see the module docstring
        E = experts.gate_up_proj.shape[0]
        if ep_size < 1 or E % ep_size:
            raise ValueError(f"learner.ep_size={ep_size} must divide the number of experts ({E})")
        self.num_experts, self.ep_size, self.ep_rank = E, ep_size, ep_rank
        self.num_local_experts = E // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.first_expert = ep_rank * self.num_local_experts
        self.group, self.fake_quant = group, fake_quant
        sl = slice(self.first_expert, self.first_expert + self.num_local_experts)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[sl].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[sl].clone())
        if ep_size > 1:
            for p in (self.gate_up_proj, self.down_proj):
                p.allreduce = False  # DeepSpeed: an expert parameter, reduced over the expert-data-parallel group
                p.group_name = self.expert_group_name

    def forward(self, x_NH: torch.Tensor, ids_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> torch.Tensor:
        N, k = ids_Nk.shape
        ids_A = ids_Nk.reshape(-1)
        order_A = torch.argsort(ids_A, stable=True)
        token_A = order_A // k
        x_AH = x_NH[token_A]
        counts_E = torch.bincount(ids_A, minlength=self.num_experts)
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.fake_quant:
            gate_up, down = fake_quantize_mxfp4(gate_up), fake_quantize_mxfp4(down)
        if self.ep_size == 1:
            y_AH = _run_experts(x_AH, counts_E.tolist(), gate_up, down)
        else:
            y_AH = self._exchange_and_run(x_AH, counts_E, gate_up, down)
        y_AH = y_AH * weights_Nk.reshape(-1)[order_A, None]
        return torch.zeros_like(x_NH).index_add_(0, token_A, y_AH)

    def _exchange_and_run(self, x_AH, counts_E, gate_up, down) -> torch.Tensor:
        P, El = self.ep_size, self.num_local_experts
        send_PEl = counts_E.view(P, El).contiguous()
        recv_PEl = torch.empty_like(send_PEl)
        dist.all_to_all_single(recv_PEl, send_PEl, group=self.group)
        send_splits, recv_splits = send_PEl.sum(1).tolist(), recv_PEl.sum(1).tolist()
        x_RH = _AllToAll.apply(x_AH, recv_splits, send_splits, self.group)  # source-major, expert-minor
        recv = recv_PEl.tolist()
        src_start = [sum(recv_splits[:p]) for p in range(P)]
        perm, per_expert = [], []
        for e in range(El):  # expert-major order for the local matmuls
            for p in range(P):
                start = src_start[p] + sum(recv[p][:e])
                perm.extend(range(start, start + recv[p][e]))
            per_expert.append(sum(recv[p][e] for p in range(P)))
        perm_R = torch.tensor(perm, dtype=torch.long, device=x_RH.device)
        y_sorted = _run_experts(x_RH[perm_R], per_expert, gate_up, down)
        y_RH = torch.zeros_like(y_sorted).index_copy_(0, perm_R, y_sorted)  # back to source-major
        return _AllToAll.apply(y_RH, send_splits, recv_splits, self.group)


if MoE is not None:
    class ExpertParallelExperts(ShardedExperts, MoE):
        """``ShardedExperts`` that DeepSpeed's engine recognises as an MoE layer (``ep_size > 1``)."""

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            """Called by DeepSpeed's engine; the groups already exist (``shard_experts`` made them)."""


def shard_experts(model: nn.Module, ep_size: int, ep_rank: int, fake_quant: bool = False) -> None:
    """Replace each layer's ``mlp.experts`` with this rank's ``ShardedExperts`` (in place).

    ``ep_size > 1`` needs ``torch.distributed`` initialised; the expert-parallel groups are
    DeepSpeed's (``groups._create_expert_and_data_parallel``), created here if missing.
    """
    if getattr(model.config, "swiglu_limit", None) is not None:
        raise ValueError("learner.ep_size > 1 and learner.fake_quant_experts do not support gpt-oss's clamped-SwiGLU "
                         "experts yet (model/gpt_oss.ClampedSwiGLUExperts); use ep_size=1, fake_quant_experts=false")
    group = None
    if ep_size > 1:
        from deepspeed.utils import groups

        name = f"ep_size_{ep_size}"
        if dist.get_world_size() % ep_size:
            raise ValueError(f"learner.ep_size={ep_size} must divide the number of learner ranks ({dist.get_world_size()})")
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(ep_size)
        group = groups._get_expert_parallel_group(name)
        ep_rank = dist.get_rank(group=group)
    cls = ExpertParallelExperts if ep_size > 1 else ShardedExperts
    for layer in model.model.layers:
        if getattr(layer, "is_moe", True):
            layer.mlp.experts = cls(layer.mlp.experts, ep_size, ep_rank, group, fake_quant)


def expert_row_offsets(model: nn.Module) -> dict[str, int]:
    """State-dict name -> first expert index, for each ``ShardedExperts`` tensor (weight push)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ShardedExperts):
            for pname in ("gate_up_proj", "down_proj"):
                out[f"{name}.{pname}"] = module.first_expert
    return out
