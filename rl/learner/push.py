"""A learner rank's part of the weight push to the rollout workers (``rl/weight_sync.py``'s bundles
over Ray's object store, or ``rl/weight_transport.py``'s broadcast): rank 0 sends the shared
parameters and its experts, every other expert-parallel rank its experts only, replicas nothing.
The critic (``value_head``) never leaves the learner; routed experts go as MXFP4 where
``rollout.quantize_experts``."""

from __future__ import annotations

import torch

from jointrl.rl.config import Config
from jointrl.rl.device import HOST
from jointrl.rl.learner.expert_parallel import expert_row_offsets
from jointrl.rl.learner.value_head import VALUE_HEAD_PREFIX
from jointrl.rl.weight_sync import WeightBundle, build_bundle, is_routed_expert
from jointrl.rl.weight_transport import WeightSender


def _never(name: str, t: torch.Tensor) -> bool:
    return False


class WeightPusher:
    """This rank's weights, as a bundle (``rollout.weight_transport=ray``) or through a ``WeightSender``
    (``dist``: open -> join, with the receivers -> push, every version)."""

    def __init__(self, cfg: Config, module: torch.nn.Module, rank: int) -> None:
        rc, ep_size = cfg.rollout, cfg.learner.ep_size
        self.module = module
        self.is_quantized = is_routed_expert if rc.quantize_experts else _never
        self.bucket_bytes = int(rc.weight_bucket_mb * 2**20)
        self.sends = rank < ep_size  # a replica of an expert shard (rank >= ep_size) sends nothing
        self.experts_only = 0 < rank < ep_size
        self.sender: WeightSender | None = None

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What this rank sends, and the bucket arguments."""
        offsets = expert_row_offsets(self.module)
        state = {k: v.detach() for k, v in self.module.state_dict().items() if not k.startswith(VALUE_HEAD_PREFIX)}
        if not self.sends:
            state = {}
        elif self.experts_only:
            state = {k: v for k, v in state.items() if k in offsets}
        return state, {"is_quantized": self.is_quantized, "row_offsets": offsets, "bucket_bytes": self.bucket_bytes}

    def bundle(self, version: int, device: torch.device | None = HOST) -> WeightBundle | None:
        """This rank's part as one bundle (payloads on ``device``: the host for Ray's object store, None
        where the weights are); None when it has nothing to send."""
        state, kw = self.state()
        return build_bundle(state, version=version, device=device, **kw) if state else None

    def open(self, num_receivers: int, backend: str, timeout_s: float) -> tuple[str, int]:
        if self.sender is not None:  # rebuilt groups: leave the old one first
            self.sender.close()
        self.sender = WeightSender(num_receivers, backend, timeout_s)
        return self.sender.address

    def join(self) -> None:
        self.sender.connect()

    def push(self, version: int) -> dict[str, float]:
        state, kw = self.state()
        return self.sender.send(state, version, **kw)
