"""The CPU preset runs the image `make image` last built and recorded (fast, no podman):
a rebuild with a new digest and a stale k8s/params.yaml, or the reverse, fails here."""

from __future__ import annotations

import json

from deployments.harness import records
from deployments.k8s.params import DEFAULT_PARAMS, load_params

SCHEMA = {"benchmark", "title", "what", "command", "date", "commit", "host", "inputs",
          "columns", "rows", "notes"}


def test_cpu_preset_digest_is_the_recorded_build():
    stack = load_params()["stacks"]["cpu"]
    assert stack["image_digest"] == records.recorded_image_digest(), (
        "k8s/params.yaml stacks.cpu.image_digest is not the digest of the last `make image` "
        "(benchmarks/results/image_build.json). Fix: put the recorded digest there and run "
        "`dsv4-serve k8s render`, or run `make image` if the image is what is stale.")
    manifest = (DEFAULT_PARAMS.parent / "local-cpu.rayservice.yaml").read_text()
    assert f"image: {stack['image']}@{stack['image_digest']}" in manifest


def test_results_are_data_in_the_shared_schema():
    for path in (records.IMAGE_BUILD, records.KUBERAY_HARNESS):
        data = json.loads(path.read_text())
        assert set(data) == SCHEMA, path
        assert all(len(row) == len(data["columns"]) for row in data["rows"]), path
        assert {"cpu_model", "flags", "cores"} <= set(data["host"]), path


def test_the_kuberay_harness_ran_the_image_the_preset_names():
    """``make test-kuberay`` is run before a stop that changes the image or k8s/: its
    record is of the image k8s/params.yaml names, and it passed."""
    stack = load_params()["stacks"]["cpu"]
    data = json.loads(records.KUBERAY_HARNESS.read_text())
    assert data["inputs"]["image"] == f"{stack['image']}@{stack['image_digest']}", (
        f"benchmarks/results/kuberay_harness.json ran {data['inputs']['image']}, but the CPU "
        f"preset names {stack['image']}@{stack['image_digest']}. Fix: run `make test-kuberay` "
        "(after `make image`) and commit its record.")
    steps = dict(data["rows"])
    assert steps["kill_to_agree_s"] < 120, steps
    assert "left after cleanup: {'containers': 0, 'pods': 0, 'networks': 0}" in data["notes"]
