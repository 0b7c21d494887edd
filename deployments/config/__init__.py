"""Every config model in one place: our part of a Ray Serve config, validated before Ray.

The YAML is the ordinary Serve config format (what ``serve run``, ``serve deploy``
and KubeRay's ``serveConfigV2`` take)::

    applications:
      - name: dsv4
        route_prefix: /
        import_path: deployments.app:build_app
        args: {llm: {...}, dsv4: {...}, http: {...}}

Only ``args`` of applications whose ``import_path`` is ours is modelled. ``args.llm``
(``llm``) mirrors Ray Serve LLM's ``LLMConfig`` field names, so a Ray Serve LLM user can
paste what they know; we type the parts that decide the KV layout and the replica
shape and pass the rest through to ``LLMConfig``, which validates it again.
``args.dsv4`` (``dsv4``) is ours: the layout every replica must end up with, the
controller's policy, the node. ``args.http`` (``http``): the edge's keys and bounds.
``args.pd`` (``pd``): prefill/decode pools. ``app_args`` ties the sections together,
``serve_file`` models the whole file.

The models check structure; the policy rules that tie sections together are
``checks.check``, which ``parse.parse_app_args`` and ``loader.load_serve_config``
apply (``refuse=False`` leaves them to the caller: ``dsv4-serve plan`` reports them).
``sizing`` is the GPU/CPU arithmetic the models answer with. Every error names the
field, the bad value, what was expected and the fix (``errors``).

May import: pydantic, yaml, ``deployments.resources``, ``dsv4_patch.rules`` and
``dsv4_patch.tiny_model``; nothing else of ours (everything else imports this). The
modules import one another directly; this face is for everyone else.
"""

from deployments.config.app_args import (
    AppArgs,
)
from deployments.config.base import (
    DEFAULT_CONFIG,
    DEFAULT_DRAIN_POLL_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    IMPORT_PATH,
    PLUGIN_NAME,
    TINY_MODEL_SOURCE,
    WORKER_EXTENSION,
    Policy,
)
from deployments.config.dsv4 import (
    DSv4Section,
    NodeSpec,
    ReplicaOverride,
)
from deployments.config.errors import (
    ConfigError,
    format_validation_error,
)
from deployments.config.http import (
    DEFAULT_API_KEYS_ENV,
    DEFAULT_API_KEYS_FILE_ENV,
    SECRET_ENV_VARS,
    AuthConfig,
    HTTPEdge,
)
from deployments.config.llm import (
    AutoscalingConfig,
    DeploymentConfig,
    EngineKwargs,
    LLMSection,
    ModelLoading,
    PlacementGroupConfig,
)
from deployments.config.loader import (
    load_serve_config,
)
from deployments.config.parse import (
    args_model,
    parse_app_args,
    refuse_problems,
)
from deployments.config.pd import (
    HMA_CONNECTORS,
    POOLS,
    ROLES,
    PDAppArgs,
    PDSection,
    PoolSection,
)
from deployments.config.serve_file import (
    SERVE_DEFAULT_HOST,
    HTTPOptions,
    ServeApplication,
    ServeConfig,
)

__all__ = [
    "DEFAULT_API_KEYS_ENV",
    "DEFAULT_API_KEYS_FILE_ENV",
    "DEFAULT_CONFIG",
    "DEFAULT_DRAIN_POLL_S",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "HMA_CONNECTORS",
    "IMPORT_PATH",
    "PLUGIN_NAME",
    "POOLS",
    "ROLES",
    "SECRET_ENV_VARS",
    "SERVE_DEFAULT_HOST",
    "TINY_MODEL_SOURCE",
    "WORKER_EXTENSION",
    "AppArgs",
    "AuthConfig",
    "AutoscalingConfig",
    "ConfigError",
    "DSv4Section",
    "DeploymentConfig",
    "EngineKwargs",
    "HTTPEdge",
    "HTTPOptions",
    "LLMSection",
    "ModelLoading",
    "NodeSpec",
    "PDAppArgs",
    "PDSection",
    "PlacementGroupConfig",
    "Policy",
    "PoolSection",
    "ReplicaOverride",
    "ServeApplication",
    "ServeConfig",
    "args_model",
    "format_validation_error",
    "load_serve_config",
    "parse_app_args",
    "refuse_problems",
]
