"""The MoE transformer: config, layers, KV cache and Hugging Face import/export."""

from jointrl.model.config import PRESETS, MoEConfig
from jointrl.model.hf import load_hf, save_hf
from jointrl.model.kv_cache import KVCache
from jointrl.model.moe_transformer import ModelOutput, MoETransformer
from jointrl.model.params import num_parameters
from jointrl.model.routing import update_router_bias

__all__ = ["PRESETS", "KVCache", "MoEConfig", "ModelOutput", "MoETransformer", "load_hf", "num_parameters",
           "save_hf", "update_router_bias"]
