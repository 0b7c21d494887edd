"""Reaching one deployment's replicas: Serve's RUNNING count, their live actors and a
broadcast under a per-replica deadline.

Ray internals touched, documented and probed in ``deployments.ray_touches``:
``serve.broadcast_per_replica_results`` (fallback ``results_async``) and
``serve.replica_ids``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle


def running_replicas(app_name: str, deployment_name: str) -> int | None:
    """RUNNING replicas of one deployment per Serve, or None if Serve does not list it."""
    app = serve.status().applications.get(app_name)
    if app is None or deployment_name not in app.deployments:
        return None
    return int(app.deployments[deployment_name].replica_states.get("RUNNING", 0))


def replica_actors(app_names: Collection[str],
                   deployment: Callable[[str], bool]) -> list[tuple[str, dict[str, str]]]:
    """(replica id, named-actor entry) of each live replica actor of the apps'
    deployments whose name ``deployment`` accepts.

    Serve's replica actors are found by parsing their names with Serve's own
    ``ReplicaID`` (the ``serve.replica_ids`` touch), never a hard-coded format.
    """
    import ray
    from ray.serve._private.common import ReplicaID

    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not ReplicaID.is_full_id_str(actor["name"]):
            continue
        replica = ReplicaID.from_full_id_str(actor["name"])
        owner = replica.deployment_id
        if owner.app_name in app_names and deployment(owner.name):
            found.append((replica.unique_id, actor))
    return found


def alive_replica_ids(app_name: str, deployment_name: str) -> set[str]:
    """Replica ids of the deployment's live actors."""
    return {rid for rid, _ in replica_actors({app_name}, lambda name: name == deployment_name)}


async def call_each(server: DeploymentHandle, per_replica: bool, timeout: float, method: str,
                    *args: Any, **kwargs: Any) -> tuple[list[Any], int, str | None]:
    """``method`` on every replica of ``server``, each under its own deadline.

    Returns (answers or exceptions of the replicas that finished, how many
    missed the deadline, an error reaching the replica set).
    """
    try:
        response = server.broadcast(method, *args, **kwargs)
        if not per_replica:
            return await response.results_async(timeout_s=timeout,
                                                return_exceptions=True), 0, None
        results = await asyncio.wait_for(
            response._fetch_replica_results_async(), timeout)
    except TimeoutError:
        return [], 0, f"{method}: could not reach the replica set within {timeout} s"
    except Exception as exc:  # DeploymentUnavailableError while (re)starting
        return [], 0, f"{method} failed: {type(exc).__name__}: {exc}"

    async def one(result: Any) -> Any:
        try:
            return await asyncio.wait_for(result.get_async(), timeout)
        except TimeoutError as exc:
            result.cancel()  # a hung call must not pile up on the replica
            return exc
        except Exception as exc:  # the replica raised: recorded as its no_answer
            return exc

    answers = await asyncio.gather(*(one(r) for r in results))
    late = sum(isinstance(a, TimeoutError) for a in answers)
    return [a for a in answers if not isinstance(a, TimeoutError)], late, None
