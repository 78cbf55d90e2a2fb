"""Constructing the model, its tokenizer and chat template from ``Config``: one place, so the
learner, rollout and env workers, server and tracker build them alike."""

from __future__ import annotations

from dataclasses import asdict

import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf import load_hf
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.model.tokenizer import ByteTokenizer, Tokenizer
from jointrl.rl.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build_tokenizer(cfg: Config) -> Tokenizer:
    """The run's tokenizer: ``model.tokenizer`` / ``model.path``'s (``HFTokenizer``), else the byte tokenizer."""
    source = cfg.model.tokenizer or cfg.model.path
    if source is None:
        return ByteTokenizer()
    return HFTokenizer(source)


def build_template(cfg: Config, image_tokens: int = 0) -> ChatTemplate | HFChatTemplate:
    """The run's chat template: the checkpoint's own Jinja (``HFChatTemplate``, checked for the prefix
    property at construction) when ``model.path`` is set, else the byte ChatML ``ChatTemplate``."""
    tok = build_tokenizer(cfg)
    if isinstance(tok, ByteTokenizer):
        return ChatTemplate(tok, image_tokens=image_tokens)
    return HFChatTemplate(tok, image_tokens=image_tokens)


def model_config(cfg: Config) -> MoEConfig:
    return MoEConfig(**{k: v for k, v in asdict(cfg.model).items() if k not in ("name", "dtype", "kernels", "path", "tokenizer")})


def build_model(cfg: Config) -> MoETransformer:
    """The policy at initialisation: ``model.path``'s weights (``model/hf.load_hf``) when set, else
    random and deterministic in ``cfg.seed``; its kernel backend ``model.kernels``."""
    if cfg.model.path is not None:
        model = load_hf(cfg.model.path, dtype=DTYPES[cfg.model.dtype], config=model_config(cfg))
        model.set_kernels(cfg.model.kernels)
        return model
    return MoETransformer.from_config(model_config(cfg), dtype=DTYPES[cfg.model.dtype], seed=cfg.seed,
                                      kernels=cfg.model.kernels)
