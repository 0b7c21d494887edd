"""``deployments.app:build_app``: the ``import_path`` users write, and nothing else.

Usable from ``serve run``/``serve deploy``, KubeRay ``serveConfigV2`` and
``dsv4-serve run``. It validates ``args`` (``deployments.config``) and hands them to
the pattern they describe: one pool of server replicas (``deployments.serving.builder``)
or prefill/decode pools (``deployments.pd.builder``). Patterns import the serving core,
never the reverse, and never this module: it is the top of the house.
"""

from __future__ import annotations

from typing import Any

from ray.serve.deployment import Application

from deployments import ray_touches, serve_env
from deployments.config import AppArgs, ConfigError, PDAppArgs, parse_app_args
from deployments.serving.builder import build_one_pool_app

# What users name: `import_path: deployments.app:build_app` (YAML), and `dsv4-serve run`.
__all__ = ["build_app", "build_parsed_app"]


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (``deployments.config.AppArgs``) and build the application."""
    return build_parsed_app(parse_app_args(args))


def build_parsed_app(parsed: AppArgs) -> Application:
    """Build the application from args the loader already validated (``dsv4-serve run``)."""
    pd = isinstance(parsed, PDAppArgs)  # prefill/decode pools
    # The Ray internals we build on (deployments/ray_touches/); those only a process
    # that imports Ray Serve LLM's server can probe are required where it is imported.
    ray_touches.require(pd=pd, llm=pd)
    problem = serve_env.ingress_problem(parsed.http.ingress)  # this process has Ray's env
    if problem:
        raise ConfigError(problem)
    if isinstance(parsed, PDAppArgs):  # Ray Serve LLM's P/D builders: imports vLLM
        from deployments.pd.builder import build_pd_app

        return build_pd_app(parsed)
    return build_one_pool_app(parsed)
