"""The DeepSeek-V4 server replica: Ray Serve LLM's ``LLMServer`` plus a KV self-check.

Used through ``LLMConfig.server_cls``. Before ``LLMServer.__init__`` builds the
engine, the replica probes its own node (platform, compute capability,
attention backend: only the replica, running on the GPU node, knows them),
resolves ``kv_cache_dtype`` with ``dsv4_patch.rules``, logs what ``auto`` became
and why, and refuses to start when the node contradicts the deployment's
expected layout. After the engine is up it asks its workers for their real KV
specs (the front-end keeps ``auto``; only workers know) and checks them too.

``kv_page_spec()`` is what the KV-spec controller calls on every replica (a
``deployments.control.wire.ReplicaSpec``: the real per-layer specs and the byte model's
prediction for the deployment's config); ``apply_kv_verdict`` is how the
controller tells a replica it is odd. The replica acts within its *own*
configured policy: ``warn`` keeps serving, ``drain`` reports itself through
``record_routing_stats`` so ``deployments.serving.router.KVSpecRouter`` sends it nothing,
``enforce`` fails ``check_health`` so Serve replaces it (bounded by the controller).

The replica is also the application's HTTP ingress (``deployments.http.front``): Serve
builds its ASGI app (vLLM's, hardened by our edge, plus ``GET /v1/kv-spec``) through
``__serve_build_asgi_app__``; its other doors are ``deployments.doors.lifecycle``'s.
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.llm import LLMConfig, LLMServer
from ray.serve.llm.deployment import DPServer

from deployments import ray_touches
from deployments.config import WORKER_EXTENSION, DSv4Section, HTTPEdge
from deployments.config.llm import ours_or_unset
from deployments.config.responses import ResponsesStore as StoreSettings
from deployments.control.enforcement import (
    KVLayoutMismatch,
    drain_stats,
    others_serving,
    raise_if_enforced,
    take_verdict,
)
from deployments.control.prediction import (
    predict,
)
from deployments.control.summary import ReplicaKV, summarize_workers
from deployments.control.wire import (
    DRAIN_STAT,
    ENGINE_DEAD_STAT,
    HTTP_IN_FLIGHT_STAT,
    KV_USAGE_STAT,
    Prediction,
    ReplicaSpec,
    ReplicaVerdict,
    TransferSpec,
    answer_kv_page_spec,
)
from deployments.doors.lifecycle import Doors, listening_ingress
from deployments.http import front
from deployments.http.public import RefreshGate
from deployments.logs import get_logger
from deployments.responses.replica import ReplicaStore, bind_store
from deployments.serving import autoscale, boot, engine_metrics
from deployments.serving.engine_wait import AfterEngineSpawn, freeze_heap
from deployments.serving.resolve import (
    apply_override,
    node_id,
    probe_node,
    read_model_config,
    resolve_for_replica,
    source_of,
    versions,
    with_overrides,
)
from deployments.serving.self_check import check_own_spec
from dsv4_patch import rules
from dsv4_patch.node import layout_contradiction, table_decision
from dsv4_patch.worker_ext import KV_SPECS_METHOD

logger = get_logger("server")

__all__ = ["DSv4DPServer", "DSv4Server", "KVLayoutMismatch"]


class DSv4ServerMixin:
    """Resolves the KV dtype before the engine is built and can prove the KV layout.

    A mixin so the same checks wrap Ray Serve LLM's ``LLMServer`` (one engine per
    replica) and its ``DPServer`` (DP attention: one replica per DP rank).
    """

    async def __init__(self, llm_config: LLMConfig | dict[str, Any], *, dsv4: dict[str, Any],  # type: ignore[misc]  # Serve awaits an async __init__
                       http: dict[str, Any] | None = None, serving_replicas: int = 1,
                       kv_spec_controller: DeploymentHandle | None = None,
                       drain_timeout_s: float = 60.0,
                       responses: dict[str, Any] | None = None, **kwargs: Any):
        ray_touches.require(llm=True)  # a light build left these to the replica
        llm_config = as_llm_config(llm_config, self)
        self._settings = DSv4Section.model_validate(dsv4)
        # ``http`` is given to the replicas that answer HTTP (the ingress); a P/D
        # prefill replica is called only by decode replicas and has no edge.
        self._http = HTTPEdge.model_validate(http or {})
        self._edge = front.start_edge(self._http, serving_replicas) if http is not None else None
        if self._edge is not None:
            self._http = self._edge.settings
        self._kv_spec = kv_spec_controller
        self._refresh = RefreshGate(self._http.kv_spec_refresh_interval_s)
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.unique_id
        self._asgi_app: Any = None
        self._doors = Doors(self._http, http is not None, drain_timeout_s)
        self._responses = StoreSettings.model_validate(responses or {})
        self._store: ReplicaStore | None = None
        self._app_name = ctx.app_name
        self._rank = ctx.rank.rank if ctx.rank is not None else None
        self._code_version = getattr(ctx, "code_version", None)
        self._node_id = node_id()
        base_config = llm_config
        llm_config = llm_config.model_copy(deep=True)
        self._override = apply_override(llm_config, self._settings, self._rank)
        self._requested = llm_config.engine_kwargs.get("kv_cache_dtype", "auto")
        ours_or_unset(llm_config.engine_kwargs.get("worker_extension_cls"))
        llm_config.update_engine_kwargs(worker_extension_cls=WORKER_EXTENSION)
        self._node = probe_node(self._settings, llm_config.engine_kwargs)
        self._expected = self._settings.expected_for(self._node.as_dict())
        self._model_config = read_model_config(base_config)  # the one read of config.json
        cfg, _ = with_overrides(*self._model_config, base_config)
        self._family = rules.family_of(cfg) if cfg else None
        ahead = None if self._family is rules.Family.V41 else table_decision(self._node)
        self._resolution = resolve_for_replica(llm_config, self._settings, self._node,
                                               self._family, ahead)
        while_engine_starts = AfterEngineSpawn()
        layout_check = None if ahead is None else while_engine_starts.submit(
            "the layout check", partial(layout_contradiction, self._node, ahead))
        while_engine_starts.submit("the heap freeze", freeze_heap)
        while_engine_starts.close()
        self._prediction, self._own_prediction = self._predictions(base_config, llm_config)
        self._verdict = ReplicaVerdict()
        self._engine_dead = False
        self._kv: ReplicaKV | None = None
        boot.keep_telemetry_off_boot_path()
        engine_metrics.install()  # before the engine builds its stat loggers
        started = time.monotonic()
        await super().__init__(llm_config, **kwargs)  # type: ignore[misc, call-arg]  # mixed in
        self._engine_start_s = round(time.monotonic() - started, 1)
        if layout_check is not None:
            contradiction = await asyncio.wrap_future(layout_check)
            if contradiction:
                raise KVLayoutMismatch(
                    f"replica {self._replica_id}: {contradiction}. Refusing to serve: this "
                    "dsv4-serve's table for the installed vLLM is wrong. Fix: install the "
                    "vLLM release dsv4-serve pins, and report the mismatch.")
        spec = ReplicaSpec.model_validate(await self.kv_page_spec())
        self._self_check(spec)

    def _predictions(self, base: LLMConfig,
                     own: LLMConfig) -> tuple[Prediction, Prediction | None]:
        """The byte model's KV spec for the deployment's config and, if overridden, for ours.

        The deployment's (no replica override, the declared layout) is what the
        controller judges this replica against; ours says whether a canary built
        what its override asks for.
        """
        vllm = versions()["vllm"]
        layout = rules.Layout(self._expected) if self._expected in \
            {m.value for m in rules.Layout} else self._resolution.layout
        node = self._node.as_dict()
        base_cfg, why = with_overrides(*self._model_config, base)
        deployment = predict(base_cfg, layout, self._requested, vllm,
                             source=source_of(base, vllm, why), node=node,
                             engine=base.engine_kwargs)
        if self._override is None:
            return deployment, None
        own_cfg, why = with_overrides(*self._model_config, own)
        return deployment, predict(own_cfg, self._resolution.layout, self._requested,
                                   vllm, source=source_of(own, vllm, why) + " + override "
                                   f"rank {self._rank}", node=node,
                                   engine=own.engine_kwargs)

    def _self_check(self, spec: ReplicaSpec) -> None:
        """Refuse to serve when the workers contradict the expectation or their own config."""
        check_own_spec(spec, replica_id=self._replica_id, rank=self._rank,
                       expected=self._expected, policy=self._settings.policy,
                       engine_start_s=self._engine_start_s)

    async def __serve_build_asgi_app__(self) -> Any:
        """Serve's late-bound ingress hook: vLLM's OpenAI app, hardened (``front.harden``)."""
        app = await super().__serve_build_asgi_app__()  # type: ignore[misc]  # a mixin: the superclass that defines it is Ray Serve LLM's LLMServer
        if self._edge is None:  # no http args (a P/D prefill replica): no HTTP door
            self._asgi_app = front.closed_app
            return self._asgi_app
        self._asgi_app = front.harden(
            app, self._edge, self._kv_spec_report if self._kv_spec is not None else None)
        if self._http.responses_store:  # before the first request: the fleet's store
            self._store = bind_store(app, self._responses, self._app_name)
        await self._doors.open(self._asgi_app, front.proxy_host)
        return self._asgi_app

    async def dsv4_close_listener(self) -> None:
        """Shutdown: stop taking connections on the replica's own port, let held
        requests finish (up to the deployment's graceful shutdown time), then close the
        Responses store (its poller, its connections)."""
        await self._doors.close()
        if self._store is not None:  # its poller and connections end with the replica
            store, self._store = self._store, None
            await store.close()

    async def _kv_spec_report(self, refresh: bool) -> tuple[Any, str]:
        """The controller's report for ``GET /v1/kv-spec``: refreshes coalesced, rate-limited."""
        controller = self._kv_spec
        assert controller is not None
        return await self._refresh.report(
            refresh, lambda fresh: controller.report.remote(refresh=fresh))

    async def kv_page_spec(self, known: dict[str, str] | None = None) -> dict[str, Any]:
        """This replica's ``deployments.control.wire.ReplicaSpec``, dumped to plain JSON.

        Workers are asked once; the specs cannot change without a new engine,
        and a new engine means a new replica. ``known`` (replica id -> the
        fingerprint the controller holds) turns the answer into a
        ``ReplicaSpecBrief`` when the controller already holds this spec.
        """
        if self._kv is None:
            workers = await self.collective_rpc(  # type: ignore[attr-defined]  # a mixin: Ray Serve LLM's LLMServer provides it
                KV_SPECS_METHOD, timeout=60.0)
            self._kv = summarize_workers(workers)
        spec = ReplicaSpec(
            replica_id=self._replica_id, rank=self._rank, node_id=self._node_id,
            pid=os.getpid(), deployment_version=self._code_version,
            policy=self._settings.policy.value,
            expected_layout=self._expected, versions=versions(),
            node=self._node.as_dict(), kv_cache_dtype_requested=self._requested,
            kv_cache_dtype_engine=self._resolution.engine_dtype,
            resolution_reason=self._resolution.reason,
            override=None if self._override is None else self._override.model_dump(),
            prediction=self._prediction, own_prediction=self._own_prediction,
            verdict=self._verdict, transfer=await self._transfer_spec(),
            **self._kv.fields())
        return answer_kv_page_spec(spec, known)

    async def _transfer_spec(self) -> TransferSpec | None:
        """What a KV transfer depends on; only the P/D pools' servers have one."""
        return None

    async def apply_kv_verdict(self, message: dict[str, Any]) -> dict[str, Any]:
        """Take the controller's verdict; act on it within this replica's own policy."""
        self._verdict = take_verdict(message, self._replica_id, self._settings.policy.value,
                                     self._verdict)
        await self._follow_drain(message)
        return {"replica_id": self._replica_id, "odd": self._verdict.odd,
                "action": self._verdict.action.value}

    async def _follow_drain(self, message: dict[str, Any]) -> None:
        """The doors follow the verdict (``Doors.follow_drain``); whether another
        replica would still serve is asked only of a drained one."""
        drained = bool(drain_stats(self._verdict)[DRAIN_STAT])
        await self._doors.follow_drain(drained, drained and others_serving(
            message, self._replica_id, self._settings.policy.value))

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve LLM's routing stats plus whether the KV-spec router must skip us."""
        stats = await super().record_routing_stats() or {}  # type: ignore[misc]  # a mixin: the superclass that defines it is Ray Serve LLM's LLMServer
        held = {HTTP_IN_FLIGHT_STAT: self._edge.in_flight} if self._edge is not None else {}
        load = engine_metrics.engine_load()
        engine = {ENGINE_DEAD_STAT: self._engine_dead} | (
            {KV_USAGE_STAT: load[0]} if load is not None else {})
        return dict(stats) | drain_stats(self._verdict) | held | engine

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What ``autoscale.KVPressurePolicy`` scales on: KV usage, waiting and running as
        vLLM's stat logger last set them here, and whether the KV-spec check drained us.
        Serve asks only once the replica (its engine) is up; vLLM sets its gauges at the
        end of a step, so before the first one ends (idle, or one long first prefill)
        the engine has shown nothing running: zeros (an empty sample would hold the
        policy at no_metrics until then), and its floor of Serve's request count shows
        the load."""
        load = engine_metrics.engine_load() or (0.0, 0.0, 0.0)
        drained = bool(drain_stats(self._verdict)[DRAIN_STAT])
        return autoscale.stats(*load, drained=drained)

    async def check_health(self) -> None:
        """Engine health first; then, if our verdict says so, fail so Serve replaces us.

        Also looks at the API key file (``KeyStore.refresh``), so a refused edit is
        logged and in the metrics within a health period even without traffic; a
        stale key file does not fail health (the last good keys still serve).
        """
        if self._edge is not None:
            self._edge.keys.refresh()
        self._doors.raise_if_broken()
        try:
            await super().check_health()  # type: ignore[misc]  # a mixin: the superclass that defines it is Ray Serve LLM's LLMServer
        except Exception:
            self._engine_dead = True  # the affinity router skips us (routing stats)
            self._doors.engine_dead()
            raise
        self._engine_dead = False
        await self._doors.engine_healthy()
        raise_if_enforced(self._verdict)


class DSv4Server(DSv4ServerMixin, LLMServer):
    """The DSv4 replica: one vLLM engine (TP x PP workers) per Serve replica."""


class DSv4DPServer(DSv4ServerMixin, DPServer):
    """The DSv4 replica for DP attention: one Serve replica per DP rank, gang-scheduled."""


# What the replicas of the one-pool app run, named by import path
# (deployments.serving.server_options.SERVER_IMPORT_PATHS).
DSv4Ingress = listening_ingress(DSv4Server)
DSv4DPIngress = listening_ingress(DSv4DPServer)


def as_llm_config(llm_config: LLMConfig | dict[str, Any], server: object) -> LLMConfig:
    """The ``LLMConfig`` a replica runs: a build by import path binds the dict, validated
    here by Ray Serve LLM as its builder would have (``server_cls`` as it sets it)."""
    if isinstance(llm_config, LLMConfig):
        return llm_config
    server_cls = DSv4DPServer if isinstance(server, DPServer) else DSv4Server
    return LLMConfig(**llm_config, server_cls=server_cls)
