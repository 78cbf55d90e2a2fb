"""`num_parameters(config, active)`: parameter counts from a `MoEConfig`, without building the model.

Counts `nn.Parameter`s exactly as `MoETransformer` holds them (buffers such as the router's selection
bias are not parameters; a tied lm_head counts once). `active=True` counts what one token uses: the
whole model except the routed experts it is not sent to, i.e. (E − k) experts per MoE layer are left
out; embeddings, lm_head, attention, routers, shared experts and dense MLPs are all counted.
Attention is the "full" GQA layer (the hybrid's KDA / DSA layers are counted by their own modules).
"""

from __future__ import annotations

from jointrl.model.config import MoEConfig


def num_parameters(config: MoEConfig, active: bool = False) -> int:
    """Total (or per-token active) parameter count; see the module docstring."""
    c = config
    H, D = c.hidden_size, c.head_dim
    embed = c.vocab_size * H * (1 if c.tie_word_embeddings else 2)
    qk_norm = {"head": 2 * D, "full": (c.num_attention_heads + c.num_key_value_heads) * D, "none": 0}[c.qk_norm]
    attention = 2 * H * c.num_attention_heads * D + 2 * H * c.num_key_value_heads * D + qk_norm
    layer_norms = 2 * H
    dense_mlp = 3 * H * c.intermediate_size
    experts = c.num_experts_per_tok if active else c.num_experts
    moe = (experts * 3 * H * c.moe_intermediate_size            # routed experts
           + c.num_experts * H                                  # router
           + c.n_shared_experts * 3 * H * c.moe_intermediate_size
           + (H if c.shared_expert_gate else 0))
    per_layer = attention + layer_norms
    return (embed + H                                            # final norm
            + c.num_hidden_layers * per_layer
            + c.first_k_dense_replace * dense_mlp
            + c.num_moe_layers * moe)
