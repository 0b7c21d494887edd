"""A local cluster does not outlive its driver, however the driver dies.

``dsv4-serve run --nodes N`` starts its head in a session of its own; a driver
killed with SIGKILL runs no cleanup. Real Ray head (no replicas: this is about
process ownership, not serving), real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO, cast

import pytest

from deployments.local.cluster import session_pids

pytestmark = pytest.mark.slow

DRIVER = """
import sys, time
from deployments.local.cluster import ClusterSpec, LocalCluster
cluster = LocalCluster.start(ClusterSpec(max_nodes=1, node_cpus=1, head_cpus=1))
print(cluster.session, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_driver_takes_its_cluster_with_it() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd())
    try:
        session = int(cast(IO[str], driver.stdout).readline())  # stdout=PIPE
        deadline = time.monotonic() + 60
        while len(session_pids(session)) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)  # gcs_server, raylet, the reaper, ...: the head is up
        alive = session_pids(session)
        assert len(alive) >= 3, f"the head's processes did not start: {alive}"
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 30
        while session_pids(session) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_pids(session) == [], (
            f"processes of the cluster outlived its SIGKILLed driver: {session_pids(session)}")
    finally:
        if driver.poll() is None:
            driver.kill()
