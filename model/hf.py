"""Hugging Face checkpoints for `tiny_moe`-shaped models: `save_hf` / `load_hf` (local files only).

The directory layout is what `transformers.AutoModelForCausalLM.from_pretrained(dir)` reads for
Qwen3-MoE: `config.json` plus `model.safetensors` (or sharded `model.safetensors.index.json`).
Expert weights are written in transformers 5.x's fused layout (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); on load, the per-expert layout of hub checkpoints
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) is fused too. MXFP4 export is a later issue.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jointrl.model.config import MoEConfig
from jointrl.model.moe_transformer import MoETransformer

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def save_hf(model: MoETransformer, directory: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (the model's dtype; tied lm_head stored once)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    config = model.config.to_hf_dict()
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def load_hf(directory: str | Path, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> MoETransformer:
    """Load a Qwen3-MoE checkpoint directory; `dtype` None keeps the stored dtype.

    Raises ValueError naming an unsupported model_type or config field, or missing/unexpected keys.
    """
    src = Path(directory)
    config = MoEConfig.from_hf_dict(json.loads((src / "config.json").read_text()))
    state = _fuse_per_expert(_read_safetensors(src))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = MoETransformer(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {src} does not match MoEConfig: missing {missing}, unexpected {unexpected}")
    for key, shape in ((k, v.shape) for k, v in model.state_dict().items()):
        if state[key].shape != shape:
            raise ValueError(f"checkpoint {src}: {key} has shape {tuple(state[key].shape)}, expected {tuple(shape)}")
    if dtype is None:
        dtype = state["model.embed_tokens.weight"].dtype
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _read_safetensors(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(src / shard))
        return state
    single = src / "model.safetensors"
    if not single.exists():
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {src}")
    return load_file(single)


def _fuse_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`experts.{e}.gate/up/down_proj.weight` → `experts.gate_up_proj` [E, 2I, H] (gate rows first)
    and `experts.down_proj` [E, H, I]; other keys unchanged."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    fused: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            fused[key] = tensor
        else:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensor
    for prefix, parts in groups.items():
        n = len(parts.get("gate", {}))
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate", "up", "down")):
            raise ValueError(f"{prefix}: per-expert gate/up/down weights are incomplete")
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((parts["gate"][e], parts["up"][e])) for e in range(n)])
        fused[f"{prefix}.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    return fused
