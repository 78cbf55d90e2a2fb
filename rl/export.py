"""``jointrl export checkpoint=<dir> format=hf|mxfp4|both out=<dir> [config overrides]``.

Reads a training checkpoint (``<output_dir>/checkpoints`` -- its ``latest`` tag -- or
``.../checkpoints/step_N``) in the one format (``rl/checkpoint_format.py``): every learner rank's
part, fp32 masters joined (expert rows in expert order) and cast to the model's dtype, whatever
``learner.num_ranks`` / ``ep_size`` wrote it; Adam's moments are not read. The model's shape comes from the run's ``config.yaml`` (the driver writes it
beside ``checkpoints/``), else from ``conf/`` and the overrides given.

``hf``: ``transformers``-loadable safetensors through the model's exporters (``model/hf.save_gpt_oss``
for gpt-oss, in its own layout -- MXFP4 experts as ``*_blocks`` + ``*_scales`` with ``format=mxfp4``;
``model/hf.save_hf`` for Qwen3-MoE shapes: shards of at most 4 GB plus ``model.safetensors.index.json``, written shard
by shard; ``model/hf.save_kimi_linear`` for Kimi-Linear-shaped models with MLA layers, in its layout;
``model/hf_hybrid.save_hybrid`` -- remote code -- for other hybrids) plus the tokenizer and
chat template: the run's ``model.path`` checkpoint's own files, copied, else the byte
tokenizer's (``model/hf_tokenizer.py``).

``mxfp4``: the same directory (sharded alike), but every routed expert is stored per expert in the
compressed-tensors ``mxfp4-pack-quantized`` layout (``experts.{e}.{gate,up,down}_proj``
``.weight_packed`` uint8 ``[out, in/2]``, low nibble first, and ``.weight_scale`` E8M0 uint8
``[out, in/32]``), quantized by ``kernels.mxfp4`` with ``rollout``'s scale rule (the push's:
``floor``) from the tensors the push quantizes, so they dequantize to exactly the weights the
rollout engine ran; ``config.json`` carries the ``quantization_config`` and ``README.md`` (the
model card) states the scale rule. ``both``: ``<out>/hf`` and ``<out>/mxfp4``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from jointrl.kernels.mxfp4 import quantize_mxfp4
from jointrl.model.hf import SHARD_BYTES, kimi_linear_misfit, save_gpt_oss, save_hf, save_kimi_linear
from jointrl.model.hf_hybrid import save_hybrid
from jointrl.model.hf_tokenizer import copy_tokenizer, save_tokenizer
from jointrl.model.moe_transformer import MoETransformer
from jointrl.rl.checkpoint_format import read_policy
from jointrl.rl.config import Config, load_config
from jointrl.rl.weight_sync import is_routed_expert

FORMATS = ("hf", "mxfp4", "both")
SCALE_RULE = "floor"  # what the weight push uses (weight_sync.iter_buckets' default)


def run_config(checkpoint: Path, overrides: list[str]) -> Config:
    """The run's ``config.yaml`` (found beside ``checkpoints/``) with ``overrides``, else ``conf/``."""
    for d in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (d / "config.yaml").is_file():
            merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(d / "config.yaml"),
                                     OmegaConf.from_dotlist(overrides))
            return OmegaConf.to_object(merged)
    return load_config(overrides)


