"""``jointrl export``: a training checkpoint -> transformers-loadable safetensors (our logits in
transformers, our tokenizer and chat template) and the compressed-tensors MXFP4 layout (the
exact weights the rollout engine ran)."""

import io
import socket
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from jointrl.envs.base import Message, ToolCall, ToolSpec
from jointrl.model.chat_template import ChatTemplate
from jointrl.model.tokenizer import ByteTokenizer
from jointrl.rl.config import load_config
from jointrl.rl.checkpoint_format import read_policy
from jointrl.rl.export import main as export_main
from jointrl.rl.weight_sync import build_bundle, is_routed_expert

IDS = [[257, 115, 121, 115, 10, 72, 105, 33, 258, 10, 257, 97, 10, 259, 120, 260, 50, 43, 50]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the driver leaves it: config.yaml, and a checkpoint at step 3
    whose weights are not the initial ones."""
    from jointrl.rl.learner.worker import LearnerWorker

    out = tmp_path_factory.mktemp("run")
    cfg = load_config([f"output_dir={out}", "seed=5"])
    OmegaConf.save(OmegaConf.structured(cfg), out / "config.yaml")
    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_port())
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in lw.engine.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    lw.save_checkpoint(str(out / "checkpoints"), 3)
    lw.wait_checkpoint()
    return out


def test_hf_export_reproduces_our_logits_tokenizer_and_template_in_transformers(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_main([f"checkpoint={run_dir / 'checkpoints'}", "format=hf", f"out={tmp_path}"])
    ours, step = read_policy(load_config(["seed=5"]), run_dir / "checkpoints" / "step_3")
    assert step == 3
    ids = torch.tensor(IDS)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits
        want = ours(ids).logits
    assert torch.allclose(theirs, want, atol=1e-5, rtol=0), (theirs - want).abs().max()
    fresh = read_policy(load_config(["seed=6"]), run_dir / "checkpoints")[0]  # the checkpoint's weights, not the seed's
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ours.state_dict().values()))

    tok, byte_tok, template = AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer(), ChatTemplate()
    text = "héllo wörld\n\t{'a': 1} 日本"
    assert tok.encode(text, add_special_tokens=False) == byte_tok.encode(text)
    tools = [ToolSpec("bash", "Run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}})]
    msgs = [Message("system", "Be brief."), Message("user", "list files"),
            Message("assistant", "ok", reasoning="hmm", tool_calls=[ToolCall("bash", {"cmd": "ls -la"})]),
            Message("tool", "a b c", name="bash")]
    rendered = tok.apply_chat_template([m.to_openai() for m in msgs], tools=[t.to_openai() for t in tools],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered == byte_tok.decode(template.render(msgs, tools))
    plain = tok.apply_chat_template([m.to_openai() for m in msgs[1:]], tokenize=False, add_generation_prompt=True)
    assert tok.encode(plain, add_special_tokens=False) == template.render(msgs[1:])


def test_mxfp4_export_dequantizes_to_exactly_the_rollout_engines_weights(run_dir, tmp_path):
    import json

    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from jointrl.rl.rollout.worker import RolloutWorker

    export_main([f"checkpoint={run_dir / 'checkpoints'}", "format=mxfp4", f"out={tmp_path}"])
    cfg = load_config(["seed=5"])
    policy, step = read_policy(cfg, run_dir / "checkpoints")
    engine = RolloutWorker(cfg).engine  # receives the checkpoint's weights as the driver pushes them
    engine.update_weights(step, build_bundle(policy.state_dict(), step, is_quantized=is_routed_expert))
    ran = engine.model.state_dict()

    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert qc.format == "mxfp4-pack-quantized" and scheme.weights.group_size == 32
    assert "Scale rule: `floor`" in (tmp_path / "README.md").read_text()
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    stored = {k: v for shard in shards for k, v in load_file(tmp_path / shard).items()}
    checked = 0
    for name, weight in ran.items():
        if not is_routed_expert(name, weight):
            assert torch.equal(stored[name], weight), name  # dense tensors as they are
            continue
        half = weight.shape[1] // 2
        projs = {"down_proj": slice(None)} if name.endswith("down_proj") else \
            {"gate_proj": slice(0, half), "up_proj": slice(half, None)}
        prefix = name.rsplit(".", 1)[0]
        for e in range(weight.shape[0]):
            for proj, rows in projs.items():
                packed = {k: stored[f"{prefix}.{e}.{proj}.{k}"] for k in ("weight_packed", "weight_scale")}
                dense = MXFP4PackedCompressor.decompress(packed, scheme)["weight"]  # compressed-tensors' reader
                assert torch.equal(dense.float(), weight[e, rows]), f"{prefix}.{e}.{proj}"
                checked += 1
    assert checked == 3 * cfg.model.num_experts * cfg.model.num_hidden_layers
    # ... and they are not the learner's unquantized weights
    assert not torch.equal(ran["model.layers.0.mlp.experts.down_proj"], policy.state_dict()["model.layers.0.mlp.experts.down_proj"])


def test_cli_names_a_bad_format(run_dir, tmp_path, monkeypatch):
    from jointrl.rl.cli import main as cli_main

    monkeypatch.setattr(sys, "argv", ["jointrl", "export", f"checkpoint={run_dir / 'checkpoints'}", "format=gguf",
                                      f"out={tmp_path}"])
    with pytest.raises(SystemExit, match=r"format='gguf' is not allowed; allowed values: \['hf', 'mxfp4', 'both'\]"):
        cli_main()
    assert not any(tmp_path.iterdir())


# -- expert-sharded checkpoints (2 processes) ------------------------------------------------


def _ep_rank(rank: int, port: int, out: str, q) -> None:
    from jointrl.rl.learner.worker import LearnerWorker

    cfg = load_config([f"output_dir={out}", "seed=5", "learner.num_ranks=2", "learner.ep_size=2"])
    lw = LearnerWorker(cfg, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for name, p in lw.engine.module.named_parameters():
            if ".experts." in name:  # each rank moves its own experts; shared weights stay equal
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    lw.engine.optimizer.refresh_fp32_params()  # the fp32 masters (what a checkpoint holds) follow, as after a step
    lw.save_checkpoint(str(Path(out) / "checkpoints"), 2)
    lw.wait_checkpoint()
    logprobs = lw.logprobs(IDS)  # the expert-parallel forward: every rank takes part
    if rank == 0:
        buf = io.BytesIO()
        torch.save(logprobs, buf)
        q.put(buf.getvalue())


@pytest.mark.slow
def test_expert_sharded_checkpoint_exports_the_expert_parallel_model(tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from jointrl.rl.learner.batch import logprobs_from_logits

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    OmegaConf.save(OmegaConf.structured(load_config(["seed=5", "learner.num_ranks=2", "learner.ep_size=2"])),
                   tmp_path / "config.yaml")
    ctx, port = mp.get_context("spawn"), _port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_ep_rank, args=(r, port, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    want = torch.load(io.BytesIO(q.get(timeout=600)))
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    # one part per rank, nothing else beside them (no DeepSpeed files)
    assert sorted(x.name for x in (tmp_path / "checkpoints" / "step_2").iterdir()) == \
        ["part_000.pt", "part_001.pt", "topology.json"]
    export_main([f"checkpoint={tmp_path / 'checkpoints'}", "format=hf", f"out={tmp_path / 'hf'}"])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.tensor(IDS)).logits
    got = logprobs_from_logits(logits, torch.tensor(IDS), 1.0)[0]
    assert torch.allclose(got[1:], torch.tensor(want[0])[1:], atol=1e-5)


def test_kimi_linear_shaped_model_exports_in_kimi_linears_layout(tmp_path):
    """3 KDA : 1 MLA with sigmoid routing, a shared expert and a dense first MLP: written as kimi_linear (no
    remote code), which plain transformers loads as `KimiLinearForCausalLM` with our logits."""
    from transformers import AutoModelForCausalLM

    from jointrl.model import MoEConfig, MoETransformer
    from jointrl.rl.export import export_hf

    cfg = MoEConfig.preset("tiny_hybrid", layer_types=("kda", "kda", "kda", "mla"), first_k_dense_replace=1,
                           q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                           num_key_value_heads=4)
    ours = MoETransformer.from_config(cfg, seed=2).eval()
    export_hf(ours, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "KimiLinearForCausalLM"
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids).logits).abs().max() <= 1e-5
