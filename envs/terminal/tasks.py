"""Terminal task folders and their loader: the Harbor format and the Terminal-Bench 1 format.

**Harbor** (what we ship; ``envs/terminal/tasks/<id>/``)::

    task.toml          [metadata] (free-form), [verifier] timeout_sec, [agent] timeout_sec (caps
                       envs.episode_timeout_s), [environment] docker_image, build_timeout_sec,
                       cpus, memory_mb / memory ("4G"), storage_mb / storage, allow_internet
                       (docker backend: the container's bounds, a network for the verifier), version;
                       ours on top: id (= folder name, optional), tier, max_turns, [reward]
    instruction.md     the prompt, verbatim
    environment/       files copied into /work at reset (and ``setup.sh``, run there once, then
                       removed); with a ``Dockerfile`` it is a Docker build context instead:
                       the task needs its own image, which only the docker backend builds
    solution/solve.sh  the oracle as a script (shipped tasks: the bash commands of the oracle
                       policy, in order; tests/envs/terminal/test_tasks.py keeps them in sync)
    tests/test.sh      the verifier, run as `bash /tests/test.sh` in a fresh sandbox over the
                       episode's final files with tests/ read-only at /tests; on success it
                       writes 1 to /logs/verifier/reward.txt (or {"reward": 1} to reward.json)
                       and exits 0
    policies.json      scripted policies: {"oracle": [turn, ...], "wrong": [turn, ...]}, each
                       turn a list of {"name": ..., "arguments": {...}} tool calls

**Terminal-Bench 1** (loaded, not shipped)::

    task.yaml          instruction, difficulty, category, tags, max_agent_timeout_sec,
                       max_test_timeout_sec, ...
    solution.sh        the oracle
    run-tests.sh       the verifier (runs tests/ with pytest); exit 0 = pass
    tests/             mounted read-only at /tests ($TEST_DIR)
    Dockerfile         the task's image (docker backend only); a folder without one runs on bwrap

A TB1 task's reward is 1 iff ``run-tests.sh`` exits 0 (the loader's verifier command then
writes ``reward.txt``). ``Task.metadata`` records the ``format`` and, for a task that needs its
own image, ``docker_image`` (the Dockerfile's path).
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any

from jointrl.envs.base import Task

DOMAIN = "terminal"
TASKS_DIR = Path(__file__).parent / "tasks"
log = logging.getLogger(__name__)
_TOML_KEYS = {"id", "tier", "max_turns", "reward", "metadata", "version", "verifier", "agent", "environment",
              "solution"}
TB1_RUN_TESTS = "/tb1/run-tests.sh"  # where a TB1 task's run-tests.sh is mounted for the verifier


def load_task(folder: Path) -> Task:
    """Load one task folder (Harbor or TB1). Raises ``ValueError`` naming the file and the problem."""
    folder = Path(folder)
    if (folder / "task.yaml").is_file() and not (folder / "task.toml").exists():
        return _load_tb1(folder)
    return _load_harbor(folder)


def _load_harbor(folder: Path) -> Task:
    toml_path = folder / "task.toml"
    for required in (toml_path, folder / "instruction.md", folder / "tests" / "test.sh"):
        if not required.is_file():
            raise ValueError(f"task folder {str(folder)!r} lacks {required.name!r} ({str(required)!r})")
    with open(toml_path, "rb") as f:
        try:
            spec = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{str(toml_path)!r}: {e}") from e
    unknown = set(spec) - _TOML_KEYS
    if unknown:
        raise ValueError(f"{str(toml_path)!r}: unknown keys {sorted(unknown)}; allowed {sorted(_TOML_KEYS)}")
    if spec.get("id", folder.name) != folder.name:
        raise ValueError(f"{str(toml_path)!r}: id {spec.get('id')!r} must equal the folder name {folder.name!r}")
    reward = spec.get("reward", {"tests_pass": 1.0})
    if not isinstance(reward, dict) or not all(isinstance(w, int | float) for w in reward.values()):
        raise ValueError(f"{str(toml_path)!r}: [reward] must map reward names to numeric weights, got {reward!r}")
    metadata: dict[str, Any] = {"format": "harbor", **dict(spec.get("metadata", {}))}
    timeout = spec.get("verifier", {}).get("timeout_sec")
    if timeout is not None:
        metadata["verifier_timeout_s"] = float(timeout)
    agent_timeout = spec.get("agent", {}).get("timeout_sec")
    if agent_timeout is not None:
        metadata["agent_timeout_s"] = _number(toml_path, "agent.timeout_sec", agent_timeout)
    environment = spec.get("environment", {})
    metadata.update(_environment(toml_path, environment))
    image = environment.get("docker_image")
    if (folder / "environment" / "Dockerfile").is_file():
        image = str(folder / "environment" / "Dockerfile")
    if image:
        metadata["docker_image"] = image
    return Task(
        id=folder.name,
        domain=DOMAIN,
        prompt=(folder / "instruction.md").read_text().strip(),
        tier=spec.get("tier", "low"),
        max_turns=int(spec.get("max_turns", 8)),
        root=folder.resolve(),
        reward={k: float(w) for k, w in reward.items()},
        metadata=metadata,
    )


def _number(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{str(path)!r}: {key} must be a number > 0, got {value!r}")
    return float(value)


def _size_mb(path: Path, key: str, value: Any) -> float:
    """A Harbor size: a number of MB, or a string with a unit (``"4G"``, ``"512M"``)."""
    if isinstance(value, str):
        units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        try:
            return _number(path, key, float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text))
        except (ValueError, KeyError):
            raise ValueError(f"{str(path)!r}: {key} must be MB or a size like '4G', got {value!r}") from None
    return _number(path, key, value)


def _environment(path: Path, env: dict[str, Any]) -> dict[str, Any]:
    """Harbor's ``[environment]`` resources and flags as ``Task.metadata`` entries (docker backend)."""
    out: dict[str, Any] = {}
    if "cpus" in env:
        out["cpus"] = _number(path, "environment.cpus", env["cpus"])
    for key, alias in (("memory_mb", "memory"), ("storage_mb", "storage")):
        value = env.get(key, env.get(alias))
        if value is not None:
            out[key] = _size_mb(path, f"environment.{key}", value)
    if "build_timeout_sec" in env:
        out["build_timeout_s"] = _number(path, "environment.build_timeout_sec", env["build_timeout_sec"])
    if "allow_internet" in env:
        if not isinstance(env["allow_internet"], bool):
            raise ValueError(f"{str(path)!r}: environment.allow_internet must be true or false")
        out["allow_internet"] = env["allow_internet"]
    return out


