"""Fixtures shared by the tests of rl/."""

import pytest
import ray


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module's tests (2 logical CPUs, no dashboard)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