def export_hf(model: MoETransformer, out: str | Path, tokenizer_dir: str | Path | None = None,
              tensors=None, config_extra: dict | None = None, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Sharded safetensors + index + config (``model/hf.save_hf``; remote code and one file for
    hybrids) + the tokenizer and chat template: copied from ``tokenizer_dir`` (the checkpoint the
    run started from, ``model.path``) when given, else the byte tokenizer's (``model/hf_tokenizer``)."""
    out = Path(out)
    if model.config.is_gpt_oss:  # gpt-oss's own layout: experts unquantized here, MXFP4 in export_mxfp4
        save_gpt_oss(model, out, mxfp4=tensors is not None, max_shard_bytes=max_shard_bytes)
    elif "mla" in model.config.kinds and kimi_linear_misfit(model.config) is None:  # Kimi-Linear's own layout
        if tensors is not None:
            raise ValueError("MXFP4 export of Kimi-Linear models is not supported")
        save_kimi_linear(model, out, max_shard_bytes)
    elif any(kind != "full" for kind in model.config.kinds):
        if tensors is not None:
            raise ValueError("MXFP4 export of hybrid models is not supported")
        save_hybrid(model, out)
    else:
        save_hf(model, out, max_shard_bytes, tensors, config_extra)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    else:
        save_tokenizer(out)
    return out


def export_mxfp4(model: MoETransformer, out: str | Path, step: int, tokenizer_dir: str | Path | None = None,
                 max_shard_bytes: int = SHARD_BYTES) -> Path:
    """``export_hf`` with routed experts stored as their per-expert MXFP4 packing, shard by shard (gpt-oss:
    the hub's ``*_blocks`` / ``*_scales`` layout and ``quant_method: mxfp4``, model/hf_gpt_oss.py)."""
    out = export_hf(model, out, tokenizer_dir, _mxfp4_tensors, {"quantization_config": quantization_config()},
                    max_shard_bytes)
    (out / "README.md").write_text(MODEL_CARD.format(step=step, rule=SCALE_RULE))
    return out


def _mxfp4_tensors(name: str, t: torch.Tensor):
    """One state-dict entry as stored: itself, or a routed expert tensor as per-expert
    ``weight_packed`` / ``weight_scale`` (quantized along the input dim, as the push does)."""
    if not is_routed_expert(name, t):
        yield name, t
        return
    blocks, scales = quantize_mxfp4(t.detach().to("cpu"), SCALE_RULE)
    prefix, kind = name.rsplit(".", 1)  # ...mlp.experts, gate_up_proj | down_proj
    parts = {"down_proj": (0, t.shape[1])} if kind == "down_proj" else \
        {"gate_proj": (0, t.shape[1] // 2), "up_proj": (t.shape[1] // 2, t.shape[1])}
    for e in range(t.shape[0]):
        for proj, (lo, hi) in parts.items():
            yield f"{prefix}.{e}.{proj}.weight_packed", blocks[e, lo:hi]
            yield f"{prefix}.{e}.{proj}.weight_scale", scales[e, lo:hi]


def quantization_config() -> dict:
    """compressed-tensors' ``quantization_config`` for MXFP4 routed experts, the rest unquantized."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None, "actorder": None,
               "block_structure": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                          "weights": weights, "input_activations": None, "output_activations": None,
                                          "format": "mxfp4-pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


MODEL_CARD = """# jointrl policy, step {step}: routed experts in MXFP4

Exported by `jointrl export ... format=mxfp4`. Routed-expert weights (`model.layers.*.mlp.experts.*`)
are stored per expert in the compressed-tensors `mxfp4-pack-quantized` layout; everything else
(attention, router, norms, embeddings, shared experts) is stored unquantized in the model's dtype.

* `*.weight_packed`: uint8 `[out, in/2]`, FP4 E2M1 (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
  element `2j` in the low nibble, `2j+1` in the high nibble.
* `*.weight_scale`: uint8 `[out, in/32]`, E8M0: one scale `2^(byte - 127)` per 32 consecutive
  input elements; `0xFF` marks a non-finite block (NaN).
* weight = E2M1(code) * 2^(byte - 127).

**Scale rule: `{rule}`** (OCP MX v1.0): the shared exponent of a block is
`e = floor(log2(amax)) - 2` (2 = emax of E2M1), clamped to [-127, 127], so `amax / 2^e` lies in
[4, 8) and the top of the block may saturate to 6. Elements `x / 2^e` round to the nearest E2M1
value, ties to even, saturating at +-6. This is the rule of the training run's weight push
(`jointrl/kernels/mxfp4.py`), so these weights dequantize to exactly the weights the rollout
engine sampled with at this policy version.
"""


def main(argv: list[str] | None = None) -> Path:
    """``checkpoint=`` ``format=`` ``out=`` are the command's; other ``key=value``s override the config."""
    args = list(sys.argv[1:] if argv is None else argv)
    mine = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in ("checkpoint", "format", "out")}
    overrides = [a for a in args if a.split("=", 1)[0] not in mine]
    if "checkpoint" not in mine or "out" not in mine:
        raise SystemExit("usage: jointrl export checkpoint=<run>/checkpoints format=hf|mxfp4|both out=<dir> [key=value ...]")
    fmt = mine.get("format", "hf")
    if fmt not in FORMATS:
        raise SystemExit(f"jointrl export: format={fmt!r} is not allowed; allowed values: {list(FORMATS)}")
    checkpoint, out = Path(mine["checkpoint"]), Path(mine["out"])
    cfg = run_config(checkpoint, overrides)
    model, step = read_policy(cfg, checkpoint)
    tokenizer = cfg.model.tokenizer or cfg.model.path  # the run started from a checkpoint: its tokenizer
    targets = {"hf": [("hf", out)], "mxfp4": [("mxfp4", out)], "both": [("hf", out / "hf"), ("mxfp4", out / "mxfp4")]}
    for kind, d in targets[fmt]:
        export_hf(model, d, tokenizer) if kind == "hf" else export_mxfp4(model, d, step, tokenizer)
        print(f"exported step {step} ({kind}) -> {d}", flush=True)
    return out
