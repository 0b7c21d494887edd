"""The Ray internals the replica's doors touch: the proxy's bind, direct ingress and
HAProxy, Serve's data plane and its stopping flag (``deployments.doors``, the edge)."""

from __future__ import annotations

from deployments.ray_touches.probes import (
    RayTouch,
    attr_chain,
    dataclass_field,
    every,
    optional,
    source_mentions,
    symbols,
    text_mentions,
)

# The replica actor holds its Replica as ``_replica_impl``: how the doors reach Serve's
# per-replica state from the replica's own process.
REPLICA_IMPL = source_mentions("ray.serve._private.replica", "ReplicaActor.__init__",
                               "self._replica_impl")

TOUCHES: tuple[RayTouch, ...] = (
    RayTouch(
        name="serve.proxy_host",
        target="ray.serve.context:_get_global_client().http_config.host",
        used_in=("deployments.http.front:proxy_host",),
        why="the edge requires an API key unless Serve's proxies bind a loopback address; "
            "only the Serve controller knows the bind address",
        how="read it once when a server replica starts; unknown = treated as reachable",
        upstream="no public accessor for the running http_options in Ray 2.60",
        removal="when serve exposes the running HTTP options",
        probe=symbols("ray.serve.context", "_get_global_client"),
    ),
    *optional(
        RayTouch(
            name="serve.direct_ingress_flag",
            target="ray.serve._private.constants: RAY_SERVE_ENABLE_DIRECT_INGRESS as Serve "
                   "resolved it (RAY_SERVE_THROUGHPUT_OPTIMIZED and RAY_SERVE_ENABLE_HA_PROXY "
                   "turn it on)",
            used_in=("deployments.serve_env:replicas_listen",
                     "deployments.http.front:proxy_host"),
            why="under direct ingress each replica listens on its own port beside the proxy, "
                "so http_options.host no longer bounds who connects: the edge must require keys",
            how="read the resolved constant when a server replica starts; on = reachable",
            upstream="the env flags are documented (docs.ray.io, Enable High Throughput on Ray "
                     "Serve, Ray 2.55+); their resolution lives in constants.py",
            removal="when Serve exposes whether a replica runs its own HTTP server",
            probe=symbols("ray.serve._private.constants", "RAY_SERVE_ENABLE_DIRECT_INGRESS"),
        ),
        RayTouch(
            name="serve.replica_shutting_down",
            target="ray.serve._private.replica:Replica._shutting_down via "
                   "ray._private.worker.global_worker.actors[actor_id]._replica_impl",
            used_in=("deployments.doors.stopping:serve_stopping",),
            why="Serve tells the replica's code nothing until __del__, after draining only "
                "the requests it routed: the replica's own port (http.replica_port) must "
                "stop taking connections as the shutdown begins, and its held requests get "
                "what is left of graceful_shutdown_timeout_s (issue 34)",
            how="read the flag every 0.25 s from the listener's watch task; read only, "
                "never written; absent = the port closes at __del__ (logged)",
            upstream="no public replica-stopping hook in Ray 2.60 (the flag's comment says "
                     "replica subclasses may use it)",
            removal="when Serve calls a user hook at the start of a graceful shutdown",
            probe=every(source_mentions("ray.serve._private.replica",
                                        "Replica._perform_graceful_shutdown",
                                        "self._shutting_down = True"),
                        REPLICA_IMPL,
                        attr_chain("ray._private.worker", "global_worker.actors")),
        ),
        RayTouch(
            name="serve.dataplane_health",
            target="ray.serve._private.replica:Replica._dataplane_health_check (the answer of "
                   "/-/healthz on the replica's direct-ingress port) via "
                   "global_worker.actors[actor_id]._replica_impl",
            used_in=("deployments.doors.dataplane:install",
                     "deployments.doors.stopping:touched_replica",
                     "deployments.doors.lifecycle:Doors.follow_drain"),
            why="under http.ingress: haproxy Ray 2.60 refuses our KVSpecRouter and HAProxy picks "
                "the replica among those whose /-/healthz answers 200: a replica the KV-spec "
                "check drains must fail it to leave the rotation (issue 34)",
            how="an instance-level wrapper: Serve's own answer first (shutdown, engine health), "
                "then (False, 'DRAINED ...') while the verdict drains this replica and another "
                "serves; absent = drained replicas keep HAProxy traffic (logged)",
            upstream="no public drain hook for direct ingress in Ray 2.60; an "
                     "ingress_request_router (private _with_ingress_request_router) would route "
                     "in Python again",
            removal="when Serve lets a replica take itself out of the data plane, or takes a "
                    "custom request router under HAProxy",
            probe=every(source_mentions("ray.serve._private.replica",
                                        "Replica._direct_ingress_asgi",
                                        "await self._dataplane_health_check()"),
                        attr_chain("ray.serve._private.replica",
                                   "Replica._dataplane_health_check"),
                        REPLICA_IMPL),
        ),
        RayTouch(
            name="serve.replica_port_behind_haproxy",
            target="ray.serve._private.replica:Replica._http_port, ._http_options, "
                   "._route_prefix, "
                   "._event_loop, ._dataplane_health_check and ._metrics_manager "
                   "(ReplicaMetricsManager.inc_num_ongoing_requests / dec_...), "
                   "ray.serve._private.common:RequestMetadata; the template's server line "
                   "(haproxy_templates.HAPROXY_CONFIG_TEMPLATE)",
            used_in=("deployments.doors.haproxy_target:open_port",
                     "deployments.doors.haproxy_target:ServeCount",
                     "deployments.doors.haproxy_target:serve_health",
                     "deployments.doors.haproxy_target:wanted",
                     "deployments.doors.haproxy:harden"),
            why="Serve's direct-ingress server runs on Serve's loop and hands every streamed "
                "chunk across threads to the app: ~0.1 CPU-ms per token, the serving path's "
                "excess over vLLM's API server (issue 34, docs/benchmarks.md 2h)",
            how="the replica serves the app on its own port (Ray's port + the range's span) on "
                "the user-code loop; dsv4-haproxy points HAProxy's server lines there; "
                "/-/healthz answers Serve's data-plane health, each request is counted in "
                "Serve's ongoing requests (two call_soon_threadsafe per request); absent = "
                "http.ingress: haproxy is refused at replica start unless "
                "DSV4_HAPROXY_TARGET=ray",
            upstream="no public way to serve a replica's HTTP on the user-code loop in Ray "
                     "2.60 (ray#59681, Serve LLM's overhead, open)",
            removal="when Serve's direct ingress runs the ASGI app on the loop it serves HTTP "
                    "on, or publishes a per-request load hook",
            probe=every(source_mentions("ray.serve._private.replica",
                                        "Replica._maybe_start_direct_ingress_servers",
                                        "self._http_port,",
                                        "self._http_options"),
                        source_mentions("ray.serve._private.replica",
                                        "Replica._direct_ingress_asgi",
                                        "root_path + self._route_prefix"),
                        attr_chain("ray.serve._private.replica",
                                   "ReplicaMetricsManager.inc_num_ongoing_requests",
                                   "ReplicaMetricsManager.dec_num_ongoing_requests",
                                   "Replica._dataplane_health_check"),
                        dataclass_field("ray.serve._private.common", "RequestMetadata",
                                        "is_direct_ingress"),
                        text_mentions("ray.serve._private.haproxy_templates",
                                      "HAPROXY_CONFIG_TEMPLATE",
                                      "server {{ server.name }} {{ server.host }}:"
                                      "{{ server.port }} check")),
        ),
        RayTouch(
            name="serve.haproxy_binary",
            target="ray.serve._private.constants:RAY_SERVE_HAPROXY_BINARY_PATH, run by "
                   "ray.serve._private.haproxy:HAProxyApi._start_and_wait_for_haproxy as "
                   "`BINARY -db -f CONFIG ...`; the template's stats, prometheus and admin "
                   "socket lines (haproxy_templates.HAPROXY_CONFIG_TEMPLATE)",
            used_in=("deployments.doors.haproxy:main", "deployments.serve_env:haproxy_env",
                     "deployments.serve_env:ingress_problem"),
            why="Ray's HAProxy binds its stats page and Prometheus exporter on every interface "
                "without auth and makes its admin socket mode 666; Ray takes no host or mode "
                "for them, only the binary",
            how="the binary is dsv4-haproxy: it rewrites those three lines of the config it is "
                "given (loopback, mode 600) into a copy and execs Ray's bundled HAProxy on it, "
                "set to end with the manager that started it; a config without the lines is "
                "refused (HAProxy does not start)",
            upstream="no bind host for HAProxy's stats/metrics frontends in Ray 2.60",
            removal="when Ray binds them to a configurable host (or drops them) and takes the "
                    "admin socket's mode",
            probe=every(symbols("ray.serve._private.constants", "RAY_SERVE_HAPROXY_BINARY_PATH",
                                "RAY_SERVE_ENABLE_HA_PROXY"),
                        source_mentions("ray.serve._private.haproxy",
                                        "HAProxyApi._start_and_wait_for_haproxy",
                                        '"-f", self.config_file_path'),
                        text_mentions("ray.serve._private.haproxy_templates",
                                      "HAPROXY_CONFIG_TEMPLATE",
                                      "listen stats\n  bind *:{{ config.stats_port }}",
                                      "frontend prometheus\n    bind :{{ config.metrics_port }}",
                                      "stats socket {{ config.socket_path }} mode 666")),
        ),
        RayTouch(
            name="serve.proxy_callback",
            target="ray.serve._private.http_util:configure_http_middlewares "
                   "(RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), called by ProxyActor.__init__",
            used_in=("deployments.http.proxy_gate:proxy_middlewares",
                     "deployments.local.ray_head:start_cluster"),
            why="Serve's proxy answers GET /-/routes (every application's name and route) "
                "itself, before any replica's key check: beyond loopback nothing may answer "
                "without a key (issue 52)",
            how="the local start sets the env var to deployments.http.proxy_gate."
                "proxy_middlewares (inherited by the proxy actors); it returns one Starlette "
                "middleware that runs the edge's key check on the proxy's /-/ paths except "
                "/-/healthz (KubeRay's readiness probe); absent = /-/routes stays keyless (doctor)",
            upstream="an env var read by Ray 2.60's serve/_private/constants.py and "
                     "http_util.py; not in the Serve docs, no public proxy middleware option",
            affected="ray 2.60.0 (pinned)",
            removal="when Serve takes proxy middlewares or an auth hook in http_options, or "
                    "gates its /-/ routes itself",
            probe=every(symbols("ray.serve._private.constants",
                                "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"),
                        source_mentions("ray.serve._private.proxy",
                                        "ProxyActor.__ray_actor_class__.__init__",
                                        "configure_http_middlewares(http_options)"),
                        source_mentions("ray.serve._private.http_util",
                                        "configure_http_middlewares",
                                        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"),
                        source_mentions("ray.serve._private.http_util", "start_asgi_http_server",
                                        "_apply_middlewares(app, http_options.middlewares)")),
        ),
    ),
)
