"""``dsv4-serve run --nodes 3``: one replica per node, autoscaling with node add/remove,
node loss under traffic, and a clean stop after it -- on ONE cluster, in order, behind
the door the KubeRay presets ship (``http.ingress: haproxy``, with an API key).

The module boots one run (``deployments.harness.multinode_scenario``): a head that takes no
replicas and worker nodes from Ray's autoscaler, the local app autoscaled 1..2. The tests are
steps of one story and run in file order, each starting from where the previous
left the cluster: 1 replica -> load: 2 replicas on 2 nodes -> the first node's
raylet SIGKILLed under traffic: a replacement on a third node -> load stops:
back to 1 replica and its idle node removed -> SIGTERM: nothing left (HAProxy
included), exit 0. Every request goes through HAProxy straight to a replica's own port,
so the scale-up also proves Serve's autoscaler sees load it never routes.
Step times are printed (``-s``); ``benchmarks/multinode.py`` runs the same steps
for docs/benchmarks.md. The file sorts before the session stack's tests, so the
two never share the cores.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deployments import serve_env
from deployments.harness import multinode_scenario as mn
from deployments.local.cluster import cmdline
from tests.support.procs import alive
from tests.support.serve_client import Traffic

pytestmark = pytest.mark.slow

NODES = 3
IDLE_TIMEOUT_S = 5.0
MODEL = "dsv4-tiny"
STATE: dict[str, Any] = {}
# How long after a raylet's SIGKILL a request may still fail: Ray declares the node dead
# after its GCS health checks fail (Ray's defaults: every 3 s, 5 in a row; the replica's
# process can accept until then, seen at ~15 s), then HAProxy takes the server out at its
# next check (every 5 s, down after 2 failures 250 ms apart).
LOST_WINDOW_S = 25


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mn.Run]:
    config = mn.autoscaling_config_file(tmp_path_factory.mktemp("multinode"))
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as env:
        # as from a fresh shell: the session stack's in-process Ray set these here
        for name in serve_env.LOCAL_QUIET_ENV:
            env.delenv(name, raising=False)
        the_run = mn.start_run(config, NODES, IDLE_TIMEOUT_S, env=mn.STORY_ENV)
    the_run.marks["boot"] = time.monotonic() - started
    try:
        yield the_run
    finally:
        mn.kill_leftovers(the_run)  # only if a step failed midway


def _peak_memory(run: mn.Run) -> None:
    STATE["pss_mib"] = max(float(STATE.get("pss_mib", 0.0)), mn.pss_mib(run.all_pids()))


def test_one_replica_per_node_none_on_the_head(run: mn.Run) -> None:
    rep = mn.wait_report(mn.agreeing(1), "1 replica agreeing on a worker node")
    [node] = mn.replica_nodes(rep).values()
    assert node in mn.worker_nodes(run), (node, mn.worker_nodes(run))
    assert "on node " + node in run.boot_output, "run did not print the replica's node"
    # the local cluster's nodes (every Ray process) run the quiet Serve loops, logged
    head_env = Path(f"/proc/{run.session}/environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5" in head_env
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 (local run, quiet at rest)" in run.boot_output
    # no log monitor on any node (no driver reads one; the nodes share this host's logs)
    monitors = [p for p in run.all_pids() if b"log_monitor.py" in cmdline(p)]
    assert not monitors, {p: cmdline(p)[:120] for p in monitors}
    print(f"boot with --nodes {NODES}: serving on 1 worker node after "
          f"{run.marks['boot']:.1f} s")
    STATE["first"] = rep
    _peak_memory(run)


def test_load_scales_to_two_replicas_on_two_nodes(run: mn.Run) -> None:
    before = STATE["first"]
    assert isinstance(before, dict)
    with Traffic(mn.URL, MODEL, threads=4, headers=mn.AUTH) as traffic:
        started = time.monotonic()
        rep = mn.wait_report(mn.agreeing(2), "scale-up to 2 replicas on 2 nodes")
        scaled_s = time.monotonic() - started
        traffic.wait_for(6)
        _peak_memory(run)
        # under load (2 replicas stay): some made on the node lost next
        STATE["responses"] = _chain(6)
    nodes = set(mn.replica_nodes(rep).values())
    assert set(mn.replica_nodes(before).values()) < nodes, "the first replica moved"
    assert nodes <= set(mn.worker_nodes(run))
    failed = [o for o in traffic.outcomes if not o.ok]
    print(f"scale-up 1->2 under load: new node + replica agreeing after {scaled_s:.1f} s; "
          f"{len(traffic.outcomes)} requests, {len(failed)} failed")
    assert not failed, [o.error for o in failed[:3]]
    STATE["two"] = rep


def _chain(turns: int, previous: str | None = None) -> list[str]:
    """A ``previous_response_id`` chain of stored responses through the door."""
    import openai

    client = openai.OpenAI(base_url=mn.URL, api_key=mn.KEY, timeout=120, max_retries=0)
    ids = []
    for turn in range(turns):
        resp = client.responses.create(model=MODEL, input=f"turn {turn}",
                                       max_output_tokens=2, previous_response_id=previous)
        ids.append(previous := resp.id)
    return ids


def _responses_still_served(step: str) -> None:
    """Every stored response is retrieved and continued after ``step`` (the store
    outlives the replicas and nodes that made them)."""
    import openai

    ids = STATE["responses"]
    assert isinstance(ids, list)
    client = openai.OpenAI(base_url=mn.URL, api_key=mn.KEY, timeout=120, max_retries=0)
    for rid in ids:
        assert client.responses.retrieve(rid).id == rid, (step, rid)
    ids += _chain(2, previous=ids[-1])
    print(f"{step}: {len(ids)} stored responses retrieved and continued")


def test_node_loss_under_traffic_is_confined_and_replaced_on_a_new_node(run: mn.Run) -> None:
    two = STATE["two"]
    assert isinstance(two, dict)
    placed = mn.replica_nodes(two)
    first = STATE["first"]
    assert isinstance(first, dict)
    [victim_node] = mn.replica_nodes(first).values()
    [survivor] = [rid for rid, node in placed.items() if node != victim_node]
    raylet = mn.worker_nodes(run)[victim_node]
    with Traffic(mn.URL, MODEL, threads=4, headers=mn.AUTH) as traffic:
        traffic.wait_for(8)
        killed_at = time.monotonic()
        os.kill(raylet, signal.SIGKILL)
        rep = mn.wait_report(mn.agreeing(2, new_node_besides=set(placed.values())),
                             "a replacement replica on a new node")
        recovery_s = time.monotonic() - killed_at
        traffic.wait_for(6)
        _peak_memory(run)
    now = mn.replica_nodes(rep)
    assert survivor in now and now[survivor] == placed[survivor], "the other node was touched"
    assert victim_node not in now.values()
    outcomes = traffic.outcomes
    failed = [o for o in outcomes if not o.ok]
    print(f"node loss (raylet SIGKILL) under traffic: replacement on a new node agreeing "
          f"after {recovery_s:.1f} s; {len(outcomes)} requests, {len(failed)} failed")
    for o in failed:  # only what was in flight on (or routed to) the lost node
        assert o.started < killed_at + LOST_WINDOW_S and o.ended - o.started < 60, o
    assert len(failed) <= 8, [o.error for o in failed]
    assert sum(o.ok for o in outcomes if o.started > killed_at) >= 4
    STATE["after_loss"] = rep
    _responses_still_served("after the node loss")


def test_load_stops_scale_down_and_the_idle_node_is_removed(run: mn.Run) -> None:
    started = time.monotonic()
    rep = mn.wait_report(mn.agreeing(1), "scale-down to 1 replica")
    down_s = time.monotonic() - started
    deadline = time.monotonic() + mn.STEP_TIMEOUT_S
    while len(mn.worker_nodes(run)) > 1 and time.monotonic() < deadline:
        time.sleep(1)
    removed_s = time.monotonic() - started
    [node] = mn.replica_nodes(rep).values()
    assert set(mn.worker_nodes(run)) == {node}, mn.worker_nodes(run)
    print(f"load stopped: 1 replica agreeing after {down_s:.1f} s, idle node removed after "
          f"{removed_s:.1f} s (node idle timeout {IDLE_TIMEOUT_S} s)")
    _responses_still_served("after the scale-down")


def test_sigterm_after_node_loss_leaves_nothing_and_exits_0(run: mn.Run) -> None:
    pids = run.all_pids()
    engines = [p for p in pids if b"VLLM::" in cmdline(p)]
    assert engines, "no engine process seen before the stop"
    code, out, stop_s = mn.stop_run(run)
    assert code == 0, out[-4000:]
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive(pids), alive(pids)
    assert not mn.session_pids(run.session)
    print(f"SIGTERM to the run's process group: exit 0 after {stop_s:.1f} s, nothing left; "
          f"peak memory of the whole run {float(STATE.get('pss_mib', 0)) / 1024:.1f} GiB PSS")

