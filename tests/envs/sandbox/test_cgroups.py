"""``cgroups.probe``: whether this process may make memory + pids cgroups. The first sandboxes of a process
start in threads at once (an env worker's resets); every one of them, and every later one, gets the answer a
lone probe gets. (A shared probe-cgroup name once made concurrent first probes fail and the process keep
running its sandboxes without cgroups.)"""

from __future__ import annotations

import threading

import pytest

from jointrl.envs.sandbox import cgroups


def test_concurrent_first_probes_of_one_process_agree():
    alone = cgroups.probe()
    if alone[0] is None:
        pytest.skip(f"no cgroups here to probe for: {alone[1]}")
    found, start = [], threading.Barrier(16)

    def ask():
        start.wait()
        found.extend(cgroups.probe()[0] for _ in range(20))

    for _ in range(5):  # five fresh first calls, 16 threads each
        cgroups._probe.cache_clear()
        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert found == [alone[0]] * (5 * 16 * 20)
