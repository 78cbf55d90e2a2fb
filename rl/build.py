"""Constructing the model, its tokenizer and chat template from ``Config``: one place, so the
learner, rollout and env workers, server and tracker build them alike."""

from __future__ import annotations

from dataclasses import asdict

import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.hf import load_hf
from jointrl.model.harmony import HarmonyTemplate
from jointrl.model.hf_chat_template import HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.model.tokenizer import ByteTokenizer, Tokenizer
from jointrl.rl.config import Config
from jointrl.rl.device import as_device, materialise

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build_tokenizer(cfg: Config) -> Tokenizer:
    """The run's tokenizer: ``model.tokenizer`` / ``model.path``'s (``HFTokenizer``), else the byte tokenizer."""
    source = cfg.model.tokenizer or cfg.model.path
    if source is None:
        return ByteTokenizer()
    return HFTokenizer(source)


def build_template(cfg: Config, image_tokens: int = 0) -> ChatTemplate | HFChatTemplate | HarmonyTemplate:
    """The run's chat template: the checkpoint's own Jinja (``HFChatTemplate``, checked for the prefix
    property at construction) when ``model.path`` is set, else the byte ChatML ``ChatTemplate``; a
    harmony tokenizer (gpt-oss) gets ``HarmonyTemplate``, our renderer of the published format."""
    tok = build_tokenizer(cfg)
    if isinstance(tok, ByteTokenizer):
        return ChatTemplate(tok, image_tokens=image_tokens)
    if tok.harmony:
        return HarmonyTemplate(tok, image_tokens=image_tokens)
    return HFChatTemplate(tok, image_tokens=image_tokens)


def model_config(cfg: Config) -> MoEConfig:
    return MoEConfig(**{k: v for k, v in asdict(cfg.model).items() if k not in ("name", "dtype", "kernels", "path", "tokenizer")})


def build_model(cfg: Config, device: torch.device | str | None = None) -> MoETransformer:
    """The policy at initialisation on ``device`` (None: ``rl/device.rank_device()``): ``model.path``'s
    weights (``model/hf.load_hf``) when set, else random and deterministic in ``cfg.seed``. Either way
    the model is built on the meta device and each tensor allocated once, on ``device``
    (``rl/device.materialise``): the same code for the host and a GPU. Its kernel backend is
    ``model.kernels``, resolved on ``device`` (``MoETransformer.set_kernels``)."""
    device, dtype = as_device(device), DTYPES[cfg.model.dtype]
    if cfg.model.path is not None:
        model = load_hf(cfg.model.path, dtype=dtype, device=device, config=model_config(cfg))
    else:
        with torch.device("meta"):
            model = MoETransformer(model_config(cfg))
        model = materialise(model, device, dtype, cfg.seed)
    model.set_kernels(cfg.model.kernels)
    return model
