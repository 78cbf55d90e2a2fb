"""Every shipped config composes, every config choice is a StrEnum, and every value of every choice
parses at composition (a bad one fails there, naming the key and the allowed values)."""

import dataclasses
import enum
import types
import typing
from pathlib import Path

import pytest

from omegaconf import OmegaConf

from jointrl.rl.config import CONF_DIR, Config, Split, ThinkingTier, load_config, to_config

# The free-text fields: names, paths, addresses. Anything else typed ``str`` would be a choice
# decided by string comparison somewhere; a new one must be a StrEnum or be added here on purpose.
FREE_TEXT = {"model.name", "model.path", "model.tokenizer", "rollout.vllm.venv", "envs.domains.*.task_dir", "envs.sandbox.rootfs", "cluster.ray_address", "logger.project",
             "serve.host", "serve.model_name", "serve.record_path", "checkpoint", "run_name", "output_dir",
             # a user's datasets: paths, their own split names, an image-name template
             "envs.domains.*.dataset", "envs.domains.*.dataset_split", "envs.domains.*.dataset_image",
             "recipe.sft_data", "recipe.sft_data_split",
             # another recipe run's output_dir (paths); a domain's family names (checked against its tasks,
             # envs/splits.check_families); domain names (checked against the registry, as grpo_task_dirs' keys)
             "recipe.sft_from", "recipe.match_cpu_of", "envs.domains.*.heldout_families", "recipe.grpo_domains"}
# Values a choice needs beside it to pass the cross-field checks (``__post_init__``).
COMPANIONS = {("algo.mismatch", m): {"algo.behaviour_logprobs": "learner"} for m in ("tis", "icepop", "mis")}
COMPANIONS[("model.layer_types", "sliding")] = {"model.attention_window": 4}  # a sliding layer needs its window


def _args(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType, list, dict) else ()


def _leaves(cls: type, prefix: str = ""):
    """(dotted key, the field's type) for every leaf field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        inner = [a for a in _args(tp) if a is not type(None)]
        nested = [a for a in ([tp] + inner) if dataclasses.is_dataclass(a)]
        if nested:
            yield from _leaves(nested[0], key + (".*." if typing.get_origin(tp) is dict else "."))
        else:
            yield key, tp


def _enums(tp) -> list[type[enum.Enum]]:
    found = [tp] if isinstance(tp, type) and issubclass(tp, enum.Enum) else []
    return found + [e for a in _args(tp) for e in _enums(a)]


def _is_plain_str(tp) -> bool:
    return tp is str or str in _args(tp) or any(_is_plain_str(a) for a in _args(tp) if typing.get_origin(a))


def test_no_config_choice_is_a_plain_str():
    plain = {key for key, tp in _leaves(Config) if _is_plain_str(tp) and typing.get_origin(tp) is not dict}
    assert plain == FREE_TEXT
    dict_str_values = {key for key, tp in _leaves(Config) if typing.get_origin(tp) is dict and _args(tp)[1] is str}
    # domain -> a task folder (a path); a record field -> the user's dataset's column name
    assert dict_str_values == {"recipe.grpo_task_dirs", "envs.domains.*.dataset_columns"}
    for key, tp in _leaves(Config):
        for e in _enums(tp):
            assert issubclass(e, enum.StrEnum) and all(m.name == m.value for m in e), (key, e)  # OmegaConf reads names


def _choice_keys() -> list[tuple[str, type[enum.Enum]]]:
    return [(key, e) for key, tp in _leaves(Config) if "*" not in key and typing.get_origin(tp) is not dict
            for e in _enums(tp)]


@pytest.fixture(scope="module")
def composed():
    """The default config as Hydra composes it (an override per value through Hydra costs ~4x more)."""
    from hydra import compose, initialize_config_dir

    from jointrl.rl.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config")


@pytest.mark.parametrize("key,choice", _choice_keys(), ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_every_value_of_every_choice_parses(composed, key, choice):
    is_list = key.endswith(("layer_types", "eval_tiers"))
    for member in choice:
        raw = composed.copy()
        for k, v in {**COMPANIONS.get((key, member.value), {}),
                     key: (["full", member.value] if key == "model.layer_types" else [member.value]) if is_list
                     else member.value}.items():
            OmegaConf.update(raw, k, v)
        got = to_config(raw)
        for part in key.split("."):
            got = getattr(got, part)
        got = got[-1] if is_list else got
        assert got is member, (key, got)
    plain = OmegaConf.to_container(composed)  # as a saved config.yaml or an edited group file would hold it
    node = plain
    for part in key.split(".")[:-1]:
        node = node[part]
    node[key.split(".")[-1]] = ["bogus"] if is_list else "bogus"
    with pytest.raises(ValueError) as e:  # named with every allowed value (test_config.py: on the command line)
        to_config(OmegaConf.create(plain))
    assert key in str(e.value) and all(m.value in str(e.value) for m in choice)


def test_choice_keyed_maps_parse_and_refuse_unknown_keys():
    cfg = load_config(["+envs.domains.terminal.tiers={high: 1.0}", "++recipe.sft_demos={oracle: 0.5, wrong: 0.5}",
                       "+recipe.sft_demo_style={code_repo: sed}"])
    assert list(cfg.envs.domains["terminal"].tiers) == [ThinkingTier.high]
    assert cfg.envs.domains["terminal"].split is Split.train
    assert set(cfg.recipe.sft_demos) == {"oracle", "wrong"} and cfg.recipe.sft_demo_style["code_repo"] == "sed"
    for bad in ("+envs.domains.terminal.tiers={mid: 1.0}", "++recipe.sft_demos={oracle: 1.0, lucky: 1.0}",
                "+recipe.sft_demo_style={code_repo: awk}"):
        with pytest.raises(ValueError, match="low|oracle|shell"):
            load_config([bad])


def _group_options() -> list[str]:
    return sorted(f"{d.name}={f.stem}" for d in Path(CONF_DIR).iterdir() if d.is_dir() and d.name != "experiment"
                  for f in d.glob("*.yaml"))


@pytest.mark.parametrize("option", _group_options())
def test_every_group_option_composes(option, request):
    # model=hf starts from a checkpoint directory: the tiny Qwen3-MoE the test session builds
    extra = [f"model.path={request.getfixturevalue('qwen3_dir')}"] if option == "model=hf" else []
    cfg = load_config([option, *extra])
    assert isinstance(cfg, Config)


@pytest.mark.parametrize("experiment", sorted(f.stem for f in (Path(CONF_DIR) / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    assert isinstance(load_config([f"+experiment={experiment}"]), Config)
