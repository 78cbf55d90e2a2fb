"""Constructing the model from ``Config``: one place, so learner and rollout build it alike."""

from __future__ import annotations

from dataclasses import asdict

import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.rl.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model_config(cfg: Config) -> MoEConfig:
    return MoEConfig(**{k: v for k, v in asdict(cfg.model).items() if k not in ("name", "dtype", "path", "tokenizer")})


def build_model(cfg: Config) -> MoETransformer:
    """The policy at initialisation: ``model.path``'s weights (``model/hf.load_hf``) when set, else
    random and deterministic in ``cfg.seed``."""
    if cfg.model.path is not None:
        from jointrl.model.hf import load_hf

        return load_hf(cfg.model.path, dtype=DTYPES[cfg.model.dtype], config=model_config(cfg))
    return MoETransformer.from_config(model_config(cfg), dtype=DTYPES[cfg.model.dtype], seed=cfg.seed)
