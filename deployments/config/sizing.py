"""How many GPUs and CPUs one engine and one replica take: the one place for that arithmetic.

Pure (no Ray, no vLLM, no config models): ``deployments.config`` exposes these
numbers on its models, and the planner (``deployments.plan.preflight``), the manifest
renderer (``deployments.k8s``) and the local runner (``deployments.local.ray_head``)
all read them from here, so a replica is sized the same way everywhere.

Units, as Ray Serve LLM 2.60 deploys them:

* an **engine** is one vLLM engine: ``tensor_parallel_size x pipeline_parallel_size``
  workers, one placement-group bundle each;
* a **replica** (the scaling unit) is one engine, or with DP attention
  (``data_parallel_size > 1``) a gang of ``data_parallel_size`` engines, each its own
  Serve replica actor (``DPServer``), gang-scheduled together.

Ray Serve LLM puts each Serve replica actor (``ray_actor_options.num_cpus``, 1 by
default) into the first bundle of its engine's placement group, so one engine
reserves its bundles' CPUs plus its actor's.

The cache block size is ``dsv4_patch.rules.DSV4_BLOCK_SIZE`` (256 tokens); the
byte geometry of a stored token lives in ``dsv4_patch.rules`` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsv4_patch.rules.prediction import DSV4_BLOCK_SIZE

# Ray Serve's default ``ray_actor_options.num_cpus`` of a replica actor.
REPLICA_ACTOR_CPUS = 1.0
# The CPUs of one engine when no placement_group_config is given: Ray Serve LLM's
# CPU default is one ``{CPU: 1}`` bundle (its GPU default bundles carry no CPU).
DEFAULT_CPU_BUNDLE_CPUS = 1.0


@dataclass(frozen=True)
class Parallel:
    """The parallel layout of one engine and of one replica (a DP gang or one engine)."""

    tp: int
    pp: int
    dp: int = 1
    ep: bool = False
    nodes: int = 1

    @property
    def gpus_per_engine(self) -> int:
        """Workers (GPUs) of one vLLM engine: TP x PP."""
        return self.tp * self.pp

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one scaling unit: a DP gang (DP x TP x PP), or one engine."""
        return self.gpus_per_engine * self.dp

    @property
    def ep_size(self) -> int:
        """vLLM's expert-parallel group spans DP x TP inside one pipeline stage."""
        return self.tp * self.dp if self.ep else 1

    def as_dict(self) -> dict[str, int | bool]:
        """The layout with every derived count, in vLLM/Ray field names (plan output)."""
        return {
            "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
            "data_parallel_size": self.dp, "enable_expert_parallel": self.ep,
            "expert_parallel_size": self.ep_size, "gpus_per_engine": self.gpus_per_engine,
            "engines_per_replica": self.dp, "gpus_per_replica": self.gpus_per_replica,
            "nodes_per_replica": self.nodes,
        }


def serve_replicas(scaling_units: int, par: Parallel) -> int:
    """Serve replica actors of ``scaling_units`` replicas: with DP attention every rank
    is its own Serve replica (``DPServer``), so a gang of ``dp`` counts ``dp`` times.

    Each of them is an HTTP ingress with its own edge (``deployments.http.front``):
    this, not the count of gangs or nodes, is what shares ``http.max_in_flight``.
    """
    return scaling_units * par.dp


def block_size(configured: int | None) -> int:
    """The KV cache block size an engine runs: the configured one, else DeepSeek-V4's 256."""
    return configured or DSV4_BLOCK_SIZE


def engine_cpus(bundles: Sequence[Mapping[str, float]] | None,
                actor_cpus: float = REPLICA_ACTOR_CPUS) -> float:
    """CPUs one engine reserves: its replica actor plus its placement-group bundles."""
    if bundles is None:
        return actor_cpus + DEFAULT_CPU_BUNDLE_CPUS
    return actor_cpus + sum(b.get("CPU", 0) for b in bundles)


def replica_cpus(bundles: Sequence[Mapping[str, float]] | None, par: Parallel,
                 actor_cpus: float = REPLICA_ACTOR_CPUS) -> float:
    """CPUs one scaling unit reserves: every engine of a DP gang with its actor."""
    return par.dp * engine_cpus(bundles, actor_cpus)


def nodes_for(replicas: Sequence[tuple[int, int]], gpus_per_node: int) -> int:
    """GPU nodes that hold ``(count, GPUs each)`` replicas, every replica inside one node.

    Exact (only the last node may have idle GPUs) when every replica size divides the
    node's GPUs and the sizes divide each other, as TP sizes (powers of two) do; a
    prefill/decode app's two pools then share nodes. Anything else raises ValueError:
    packing it is the Ray autoscaler's problem and no single pod count is right.
    """
    sizes = sorted({gpus for count, gpus in replicas if count})
    bad = [g for g in sizes if g > gpus_per_node or gpus_per_node % g]
    if bad or any(big % small for small in sizes for big in sizes if big >= small):
        raise ValueError(
            f"replicas of {sizes} GPUs on {gpus_per_node}-GPU nodes: expected sizes that "
            "divide the node's GPU count and each other (e.g. 4 and 4, or 2 and 4 on 8)")
    total = sum(count * gpus for count, gpus in replicas)
    return -(-total // gpus_per_node)


def cluster_cpus(replicas: Sequence[tuple[int, float]]) -> float:
    """Logical CPUs a cluster needs for applications given as (max_replicas, replica CPUs).

    Nothing else of an application reserves CPU: the server replicas are the HTTP
    ingress (``deployments.http.front``), the KV-spec controller asks for ``num_cpus: 0``,
    and so do Ray Serve LLM's node-init tasks and Serve's proxy.
    """
    return sum(top * cpus for top, cpus in replicas)
