"""Where the Responses store runs on KubeRay, and how it is secured (``deployments.k8s``).

A RayService's replicas run on several pods: the store must be a server (Redis/Valkey),
so a preset with the store on SQLite is not rendered; with Redis, every pod (any may
hold a serving replica) gets the password by Secret reference, never a value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import ConfigError
from deployments.k8s.params import DEFAULT_PARAMS, Preset, load_params, presets
from deployments.k8s.render import render_documents

URL = "redis://dsv4-responses-store.dsv4.svc:6379/0"


def _preset(tmp_path: Path, change: Any) -> Preset:
    [preset] = [p for p in presets(load_params(), DEFAULT_PARAMS) if p.name == "flash-h200"]
    raw = yaml.safe_load(preset.config_path.read_text())
    change(raw["applications"][0]["args"])
    path = tmp_path / "flash-h200.yaml"
    path.write_text(yaml.safe_dump(raw))
    return Preset(preset.name, path, preset.worker)


def _envs(service: dict[str, Any]) -> list[list[dict[str, Any]]]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c["env"] for g in groups for c in g["template"]["spec"]["containers"]]


def test_store_on_sqlite_is_not_rendered_for_a_fleet(tmp_path: Path) -> None:
    preset = _preset(tmp_path, lambda a: a["http"].update(responses_store=True))
    with pytest.raises(ConfigError, match=r"responses\.backend: redis"):
        render_documents(preset, load_params())


def test_store_on_redis_gets_its_password_from_a_secret_on_every_pod(tmp_path: Path) -> None:
    def on(args: dict[str, Any]) -> None:
        args["http"]["responses_store"] = True
        args["responses"] = {"backend": "redis", "url": URL}
    service = render_documents(_preset(tmp_path, on), load_params())[0]
    envs = _envs(service)
    assert len(envs) >= 2
    for env in envs:
        [entry] = [e for e in env if e["name"] == "DSV4_RESPONSES_STORE_PASSWORD"]
        assert "value" not in entry
        assert entry["valueFrom"]["secretKeyRef"] == {
            "name": "dsv4-responses-store", "key": "password", "optional": False}


def test_store_off_adds_nothing() -> None:
    [preset] = [p for p in presets(load_params(), DEFAULT_PARAMS) if p.name == "flash-h200"]
    for env in _envs(render_documents(preset, load_params())[0]):
        assert not any(e["name"] == "DSV4_RESPONSES_STORE_PASSWORD" for e in env)
