"""The Ray internals the local cluster of ``dsv4-serve run`` touches: head, drain, nodes.

None refuses a build (``optional``): without one a local run is slower, louder or less
exact in what it prints, never wrong."""

from __future__ import annotations

from deployments.ray_touches.probes import (
    USAGE_STATS_SWITCH,
    RayTouch,
    attr_chain,
    every,
    optional,
    parameter,
    per_replica,
    private_keyword,
    serve_env,
    source_mentions,
    symbols,
)

# A node starts a log monitor as its RayParams say (include_log_monitor): what the quiet
# local head and the fake worker nodes both switch off.
LOG_MONITOR_SWITCH = every(symbols("ray._private.parameter", "RayParams"),
                           source_mentions("ray._private.node", "Node.start_ray_processes",
                                           "self._ray_params.include_log_monitor"))

TOUCHES: tuple[RayTouch, ...] = optional(
    per_replica(
        "serve.replica_ongoing_requests", "ray.serve._private.replica",
        "ReplicaActor.get_num_ongoing_requests", "ReplicaActor.record_routing_stats",
        used_in=("deployments.local.drain:in_flight_requests",),
        why="the count of in-flight requests the drain waits for: Serve's own count, and "
            "the edge's (dsv4_http_in_flight in our routing stats), which also sees the "
            "requests on the replicas' own port (http.replica_port) that Serve never routes",
        how="call both on each ingress replica actor, take the larger per replica (10 s "
            "bound; a failure is logged and the drain goes on)",
        upstream="private actor methods",
    ),
    private_keyword(
        "serve.delete_nonblocking", "ray.serve", "delete", "_blocking",
        used_in=("deployments.local.drain:drain",),
        why="deleting every application at once lets their drains overlap; a blocking "
            "delete would drain them one after another",
        how="delete each app without waiting (_blocking=False), then poll serve.status() "
            "until all are gone",
        removal="when serve.delete takes several names or a public non-blocking flag"),
    private_keyword(
        "ray.metrics_export_port", "ray", "init", "_metrics_export_port",
        used_in=("deployments.local.ray_head:start_cluster",),
        why="`dsv4-serve run` prints the Prometheus URL, so the port must be ours to know",
        how="pass a free port to ray.init of the private local cluster (ray.init pops the "
            "keyword from **kwargs)",
        removal="when ray.init takes a public metrics port"),
    RayTouch(
        name="ray.loopback_node_ip",
        target="ray._private.ray_constants:ENABLE_RAY_CLUSTER, read by "
               "ray._private.services:get_node_ip_address",
        used_in=("deployments.local.ray_head:loopback_node_ip",
                 "deployments.local.ray_head:check_loopback_node"),
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
        probe=every(symbols("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
                    source_mentions("ray._private.services", "get_node_ip_address",
                                    "ray_constants.ENABLE_RAY_CLUSTER"),
                    source_mentions("ray.dashboard.modules.reporter.reporter_agent",
                                    "ReporterAgent.__init__", "is_localhost(self._ip)")),
    ),
    RayTouch(
        name="ray.quiet_local_head",
        target="ray._private.parameter:RayParams (no_monitor, include_log_monitor), read by "
               "ray._private.node:Node.start_head_processes / start_ray_processes; "
               "ray._private.node:Node.start_api_server",
        used_in=("deployments.local.ray_head:quiet_head",
                 "deployments.local.ray_params:ray_params_set"),
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
        probe=every(LOG_MONITOR_SWITCH,
                    source_mentions("ray._private.node", "Node.start_head_processes",
                                    "self._ray_params.no_monitor", "self.start_api_server("),
                    source_mentions("ray._private.worker", "init",
                                    "ray._private.parameter.RayParams("),
                    parameter("ray._private.node", "Node.start_api_server",
                              "raise_on_failure"),
                    USAGE_STATS_SWITCH),
    ),
    RayTouch(
        name="ray.prompt_node_registration",
        target="ray._private.services:get_node, called by ray._private.node:Node.__init__ "
               "after starting the raylet (C++ GlobalStateAccessor::GetNode sleeps 1 s "
               "after each miss)",
        used_in=("deployments.local.ray_head:prompt_node_registration",),
        why="the head's raylet registers ~0.6 s after it starts on a 2-core box; Ray asks "
            "once after 0.1 s, misses, and its GCS client sleeps a whole second: ~1 s of "
            "every local start spent waiting for nothing (docs/benchmarks.md §2d)",
        how="for the duration of ray.init(address='local'), services.get_node first polls "
            "GlobalState.node_table() every 20 ms (bounded), then asks the same "
            "connection's GlobalState.get_node (what services.get_node calls), which "
            "finds the node at once; restored afterwards",
        upstream="ray-project/ray#55389 made node start ask for one node, keeping the "
                 "accessor's 1 s retry sleep",
        removal="when GlobalStateAccessor::GetNode retries at sub-second intervals, or "
                "Node waits on the raylet's registration itself",
        probe=every(source_mentions("ray._private.node", "Node.__init__",
                                    "ray._private.services.get_node("),
                    symbols("ray._private.services", "get_node", "_get_gcs_client_options"),
                    source_mentions("ray._private.services", "get_node",
                                    "global_state.get_node(node_id)"),
                    attr_chain("ray._private.state", "GlobalState._initialize_global_state",
                               "GlobalState.node_table",
                               "GlobalState.disconnect")),
    ),
    RayTouch(
        name="serve.controller_before_proxies",
        target="ray.serve._private.api:_create_controller_and_proxy_refs, "
               "_coerce_controller_options; ray.serve.context:_set_global_client; "
               "ray.serve._private.client:ServeControllerClient",
        used_in=("deployments.local.serve_start:start_serve",),
        why="serve.start blocks until every HTTP proxy is ready (~0.8 s here), though no "
            "replica needs a proxy to start: the wait sat on the boot's critical path",
        how="create the controller and proxies as serve.start does, register the client "
            "as serve.start does, deploy, then ray.get the proxies' ready refs (Serve's "
            "HTTP_PROXY_TIMEOUT) before any URL is reported",
        upstream="ray-project/ray#63597 split controller creation from the proxies' wait "
                 "so callers resolve the refs themselves; serve.start still waits",
        removal="when serve.start can return before its proxies are ready",
        probe=every(symbols("ray.serve._private.api", "_create_controller_and_proxy_refs",
                            "_coerce_controller_options"),
                    symbols("ray.serve.context", "_set_global_client"),
                    symbols("ray.serve._private.client", "ServeControllerClient"),
                    symbols("ray.serve._private.constants", "HTTP_PROXY_TIMEOUT"),
                    # what serve.start does that start_serve does the same way
                    source_mentions("ray.serve._private.api", "serve_start",
                                    "ray.get(proxy_ready_refs, timeout=HTTP_PROXY_TIMEOUT)",
                                    "_set_global_client(client)")),
    ),
    serve_env(
        "serve.local_quiet_env", "CONTROL_LOOP_INTERVAL_S",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS",
        used_in=("deployments.serve_env:LOCAL_QUIET_ENV",
                 "deployments.serve_env:apply_local_quiet",
                 "deployments.local.ray_head:start_cluster",
                 "deployments.local.cluster:LocalCluster.start"),
        why="a local run idles quietly: Serve's 10 Hz control loop and 10 Hz metrics flush "
            "are most of what the app costs at rest on a small box (docs/benchmarks.md §2f)",
        how="process environment before the local Ray starts (the loop's variable is "
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S); a value the user set wins",
        removal="when Serve offers a documented idle or local profile"),
    serve_env(
        "serve.local_drain_window", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
        "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER", "RAY_SERVE_HAPROXY_HEALTH_CHECK_FASTINTER",
        "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL",
        used_in=("deployments.serve_env:apply_ingress",
                 "deployments.serve_env:local_drain_env",
                 "deployments.serve_env:HAPROXY_CHECK_DEFAULTS"),
        why="a stopping replica under HAProxy keeps serving 30 s (sized for an external "
            "balancer; Ray 2.60 replica.py _drain_behind_haproxy holds it open that long); "
            "in a local run this host's HAProxy is the only one and takes a failing replica "
            "out in ~5 s, so every local stop and scale-down waited ~20 s for nobody",
        how="process environment before the local Ray starts (http.ingress: haproxy): "
            "twice HAProxy's down time from the check settings (their defaults are read "
            "too); a value the user set wins",
        removal="when Serve derives the drain window from its own HAProxy's check settings"),
    serve_env(
        "serve.direct_ingress_port_range", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
        used_in=("deployments.serve_env:direct_env",),
        why="pin the one replica's own HTTP port so a client can find it under direct "
            "ingress (Serve otherwise picks from 30000-31000, and publishes no replica's "
            "port)",
        how="process environment before Ray starts; MIN=p, MAX=p+1 (node_port_manager."
            "PortAllocator takes range(MIN, MAX))",
        removal="when Serve publishes replica ports or balances direct ingress itself"),
    RayTouch(
        name="autoscaler.fake_multinode",
        target="ray.autoscaler._private.fake_multi_node.node_provider:FakeMultiNodeProvider",
        used_in=("deployments.local.node_provider:OneLogMonitorProvider",
                 "deployments.local.cluster:RAY_FAKE_PROVIDER",
                 "deployments.local.cluster:ClusterSpec.autoscaling_config"),
        why="Ray's real autoscaler adding and removing local raylets stands in for GPU nodes",
        how="declared as an external provider module (Ray's wheel lacks the example.yaml "
            "provider type fake_multinode reads)",
        upstream="test utility, not a public API",
        removal="when Ray ships a public local multi-node cluster",
        probe=symbols("ray.autoscaler._private.fake_multi_node.node_provider",
                      "FakeMultiNodeProvider"),
    ),
    RayTouch(
        name="ray.fake_nodes_one_log_monitor",
        target="ray.autoscaler._private.fake_multi_node.node_provider:"
               "FakeMultiNodeProvider._create_node_with_resources_and_labels, "
               "ray._private.parameter:RayParams (include_log_monitor)",
        used_in=("deployments.local.node_provider:OneLogMonitorProvider",
                 "deployments.local.ray_params:ray_params_set"),
        why="the fake provider starts each worker node with Ray's defaults, a log monitor "
            "included; its nodes share this host and the head's session directory, so "
            "each extra monitor tails the same files again (Ray: one per physical host) "
            "and polls at rest on the cores the engines use (docs/benchmarks.md §2h)",
        how="a provider subclass whose node creation runs with RayParams replaced by a "
            "subclass setting include_log_monitor=False, restored afterwards",
        upstream="test utility; its RayParams take no per-node options from the config",
        removal="when the fake provider takes node start options, or Ray ships a public "
                "local multi-node cluster",
        probe=every(LOG_MONITOR_SWITCH,
                    parameter("ray._private.parameter", "RayParams.__init__",
                              "include_log_monitor"),
                    source_mentions("ray.autoscaler._private.fake_multi_node.node_provider",
                                    "FakeMultiNodeProvider."
                                    "_create_node_with_resources_and_labels",
                                    "ray._private.parameter.RayParams(")),
    ),
)
