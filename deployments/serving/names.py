"""The names of the application's deployments, and which of them answer HTTP.

Light on purpose (no Ray import): the CLI (``dsv4-serve policy``), the local runner's
drain and both builders need these strings, and none should import a builder (Ray
Serve LLM, seconds of import) for a name. ``DSv4Server``/``DSv4DPServer`` are the
server classes of ``deployments.serving.server`` (a unit test holds the two equal);
``DECODE_PREFIX`` is the name Ray Serve LLM's P/D builder gives the decode pool.
"""

from __future__ import annotations

from deployments.config import AppArgs

CONTROLLER_NAME = "KVSpecController"
SERVER_CLASS_NAMES = ("DSv4Server", "DSv4DPServer")
# The P/D app's decode deployment is named "Decode:<model id>" (Ray's P/D builder's prefix).
DECODE_PREFIX = "Decode:"
# The deployments whose replicas answer HTTP: Serve names a server deployment
# "<class>:<model id>", the P/D decode pool "Decode:<model id>".
HTTP_SERVER_CLASSES = (*SERVER_CLASS_NAMES, DECODE_PREFIX[:-1])
# The controller holds no client requests; a check in progress may finish.
CONTROLLER_DRAIN_S = 5.0


def serves_http(deployment_name: str) -> bool:
    """Whether replicas of this deployment of our app answer clients (every request
    passes exactly one of them)."""
    return deployment_name.split(":", 1)[0] in HTTP_SERVER_CLASSES


def ingress_drain_timeout_s(args: AppArgs) -> float:
    """Seconds a serving replica may take to stop: its drain timeout.

    When an application is deleted, Serve stops all its deployments at once; each
    replica waits for its own in-flight requests, up to its
    ``graceful_shutdown_timeout_s``, before it is killed. The server replicas are
    the ingress, so their drain is the application's.
    """
    return args.llm.deployment_config.drain_timeout_s
