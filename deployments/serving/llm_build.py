"""The server deployment through Ray Serve LLM's own builders, where ours does not reach.

``build_llm_deployment`` / ``build_dp_deployment`` import vLLM and torch in the process
that builds the app. The one-pool app uses them only for what
``deployments.serving.server_options`` does not cover (no explicit bundles, TPU, another
router); the P/D app always does. Importing this module is that cost.
"""

from __future__ import annotations

from typing import Any

from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_dp_deployment, build_llm_deployment

from deployments import ray_touches
from deployments.serving.server import (
    DSv4DPIngress,
    DSv4DPServer,
    DSv4Ingress,
    DSv4Server,
)
from deployments.serving.server_options import dp_size


def server_deployment_name(cls: Any, llm_config: LLMConfig,
                           name_prefix: str | None = None) -> str:
    """The name Ray Serve LLM's builder gives a server deployment (``<prefix><model>``;
    the prefix defaults to ``<class>:``)."""
    from ray.llm._internal.serve.core.server.builder import _get_deployment_name

    options = cls.get_deployment_options(llm_config)
    prefix = name_prefix or f"{cls.__name__}:"
    return prefix + options.get("name", _get_deployment_name(llm_config))


class RayServeLLMServer:
    """The server deployment built by Ray Serve LLM: its ``LLMConfig`` validates the dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        ray_touches.require(llm=True)  # this process imports Ray Serve LLM now
        self.dp = dp_size(config) > 1
        self.cls = DSv4DPServer if self.dp else DSv4Server
        # The class that runs: on the DP path build_dp_deployment's deployment_cls wins.
        self.llm_config = LLMConfig(**config, server_cls=self.cls)

    @property
    def name(self) -> str:
        return server_deployment_name(self.cls, self.llm_config)

    def bind(self, bind_kwargs: dict[str, Any]) -> Application:
        if self.dp:  # DP attention: Ray Serve LLM's gang-scheduled DPServer pattern
            return build_dp_deployment(self.llm_config, bind_kwargs=bind_kwargs,
                                       deployment_cls=DSv4DPIngress)
        return build_llm_deployment(self.llm_config, bind_kwargs=bind_kwargs,
                                    deployment_cls=DSv4Ingress)
