"""The Ray internals the served app touches: its replicas, its controller, its builders."""

from __future__ import annotations

from deployments.ray_touches.probes import (
    USAGE_STATS_SWITCH,
    RayTouch,
    attr_chain,
    called_by,
    dataclass_field,
    every,
    optional,
    per_replica,
    source_mentions,
    symbols,
)

_LLM = "ray.llm._internal.serve"

TOUCHES: tuple[RayTouch, ...] = (
    RayTouch(
        name="serve.late_bound_ingress",
        target="ray.serve:ingress() without an app + "
               f"{_LLM}.core.server.llm_server:LLMServer.__serve_build_asgi_app__",
        used_in=("deployments.serving.server:DSv4ServerMixin.__serve_build_asgi_app__",
                 "deployments.doors.lifecycle:listening_ingress",
                 "deployments.http.front:harden"),
        why="the ingress replica cost a Python hop per request and per streamed chunk "
            "(16 ms of a 100 ms one-token request, docs/benchmarks.md §2a): the replica answers "
            "HTTP itself with vLLM's OpenAI app",
        how="build_llm_deployment(deployment_cls=serve.ingress()(DSv4Server)); "
            "DSv4Server.__serve_build_asgi_app__ hardens vLLM's app (front.harden)",
        upstream="the late-bound hook is public Serve API in 2.60; Ray Serve LLM's direct "
                 "streaming uses the same method (with HAProxy, binding all interfaces)",
        removal="keep while Serve keeps the hook",
        probe=attr_chain(f"{_LLM}.core.server.llm_server",
                         "LLMServer.__serve_build_asgi_app__"),
        loads_llm=True,
    ),
    RayTouch(
        name="llm.pd_canary_engine",
        target=f"{_LLM}.engines.vllm.vllm_engine:VLLMEngine._engine_client, "
               f"{_LLM}.serving_patterns.prefill_decode.pd_server:"
               "PDOrchestratorMixin._get_connector_backend and PDDecodeServer._prefill_handle",
        used_in=("deployments.pd.canary_run:PDCanaryMixin",),
        why="the P/D output canary runs on the decode replica: the prompt prefilled on one "
            "pinned prefill replica the way Ray's orchestrator sends a user's, then decoded "
            "and scored on the replica's own engine with per-token logprobs and "
            "num_cached_tokens, which the OpenAI responses do not carry together",
        how="prepare_prefill_request + the prefill handle's completions (pinned by request "
            "id, deployments.pd.route.pinned); AsyncLLM.generate twice on the decode engine",
        upstream="Ray 2.60 exposes neither the engine client nor the connector backend; "
                 "no P/D output check upstream (vLLM's are CI tests)",
        removal="when Ray Serve LLM exposes the engine client or a per-pair P/D health check",
        probe=every(source_mentions(f"{_LLM}.engines.vllm.vllm_engine", "VLLMEngine.start",
                                    "self._engine_client ="),
                    attr_chain(f"{_LLM}.serving_patterns.prefill_decode.pd_server",
                               "PDOrchestratorMixin._get_connector_backend"),
                    source_mentions(f"{_LLM}.serving_patterns.prefill_decode.pd_server",
                                    "PDDecodeServer.__init__", "self._prefill_handle =")),
        pd_only=True,
    ),
    RayTouch(
        name="llm.pd_direct_ingress_routes",
        target=f"{_LLM}.serving_patterns.prefill_decode.pd_server:"
               "PDOrchestratorMixin.__serve_build_asgi_app__",
        used_in=("deployments.pd.builder:build_pd_app",
                 "deployments.pd.server:DSv4PDDecodeServer"),
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
        probe=source_mentions(f"{_LLM}.serving_patterns.prefill_decode.pd_server",
                              "PDOrchestratorMixin.__serve_build_asgi_app__",
                              "self.chat(", "self.completions("),
        pd_only=True,
        loads_llm=True,
    ),
    RayTouch(
        name="llm.deployment_name",
        target=f"{_LLM}.core.server.builder:_get_deployment_name",
        used_in=("deployments.serving.llm_build:server_deployment_name",),
        why="the servers bind the controller (for /v1/kv-spec), so the controller finds "
            "them by name: a Serve graph has no cycles",
        how="the name build_llm_deployment gives: '<class>:' (P/D: 'Decode:') + "
            "_get_deployment_name",
        upstream="not public in Ray 2.60",
        removal="when the builder exposes the deployment name",
        probe=symbols(f"{_LLM}.core.server.builder", "_get_deployment_name"),
        loads_llm=True,
    ),
    RayTouch(
        name="llm.node_init_callback",
        target="ray.llm._internal.common.callbacks.base:CallbackBase, "
               "CallbackCtx.run_init_node",
        used_in=("deployments.serving.boot:LocalModelCallback.on_before_node_init",
                 "deployments.serving.builder:with_boot_callback"),
        why="Ray Serve LLM runs a per-node download task (a fresh Ray worker) before every "
            "engine boot, also for a local model directory (~15 s of a loaded 2-core boot)",
        how="LLMConfig.callback_config (public) with our callback, which sets "
            "ctx.run_init_node = False only for a local directory on a one-node group",
        upstream="callback_config is public; CallbackBase has no public re-export in 2.60",
        removal="when Ray skips initialize_node for local paths, or exports CallbackBase",
        probe=every(symbols("ray.llm._internal.common.callbacks.base", "CallbackBase",
                            "CallbackCtx"),
                    dataclass_field("ray.llm._internal.common.callbacks.base",
                                    "CallbackCtx", "run_init_node")),
    ),
    RayTouch(
        name="serve.import_path_deployment",
        target="ray.serve.deployment:Deployment.options(func_or_class=<'package.module.attr'>) -> "
               "ray.serve._private.config:ReplicaConfig.create (takes a str), loaded in the "
               "replica by ray.serve._private.replica:_load_deployment_def_from_import_path",
        used_in=("deployments.serving.server_options:server_deployment",
                 "deployments.serving.server:DSv4Ingress",
                 "deployments.serving.server:DSv4DPIngress"),
        why="the process that builds the app (dsv4-serve run's driver, KubeRay's build "
            "task) would otherwise import the server class, and with it vLLM and torch "
            "(8-11 s of a core) before any replica can start (docs/benchmarks.md §2d)",
        how="serve.deployment() on a light stand-in class with the options, then "
            ".options(func_or_class='deployments.serving.server.DSv4Ingress'): the "
            "replica imports the class; the LLMConfig is bound as a plain dict",
        upstream="ReplicaConfig.create is typed Union[Callable, str] and the replica loads "
                 "import paths; Deployment.options is typed Callable only",
        removal="when Serve documents import-path deployments, or Ray Serve LLM's builder "
                "stops importing vLLM",
        probe=every(source_mentions("ray.serve._private.config", "ReplicaConfig.create",
                                    "isinstance(deployment_def, str)"),
                    source_mentions("ray.serve._private.replica", "ReplicaActor.__init__",
                                    "_load_deployment_def_from_import_path("),
                    source_mentions("ray.serve.deployment", "Deployment.options",
                                    "func_or_class = self._replica_config.deployment_def")),
    ),
    RayTouch(
        name="llm.server_options",
        target=f"{_LLM}.core.server.llm_server:LLMServer.get_deployment_options, "
               f"{_LLM}.serving_patterns.data_parallel.dp_server:DPServer."
               "get_deployment_options and "
               f"{_LLM}.core.server.builder:build_llm_deployment (DEFAULT_DEPLOYMENT_OPTIONS, "
               "_merge_replica_actor_and_child_actor_bundles, the worker setup hook)",
        used_in=("deployments.serving.server_options:server_options",
                 "deployments.serving.server_options:defaults",
                 "deployments.serving.server_options:runtime_env_default",
                 "deployments.serving.server_options:dp_gang_options",
                 "deployments.serving.server_options:uncovered"),
        why="the same Serve options as Ray Serve LLM's builder without importing it "
            "(serve.import_path_deployment says why)",
        how="deployments.serving.server_options mirrors them for explicit bundles (one "
            "engine per replica, or DP ranks in gangs), using Ray's own defaults merge, "
            "constants and gang config; a test "
            "builds every shipped one-pool config both ways and names each option that "
            "differs; other configs use Ray Serve LLM's builder",
        upstream="not public in Ray 2.60",
        removal="when Ray Serve LLM's builder can run without importing vLLM",
        probe=every(symbols("ray.llm._internal.common.dict_utils",
                            "maybe_apply_llm_deployment_config_defaults"),
                    symbols(f"{_LLM}.constants", "ENABLE_WORKER_PROCESS_SETUP_HOOK",
                            "DEFAULT_MAX_ONGOING_REQUESTS", "DEFAULT_HEALTH_CHECK_PERIOD_S",
                            "DEFAULT_HEALTH_CHECK_TIMEOUT_S",
                            "DEFAULT_MAX_TARGET_ONGOING_REQUESTS"),
                    symbols(_LLM, "_worker_process_setup_hook"),
                    symbols(f"{_LLM}.core.configs.accelerators", "AcceleratorType",
                            "TPU_ACCELERATOR_VALUES", "infer_hardware_kind_from_bundles")),
    ),
    RayTouch(
        name="llm_config.update_engine_kwargs",
        target="ray.serve.llm:LLMConfig.update_engine_kwargs (updates _engine_config too)",
        used_in=("deployments.serving.resolve:resolve_for_replica",
                 "deployments.serving.resolve:apply_override",
                 "deployments.serving.server:DSv4ServerMixin.__init__"),
        why="the replica rewrites kv_cache_dtype (and a canary's override) after Ray Serve "
            "LLM cached the engine config at build time",
        how="rely on update_engine_kwargs also updating the cached _engine_config",
        upstream="documented as updating both, but the cached config is private",
        removal="when LLMServer takes engine kwargs at construction only",
        probe=source_mentions("ray.serve.llm", "LLMConfig.update_engine_kwargs",
                              "_engine_config.engine_kwargs.update"),
        loads_llm=True,
    ),
    *optional(
        RayTouch(
            name="llm.engine_gauges",
            target="vllm.v1.metrics.ray_wrappers:RayPrometheusStatLogger._gauge_cls and "
                   "RayKVConnectorProm._gauge_cls (RayGaugeWrapper)",
            used_in=("deployments.serving.engine_metrics:install",
                     "deployments.serving.engine_metrics:gauge_class"),
            why="vLLM sets its engine gauges (kv_cache_usage_perc, num_requests_running/"
                "waiting, ...) only when the engine steps and Ray's agent drops a gauge not set "
                "for two export intervals: ~20 s into idle the KV and queue series vanish, the "
                "dashboard's panels go empty and an autoscaler reading them is blind",
            how="in the replica, before the engine starts, both _gauge_cls become KeptGauge: "
                "each set goes to Ray at once and is set again at every keep-alive of the "
                "engine-metrics flush thread (every 5 s)",
            upstream="none filed: Ray's agent expiring unset gauges is intended "
                     "(ray/_private/telemetry); vLLM could re-set its gauges when idle",
            removal="when vLLM's Ray stat logger keeps its gauges alive itself",
            probe=attr_chain("vllm.v1.metrics.ray_wrappers",
                             "RayPrometheusStatLogger._gauge_cls",
                             "RayKVConnectorProm._gauge_cls", "RayGaugeWrapper.set"),
            loads_llm=True,
        ),
        RayTouch(
            name="llm.engine_histograms",
            target="vllm.v1.metrics.ray_wrappers:RayPrometheusStatLogger._histogram_cls "
                   "(RayHistogramWrapper; RayPrometheusMetric's tag helpers), the stat logger "
                   f"{_LLM}.engines.vllm.vllm_engine:VLLMEngine._start_async_llm_engine gives "
                   "the engine when log_engine_metrics is on",
            used_in=("deployments.serving.engine_metrics:install",
                     "deployments.serving.engine_metrics:histogram_class",
                     "deployments.serving.server:DSv4ServerMixin.__init__"),
            why="Ray 2.60's metrics agent re-records each exported histogram observation in "
                "Python (~12 us of agent CPU each) and vLLM observes inter-token latency per "
                "streamed token: at one GPU's rate the agent cost a fifth of vLLM's API server "
                "per token (docs/benchmarks.md §2k)",
            how="in the replica, before the engine starts, RayPrometheusStatLogger._histogram_cls "
                "becomes BucketHistogram (vLLM's own label handling): counts kept in-process, "
                "set every second into gauges named <name>_bucket{le} / _sum / _count",
            upstream="ray-project/ray#64852 (pass histogram bucket counts through the agent); "
                     "ray-project/ray#59337 (the agent's metrics overhead)",
            removal="when Ray's agent passes histogram buckets through (ray#64852)",
            probe=every(attr_chain("vllm.v1.metrics.ray_wrappers",
                                   "RayPrometheusStatLogger._histogram_cls",
                                   "RayPrometheusMetric._get_tag_keys",
                                   "RayPrometheusMetric._build_tags",
                                   "RayPrometheusMetric._get_sanitized_opentelemetry_name"),
                        source_mentions(f"{_LLM}.engines.vllm.vllm_engine",
                                        "VLLMEngine._start_async_llm_engine",
                                        "RayPrometheusStatLogger")),
            loads_llm=True,
        ),
        per_replica(
            "serve.replica_ids", "ray.serve._private.common", "ReplicaID.is_full_id_str",
            "ReplicaID.from_full_id_str",
            used_in=("deployments.control.replicas:replica_actors",
                     "deployments.control.replicas:alive_replica_ids",
                     "deployments.local.drain:in_flight_requests"),
            why="the drain prints how many requests are in flight; the controller names the "
                "replicas that missed a check's deadline; both find a deployment's replicas "
                "among the named actors by their replica id",
            how="parse every named actor's name (never a hard-coded name format); keep the "
                "replicas of one deployment",
            upstream="no public per-replica request count in Ray 2.60",
        ),
        RayTouch(
            name="ray_llm.telemetry_push",
            target="ray.llm._internal.serve.core.server.llm_server:"
                   "push_telemetry_report_for_all_models (called by LLMServer._start_engine)",
            used_in=("deployments.serving.boot:keep_telemetry_off_boot_path",),
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
            probe=every(called_by("ray.llm._internal.serve.core.server.llm_server",
                                  "push_telemetry_report_for_all_models",
                                  "LLMServer._start_engine"),
                        USAGE_STATS_SWITCH),
            loads_llm=True,
        ),
        RayTouch(
            name="serve.broadcast_per_replica_results",
            target="ray.serve.handle:DeploymentBroadcastResponse._fetch_replica_results_async; "
                   "ray.serve._private.replica_result:ReplicaResult.get_async, cancel",
            used_in=("deployments.control.replicas:call_each",),
            why="the public results_async(timeout_s=) is all-or-nothing: one hung replica "
                "discards every answer",
            how="await each replica's result under its own timeout and cancel the ones that "
                "miss it (fallback when absent: results_async, logged once per controller)",
            upstream="no per-replica timeout in broadcast (alpha) as of Ray 2.60",
            removal="when broadcast exposes per-replica results with timeouts",
            probe=every(attr_chain("ray.serve.handle",
                                   "DeploymentBroadcastResponse._fetch_replica_results_async"),
                        attr_chain("ray.serve._private.replica_result", "ReplicaResult.get_async",
                                   "ReplicaResult.cancel")),
        ),
    ),
    RayTouch(
        name="pd.serving_args",
        target=f"{_LLM}.serving_patterns.prefill_decode.builder:PDServingArgs",
        used_in=("deployments.pd.builder:pool_configs",),
        why="Ray Serve LLM's own validation of a prefill/decode pair (both kv_transfer_config, "
            "the roles); build_pd_openai_app takes a dict and builds its own servers and "
            "ingress, not ours",
        how="validate our two LLMConfigs with it and use the configs it returns",
        upstream="PDServingArgs is not exported by ray.serve.llm in Ray 2.60",
        removal="when ray.serve.llm exports it, or build_pd_openai_app takes server classes "
                "and an ingress",
        probe=symbols(f"{_LLM}.serving_patterns.prefill_decode.builder", "PDServingArgs"),
        loads_llm=True,
        pd_only=True,
    ),
    RayTouch(
        name="pd.local_prefill",
        target="ray.serve.llm.deployment:PDDecodeServer.chat, completions (the remote-prefill "
               "path) over LLMServer.chat, completions (the local one)",
        used_in=("deployments.pd.server:DSv4PDDecodeServer.chat",
                 "deployments.pd.server:DSv4PDDecodeServer.completions"),
        why="a decode replica with no prefill replica proven compatible must not receive "
            "unproven KV pages: it prefills on its own engine instead",
        how="when pd_route forbids a transfer, call LLMServer's method on self, skipping "
            "PDDecodeServer's override (relies on that override being the only place the "
            "remote prefill happens)",
        upstream="no per-request switch for the remote prefill in Ray 2.60",
        removal="when PDDecodeServer can be told per request to prefill locally",
        probe=every(source_mentions("ray.serve.llm.deployment", "PDDecodeServer.chat",
                                    "_pd_handle_request"),
                    source_mentions("ray.serve.llm.deployment", "PDDecodeServer.completions",
                                    "_pd_handle_request"),
                    attr_chain("ray.serve.llm.deployment", "LLMServer.completions")),
        pd_only=True,
        loads_llm=True,
    ),
)
