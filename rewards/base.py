"""Reward API: ``score(task, episode) -> RewardResult`` and a registry by name.

A reward module is a small, pure, documented function. Checks that run code (tests,
verifiers) do so in a *fresh* verification sandbox over the episode's final files
(``Episode.verify_sandbox()``), never in the sandbox the agent had its hands on.
A checker that crashes raises ``jointrl.envs.base.EnvError``: that is an
infrastructure failure, retried and then marked ``env_error`` -- never scored 0.

The registry is complete whenever this module can be used: importing ``jointrl.rewards.base``
first runs the package's ``__init__``, which imports every built-in reward module (each
registers itself here on import).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jointrl.envs.base import Message, Task


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Episode:
    """What a reward module may look at once an episode is over.

    ``verify_sandbox`` opens a fresh sandbox over a copy of the episode's final files, with
    the task's tests mounted read-only; the caller closes it.
    """

    messages: list[Message]
    final_answer: str | None = None
    verify_sandbox: Callable[[], Any] | None = None
    num_turns: int = 0
    num_tool_errors: int = 0
    finished: bool = False  # the model ended its last turn with <|im_end|>


RewardFn = Callable[[Task, Episode], RewardResult]
_REGISTRY: dict[str, RewardFn] = {}
_SUCCESS_AT: dict[str, float] = {}  # a module's success threshold, where it is not 1 (see ``succeeded``)


def register(name: str, success_at: float | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register a reward module under ``name``. ``success_at``: the score from which an episode
    counts as solved (``succeeded``), for a continuous score; default 1 up to ``SUCCESS_TOL``."""
    if success_at is not None and not 0.0 < success_at <= 1.0:
        raise ValueError(f"reward {name!r}: success_at must be in (0, 1], got {success_at!r}")

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is registered twice")
        _REGISTRY[name] = fn
        if success_at is not None:
            _SUCCESS_AT[name] = success_at
        return fn

    return deco


def get(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered() -> list[str]:
    return sorted(_REGISTRY)


def combine(weights: dict[str, float], task: Task, episode: Episode) -> RewardResult:
    """Weighted sum of the named reward modules; each one's score is kept in ``info``."""
    total, info = 0.0, {}
    for name, weight in weights.items():
        result = get(name)(task, episode)
        total += weight * result.score
        info[name] = result.score
        info.update({f"{name}/{k}": v for k, v in result.info.items()})
    return RewardResult(score=total, info=info)


SUCCESS_TOL = 1e-6  # a score that is 1 up to rounding


def success_threshold(name: str) -> float:
    """The score from which reward module ``name`` counts an episode as solved: the module's
    ``register(..., success_at=)`` (CAD: ``cad_iou`` 0.995, ``cad_chamfer`` 0.95), else 1 - ``SUCCESS_TOL``."""
    return _SUCCESS_AT.get(name, 1.0 - SUCCESS_TOL)


def succeeded(info: dict[str, Any]) -> bool:
    """The task is solved: every outcome module in ``combine``'s ``info`` reached its
    ``success_threshold`` -- 1 for the pass/fail modules, a stated threshold for continuous ones
    (``format``, a shaping bonus, does not count). What ``<domain>/success`` and ``jointrl
    eval``'s pass@k count."""
    scores = {k: v for k, v in info.items()
              if "/" not in k and k not in ("format", "raw_reward", "error") and isinstance(v, (int, float))}
    return bool(scores) and all(v >= success_threshold(k) for k, v in scores.items())
