"""The CAD domain: CadQuery programs run in a bubblewrap sandbox, scored by geometry against a target."""

from jointrl.envs.cad.env import RUN_CADQUERY, SUBMIT, CadEnv
from jointrl.envs.cad.interpreter import CadConfig, CadSandbox
from jointrl.envs.cad.policies import load_policy, policy_names
from jointrl.envs.cad.tasks import generate, load_tasks

__all__ = ["RUN_CADQUERY", "SUBMIT", "CadConfig", "CadEnv", "CadSandbox", "generate", "load_policy",
           "load_tasks", "policy_names"]
