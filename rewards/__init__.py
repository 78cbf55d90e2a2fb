"""Reward modules, registered by name on import (``jointrl.rewards.base.get``)."""

from jointrl.rewards import format, swe_tests, tests_pass  # noqa: F401  (registers "format", "swe_tests", "tests_pass")
from jointrl.rewards import answer_match, app_state  # noqa: F401  (answer_match / _includes / _number, app_state)
from jointrl.rewards import office_checks  # noqa: F401  (registers "office_checks")
from jointrl.rewards import cad_geometry  # noqa: F401  (registers "cad_iou", "cad_chamfer")
from jointrl.rewards.base import Episode, RewardResult, combine, get, register, registered

__all__ = ["Episode", "RewardResult", "combine", "get", "register", "registered"]
