"""The terminal domain: shell tasks in a bubblewrap sandbox, verified by each task's tests."""

from jointrl.envs.terminal.env import BASH, SUBMIT, TerminalEnv
from jointrl.envs.terminal.policies import NOOP, Replay, load_policy, policy_names, replay
from jointrl.envs.terminal.tasks import TASKS_DIR, load_task, load_tasks
from jointrl.envs.terminal.verifier import REWARD_FILE, TESTS_MOUNT, VERIFIER_LOGS, FinalFiles

__all__ = [
    "BASH",
    "NOOP",
    "REWARD_FILE",
    "SUBMIT",
    "TASKS_DIR",
    "TESTS_MOUNT",
    "VERIFIER_LOGS",
    "FinalFiles",
    "Replay",
    "TerminalEnv",
    "load_policy",
    "load_task",
    "load_tasks",
    "policy_names",
    "replay",
]
