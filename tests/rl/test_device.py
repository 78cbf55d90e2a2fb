"""The device is a parameter (rl/device.py): models built on the meta device and materialised equal the
eagerly built ones bit for bit; DeepSpeed's accelerator follows the device; and no module of rl/ or
model/ hard-codes the host device or forces DeepSpeed's accelerator (a source scan, with the few
places that must name the host listed with their reason)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jointrl.model import MoETransformer
from jointrl.rl.build import DTYPES, build_model, model_config
from jointrl.rl.config import load_config
from jointrl.rl.device import HOST, as_device, choose_accelerator, dist_backend, rank_device

ROOT = Path(__file__).resolve().parents[2]
HYBRID = ["model=tiny_hybrid", "model.index_topk=4", "model.kda_chunk_size=4", "model.dsa_query_chunk=5"]


@pytest.mark.parametrize("overrides", [[], ["model.dtype=bfloat16"], ["model.tie_word_embeddings=true"],
                                       ["model.scoring_func=sigmoid"], HYBRID])
def test_meta_build_equals_eager(overrides):
    """build_model (meta, then one allocation on the device) == the eager constructor, every tensor and dtype."""
    cfg = load_config(["seed=3", *overrides])
    eager = MoETransformer.from_config(model_config(cfg), dtype=DTYPES[cfg.model.dtype], seed=3)
    built = build_model(cfg, HOST)
    want, got = eager.state_dict(), built.state_dict()
    assert list(want) == list(got)
    for k in want:
        assert got[k].device == HOST and got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k
    if cfg.model.tie_word_embeddings:
        assert built.lm_head.weight is built.model.embed_tokens.weight


def test_rank_device_and_backend():
    device = rank_device()
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert as_device(None) == device
    assert dist_backend(torch.device("cuda", 0)) == "nccl" and dist_backend(HOST) == "gloo"


def test_choose_accelerator_refuses_a_contradiction(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='cuda'"):
        choose_accelerator(HOST)
    monkeypatch.delenv("DS_ACCELERATOR")
    assert choose_accelerator(HOST) == "cpu" and os.environ["DS_ACCELERATOR"] == "cpu"


def test_choose_accelerator_refuses_deepspeeds_earlier_choice():
    """A process whose DeepSpeed already chose the host accelerator cannot run a CUDA rank."""
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
            "from deepspeed.accelerator import get_accelerator; get_accelerator()\n"
            "del os.environ['DS_ACCELERATOR']\n"
            "import torch; from jointrl.rl.device import choose_accelerator\n"
            "try:\n    choose_accelerator(torch.device('cuda', 0))\nexcept ValueError as e:\n    print('refused', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "refused DeepSpeed already chose accelerator 'cpu'" in out.stdout, out.stderr[-2000:]


# --- the scan ------------------------------------------------------------------------------------
# (file, what names the host) -> why it must. Anything else in rl/ or model/ that calls .cpu(), passes
# "cpu" to a call, or mentions DS_ACCELERATOR fails the test.
ALLOWED = {
    ("rl/device.py", 'device("cpu")'): "the one definition of the host device (HOST) and DeepSpeed's accelerator",
    ("rl/device.py", "DS_ACCELERATOR"): "the one place DeepSpeed's accelerator is chosen, from the rank's device",
    ("rl/weight_sync.py", ".cpu()"): "XXH3 digests hash host bytes (numpy view of a tensor)",
    ("rl/types.py", ".cpu()"): "a tensor encoded into JSON / numpy for a record (host bytes)",
    ("rl/rollout/llm_engine.py", ".cpu()"): "image patches hashed into the prefix cache's key (host bytes)",
    ("rl/rollout/server.py", 'map_location="cpu"'): "a saved state read from disk: loaded to the host, then copied in",
    ("rl/export.py", 'to("cpu")'): "an export writes host tensors to safetensors files",
    ("rl/learner/portable_checkpoint.py", ".cpu()"): "checkpoint: parameters and moments saved from host copies",
    ("rl/learner/portable_checkpoint.py", 'map_location="cpu"'): "checkpoint parts loaded to the host, then copied in",
    ("rl/learner/checkpoint.py", 'map_location="cpu"'): "checkpoint files loaded to the host, then copied in",
    ("rl/learner/portable_checkpoint.py", 'to("cpu")'): "checkpoint: each rank's part copied to host memory first",
    ("rl/checkpoint_format.py", 'map_location="cpu"'): "checkpoint parts memory-mapped on the host, then copied in",
    ("rl/rollout/vllm/weights.py", 'to("cpu")'): "the CPU weight push to vLLM writes host tensors to a safetensors file",
    ("model/hf_gpt_oss.py", 'to("cpu")'): "a gpt-oss export quantizes host copies into safetensors files",
    ("rl/weight_transport.py", ".cpu()"): "the wire format's header and lengths are read as host bytes",
    ("model/hf.py", 'to("cpu")'): "save_hf writes host tensors to safetensors files",
    ("model/hf_hybrid.py", 'to("cpu")'): "a hybrid checkpoint writes host tensors to safetensors files",
}


def _host_names(path: Path) -> list[tuple[str, int]]:
    """(what, line) for each .cpu() call, each call given the string "cpu" (positional or keyword) and
    each mention of DS_ACCELERATOR in ``path``'s code (comparisons such as ``x.device.type == "cpu"``
    test a capability and are not listed)."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "cpu" and not node.args:
                found.append((".cpu()", node.lineno))
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Constant) and arg.value == "cpu":
                    kw = next((k.arg for k in node.keywords if k.value is arg), None)
                    callee = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "?")
                    found.append((f'{kw}="cpu"' if kw else f'{callee}("cpu")', node.lineno))
        elif isinstance(node, ast.Constant) and node.value == "DS_ACCELERATOR":
            found.append(("DS_ACCELERATOR", node.lineno))
    return found


def test_no_hard_coded_host_device():
    bad = []
    for top in ("rl", "model"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for what, line in _host_names(path):
                if (rel, what) not in ALLOWED:  # a stale entry is not an error: files change under merges
                    bad.append(f"{rel}:{line}: {what}")
    assert not bad, "hard-coded host device (pass the device, or add to ALLOWED with the reason):\n" + "\n".join(bad)


def test_scan_catches_hard_coding(tmp_path):
    """The scan sees each form (so the test above can fail)."""
    src = tmp_path / "m.py"
    src.write_text('import os, torch\nx = torch.zeros(2).cpu()\ny = torch.zeros(2, device="cpu")\nz = x.to("cpu")\n'
                   'os.environ.setdefault("DS_ACCELERATOR", "cpu")\nok = x.device.type == "cpu"\n')
    assert sorted(_host_names(src)) == sorted([(".cpu()", 2), ('device="cpu"', 3), ('to("cpu")', 4),
                                               ("DS_ACCELERATOR", 5), ('setdefault("cpu")', 5)])