def _load_tb1(folder: Path) -> Task:
    import yaml  # PyYAML (a dependency; Hydra needs it too)

    path = folder / "task.yaml"
    for required in (folder / "run-tests.sh", folder / "tests"):
        if not required.exists():
            raise ValueError(f"Terminal-Bench task folder {str(folder)!r} lacks {required.name!r}")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{str(path)!r}: {e}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("instruction"), str):
        raise ValueError(f"{str(path)!r}: needs an 'instruction' string")
    metadata: dict[str, Any] = {
        "format": "terminal-bench-1",
        **{k: spec[k] for k in ("difficulty", "category", "tags", "author_email") if k in spec},
        "verifier_command": f"cd /work && TEST_DIR=/tests bash {TB1_RUN_TESTS} && echo 1 > /logs/verifier/reward.txt",
        "verifier_mounts": {str((folder / "run-tests.sh").resolve()): TB1_RUN_TESTS},
    }
    if "max_test_timeout_sec" in spec:
        metadata["verifier_timeout_s"] = float(spec["max_test_timeout_sec"])
    if (folder / "Dockerfile").is_file():
        metadata["docker_image"] = str(folder / "Dockerfile")
    return Task(id=folder.name, domain=DOMAIN, prompt=spec["instruction"].strip(), max_turns=int(spec.get("max_turns", 16)),
                root=folder.resolve(), metadata=metadata)


def solution_script(task: Task) -> Path | None:
    """The task's oracle script: ``solution/solve.sh`` (Harbor) or ``solution.sh`` (TB1)."""
    if task.root is None:
        return None
    for rel in ("solution/solve.sh", "solution.sh"):
        if (task.root / rel).is_file():
            return task.root / rel
    return None


def load_tasks(root: Path | None = None, *, backend: str | None = None) -> list[Task]:
    """Every task folder under ``root`` (default: the shipped set), sorted by id.

    ``backend="bwrap"`` leaves out tasks that need their own Docker image, with one warning
    naming them, and raises ``ValueError`` (suggesting the docker backend) if that leaves none.
    """
    root = TASKS_DIR if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"task root {str(root)!r} is not a directory")
    tasks = [load_task(d) for d in sorted(root.iterdir())
             if d.is_dir() and ((d / "task.toml").exists() or (d / "task.yaml").exists())]
    if backend == "bwrap":
        kept = [t for t in tasks if not t.metadata.get("docker_image")]
        left = [t.id for t in tasks if t.metadata.get("docker_image")]
        if left and not kept:
            raise ValueError(f"all {len(left)} terminal tasks under {str(root)!r} need their own Docker image "
                             f"({_names(left)}); the bwrap backend cannot build one: set envs.sandbox.backend=docker")
        if left:
            log.warning("%d of %d terminal tasks under %s need their own Docker image and are left out on the bwrap "
                        "backend (envs.sandbox.backend=docker runs them): %s", len(left), len(tasks), root, _names(left))
        tasks = kept
    return tasks


def _names(ids: list[str], shown: int = 10) -> str:
    return ", ".join(ids[:shown]) + (f", ... ({len(ids) - shown} more)" if len(ids) > shown else "")
