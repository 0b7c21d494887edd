"""Every touch of Ray internals in ``deployments/``: one documented, probed registry.

Ray Serve LLM 2.60 (pinned in pyproject) exposes ``LLMConfig``, the builders, the
ingress class and ``LLMServer``; everything below reaches past that public face.
Each entry says, like the vLLM patches of ``dsv4_patch.patches``: the target
symbol, why we need it, how we use it, the upstream state, the Ray versions it is
known to hold on, and when to delete it. ``probe()`` checks the real symbol in the
installed Ray without side effects. ``build_app`` refuses to build when a
``required`` touch is missing (``require()``), so a Ray upgrade fails loudly at
deploy time instead of at the first request; ``dsv4-serve doctor`` lists them all.

Optional touches (``required=False``) never refuse a build: the drain's request
count (logged when it fails), the controller's per-replica broadcast results
(``deployments.control.controller`` falls back to ``results_async``, logged), the local
multi-node cluster of ``dsv4-serve run --nodes``. Touches only a P/D app uses
(``pd_only``) refuse only a P/D build (``require(pd=True)``).

Code that behaves differently when a touch is absent asks ``present(name)``;
it never probes Ray itself (one place per touch).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

AFFECTED = "Ray 2.60.0 (checked; other releases are probed, not assumed)"


@dataclass(frozen=True)
class RayTouch:
    """One use of a Ray internal, documented like a vLLM patch."""

    name: str
    target: str  # the internal symbol (module:attribute or a parameter)
    used_in: str  # where in deployments/
    why: str
    how: str
    upstream: str
    removal: str
    probe: Callable[[], str | None]  # None = present as used; else what is missing
    required: bool = True  # a missing required touch refuses build_app
    affected: str = AFFECTED
    pd_only: bool = False  # used by the P/D app only: refuses only a P/D build


def _symbols(module: str, *names: str) -> Callable[[], str | None]:
    """A probe: ``module`` imports and has every one of ``names``."""
    def probe() -> str | None:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            return f"cannot import {module}: {exc}"
        missing = [n for n in names if not hasattr(mod, n)]
        return f"{module} lacks {', '.join(missing)}" if missing else None
    return probe


def _resolve(module: str, path: str) -> tuple[object | None, str | None]:
    """(``module.path``, None), or (None, what is missing)."""
    try:
        obj: object = importlib.import_module(module)
    except ImportError as exc:
        return None, f"cannot import {module}: {exc}"
    for part in path.split("."):
        if not hasattr(obj, part):
            return None, f"{module}.{path} does not exist ({part!r} missing)"
        obj = getattr(obj, part)
    return obj, None


def _attr_chain(module: str, path: str) -> Callable[[], str | None]:
    """A probe: ``module.path`` (dotted attributes) exists."""
    return lambda: _resolve(module, path)[1]


def _source_mentions(module: str, path: str, text: str) -> Callable[[], str | None]:
    """A probe: the source of ``module.path`` contains ``text`` (a behaviour we rely on)."""
    def probe() -> str | None:
        obj, missing = _resolve(module, path)
        if missing:
            return missing
        try:
            source = inspect.getsource(obj)  # type: ignore[arg-type]
        except (OSError, TypeError) as exc:
            return f"cannot read the source of {module}.{path}: {exc}"
        return None if text in source else f"{module}.{path} no longer does {text!r}"
    return probe


def _parameter(module: str, path: str, param: str) -> Callable[[], str | None]:
    """A probe: the callable ``module.path`` takes keyword ``param`` (or pops it from kwargs)."""
    def probe() -> str | None:
        obj, missing = _resolve(module, path)
        if missing:
            return missing
        func = inspect.unwrap(obj)  # type: ignore[arg-type]
        if param in inspect.signature(func).parameters:
            return None
        return None if f'"{param}"' in inspect.getsource(func) else \
            f"{module}.{path} does not take {param}"
    return probe


_LLM = "ray.llm._internal.serve"

TOUCHES: tuple[RayTouch, ...] = (
    RayTouch(
        name="serve.late_bound_ingress",
        target="ray.serve:ingress() without an app + "
               f"{_LLM}.core.server.llm_server:LLMServer.__serve_build_asgi_app__",
        used_in="deployments/app.py build_parsed_app, deployments/serving/server.py, "
                "deployments/http/front.py",
        why="the ingress replica cost a Python hop per request and per streamed chunk "
            "(TTFT 1.96x plain vLLM, docs/benchmarks.md 2a): the server replica answers "
            "HTTP itself with vLLM's OpenAI app",
        how="build_llm_deployment(deployment_cls=serve.ingress()(DSv4Server)); "
            "DSv4Server.__serve_build_asgi_app__ hardens vLLM's app (front.harden)",
        upstream="the late-bound hook is public Serve API in 2.60; Ray Serve LLM's direct "
                 "streaming uses the same method (with HAProxy, binding all interfaces)",
        removal="keep while Serve keeps the hook",
        probe=_attr_chain(f"{_LLM}.core.server.llm_server",
                          "LLMServer.__serve_build_asgi_app__"),
    ),
    RayTouch(
        name="llm.pd_direct_ingress_routes",
        target=f"{_LLM}.serving_patterns.prefill_decode.pd_server:"
               "PDOrchestratorMixin.__serve_build_asgi_app__",
        used_in="deployments/pd/builder.py build_pd_app, deployments/pd/server.py "
                "DSv4PDDecodeServer",
        why="the P/D decode replica is the ingress (no ingress replica, as for one pool); "
            "vLLM's own chat/completions routes would decode locally and skip the remote "
            "prefill",
        how="serve.ingress()(DSv4PDDecodeServer): the hook (reached through "
            "DSv4ServerMixin.__serve_build_asgi_app__, which then hardens the app) re-points "
            "/v1/chat/completions and /v1/completions at self.chat / self.completions, "
            "ours: remote prefill only to a proven prefill replica (pd_route), else local",
        upstream="Ray 2.60's direct-streaming P/D builder uses it (build_pd_openai_app "
                 "with RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING); not public API",
        removal="when Ray exports a P/D server whose ASGI app can be built without the "
                "direct-streaming builder",
        probe=lambda: _source_mentions(
            f"{_LLM}.serving_patterns.prefill_decode.pd_server",
            "PDOrchestratorMixin.__serve_build_asgi_app__", "self.chat(")() or
        _source_mentions(f"{_LLM}.serving_patterns.prefill_decode.pd_server",
                         "PDOrchestratorMixin.__serve_build_asgi_app__", "self.completions(")(),
        pd_only=True,
    ),
    RayTouch(
        name="llm.deployment_name",
        target=f"{_LLM}.core.server.builder:_get_deployment_name",
        used_in="deployments/app.py server_deployment_name, deployments/pd/builder.py",
        why="the servers bind the controller (for /v1/kv-spec), so the controller finds "
            "them by name: a Serve graph has no cycles",
        how="the name build_llm_deployment gives: '<class>:' (P/D: 'Decode:') + "
            "_get_deployment_name",
        upstream="not public in Ray 2.60",
        removal="when the builder exposes the deployment name",
        probe=_symbols(f"{_LLM}.core.server.builder", "_get_deployment_name"),
    ),
    RayTouch(
        name="llm.node_init_callback",
        target="ray.llm._internal.common.callbacks.base:CallbackBase, "
               "CallbackCtx.run_init_node",
        used_in="deployments/serving/boot.py LocalModelCallback, deployments/app.py",
        why="Ray Serve LLM runs a per-node download task (a fresh Ray worker) before every "
            "engine boot, also for a local model directory (~15 s of a loaded 2-core boot)",
        how="LLMConfig.callback_config (public) with our callback, which sets "
            "ctx.run_init_node = False only for a local directory on a one-node group",
        upstream="callback_config is public; CallbackBase has no public re-export in 2.60",
        removal="when Ray skips initialize_node for local paths, or exports CallbackBase",
        probe=lambda: _symbols("ray.llm._internal.common.callbacks.base", "CallbackBase",
                               "CallbackCtx")() or (
            None if "run_init_node" in __import__(
                "ray.llm._internal.common.callbacks.base",
                fromlist=["CallbackCtx"]).CallbackCtx.__dataclass_fields__
            else "CallbackCtx has no run_init_node"),
    ),
    RayTouch(
        name="serve.proxy_host",
        target="ray.serve.context:_get_global_client().http_config.host",
        used_in="deployments/http/front.py proxy_host",
        why="the edge requires an API key unless Serve's proxies bind a loopback address; "
            "only the Serve controller knows the bind address",
        how="read it once when a server replica starts; unknown = treated as reachable",
        upstream="no public accessor for the running http_options in Ray 2.60",
        removal="when serve exposes the running HTTP options",
        probe=_symbols("ray.serve.context", "_get_global_client"),
    ),
    RayTouch(
        name="serve.direct_ingress_flag",
        target="ray.serve._private.constants: RAY_SERVE_ENABLE_DIRECT_INGRESS as Serve "
               "resolved it (RAY_SERVE_THROUGHPUT_OPTIMIZED and RAY_SERVE_ENABLE_HA_PROXY "
               "turn it on)",
        used_in="deployments/serving/serve_env.py replicas_listen, read by front.proxy_host",
        why="under direct ingress each replica listens on its own port beside the proxy, "
            "so http_options.host no longer bounds who connects: the edge must require keys",
        how="read the resolved constant when a server replica starts; on = reachable",
        upstream="the env flags are documented (docs.ray.io, Enable High Throughput on Ray "
                 "Serve, Ray 2.55+); their resolution lives in constants.py",
        removal="when Serve exposes whether a replica runs its own HTTP server",
        probe=_symbols("ray.serve._private.constants", "RAY_SERVE_ENABLE_DIRECT_INGRESS"),
        required=False,
    ),
    RayTouch(
        name="llm_config.update_engine_kwargs",
        target="ray.serve.llm:LLMConfig.update_engine_kwargs (updates _engine_config too)",
        used_in="deployments/serving/server.py canonicalize, _apply_override, DSv4ServerMixin",
        why="the replica rewrites kv_cache_dtype (and a canary's override) after Ray Serve "
            "LLM cached the engine config at build time",
        how="rely on update_engine_kwargs also updating the cached _engine_config",
        upstream="documented as updating both, but the cached config is private",
        removal="when LLMServer takes engine kwargs at construction only",
        probe=_source_mentions("ray.serve.llm", "LLMConfig.update_engine_kwargs",
                               "_engine_config.engine_kwargs.update"),
    ),
    RayTouch(
        name="serve.replica_ids",
        target="ray.serve._private.common:ReplicaID.is_full_id_str, from_full_id_str",
        used_in="deployments/control/controller.py replica_actors (for alive_replica_ids and "
                "drain.py in_flight_requests)",
        why="the drain prints how many requests are in flight; the controller names the "
            "replicas that missed a check's deadline; both find a deployment's replicas "
            "among the named actors by their replica id",
        how="parse every named actor's name (never a hard-coded name format); keep the "
            "replicas of one deployment",
        upstream="no public per-replica request count in Ray 2.60",
        removal="when serve.status() reports ongoing requests per replica",
        probe=lambda: _attr_chain("ray.serve._private.common", "ReplicaID.is_full_id_str")()
        or _attr_chain("ray.serve._private.common", "ReplicaID.from_full_id_str")(),
        required=False,
    ),
    RayTouch(
        name="serve.replica_ongoing_requests",
        target="ray.serve._private.replica:ReplicaActor.get_num_ongoing_requests, "
               "record_routing_stats",
        used_in="deployments/local/drain.py in_flight_requests",
        why="the count of in-flight requests the drain waits for: Serve's own count, and "
            "the edge's (dsv4_http_in_flight in our routing stats), which also sees the "
            "requests on the replicas' own port (http.replica_port) that Serve never routes",
        how="call both on each ingress replica actor, take the larger per replica (10 s "
            "bound; a failure is logged and the drain goes on)",
        upstream="private actor method",
        removal="as serve.replica_ids",
        probe=lambda: _attr_chain("ray.serve._private.replica",
                                  "ReplicaActor.get_num_ongoing_requests")()
        or _attr_chain("ray.serve._private.replica", "ReplicaActor.record_routing_stats")(),
        required=False,
    ),
    RayTouch(
        name="serve.delete_nonblocking",
        target="ray.serve:delete(_blocking=False)",
        used_in="deployments/local/drain.py drain",
        why="deleting every application at once lets their drains overlap; a blocking "
            "delete would drain them one after another",
        how="delete each app without waiting, then poll serve.status() until all are gone",
        upstream="underscore parameter of the public serve.delete",
        removal="when serve.delete takes several names or a public non-blocking flag",
        probe=_parameter("ray.serve", "delete", "_blocking"),
        required=False,
    ),
    RayTouch(
        name="ray.metrics_export_port",
        target="ray:init(_metrics_export_port=)",
        used_in="deployments/local/ray_head.py start_cluster",
        why="`dsv4-serve run` prints the Prometheus URL, so the port must be ours to know",
        how="pass a free port to ray.init of the private local cluster",
        upstream="underscore keyword of ray.init (popped from **kwargs)",
        removal="when ray.init takes a public metrics port",
        probe=_parameter("ray", "init", "_metrics_export_port"),
        required=False,
    ),
    RayTouch(
        name="ray.loopback_node_ip",
        target="ray._private.ray_constants:ENABLE_RAY_CLUSTER, read by "
               "ray._private.services:get_node_ip_address",
        used_in="deployments/local/ray_head.py start_cluster (loopback_node_ip)",
        why="the private local cluster's Prometheus endpoint (the dashboard agent's "
            "metrics server, no auth) bound every interface: reporter_agent binds "
            "get_localhost_ip() only when the node IP is loopback, and on Linux the node "
            "IP is the routable one; ray.init(_node_ip_address='127.0.0.1') does not help "
            "(resolve_ip_for_localhost turns it back into the routable IP)",
        how="False for the duration of ray.init(address='local'): get_node_ip_address() "
            "then answers 127.0.0.1 (Ray's macOS/Windows default), so the node, and every "
            "port Ray opens for it (GCS, raylet, agents, metrics), binds loopback; "
            "start_cluster checks the node IP afterwards and logs an ERROR if not",
        upstream="no public option in Ray 2.60 for the metrics server's bind address or a "
                 "loopback node on Linux",
        removal="when ray.init or the metrics agent takes a bind address",
        probe=lambda: _symbols("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")()
        or _source_mentions("ray._private.services", "get_node_ip_address",
                            "ray_constants.ENABLE_RAY_CLUSTER")()
        or _source_mentions("ray.dashboard.modules.reporter.reporter_agent",
                            "ReporterAgent.__init__", "is_localhost(self._ip)")(),
        required=False,
    ),
    RayTouch(
        name="ray.quiet_local_head",
        target="ray._private.parameter:RayParams (no_monitor, include_log_monitor), read by "
               "ray._private.node:Node.start_head_processes / start_ray_processes; "
               "ray._private.node:Node.start_api_server",
        used_in="deployments/local/ray_head.py start_cluster (quiet_head)",
        why="ray.init starts the autoscaler monitor, the log monitor and (with "
            "include_dashboard=False) a minimal dashboard head unconditionally; the "
            "private one-node local cluster scales nothing, forwards no logs "
            "(log_to_driver off by default) and reports no usage stats (ray.init sets "
            "RAY_USAGE_STATS_ENABLED=0; the minimal head's one module is the usage "
            "reporter): three Python processes that compete for the cores while the "
            "head boots (ray.init waits for the dashboard head) and poll at rest "
            "(docs/benchmarks.md §2g)",
        how="for the duration of ray.init(address='local') the RayParams class ray.init "
            "instantiates is a subclass that sets no_monitor=True and, unless "
            "DSV4_LOG_TO_DRIVER=1, include_log_monitor=False, and Node.start_api_server "
            "starts nothing when include_dashboard is falsy and usage stats are off; "
            "both restored afterwards",
        upstream="ray start has --no-monitor / --include-log-monitor; ray.init exposes "
                 "neither, and always starts the dashboard head (Ray 2.60)",
        removal="when ray.init takes these options",
        probe=lambda: _symbols("ray._private.parameter", "RayParams")()
        or _source_mentions("ray._private.node", "Node.start_head_processes",
                            "self._ray_params.no_monitor")()
        or _source_mentions("ray._private.node", "Node.start_ray_processes",
                            "self._ray_params.include_log_monitor")()
        or _source_mentions("ray._private.worker", "init",
                            "ray._private.parameter.RayParams(")()
        or _source_mentions("ray._private.node", "Node.start_head_processes",
                            "self.start_api_server(")()
        or _parameter("ray._private.node", "Node.start_api_server", "raise_on_failure")()
        or _symbols("ray._common.usage.usage_lib", "usage_stats_enabled")(),
        required=False,
    ),
    RayTouch(
        name="ray_llm.telemetry_push",
        target="ray.llm._internal.serve.core.server.llm_server:"
               "push_telemetry_report_for_all_models (called by LLMServer._start_engine)",
        used_in="deployments/serving/boot.py keep_telemetry_off_boot_path",
        why="after the engine starts, LLMServer blocks on a usage report to a detached "
            "TelemetryAgent actor: a fresh worker process and Ray Serve LLM's imports on "
            "the replica's boot path (~3 s of a 2-core local boot) and a resident process "
            "(0.8 % of a core at rest), for Ray's usage stats only (docs/benchmarks.md §2g)",
        how="in each replica process, once, the module attribute is replaced by a wrapper "
            "that does nothing when ray._common.usage.usage_lib.usage_stats_enabled() is "
            "False (ray.init clusters set RAY_USAGE_STATS_ENABLED=0 themselves) and "
            "otherwise runs the original on a daemon thread",
        upstream="none: the push is synchronous in Ray 2.60 (llm_server.py _start_engine)",
        removal="when Ray Serve LLM pushes the report off the start path or skips it with "
                "usage stats off",
        probe=lambda: _symbols("ray.llm._internal.serve.core.server.llm_server",
                               "push_telemetry_report_for_all_models")()
        or _source_mentions("ray.llm._internal.serve.core.server.llm_server",
                            "LLMServer._start_engine",
                            "push_telemetry_report_for_all_models(")()
        or _symbols("ray._common.usage.usage_lib", "usage_stats_enabled")(),
        required=False,
    ),
    RayTouch(
        name="serve.broadcast_per_replica_results",
        target="ray.serve.handle:DeploymentBroadcastResponse._fetch_replica_results_async; "
               "ray.serve._private.replica_result:ReplicaResult.get_async, cancel",
        used_in="deployments/control/controller.py KVSpecController._call_each",
        why="the public results_async(timeout_s=) is all-or-nothing: one hung replica "
            "discards every answer",
        how="await each replica's result under its own timeout and cancel the ones that "
            "miss it (fallback when absent: results_async, logged once per controller)",
        upstream="no per-replica timeout in broadcast (alpha) as of Ray 2.60",
        removal="when broadcast exposes per-replica results with timeouts",
        probe=lambda: _attr_chain(
            "ray.serve.handle", "DeploymentBroadcastResponse._fetch_replica_results_async")()
        or _attr_chain("ray.serve._private.replica_result", "ReplicaResult.get_async")()
        or _attr_chain("ray.serve._private.replica_result", "ReplicaResult.cancel")(),
        required=False,
    ),
    RayTouch(
        name="pd.serving_args",
        target=f"{_LLM}.serving_patterns.prefill_decode.builder:PDServingArgs",
        used_in="deployments/pd/builder.py pool_configs",
        why="Ray Serve LLM's own validation of a prefill/decode pair (both kv_transfer_config, "
            "the roles); build_pd_openai_app takes a dict and builds its own servers and "
            "ingress, not ours",
        how="validate our two LLMConfigs with it and use the configs it returns",
        upstream="PDServingArgs is not exported by ray.serve.llm in Ray 2.60",
        removal="when ray.serve.llm exports it, or build_pd_openai_app takes server classes "
                "and an ingress",
        probe=_symbols(f"{_LLM}.serving_patterns.prefill_decode.builder", "PDServingArgs"),
        pd_only=True,
    ),
    RayTouch(
        name="pd.local_prefill",
        target="ray.serve.llm.deployment:PDDecodeServer.chat, completions (the remote-prefill "
               "path) over LLMServer.chat, completions (the local one)",
        used_in="deployments/pd/server.py DSv4PDDecodeServer.chat, completions",
        why="a decode replica with no prefill replica proven compatible must not receive "
            "unproven KV pages: it prefills on its own engine instead",
        how="when pd_route forbids a transfer, call LLMServer's method on self, skipping "
            "PDDecodeServer's override (relies on that override being the only place the "
            "remote prefill happens)",
        upstream="no per-request switch for the remote prefill in Ray 2.60",
        removal="when PDDecodeServer can be told per request to prefill locally",
        probe=lambda: _source_mentions("ray.serve.llm.deployment", "PDDecodeServer.chat",
                                       "_pd_handle_request")()
        or _source_mentions("ray.serve.llm.deployment", "PDDecodeServer.completions",
                            "_pd_handle_request")()
        or _attr_chain("ray.serve.llm.deployment", "LLMServer.completions")(),
        pd_only=True,
    ),
    RayTouch(
        name="serve.local_quiet_env",
        target="ray.serve._private.constants: CONTROL_LOOP_INTERVAL_S "
               "(RAY_SERVE_CONTROL_LOOP_INTERVAL_S), RAY_SERVE_METRICS_EXPORT_INTERVAL_MS",
        used_in="deployments/serve_env.py LOCAL_QUIET_ENV, set by "
                "deployments/local/ray_head.py start_cluster (the private local Ray only)",
        why="a local run idles quietly: Serve's 10 Hz control loop and 10 Hz metrics flush "
            "are most of what the app costs at rest on a small box (docs/benchmarks.md §2f)",
        how="process environment before the local Ray starts; a value the user set wins",
        upstream="environment variables read in constants.py, not in Serve's documented "
                 "settings",
        removal="when Serve offers a documented idle or local profile",
        probe=_symbols("ray.serve._private.constants", "CONTROL_LOOP_INTERVAL_S",
                       "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"),
        required=False,
    ),
    RayTouch(
        name="serve.direct_ingress_port_range",
        target="ray.serve._private.constants: RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT / "
               "MAX_HTTP_PORT (range(MIN, MAX) in node_port_manager.PortAllocator)",
        used_in="deployments/serve_env.py direct_env (benchmarks.serving_overhead "
                "ours-direct)",
        why="pin the one replica's own HTTP port so a client can find it under direct "
            "ingress (Serve otherwise picks from 30000-31000)",
        how="process environment before Ray starts; MIN=p, MAX=p+1",
        upstream="environment variables in constants.py; no public way to learn a "
                 "replica's direct-ingress port",
        removal="when Serve publishes replica ports or balances direct ingress itself",
        probe=_symbols("ray.serve._private.constants", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
                       "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"),
        required=False,
    ),
    RayTouch(
        name="autoscaler.fake_multinode",
        target="ray.autoscaler._private.fake_multi_node.node_provider:FakeMultiNodeProvider",
        used_in="deployments/local/cluster.py (`dsv4-serve run --nodes`, tests)",
        why="Ray's real autoscaler adding and removing local raylets stands in for GPU nodes",
        how="declared as an external provider module (Ray's wheel lacks the example.yaml "
            "provider type fake_multinode reads)",
        upstream="test utility, not a public API",
        removal="when Ray ships a public local multi-node cluster",
        probe=_symbols("ray.autoscaler._private.fake_multi_node.node_provider",
                       "FakeMultiNodeProvider"),
        required=False,
    ),
)


def probe_all() -> list[dict[str, str | bool]]:
    """Every touch with its probe result, as JSON-safe rows (``dsv4-serve doctor``)."""
    rows = []
    for touch in TOUCHES:
        missing = touch.probe()
        rows.append({"name": touch.name, "target": touch.target, "used_in": touch.used_in,
                     "required": touch.required, "pd_only": touch.pd_only,
                     "present": missing is None,
                     "detail": missing or "present", "why": touch.why, "how": touch.how,
                     "upstream": touch.upstream, "affected": touch.affected,
                     "removal": touch.removal})
    return rows


def present(name: str) -> bool:
    """Whether the named touch holds in the installed Ray (the probe of its entry)."""
    touch = next((t for t in TOUCHES if t.name == name), None)
    if touch is None:
        raise KeyError(f"no Ray touch named {name!r} in deployments/ray_touches.py "
                       f"(known: {', '.join(t.name for t in TOUCHES)})")
    return touch.probe() is None


def require(pd: bool = False, touches: tuple[RayTouch, ...] = TOUCHES) -> None:
    """Raise if a required touch is missing from the installed Ray (called by build_app).

    ``pd``: the app is a prefill/decode one, so its ``pd_only`` touches count too.
    """
    missing = [f"{t.name} ({t.target}): {detail}" for t in touches
               if t.required and (pd or not t.pd_only)
               for detail in [t.probe()] if detail]
    if missing:
        raise RuntimeError(
            "this Ray lacks internals dsv4-serve builds on:\n  " + "\n  ".join(missing)
            + "\nFix: install the pinned ray[serve]==2.60.0 (pyproject.toml), or update "
            "deployments/ray_touches.py and the code it names for this Ray.")


def render(rows: list[dict[str, str | bool]]) -> list[str]:
    """Doctor lines: one per touch."""
    return [f"ray touch {r['name']}: {'present' if r['present'] else 'MISSING'}"
            + ("" if r["present"] else f" ({r['detail']})")
            + ("" if r["required"] else "; optional") + ("; P/D apps" if r.get("pd_only") else "")
            + f" [{r['used_in']}]" for r in rows]
