"""The HAProxy config Ray 2.60's manager renders, with its real template and config class.

One copy for the tests of ``dsv4-haproxy`` (what it rewrites, what HAProxy accepts) and
for ``benchmarks/haproxy_threads.py`` (HAProxy's cost on the config Ray runs), not a
hand-kept imitation of Ray's template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ray_rendered_config(workdir: Path, stats_port: int = 8404, metrics_port: int = 9101,
                        backends: dict[str, Any] | None = None,
                        front: tuple[str, int] | None = None) -> str:
    """The config Ray's HAProxy manager writes for ``backends`` (default: an empty route
    table) into ``workdir``; ``front`` = (host, port) of the HTTP door (Ray's default
    otherwise). Ray reads its ``RAY_SERVE_HAPROXY_*`` settings when first imported."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

    cfg = HAProxyConfig(stats_port=stats_port, metrics_port=metrics_port,
                        socket_path=str(workdir / "admin.sock"),
                        server_state_base=str(workdir),
                        server_state_file=str(workdir / "server-state"),
                        metrics_enabled=False)
    if front is not None:
        from ray.serve.config import HTTPOptions

        cfg.http_options = HTTPOptions(host=front[0], port=front[1])
    path = workdir / "haproxy.cfg"
    HAProxyApi(cfg, backends or {}, config_file_path=str(path))._generate_config_file_internal()
    return path.read_text()


def app_backend(ports: list[int], host: str = "10.0.0.7", fallback_port: int = 8500,
                fallback_host: str = "10.0.0.1") -> dict[str, Any]:
    """One app's backend as Ray's controller describes it: a server per replica at its
    direct-ingress port, Serve's proxy as the fallback."""
    from ray.serve._private.haproxy import BackendConfig, ServerConfig

    servers = [ServerConfig(name=f"replica-{i}", host=host, port=port)
               for i, port in enumerate(ports)]
    return {"app": BackendConfig(name="app", path_prefix="/", servers=servers,
                                 fallback_server=ServerConfig(name="fallback",
                                                              host=fallback_host,
                                                              port=fallback_port))}
