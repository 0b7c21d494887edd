"""The DSv4 servers of a P/D app: Ray Serve LLM's prefill/decode servers with our checks.

``DSv4PDPrefillServer`` / ``DSv4PDDecodeServer`` are Ray Serve LLM 2.60's
``PDPrefillServer`` / ``PDDecodeServer`` (``ray.serve.llm.deployment``: the decode
replica runs the prefill remotely with ``max_tokens=1`` and ``do_remote_decode``, then
decodes locally with the returned ``kv_transfer_params``) under
``deployments.serving.server.DSv4ServerMixin`` (resolved ``kv_cache_dtype``, self-check,
``kv_page_spec``). Each also reports a
``wire.TransferSpec``: its live connector (from the engine workers) and the model's
identity by content, for ``deployments.pd.compat``.

The decode server hands a request to a prefill replica only when the controller has
proven one compatible with it (``deployments.pd.route``); otherwise it prefills on its
own engine, so no unproven pages are ever copied. The decode server also counts the
KV transfers its engine saw fail (``deployments.pd.failed_transfers``) and reports them
with each whitelist it takes.

The decode replicas are the HTTP ingress (``deployments.pd.builder``): their ASGI app is
vLLM's OpenAI app, whose chat/completions routes Ray's ``PDOrchestratorMixin`` re-points
at ``chat``/``completions`` below (registry entry ``llm.pd_direct_ingress_routes``), so
the prefill-first step, or the local prefill, runs on the HTTP path too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.serve.handle import DeploymentHandle
from ray.serve.llm.deployment import LLMServer, PDDecodeServer, PDPrefillServer

from deployments.control.canary_wire import CanaryBatch
from deployments.control.wire import PDRouteAck, PDRouteMessage, TransferSpec
from deployments.logs import get_logger
from deployments.pd import compat, failed_transfers
from deployments.pd import route as pd_route
from deployments.pd.canary_run import PDCanaryMixin
from deployments.serving.server import DSv4ServerMixin
from dsv4_patch.worker_ext import KV_TRANSFER_METHOD

logger = get_logger("pd")


def model_dir(source: str) -> str | None:
    """The local directory of a model: the path itself, or its Hub cache snapshot."""
    if Path(source, "config.json").is_file():
        return source
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(source, local_files_only=True,
                                 allow_patterns=list(compat.MODEL_FILES))
    except Exception as exc:  # not cached, or not a repo id: the identity stays unknown
        logger.warning("dsv4: model %r has no local config.json (%r); its identity is "
                       "unknown and the P/D check will not pass it", source, exc)
        return None


def transfer_spec(pool: str, workers: list[dict[str, Any]], source: str) -> TransferSpec:
    """The replica's ``TransferSpec`` from its workers' connector facts and its model."""
    first = min(workers, key=lambda w: w.get("rank", 0)) if workers else {}
    reasons = [w["reason"] for w in workers if w.get("reason")]
    lens = {tuple(w.get("region_block_lens") or ()) for w in workers}
    if len(lens) > 1:
        reasons.append(f"worker ranks report different region block lengths {sorted(lens)}")
    where = model_dir(source)
    digest, files = compat.model_identity(where) if where else (None, [])
    if digest is None:
        reasons.append(f"no config.json for model {source!r}")
    fields = {k: first.get(k) for k in (
        "connector", "connector_version", "kv_role", "transfer_mode", "kv_cache_layout",
        "kernel_block_size", "nixl_compat_hash")}
    return TransferSpec(pool=pool, model_hash=digest, model_files=files, model_path=source,
                        backend_names=first.get("backend_names") or [],
                        region_block_lens=first.get("region_block_lens") or [],
                        enforce_handshake_compat=first.get("enforce_handshake_compat", True),
                        reason="; ".join(reasons) or None, **fields)


class PDTransferMixin:
    """Reports the replica's ``TransferSpec`` (asked from the workers once)."""

    _pool: str
    _transfer: TransferSpec | None = None

    async def _transfer_spec(self) -> TransferSpec | None:
        if self._transfer is None:
            workers = await self.collective_rpc(  # type: ignore[attr-defined]  # a mixin: Ray Serve LLM's LLMServer provides it
                KV_TRANSFER_METHOD, timeout=60.0)
            source = str(self._llm_config.model_loading_config.model_source)  # type: ignore[attr-defined]  # a mixin: Ray Serve LLM's LLMServer sets it
            self._transfer = transfer_spec(self._pool, list(workers), source)
            logger.info("dsv4: %s replica connector %s v%s (%s, %s), model %s, regions %s",
                        self._pool, self._transfer.connector,
                        self._transfer.connector_version, self._transfer.kv_role,
                        self._transfer.transfer_mode, (self._transfer.model_hash or "?")[:19],
                        self._transfer.region_block_lens[:4])
        return self._transfer


class DSv4PDPrefillServer(PDTransferMixin, DSv4ServerMixin, PDPrefillServer):
    """A prefill replica (``kv_producer``)."""

    _pool = "prefill"


class DSv4PDDecodeServer(PDCanaryMixin, PDTransferMixin, DSv4ServerMixin, PDDecodeServer):
    """A decode replica (``kv_consumer``) that orchestrates the remote prefill and runs
    the output canaries of its pairs (``deployments.pd.canary_run``)."""

    _pool = "decode"

    async def __init__(self, llm_config: Any, *, dsv4: dict[str, Any],  # type: ignore[misc]  # Serve awaits an async __init__
                       prefill_server: DeploymentHandle, compat_check: bool = True,
                       **kwargs: Any):
        pd_route.ROUTE.check = compat_check
        failed_transfers.install()  # before the engine builds its stat loggers
        await super().__init__(llm_config, dsv4=dsv4, prefill_server=prefill_server, **kwargs)

    async def apply_pd_route(self, message: dict[str, Any]) -> dict[str, Any]:
        """Take the controller's whitelist of prefill replicas for this decode replica;
        answer with the failed KV transfers its engine counted (``wire.PDRouteAck``)."""
        route = pd_route.take(PDRouteMessage.model_validate(message), self._replica_id)
        count, unread = failed_transfers.reading(self._llm_config.log_engine_metrics)
        return PDRouteAck(replica_id=self._replica_id, allowed=sorted(route.allowed or ()),
                          failed_kv_transfers=count,
                          failed_kv_transfers_unread=unread).model_dump(mode="json")

    async def run_canaries(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The controller's canaries addressed to this replica, one after another."""
        batch = CanaryBatch.model_validate(message)
        return [await self.run_canary(r.model_dump(mode="json"))
                for r in batch.requests.get(self._replica_id, [])]

    async def pd_route_state(self) -> dict[str, Any]:
        """What this replica would do with a request now (tests and operators)."""
        route = pd_route.ROUTE
        return {"replica_id": self._replica_id, "check": route.check,
                "allowed": None if route.allowed is None else sorted(route.allowed),
                "verdict": route.verdict.value, "may_transfer": route.may_transfer()}

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        if pd_route.ROUTE.may_transfer():
            return await super().chat(request, raw_request_info)
        return await LLMServer.chat(self, request, raw_request_info)

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        if pd_route.ROUTE.may_transfer():
            return await super().completions(request, raw_request_info)
        return await LLMServer.completions(self, request, raw_request_info)
