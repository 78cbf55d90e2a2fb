"""Export writes what came in: a Qwen3-MoE loaded from a transformers directory (tests/conftest.py)
goes back out as sharded safetensors with an index, its own tokenizer and chat template, and
reloads in transformers with equal logits; MXFP4 keeps compressed-tensors' layout, sharded."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from jointrl.envs.base import Message, ToolCall
from jointrl.model.hf import load_hf
from jointrl.model.hf_chat_template import PROBE_TOOLS, HFChatTemplate
from jointrl.model.hf_tokenizer import HFTokenizer
from jointrl.rl.export import export_hf, export_mxfp4
from jointrl.rl.weight_sync import is_routed_expert


def _shards(d) -> dict[str, str]:
    assert not (d / "model.safetensors").exists()
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]


def test_hf_export_reloads_with_equal_logits_tokenizer_and_template(qwen3_dir, tmp_path):
    ours = load_hf(qwen3_dir)
    out = export_hf(ours, tmp_path / "out", tokenizer_dir=qwen3_dir, max_shard_bytes=300_000)
    weight_map = _shards(out)
    assert len(set(weight_map.values())) >= 3 and set(weight_map) == set(ours.state_dict())
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        assert (ours(ids, attention_mask=mask).logits - ref)[mask].abs().max() <= 1e-5
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (qwen3_dir / name).read_bytes(), name
    msgs = [Message("user", "list files"), Message("assistant", "ok", reasoning="hm",
                                                     tool_calls=[ToolCall("run", {"command": "ls"})]),
            Message("tool", "a.txt", name="run")]
    src, dst = HFChatTemplate(HFTokenizer(qwen3_dir)), HFChatTemplate(HFTokenizer(out))
    assert dst.render(msgs, PROBE_TOOLS) == src.render(msgs, PROBE_TOOLS)


def test_mxfp4_export_is_sharded_in_compressed_tensors_layout(qwen3_dir, tmp_path):
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    from jointrl.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    ours = load_hf(qwen3_dir)
    out = export_mxfp4(ours, tmp_path / "q", step=7, tokenizer_dir=qwen3_dir, max_shard_bytes=200_000)
    weight_map = _shards(out)
    assert len(set(weight_map.values())) >= 3
    config = json.loads((out / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    stored = {}
    for shard in set(weight_map.values()):
        with safe_open(out / shard, framework="pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(stored) == set(weight_map)
    checked = 0
    for name, w in ours.state_dict().items():
        if not is_routed_expert(name, w):
            assert torch.equal(stored[name], w), name
            continue
        blocks, scales = quantize_mxfp4(w, "floor")
        want = dequantize_mxfp4(blocks, scales, torch.float32)
        half = w.shape[1] // 2
        projs = {"down_proj": slice(None)} if name.endswith("down_proj") else \
            {"gate_proj": slice(0, half), "up_proj": slice(half, None)}
        for e in range(w.shape[0]):
            for proj, rows in projs.items():
                key = f"{name.rsplit('.', 1)[0]}.{e}.{proj}"
                packed = {k: stored[f"{key}.{k}"] for k in ("weight_packed", "weight_scale")}
                assert torch.equal(MXFP4PackedCompressor.decompress(packed, scheme)["weight"].float(), want[e, rows])
                checked += 1
    assert checked == 3 * ours.config.num_experts * ours.config.num_hidden_layers
