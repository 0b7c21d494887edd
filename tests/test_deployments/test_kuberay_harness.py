"""KubeRay's job from k8s/local-cpu.rayservice.yaml on podman (`make test-kuberay` only).

Heavy (an image's pods, a Ray cluster, 3 engine boots; ~5 min): not in `make test`/CI.
Needs root, podman and the CPU serving image of the manifest's digest (`make image`).
Records benchmarks/results/kuberay_harness.json.
"""

from __future__ import annotations

import os

import pytest

from deployments.harness import kuberay_scenario, records
from deployments.harness.kuberay_scenario import Run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DSV4_KUBERAY") != "1",
                       reason="make test-kuberay runs it (DSV4_KUBERAY=1): podman pods of "
                              "the CPU image, ~5 min"),
]
MANIFEST = records.REPO / "k8s" / "local-cpu.rayservice.yaml"
REPLACE_GOAL_S = 120.0


def test_rayservice_from_the_rendered_manifest():
    run = Run()
    try:
        kuberay_scenario.scenario(MANIFEST, run)
    finally:
        print(f"kuberay harness: {run.times} {run.facts}")
        assert run.facts.get("leftovers") == {"containers": 0, "pods": 0, "networks": 0}
    assert run.facts["chat_status"] == 200, run.facts["chat_text"]
    assert run.facts["no_key_status"] == 401
    assert run.facts["agree_before"] == {"state": "agree", "nodes": 2}
    assert run.facts["agree_after"] == {"state": "agree", "nodes": 2}
    # On each worker: the plugin's own line about auto -> fp8_ds_mla, and the engine's.
    assert all("auto" in line and "fp8_ds_mla" in line
               for line in run.facts["plugin_log"].values()), run.facts["plugin_log"]
    assert all(run.facts["engine_log"].values()), run.facts["engine_log"]
    assert run.facts["chat_after_status"] == 200
    records.write_result(
        records.KUBERAY_HARNESS, benchmark="kuberay_harness",
        title="KubeRay's job from the rendered CPU manifest, on podman",
        what="k8s/local-cpu.rayservice.yaml run as the KubeRay operator would (head + 2 "
             "worker pods, probes, serveConfigV2 PUT to the dashboard): seconds to each "
             "step, and from a killed worker container to kv-spec agreement again.",
        command="make test-kuberay", columns=["step", "seconds"],
        rows=[[k, round(v, 1)] for k, v in run.times.items()],
        inputs={"manifest": "k8s/local-cpu.rayservice.yaml",
                "image": MANIFEST.read_text().split("image: ", 1)[1].split()[0]},
        notes=f"chat {run.facts['chat_status']} with the key, {run.facts['no_key_status']} "
              f"without; kv-spec agree over {run.facts['agree_after']['nodes']} worker pods "
              f"before and after the replacement; goal kill->agree < {REPLACE_GOAL_S:.0f} s; "
              f"left after cleanup: {run.facts['leftovers']}.")
    assert run.times["kill_to_agree_s"] < REPLACE_GOAL_S, run.times
