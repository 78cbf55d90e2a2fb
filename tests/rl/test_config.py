import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from jointrl.rl.config import Config, DomainConfig, EnvsConfig, load_config


def test_default_config_composes():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.name == "tiny_moe" and cfg.algo.name == "grpo" and "terminal" in cfg.envs.domains


def test_unknown_key_names_the_key():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as e:
        load_config(["algo.group_sise=4"])
    assert "group_sise" in str(e.value)
    with pytest.raises(Exception) as e:
        load_config(["+learner.learning_rate=0.1"])
    assert "learning_rate" in str(e.value)


def test_bad_value_names_key_and_allowed_values():
    with pytest.raises(ValueError) as e:
        load_config(["learner.zero_stage=3"])
    assert "learner.zero_stage" in str(e.value) and "[0, 1, 2]" in str(e.value)
    with pytest.raises(ValueError) as e:
        load_config(["logger.wandb_mode=cloud"])
    assert "logger.wandb_mode" in str(e.value) and "offline" in str(e.value)
    with pytest.raises(ValueError) as e:  # a domain typo in an envs/*.yaml file
        EnvsConfig(domains={"kitchen": DomainConfig()})
    assert "kitchen" in str(e.value) and "terminal" in str(e.value)
    with pytest.raises(ValueError) as e:
        load_config(["learner.autocast=float16"])
    assert "learner.autocast" in str(e.value) and "bfloat16" in str(e.value)
    with pytest.raises(ValueError) as e:  # autocast casts float32 weights; a bfloat16 model has none
        load_config(["learner.autocast=bfloat16", "model.dtype=bfloat16"])
    assert "learner.autocast" in str(e.value) and "model.dtype" in str(e.value)
    for key in ("learner.lr_schedule", "recipe.sft_lr_schedule"):
        with pytest.raises(ValueError) as e:
            load_config([f"{key}=linear"])
        assert key in str(e.value) and "cosine" in str(e.value)


def test_wrong_type_names_the_key():
    with pytest.raises(ValueError) as e:
        load_config(["algo.group_size=many"])
    assert "group_size" in str(e.value)


def test_model_schema_matches_the_model_config():
    """conf's model group is MoEConfig's fields (derived, so it cannot drift); the default is tiny_moe."""
    from dataclasses import fields

    from jointrl.model import MoEConfig
    from jointrl.rl.build import model_config
    from jointrl.rl.config import ModelConfig

    schema = {f.name for f in fields(ModelConfig)} - {"name", "dtype", "kernels", "path", "tokenizer"}
    assert schema == {f.name for f in fields(MoEConfig)}
    assert model_config(load_config()) == MoEConfig.preset("tiny_moe")


def test_model_kernels_default_from_the_environment_and_reach_the_model(monkeypatch):
    """model.kernels: $JOINTRL_KERNEL_BACKEND is its default, a bad value names the key, and build_model hands
    the choice to the model's layers."""
    from jointrl.rl.build import build_model

    monkeypatch.setenv("JOINTRL_KERNEL_BACKEND", "torch")
    cfg = load_config()
    assert cfg.model.kernels == "torch" and build_model(cfg).kernels.backend == "torch"
    monkeypatch.delenv("JOINTRL_KERNEL_BACKEND")
    assert load_config().model.kernels == "auto"
    assert build_model(load_config(["model.kernels=triton"])).model.norm.kernels.backend == "triton"
    with pytest.raises(Exception, match="kernels"):
        load_config(["model.kernels=fast"])


def test_model_presets_in_conf_equal_the_model_presets():
    """conf/model/bench_moe.yaml is MoEConfig.preset("bench_moe"); MoE options are checked at load."""
    from jointrl.model import MoEConfig
    from jointrl.rl.build import model_config

    assert model_config(load_config(["model=bench_moe"])) == MoEConfig.preset("bench_moe")
    sigmoid = load_config(["model.scoring_func=sigmoid", "model.n_shared_experts=1"])
    assert model_config(sigmoid).scoring_func == "sigmoid"
    with pytest.raises(ValueError, match=r"model.scoring_func.*\['softmax', 'sigmoid'\]"):
        load_config(["model.scoring_func=relu"])


def test_an_envs_group_replaces_the_default_domains():
    """`envs=code_repo` trains on code_repo alone: the schema has no default domain to merge with."""
    assert list(load_config(["envs=code_repo"]).envs.domains) == ["code_repo"]
    assert list(load_config().envs.domains) == ["terminal"]


def test_envs_sandbox_holds_the_limits_and_the_old_key_is_an_alias():
    from jointrl.envs.sandbox.settings import sandbox_settings

    assert load_config([]).envs.sandbox.timeout_s == 10.0 and load_config(["envs=cad"]).envs.sandbox.timeout_s == 30.0
    cfg = load_config(["envs.command_timeout_s=5", "envs.sandbox.max_memory_mb=512", "envs.sandbox.backend=docker"])
    s = sandbox_settings(cfg.envs)
    assert (s.backend, s.config.timeout_s, s.config.max_memory_bytes) == ("docker", 5.0, 512 << 20)
    with pytest.raises(ValueError, match="envs.sandbox.max_disk_mb"):
        load_config(["envs.sandbox.max_disk_mb=0"])
    with pytest.raises(Exception, match="backend"):
        load_config(["envs.sandbox.backend=podman"])


def test_colocated_training_refuses_async_rollouts_in_one_line():
    """cluster.colocate=true: the engine sleeps through every learner step, so rollouts launched ahead
    (rollout.mode=async) could not overlap it; the config says so before anything starts."""
    with pytest.raises(ValueError, match=r"^config key 'rollout.mode' = 'async' cannot run with cluster.colocate=true"):
        load_config(["cluster.colocate=true", "rollout.mode=async"])
    assert load_config(["cluster.colocate=true", "rollout.colocate_offload_weights=true"]).rollout.colocate_offload_weights
    assert load_config(["rollout.mode=async"]).cluster.colocate is False


def test_colocate_offload_weights_needs_colocated_training_with_our_engine():
    """``rollout.colocate_offload_weights`` acts only where our engine sleeps (cluster.colocate=true,
    rollout.backend=engine): elsewhere it would be accepted and do nothing, so it is refused in one line."""
    with pytest.raises(ValueError, match=r"^config key 'rollout.colocate_offload_weights' = true needs "
                                         r"cluster.colocate=true and rollout.backend=engine \(got cluster.colocate=false"):
        load_config(["rollout.colocate_offload_weights=true"])
    with pytest.raises(ValueError, match=r"rollout.backend=simple"):
        load_config(["cluster.colocate=true", "rollout.backend=simple", "rollout.colocate_offload_weights=true"])
