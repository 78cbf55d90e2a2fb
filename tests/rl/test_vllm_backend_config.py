"""``rollout.backend=vllm`` at start: what the config and the preflight refuse, naming why, and the
driver's mismatch-KL stop (``rl/train.check_mismatch``). No vLLM start here (those are
tests/rl/rollout/test_vllm_engine.py and tests/rl/test_vllm_train.py)."""

import pytest

from jointrl.rl.config import load_config
from jointrl.rl.preflight import check
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


def test_mismatch_kl_is_printed_and_a_step_above_the_limit_stops_the_run(capsys):
    metrics = {"mismatch/kl_k3": 2e-3, "mismatch/kl_k1": 1e-3}
    check_mismatch(5, metrics, None)
    check_mismatch(5, metrics, 1e-2)
    assert capsys.readouterr().out.count("step 5: mismatch KL(rollout || learner) k3 2.000e-03") == 2
    with pytest.raises(SystemExit, match="step 5: the learner-vs-rollout mismatch KL 0.002 exceeds "
                                         "rollout.max_mismatch_kl=0.001"):
        check_mismatch(5, metrics, 1e-3)
    check_mismatch(5, {}, 1e-9)  # a step without a learner update has nothing to check
