"""Our state dict -> the checkpoint vLLM's loader reads: Hugging Face names, one safetensors file.

Our model (and transformers 5.x) hold each layer's routed experts fused,
``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up) and
``...experts.down_proj`` [E, H, I]; vLLM's Qwen3-MoE loader reads the hub's per-expert layout,
``...experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]. Every other
tensor keeps its name. Values are copied bit for bit (slices of the same tensors, same dtype).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(state: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) in the per-expert checkpoint layout for every entry of ``state`` (module docstring)."""
    for name, t in state.items():
        m = _FUSED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        if kind == "down_proj":
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            continue
        half = t.shape[1] // 2
        for e in range(t.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
            yield f"{prefix}.{e}.up_proj.weight", t[e, half:]


def write_checkpoint(state: Mapping[str, Tensor], path: str | Path) -> Path:
    """``checkpoint_tensors(state)`` as one safetensors file at ``path``, replaced atomically (written
    beside it, then renamed): a reader sees the old file or the new one, never a partial one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({n: t.detach().to("cpu").contiguous() for n, t in checkpoint_tensors(state)}, str(tmp))
    os.replace(tmp, path)
    return path
