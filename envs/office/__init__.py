"""The office domain: .xlsx / .docx / .pptx documents read and edited by tools in a sandbox."""

from jointrl.envs.office.env import OfficeEnv, office_config, run_tool
from jointrl.envs.office.generate import FAMILIES, generate
from jointrl.envs.office.tasks import NOOP, TASKS_DIR, load_policy, load_task, load_tasks, policy_names
from jointrl.envs.office.tools import TOOLS

__all__ = ["FAMILIES", "NOOP", "TASKS_DIR", "TOOLS", "OfficeEnv", "generate", "load_policy", "load_task",
           "load_tasks", "office_config", "policy_names", "run_tool"]
