"""``rollout.backend=vllm`` at start: what the config and the preflight refuse, naming why, and the
driver's mismatch-KL stop (``rl/train.check_mismatch``). No vLLM start here (those are
tests/rl/rollout/test_vllm_engine.py and tests/rl/test_vllm_train.py)."""

from pathlib import Path

import pytest

from jointrl.rl.config import load_config
from jointrl.rl.preflight import check, guard
from jointrl.rl.rollout.vllm.engine import DEFAULT_VENV, sleep_mode_unavailable
from jointrl.rl.train import check_mismatch


def test_vllm_needs_a_checkpoint_and_float32_or_bfloat16(qwen3_dir):
    with pytest.raises(ValueError, match="model=hf model.path"):
        check(["rollout.backend=vllm"])
    with pytest.raises(ValueError, match="no float64"):
        load_config(["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", "model.dtype=float64"])
    cfg = load_config(["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", "rollout.vllm.kv_cache_mb=64"])
    assert str(cfg.rollout.backend) == "vllm" and cfg.rollout.vllm.kv_cache_mb == 64


@pytest.mark.parametrize("key", ["rollout.top_k=20", "rollout.top_p=0.9"])
def test_vllm_refuses_top_k_and_top_p(qwen3_dir, key):
    with pytest.raises(ValueError, match="refuses top-k / top-p"):
        load_config(["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", key])


def test_routing_replay_with_vllm_is_refused_at_start_naming_why(qwen3_dir):
    with pytest.raises(ValueError, match="routing_replay=true with rollout.backend=vllm: .*model runner V2.*Triton"):
        check(["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", "learner.routing_replay=true"])


def test_colocated_vllm_is_refused_before_ray_where_its_build_has_no_sleep_mode(qwen3_dir, capsys):
    """cluster.colocate=true asks vLLM to sleep through each learner step; the venv's own vLLM is asked
    whether it can (``current_platform.is_sleep_mode_available()``), and a build without sleep mode is
    refused with one line naming the build. A build with it passes this check (then the GPU path runs)."""
    if not (Path(DEFAULT_VENV) / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {DEFAULT_VENV}: run `bash .ci/setup.d/vllm.sh`")
    why = sleep_mode_unavailable(DEFAULT_VENV)
    args = ["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", "cluster.colocate=true"]
    if why is None:
        check(args)  # this venv's vLLM sleeps: nothing to refuse
        pytest.skip(f"the vLLM build in {DEFAULT_VENV} has sleep mode: the refusal does not apply")
    assert "has no sleep mode" in why and DEFAULT_VENV in why
    with pytest.raises(SystemExit) as e:
        guard("train", args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("jointrl: error: cluster.colocate=true with rollout.backend=vllm needs vLLM's sleep mode: "
                          f"{why}"), err
    check(args[:-1])  # not colocated: no sleep asked for, no refusal


def test_sleep_level_is_1_or_2_and_a_missing_venv_is_named(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="rollout.vllm.sleep_level"):
        load_config(["model=hf", f"model.path={qwen3_dir}", "rollout.backend=vllm", "rollout.vllm.sleep_level=3"])
    assert load_config(["rollout.vllm.sleep_level=2"]).rollout.vllm.sleep_level == 2
    assert "no vLLM venv at rollout.vllm.venv=" in sleep_mode_unavailable(str(tmp_path / "none"))


def test_mismatch_kl_is_printed_and_a_step_above_the_limit_stops_the_run(capsys):
    metrics = {"mismatch/kl_k3": 2e-3, "mismatch/kl_k1": 1e-3}
    check_mismatch(5, metrics, None)
    check_mismatch(5, metrics, 1e-2)
    assert capsys.readouterr().out.count("step 5: mismatch KL(rollout || learner) k3 2.000e-03") == 2
    with pytest.raises(SystemExit, match="step 5: the learner-vs-rollout mismatch KL 0.002 exceeds "
                                         "rollout.max_mismatch_kl=0.001"):
        check_mismatch(5, metrics, 1e-3)
    check_mismatch(5, {}, 1e-9)  # a step without a learner update has nothing to check
