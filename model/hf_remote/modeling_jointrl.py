"""Remote code shipped beside an exported jointrl hybrid checkpoint (`model/hf_hybrid.py`).

`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` reads `config.json`'s `auto_map`
and loads the two classes below. They wrap jointrl's own `MoETransformer` (so the logits are ours by
construction): the checkpoint needs `jointrl` importable, not a copy of the model code. The wrapper's
submodules are the model's own `model` and `lm_head`, so state-dict keys equal jointrl's.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from jointrl.model.config import MoEConfig
from jointrl.model.moe_transformer import MoETransformer


class JointrlHybridConfig(PretrainedConfig):
    """Every `MoEConfig` field as a top-level attribute (unknown keys kept, as transformers does)."""

    model_type = "jointrl_hybrid"

    def to_moe_config(self) -> MoEConfig:
        names = [f.name for f in dataclasses.fields(MoEConfig)]
        return MoEConfig(**{n: getattr(self, n) for n in names if hasattr(self, n)})


class JointrlHybridForCausalLM(PreTrainedModel):
    config_class = JointrlHybridConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: JointrlHybridConfig) -> None:
        super().__init__(config)
        inner = MoETransformer(config.to_moe_config())
        self.model = inner.model
        self.lm_head = inner.lm_head
        object.__setattr__(self, "_inner", inner)  # unregistered: keys stay `model.*`, `lm_head.*`
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint; a model built from a config draws jointrl's own init."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                image_patches: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, V] of jointrl's forward (no cache: prefill-style scoring)."""
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        logits = self._inner(input_ids, position_ids=position_ids, attention_mask=mask,
                             image_patches=image_patches).logits
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
