"""The code-repository domain (SWE-bench style): records, env, tools, verifier, policies."""

from jointrl.envs.code_repo.env import CodeRepoEnv
from jointrl.envs.code_repo.policies import POLICIES, load_policy, patch_calls
from jointrl.envs.code_repo.records import DATA_DIR, DOMAIN, SweRecord, load_tasks, read_records
from jointrl.envs.code_repo.verifier import FinalRepo

__all__ = ["DATA_DIR", "DOMAIN", "POLICIES", "CodeRepoEnv", "FinalRepo", "SweRecord", "load_policy",
           "load_tasks", "patch_calls", "read_records"]
