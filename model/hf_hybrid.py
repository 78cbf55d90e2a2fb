"""Export and reload of hybrid checkpoints (`layer_types` with kda / gated_dsa): HF remote code.

`save_hybrid(model, dir)` writes `config.json` (every `MoEConfig` field, `model_type`
"jointrl_hybrid", `auto_map` → the shipped `modeling_jointrl.py`), `model.safetensors` (the
model's state dict: parameters and persistent buffers, in the model's dtype) and copies
`model/hf_remote/modeling_jointrl.py` beside them. Then
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` builds jointrl's model from
it (with `jointrl` importable) and gives our logits. `load_hybrid(dir)` reads it back here.
Qwen3-MoE-shaped models export without remote code through `model.hf.save_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jointrl.model.config import MoEConfig
from jointrl.model.moe_transformer import MoETransformer

REMOTE_CODE = Path(__file__).resolve().parent / "hf_remote" / "modeling_jointrl.py"
MODEL_TYPE = "jointrl_hybrid"


def save_hybrid(model: MoETransformer, directory: str | Path) -> Path:
    """Write a remote-code checkpoint directory (see the module docstring); returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    fields = dataclasses.asdict(model.config)
    fields["layer_types"] = list(model.config.kinds)
    config = {**fields, "model_type": MODEL_TYPE, "architectures": ["JointrlHybridForCausalLM"],
              "auto_map": {"AutoConfig": "modeling_jointrl.JointrlHybridConfig",
                           "AutoModelForCausalLM": "modeling_jointrl.JointrlHybridForCausalLM"},
              "dtype": str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(REMOTE_CODE, out / REMOTE_CODE.name)
    return out


def load_hybrid(directory: str | Path, dtype: torch.dtype | None = None) -> MoETransformer:
    """Read a `save_hybrid` directory; ValueError names a wrong model_type, field or tensor."""
    src = Path(directory)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{src}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    config = MoEConfig(**{k: v for k, v in raw.items() if k in names})
    state = load_file(src / "model.safetensors")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = MoETransformer(config)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {src}: missing {missing}, unexpected {unexpected}")
    dtype = dtype or state["model.embed_tokens.weight"].dtype
    model.load_state_dict({k: v if not v.is_floating_point() or k.endswith("e_score_correction_bias")
                           else v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
