"""A pretrained checkpoint directory to start from (``model=hf model.path=DIR``): what it must
hold, checked in well under a second (JSON only: no weights, no transformers import), and the
model shape it implies.

``check_pretrained(path)`` -> ``MoEConfig``; a ValueError with a one-line message naming the
problem: a missing directory, no ``config.json``, an unsupported ``model_type`` or config field
(``model/hf.config_from_hf``), no weights (``model.safetensors`` or an index), no
``tokenizer.json`` (nor Kimi's ``tiktoken.model`` + ``tokenizer_config.json``), or a tokenizer without a
special token the loop needs (``model/hf_tokenizer.SPECIAL_ROLES``, harmony's ``model/harmony.HARMONY_ROLES``
or Kimi's ``model/kimi.KIMI_ROLES`` and ``KIMI_TOKENS``) or with more ids than the model's vocabulary (a
tiktoken vocabulary: the ranks plus its 256 reserved special ids).

``fill_shape(fields, path)``: the model config's fields with every unset (None) one taken from
the checkpoint's; a set shape field that disagrees with ``config.json`` is a ValueError naming
both values. ``OVERRIDABLE`` fields (training and kernel knobs, not the shape) may differ.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jointrl.model.config import MoEConfig
from jointrl.model.harmony import HARMONY_ROLES, HARMONY_TOKENS
from jointrl.model.hf import config_from_hf
from jointrl.model.kimi import KIMI_ROLES, KIMI_TOKENS, NUM_RESERVED

# MoEConfig fields a run may set differently from config.json: they do not change the weights' shapes or meaning.
OVERRIDABLE = frozenset({"router_aux_loss_coef", "initializer_range", "kda_chunk_size", "dsa_mode", "dsa_query_chunk"})
_ROLES = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


def check_pretrained(path: str | Path, tokenizer: str | Path | None = None) -> MoEConfig:
    """The checkpoint's ``MoEConfig`` after checking the directory (see the module docstring);
    ``tokenizer``: a separate tokenizer directory (default: ``path``)."""
    src = Path(path)
    if not src.is_dir():
        raise ValueError(f"model.path={str(path)!r} is not a directory")
    if not (src / "config.json").is_file():
        raise ValueError(f"model.path={str(path)!r} has no config.json")
    try:
        config = config_from_hf(json.loads((src / "config.json").read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"model.path={str(path)!r}: {e}") from None
    if not ((src / "model.safetensors").is_file() or (src / "model.safetensors.index.json").is_file()):
        raise ValueError(f"model.path={str(path)!r} has no model.safetensors or model.safetensors.index.json")
    tok_dir = Path(tokenizer) if tokenizer is not None else src
    key = "model.tokenizer" if tokenizer is not None else "model.path"
    if (tok_dir / "tokenizer.json").is_file():
        source = "tokenizer.json"
        added = {t["content"]: t["id"] for t in json.loads((tok_dir / source).read_text()).get("added_tokens", [])}
        top = max(added.values(), default=-1)
    elif (tok_dir / "tiktoken.model").is_file() and (tok_dir / "tokenizer_config.json").is_file():
        source = "tokenizer_config.json"  # Kimi's: the ranks, then NUM_RESERVED special ids (model/kimi.py)
        decoder = json.loads((tok_dir / source).read_text()).get("added_tokens_decoder") or {}
        added = {t["content"]: int(i) for i, t in decoder.items()}
        with open(tok_dir / "tiktoken.model", "rb") as f:
            top = sum(1 for line in f if line.strip()) + NUM_RESERVED - 1
    else:
        raise ValueError(f"{key}={str(tok_dir)!r} has no tokenizer.json (a fast Hugging Face tokenizer) nor "
                         "tiktoken.model with tokenizer_config.json (Kimi's)")
    harmony = "<|im_start|>" not in added and all(t in added for t in HARMONY_TOKENS.values())
    kimi = "<|im_start|>" not in added and "<|im_middle|>" in added
    roles = HARMONY_ROLES.values() if harmony else [*KIMI_ROLES.values(), *KIMI_TOKENS.values()] if kimi else _ROLES
    missing = [t for t in roles if t not in added]
    if missing:
        raise ValueError(f"{key}={str(tok_dir)!r}: {source} lacks the special token(s) {missing} the agent loop needs")
    if top >= config.vocab_size:
        raise ValueError(f"{key}={str(tok_dir)!r}: token id {top} is outside the model's vocabulary "
                         f"(vocab_size {config.vocab_size})")
    return config


def fill_shape(fields: dict[str, Any], path: str | Path, tokenizer: str | Path | None = None) -> dict[str, Any]:
    """``fields`` (MoEConfig names -> value or None) with the checkpoint's values filled in."""
    hf = check_pretrained(path, tokenizer)
    out = dict(fields)
    for f in dataclasses.fields(MoEConfig):
        theirs, ours = getattr(hf, f.name), fields.get(f.name)
        if ours is None:
            out[f.name] = theirs
        elif f.name not in OVERRIDABLE and (list(ours) if f.name == "layer_types" else ours) != \
                (list(theirs) if f.name == "layer_types" and theirs is not None else theirs):
            raise ValueError(f"config key 'model.{f.name}' = {ours!r} disagrees with {path}/config.json, which gives "
                             f"{theirs!r}; leave it unset with model.path")
    return out
