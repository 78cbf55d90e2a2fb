"""PPO's critic: a linear value head on the policy's final hidden state (shared trunk).

``attach_value_head(model)`` adds ``model.value_head`` (``nn.Linear(H, 1)``, zero-initialised
so the first values are 0) as a submodule, so DeepSpeed trains it with the policy; the weight
push leaves it out (``VALUE_HEAD_PREFIX``). ``values(model, hidden_BTH)`` follows the
log-prob convention: entry t is V(tokens_<t), read from the hidden state at t - 1 (0 at t = 0),
the value of the state in which token t was chosen.
"""

from __future__ import annotations

import torch
from torch import nn

VALUE_HEAD_PREFIX = "value_head."


def attach_value_head(model: nn.Module) -> nn.Module:
    head = nn.Linear(model.config.hidden_size, 1, bias=True)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    p = next(model.parameters())
    model.add_module("value_head", head.to(device=p.device, dtype=p.dtype))
    return model


def values(model: nn.Module, hidden_BTH: torch.Tensor) -> torch.Tensor:
    """[B, T] values, shifted like log-probs (entry t from hidden state t - 1; 0 at t = 0)."""
    v_BT = model.value_head(hidden_BTH).squeeze(-1)
    return torch.cat([torch.zeros_like(v_BT[:, :1]), v_BT[:, :-1]], dim=1)
