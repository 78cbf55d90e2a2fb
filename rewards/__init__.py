"""Reward modules, registered by name on import (``jointrl.rewards.base.get``)."""

from jointrl.rewards import format, swe_tests, tests_pass  # noqa: F401  (registers "format", "swe_tests", "tests_pass")
from jointrl.rewards.base import Episode, RewardResult, combine, get, register, registered

__all__ = ["Episode", "RewardResult", "combine", "get", "register", "registered"]
