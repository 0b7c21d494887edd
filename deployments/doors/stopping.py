"""Whether Serve began stopping this replica: the signal that closes its own port.

Why: Serve tells a replica's code nothing until ``__del__``, after it has drained the
requests *it* routed; requests on ``http.replica_port`` are not among them, so the
port would keep taking new connections (1/N of the node's) while the replica is
STOPPING, and its held streams would get only what is left after Serve's drain.

How: Serve's replica sets ``Replica._shutting_down`` as its graceful shutdown begins
(documented there as "may be used by replica subclass implementations"); the actor
instance is reached through the worker's actor table. Ray touch
``serve.replica_shutting_down`` (deployments.ray_touches); when it is absent the port
closes at ``__del__``, as before, and the replica says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deployments import ray_touches
from deployments.logs import get_logger

logger = get_logger("server")

TOUCH = "serve.replica_shutting_down"


def serve_stopping() -> Callable[[], bool] | None:
    """A cheap check of "Serve is stopping this replica", or None (logged) when the
    installed Ray does not let us see it."""
    replica = touched_replica(TOUCH, "_shutting_down", "the replica's own port closes "
                              "only at __del__, after Serve's drain")
    return None if replica is None else lambda: bool(replica._shutting_down)


def touched_replica(touch: str, attr: str, without: str) -> Any | None:
    """Serve's ``Replica`` in this process, when ray touch ``touch`` is present and the
    replica has ``attr``; else None, logged with what is lost (``without``)."""
    if not ray_touches.present(touch):
        logger.warning("dsv4: ray touch %s is missing in this Ray: %s", touch, without)
        return None
    replica = this_replica()
    if replica is None or not hasattr(replica, attr):
        logger.warning("dsv4: no Serve replica with %s in this process: %s", attr, without)
        return None
    return replica


def this_replica() -> Any | None:
    """Serve's ``Replica`` instance running in this actor process, or None."""
    from ray._private.worker import global_worker

    actor = global_worker.actors.get(global_worker.actor_id)
    return getattr(actor, "_replica_impl", None)
