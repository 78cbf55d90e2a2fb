"""model=hf model.path=DIR: the shape comes from config.json, a disagreeing override and a bad
directory are one-line ValueErrors, before anything heavy starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from jointrl.model.hf import load_hf
from jointrl.rl.build import build_model
from jointrl.rl.config import load_config


def test_model_hf_takes_shape_and_weights_from_the_checkpoint(qwen3_dir):
    cfg = load_config(["model=hf", f"model.path={qwen3_dir}", "model.router_aux_loss_coef=0.0"])
    hf = json.loads((qwen3_dir / "config.json").read_text())
    assert (cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.head_dim) == (hf["vocab_size"], 128, 64)
    assert cfg.model.router_aux_loss_coef == 0.0  # a training knob, not the shape: the run's value
    model = build_model(cfg)
    assert model.config.router_aux_loss_coef == 0.0
    for (k, a), b in zip(model.state_dict().items(), load_hf(qwen3_dir).state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert load_config([]).model.vocab_size == 264  # the presets keep their shapes


def test_a_disagreeing_shape_override_names_both_values(qwen3_dir):
    with pytest.raises(ValueError, match=r"'model.hidden_size' = 256 disagrees with .*config.json, which gives 128"):
        load_config(["model=hf", f"model.path={qwen3_dir}", "model.hidden_size=256"])
    with pytest.raises(ValueError, match="'model.tokenizer' needs model.path"):
        load_config([f"model.tokenizer={qwen3_dir}"])


def _copy(src, dst, drop=(), config=None):
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in drop:
            shutil.copyfile(p, dst / p.name)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_bad_model_paths_fail_fast_with_one_line(qwen3_dir, tmp_path, kimi_files):
    with pytest.raises(ValueError, match="'model.path' is unset"):
        load_config(["model=hf"])
    # Kimi's tokenizer files: their 256 reserved special ids reach past this model's vocabulary
    kimi = kimi_files[0](_copy(qwen3_dir, tmp_path / "kimi", drop=("tokenizer.json",)))
    cases = {
        kimi: r"kimi': token id \d+ is outside the model's vocabulary",
        tmp_path / "nope": "is not a directory",
        _copy(qwen3_dir, tmp_path / "notok", drop=("tokenizer.json",)): "has no tokenizer.json",
        _copy(qwen3_dir, tmp_path / "llama", config={"model_type": "llama"}): "unsupported model_type 'llama'",
        _copy(qwen3_dir, tmp_path / "noweights", drop=("model.safetensors",)): "has no model.safetensors",
    }
    for path, message in cases.items():
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=message) as err:
            load_config(["model=hf", f"model.path={path}"])
        assert time.monotonic() - t0 < 10 and "\n" not in str(err.value), str(err.value)


def test_the_check_runs_before_anything_heavy(qwen3_dir, tmp_path):
    """In a fresh process: a bad model.path fails in config validation, without importing ray."""
    code = ("import sys; from jointrl.rl.config import load_config\n"
            "try:\n    load_config(['model=hf', 'model.path=' + sys.argv[1]])\n"
            "except ValueError as e:\n    print(e); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines()[-2:] == [f"model.path={str(tmp_path / 'missing')!r} is not a directory", "False"]
